"""Sandboxed chat-template rendering: byte-identical to HF's renderer, and unable to escape the sandbox."""

from __future__ import annotations

import pytest

from seqlab.data.chat_template import ChatTemplateError, render_chat_template

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama-2 style: bos/eos variables, raise_exception, whitespace control
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
# multi-line template with trim/lstrip blocks, tojson, namespace, loop controls, generation tag, tools
FANCY = """{%- set ns = namespace(count=0) -%}
{%- if tools %}
Tools: {{ tools | tojson }}
{%- endif %}
{% for m in messages %}
    {% if m['role'] == 'skip' %}{% continue %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    [{{ ns.count }}] {{ m['role'] | upper }}: {{ m['content'] | tojson }}
    {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}ASSISTANT:{% endif %}"""

MESSAGES = [
    [{"role": "user", "content": "Hello <b>&</b> \"quotes\" naïve 🤖"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "  spaced  "},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "multi\nline\n\ttabbed"}],
    [{"role": "user", "content": "a"}, {"role": "skip", "content": "hidden"}, {"role": "assistant", "content": "b", "extra": None}],
]


def _hf_render(template, messages, add_generation_prompt, **kwargs):
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], chat_template=template, add_generation_prompt=add_generation_prompt, **kwargs)
    return rendered[0]


@pytest.mark.parametrize("template", [CHATML, LLAMA2, FANCY], ids=["chatml", "llama2", "fancy"])
def test_matches_hf_renderer(template):
    specials = {"bos_token": "<s>", "eos_token": "</s>"}
    for messages in MESSAGES:
        for agp in (False, True):
            try:
                expected = _hf_render(template, messages, agp, **specials)
            except Exception as e:  # the template refuses this conversation: we must refuse it too
                with pytest.raises(ChatTemplateError, match="alternate"):
                    render_chat_template(template, messages, add_generation_prompt=agp, **specials)
                assert "alternate" in str(e)
                continue
            assert render_chat_template(template, messages, add_generation_prompt=agp, **specials) == expected
    tools = [{"name": "get_weather", "parameters": {"city": "Zürich"}}]
    assert render_chat_template(FANCY, MESSAGES[0], tools=tools) == _hf_render(FANCY, MESSAGES[0], False, tools=tools)
    assert "Zürich" in render_chat_template(FANCY, MESSAGES[0], tools=tools)  # tojson does not \\u-escape


def test_reasoning_reaches_the_template_under_each_of_its_names_as_in_hf():
    """transformers copies a message's reasoning / thinking / reasoning_content into the others before rendering; a
    template reading reasoning_content got nothing here for a message that said "reasoning"."""
    template = ("{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}<r>{{ m.reasoning_content }}</r>"
                "{% endif %}{% if m.thinking %}<t>{{ m.thinking }}</t>{% endif %}{{ m.content }}{% endfor %}")
    for key in ("reasoning", "thinking", "reasoning_content"):
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", key: "let me think"}]
        expected = _hf_render(template, messages, False)
        assert render_chat_template(template, messages) == expected and expected.count("let me think") == 2, key


@pytest.mark.parametrize("attack", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
    "{{ messages.append({'role': 'x'}) }}",  # the immutable sandbox refuses to mutate inputs
    "{{ raise_exception('nope') }}",
    "{{ (10 ** (10 ** 8)) > 0 }}",  # ran for ever: ** past 10 000 digits is refused
    "{{ ([0] * 10 ** 9) | length }}",  # 8 GB asked for: said as the template's failure, not a MemoryError
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",  # a RecursionError likewise
    "{% for i in range(10 ** 9) %}{% endfor %}",
    "{% include 'x.html' %}",  # no loader: there is nothing a template may read
    # strings of any size from small numbers, past the bound on '*': each allocated what it was asked for
    "{% set s = 'x'.ljust(10 ** 9) %}", "{% set s = 'x' | center(10 ** 9) %}", "{% set s = 'x' | indent(10 ** 9) %}",
    "{% set s = ('x' * 5000000) | replace('x', 'xxxx') %}", "{% set s = ('x' * 5000000).replace('x', 'xxxx') %}",
    # nested loops that print: 6 GB before a timeout stopped them
    "{% for i in range(99999) %}{% for j in range(99999) %}xxxxxxxxxxxxxxx{% endfor %}{% endfor %}",
])
def test_sandbox_refuses(attack):
    with pytest.raises(ChatTemplateError):
        render_chat_template(attack, [{"role": "user", "content": "hi"}])


def test_the_bounded_string_builders_still_work_at_ordinary_sizes():
    template = "{{ 'ab'.ljust(5) }}|{{ 'a b'.replace(' ', '_') }}|{{ 'x' | center(5) }}|{{ 'a\nb' | indent(2) }}|" \
               "{{ 'aaa' | replace('a', 'b', 2) }}"
    assert render_chat_template(template, []) == "ab   |a_b|  x  |a\n  b|bba"


def test_bad_inputs_name_the_problem():
    with pytest.raises(ChatTemplateError, match="line 1: syntax error"):
        render_chat_template("{% for m in messages %}", [])
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]: missing string field 'role'"):
        render_chat_template(CHATML, [{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat_template("", [])
