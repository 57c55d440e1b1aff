"""The public entry points: :func:`generate`, :func:`generate_output` and :func:`stream`, over every strategy.

The output keeps the Hugging Face layout: the prompt as given (padding included, and the whole prompt even when
``truncate_prompt`` made the model read only its last tokens), then the new tokens, pad after a row's EOS; so
``out[:, input_ids.shape[1]:]`` is always the new tokens.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from seqlab.eval import timing
from seqlab.generate.beam import beam_search
from seqlab.generate.config import GenerationConfig
from seqlab.generate.engine import decoder_start_token_id
from seqlab.generate.loop import sample_loop
from seqlab.generate.metrics import GenerationMetrics
from seqlab.generate.request import prepare, strategy_of
from seqlab.generate.speculative import speculative_loop
from seqlab.generate.text import Stream, StreamChunk, TextStream, until_eos


@dataclass
class GenerationOutput:
    sequences: Tensor  # [B, T_prompt + new] (encoder-decoder: [B, 1 + new], starting with the start token)
    metrics: GenerationMetrics
    scores: Tensor | None = None  # beam search: the length-penalised score of each returned sequence


@contextlib.contextmanager
def _eval_mode(model) -> Iterator[None]:
    """The modules in training mode switched to eval for the block and back after; the others untouched. A model
    already in eval mode (every request of a chat or a server) costs nothing here, where ``model.eval()`` and then
    ``model.train(...)`` set every module's flag through ``nn.Module.__setattr__`` on every request (2.6 ms for the
    6-layer bench model: 1.5 % of its 512-token TTFT)."""
    training = [m for m in model.modules() if m.training]
    for m in training:
        m.training = False
    try:
        yield
    finally:
        for m in training:
            m.training = True


def _beam_chunk(new: Tensor, eos: list[int], text: TextStream | None) -> StreamChunk:
    """Beam search's one chunk: each row's tokens up to its EOS (the padding after it left out), and their text
    where there is a tokenizer."""
    rows = new.tolist()
    tokens = [until_eos(r, eos) for r in rows]
    texts = None
    if text is not None:
        texts, _, _ = text.push(list(range(len(rows))), tokens)
        texts = [t + r for t, r in zip(texts, text.rest())]
    return StreamChunk(0, tokens, texts, [True] * len(rows))


def _run(model, input_ids, attention_mask, cfg: GenerationConfig, draft_model=None, tokenizer=None,
         want_chunks: bool = False) -> Iterator[StreamChunk]:
    """Every strategy, as a generator of stream chunks whose return value is the GenerationOutput."""
    strategy = strategy_of(cfg, draft_model)
    device = input_ids.device if isinstance(input_ids, Tensor) else None
    timing.reset_peak_memory(device)
    clock = timing.Stopwatch(device)  # started before the input checks: the TTFT counts them
    prep = prepare(model, input_ids, attention_mask, cfg,
                   lookahead=cfg.num_speculative_tokens if strategy == "speculative" else 0)
    B = prep.input_ids.shape[0]
    metrics = GenerationMetrics(strategy=strategy, batch_size=B, prompt_tokens=int(prep.lengths.sum()))
    text = None if strategy == "beam" else TextStream.for_request(tokenizer, B, cfg.stop_strings, want_chunks,
                                                                  prep.last_tokens())
    scores = None
    # inference_mode skips autograd bookkeeping on every small op of the decode loop; the returned tensors are
    # cloned outside it below, so callers may use them in autograd later (e.g. as training inputs).
    draft_mode = _eval_mode(draft_model) if draft_model is not None else contextlib.nullcontext()
    with _eval_mode(model), draft_mode, torch.inference_mode():
        if cfg.max_new_tokens == 0:
            new = torch.empty(B, 0, dtype=torch.long, device=device)
        elif strategy == "beam":
            new, scores = beam_search(model, prep, cfg, metrics, clock)
            if want_chunks:  # the whole text at once: beam search settles it only at the end
                yield _beam_chunk(new, prep.eos, TextStream.for_request(tokenizer, B, [], True, prep.last_tokens()))
        else:
            loop = (speculative_loop(model, draft_model, prep, cfg, text, metrics, want_chunks, clock)
                    if strategy == "speculative" else sample_loop(model, prep, cfg, text, metrics, want_chunks, clock))
            new = yield from loop
            if want_chunks and text is not None and any(rest := text.rest()):  # held back, now final
                yield StreamChunk(new.shape[1], [[] for _ in range(B)], rest, [True] * B)
    if prep.encdec:
        start = torch.full((B, 1), decoder_start_token_id(model), dtype=torch.long, device=new.device)
        sequences = torch.cat([start, new], dim=1)
    else:
        sequences = torch.cat([prep.given_ids, new], dim=1)
    sequences = sequences.clone()  # a normal tensor (new/scores were created under inference_mode)
    scores = scores.clone() if scores is not None else None
    metrics.total_s = timing.now(device) - clock.start
    metrics.peak_memory_bytes = timing.peak_memory_bytes(device)
    return GenerationOutput(sequences, metrics, scores)


def _config_from(config: GenerationConfig | None, overrides: dict) -> GenerationConfig:
    if config is None:
        return GenerationConfig(**overrides)
    return config.updated(**overrides) if overrides else config


def generate_output(model, input_ids: Tensor, attention_mask: Tensor | None = None, config: GenerationConfig | None = None,
                    draft_model=None, tokenizer=None, **overrides) -> GenerationOutput:
    """Run a whole request; return sequences, metrics (and beam scores)."""
    cfg = _config_from(config, overrides)
    it = _run(model, input_ids, attention_mask, cfg, draft_model, tokenizer, want_chunks=False)
    while True:
        try:
            next(it)
        except StopIteration as stop:
            return stop.value


class _Default:
    """A parameter of :func:`generate` left out (shown as its value): with ``config=``, only the parameters given
    override the config's fields, even one given at its default value (``do_sample=False`` over a sampling
    config)."""

    def __init__(self, value):
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def generate(model, input_ids: Tensor, attention_mask: Tensor | None = None, max_new_tokens: int = _Default(32),
             do_sample: bool = _Default(False), temperature: float = _Default(1.0), top_k: int = _Default(0),
             top_p: float = _Default(1.0), min_p: float = _Default(0.0), num_beams: int = _Default(1),
             length_penalty: float = _Default(1.0), draft_model=None,
             eos_token_id: int | list[int] | None = _Default(None), seed: int | None = _Default(0), *,
             config: GenerationConfig | None = None, tokenizer=None, **kwargs) -> Tensor:
    """Generate continuations; returns ``LongTensor [B, T_prompt + new]`` in the Hugging Face layout.

    Each row is the prompt as given (padding included) followed by its new tokens, padded (pad id, else EOS)
    after a row's EOS. Encoder-decoders: ``input_ids`` is the source and the result holds the decoder ids,
    starting with the decoder start token. ``eos_token_id=None`` uses ``model.config.eos_token_id``.
    Any other :class:`GenerationConfig` field can be passed as a keyword (``repetition_penalty=1.2``,
    ``stop_strings=[...]`` with ``tokenizer=``), or a whole ``config=``.
    """
    named = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                 top_p=top_p, min_p=min_p, num_beams=num_beams, length_penalty=length_penalty,
                 eos_token_id=eos_token_id, seed=seed)
    if config is None:
        cfg = GenerationConfig(**{k: v.value if isinstance(v, _Default) else v for k, v in named.items()}, **kwargs)
    else:  # only what was given overrides the config
        cfg = _config_from(config, {**{k: v for k, v in named.items() if not isinstance(v, _Default)}, **kwargs})
    return generate_output(model, input_ids, attention_mask, cfg, draft_model, tokenizer).sequences


def stream(model, input_ids: Tensor, attention_mask: Tensor | None = None, config: GenerationConfig | None = None,
           draft_model=None, tokenizer=None, **overrides) -> Stream:
    """Like :func:`generate_output`, but yields each step's new tokens (and text pieces with a tokenizer)."""
    cfg = _config_from(config, overrides)
    return Stream(_run(model, input_ids, attention_mask, cfg, draft_model, tokenizer, want_chunks=True))
