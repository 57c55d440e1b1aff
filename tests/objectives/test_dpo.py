"""DPO: the loss on hand-computed numbers, response-only log-probs, and a frozen reference."""

import math

import torch

from seqlab.data import ByteTokenizer
from seqlab.data.chat import tokenize_chat, tokenize_preference
from seqlab.data.collate import IGNORE_INDEX
from seqlab.objectives import DPO, dpo_loss
from seqlab.objectives.clm import next_token_labels
from tests.objectives.helpers import TOK, tiny_model


def test_loss_rewards_on_hand_computed_numbers():
    pi_c, pi_r = torch.tensor([-5.0, -3.0]), torch.tensor([-7.0, -2.0])
    ref_c, ref_r = torch.tensor([-6.0, -3.0]), torch.tensor([-6.5, -2.0])
    losses, r_c, r_r = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=0.5)
    # pair 0: z = 0.5 * ((-5 + 7) - (-6 + 6.5)) = 0.75 -> log(1 + e^-0.75); pair 1: z = 0 -> log 2
    assert torch.allclose(losses, torch.tensor([0.38687100611489994, 0.6931471805599453]), atol=1e-7)
    assert torch.allclose(r_c, torch.tensor([0.5, 0.0])) and torch.allclose(r_r, torch.tensor([-0.25, 0.0]))


def _pairs():
    return [
        {"prompt": "What is 2 + 2?", "chosen": "2 + 2 = 4.", "rejected": "2 + 2 = 5."},
        {"prompt": "Reverse: a b", "chosen": "b a", "rejected": "a b, reversed, is still a b"},
        {"prompt": "Write May 3, 2001 in ISO format.", "chosen": "2001-05-03", "rejected": "2001-03-05"},
    ]


def test_response_logprobs_sum_only_response_tokens():
    model = tiny_model()
    obj = DPO(TOK, beta=0.1, reference=model)
    batch = obj.collate(_pairs())
    logps = obj._logps(model, batch)
    for k, pair in enumerate(_pairs()):
        ex = tokenize_preference(TOK, pair)
        for row, key in ((k, "chosen_ids"), (k + 3, "rejected_ids")):
            ids = torch.tensor([ex["prompt_ids"] + ex[key]])
            lp = torch.log_softmax(model(ids)[0], -1)
            P = len(ex["prompt_ids"])
            manual = sum(lp[j - 1, ids[0, j]].item() for j in range(P, ids.shape[1]))
            assert abs(logps[row].item() - manual) < 1e-3


def test_policy_equal_to_reference_gives_log2_and_reference_stays_frozen():
    model = tiny_model()
    obj = DPO(TOK, beta=0.3)
    obj.setup(model)
    batch = obj.collate(_pairs())
    out = obj.loss(model, batch)
    assert out.n_targets == obj.num_targets(batch) == 3
    assert abs(float(out.loss_sum.detach()) - 3 * math.log(2)) < 1e-5
    assert out.metrics["reward_margin"] == 0.0 and out.metrics["accuracy"] == 0.0
    out.loss_sum.backward()
    assert all(p.grad is None for p in obj.reference.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    out2 = obj.loss(model, batch)  # the reference did not move with the policy
    assert abs(float(out2.loss_sum.detach()) - 3 * math.log(2)) > 1e-6


def test_policy_in_training_mode_has_no_dropout_noise():
    """The reference scores in eval mode, so a policy trained with dropout on compared noise with it: with
    ``--model dropout=0.3`` the loss at policy = reference read 0.699 per pair instead of log 2."""
    model = tiny_model(dropout=0.3, attn_dropout=0.3).train()
    obj = DPO(TOK, beta=0.3)
    obj.setup(model)
    torch.manual_seed(0)
    out = obj.loss(model, obj.collate(_pairs()))
    assert abs(float(out.loss_sum.detach()) - 3 * math.log(2)) < 1e-5
    assert out.metrics["reward_margin"] == 0.0


def test_empty_prompt_still_scores_the_first_response_token():
    """Without a chat template the prompt is BOS + its text. It used to be the text alone, so for an empty prompt
    the responses' first tokens, here the only ones that differ, had no position before them and were never
    scored: the loss stayed at log 2 whatever the policy."""
    plain = ByteTokenizer()
    plain.chat_template = None
    obj = DPO(plain, beta=1.0)
    pair = tokenize_preference(plain, {"prompt": "", "chosen": "Y", "rejected": "N"})
    assert pair["prompt_ids"] == [TOK.bos_id]
    batch = obj.collate([pair])
    targets = next_token_labels(batch["labels"], None, batch["attention_mask"])
    assert targets.tolist() == [[TOK.encode("Y")[0], TOK.eos_id], [TOK.encode("N")[0], TOK.eos_id]]


GEMMA = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}"
         "\n{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
           "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def test_templated_responses_are_the_templates_assistant_turns():
    """A response is what the template renders as the assistant's turn, as SFT scores it and as TRL takes it (the
    rendering of prompt + response after that of the prompt). It used to be the response + the tokenizer's
    end-of-turn token: Gemma's turns ended in ChatML's ``<|im_end|>`` instead of ``<end_of_turn>``, and Mistral's
    lost the space after ``[/INST]``."""
    pair = {"prompt": "2 + 2?", "chosen": "4.", "rejected": "5."}
    eos = TOK.token(TOK.eos_id)
    for template, prompt, chosen, rejected in (
            (GEMMA, "<start_of_turn>user\n2 + 2?<end_of_turn>\n<start_of_turn>model\n", "4.<end_of_turn>\n",
             "5.<end_of_turn>\n"),
            (MISTRAL, "[INST] 2 + 2? [/INST]", f" 4.{eos}", f" 5.{eos}")):
        ex = tokenize_preference(TOK, pair, template=template)
        text = lambda ids: TOK.decode(ids, skip_special_tokens=False)
        assert text(ex["prompt_ids"]) == TOK.token(TOK.bos_id) + prompt
        assert (text(ex["chosen_ids"]), text(ex["rejected_ids"])) == (chosen, rejected)
        sft = tokenize_chat(TOK, [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4."}],
                            template=template)
        assert sft["input_ids"] == ex["prompt_ids"] + ex["chosen_ids"]
        assert [i for i in sft["labels"] if i != IGNORE_INDEX] == ex["chosen_ids"]


MISTRAL_V03 = (  # the system message only while the user turn is the last one, as Mistral v0.3 / Nemo print it
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}{%- endif %}{%- endfor %}")


def test_a_template_whose_prompt_rendering_parts_keeps_the_prompt_inference_sees():
    """With a system message Mistral v0.3 renders the prompt (system shown) and the conversation with the answer
    (system gone) differently: the prompt is the one inference sees and the response its text + end of turn,
    where the span's prefix check had refused the pair."""
    pair = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "chosen": "Yes", "rejected": "No"}
    ex = tokenize_preference(TOK, pair, template=MISTRAL_V03)
    text = lambda ids: TOK.decode(ids, skip_special_tokens=False)
    assert text(ex["prompt_ids"]) == TOK.token(TOK.bos_id) + "[INST] Be brief.\n\nHi[/INST]"
    assert text(ex["chosen_ids"]) == "Yes" + TOK.eot_token
    plain = tokenize_preference(TOK, {**pair, "prompt": "Hi"}, template=MISTRAL_V03)  # no system: the span
    assert text(plain["chosen_ids"]) == " Yes" + TOK.token(TOK.eos_id)
