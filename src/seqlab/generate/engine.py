"""The generation engine: prefill once, then decode one position per row, on a cache allocated once per request.

    prompt [B, T] --prefill--> cache filled with T positions per layer, logits for position T
              token_1 --decode_step--> cache += 1 position, logits for position T+1
              token_2 --decode_step--> ...

``prefill`` is the training forward pass without gradients (all known positions in parallel); ``decode_step`` feeds
one new token per row and reads the history from the KV cache. Both work for seqlab decoders and encoder-decoders
(the encoder runs once inside ``prefill``; the cache keeps the cross-attention K/V). The engine never knows whether
tokens are words or orbitals.

Batches: rows may be left-padded (the usual layout; positions come from the cache's per-row fill level so a
padded row gets the positions it would have alone) or right-padded (the next-token logits are read at each row's
last real token; later tokens land after the holes, which attention skips). A row stops at EOS or a stop string;
with ``compact_finished`` finished rows are dropped from the batch and the cache (``cache.reorder``) so they stop
costing compute. The output keeps the Hugging Face layout: prompt as given, then new tokens, pad after EOS.
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from seqlab.eval import timing
from seqlab.generate.config import GenerationConfig
from seqlab.generate.metrics import GenerationMetrics
from seqlab.generate.sampling import LogitsProcessor, mark_seen, seen_mask


# ----------------------------------------------------------------------------------------------------------
# The two model calls.


def is_encoder_decoder(model) -> bool:
    return getattr(model.config, "arch", "decoder") == "encoder_decoder"


def decoder_start_token_id(model) -> int:
    cfg = model.config
    for name in ("decoder_start_token_id", "bos_token_id", "pad_token_id"):
        value = getattr(cfg, name, None)
        if value is not None:
            return int(value)
    raise ValueError("encoder-decoder generation needs ModelConfig.decoder_start_token_id (or bos/pad) to start "
                     "the decoder")


def prefill(model, input_ids: Tensor, cache, attention_mask: Tensor | None = None,
            decoder_input_ids: Tensor | None = None, last_index: Tensor | None = None) -> Tensor:
    """Process the known tokens in one parallel pass, filling ``cache``; return next-token logits ``[B, V]``.

    Decoder: ``input_ids`` is the prompt. ``last_index`` ([B], optional) says where each row's last real token
    is (right padding); by default the last column.
    Encoder-decoder: ``input_ids`` is the source; the encoder runs once, then the decoder processes
    ``decoder_input_ids`` (default: the decoder start token), computing and caching cross-attention K/V.
    """
    if is_encoder_decoder(model):
        memory = model.encode(input_ids, attention_mask)
        if decoder_input_ids is None:
            start = decoder_start_token_id(model)
            decoder_input_ids = torch.full((input_ids.shape[0], 1), start, dtype=torch.long, device=input_ids.device)
        h = model.decode_body(decoder_input_ids, memory, attention_mask, cache=cache)
        return model.head(h[:, -1])
    h = model.body(input_ids, attention_mask, cache=cache)
    if last_index is None:
        return model.head(h[:, -1])
    return model.head(h[torch.arange(h.shape[0], device=h.device), last_index])


def decode_step(model, tokens: Tensor, cache, position_ids: Tensor | None = None) -> Tensor:
    """Feed one token per row (``tokens`` [B]) and return the next-token logits ``[B, V]``.

    ``position_ids`` ([B, 1]) may be passed by a loop that tracks them, which saves recomputing them from the
    cache's fill level every step; left as None the model derives them (the same values).
    """
    ids = tokens.view(-1, 1)
    if is_encoder_decoder(model):
        h = model.decode_body(ids, None, None, cache=cache, position_ids=position_ids)
    else:
        h = model.body(ids, position_ids=position_ids, cache=cache)
    return model.head(h[:, -1])


_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def compiled_decode_step(model):
    """``decode_step`` under ``torch.compile`` for this model (compiled once, reused by every request).

    Shapes are marked dynamic from the start (the cache's filled length grows every step), so one compilation
    serves every step and batch size, and the whole step is one graph (no graph breaks). Worth it when per-step
    Python/dispatch overhead is a large part of the step (small models, CPU); the first request pays the
    compilation (tens of seconds to minutes). On CPU the graph is called through Inductor's C++ wrapper: the
    Python wrapper costs tens of microseconds per kernel launch, which for a one-token step is most of the
    saving compilation was for.
    """
    fn = _COMPILED.get(model)
    if fn is None:
        device = next(model.parameters()).device
        options = {"cpp_wrapper": True} if device.type == "cpu" else None
        fn = torch.compile(functools.partial(decode_step, model), dynamic=True, options=options)
        _COMPILED[model] = fn
    return fn


def step_fn(model, use_compile: bool):
    """The decode step a loop should call: ``fn(tokens, cache, position_ids) -> logits``."""
    return compiled_decode_step(model) if use_compile else functools.partial(decode_step, model)


# ----------------------------------------------------------------------------------------------------------
# Request preparation shared by every strategy.


@dataclass
class Prepared:
    input_ids: Tensor  # possibly truncated prompt (decoder) or source (encoder-decoder)
    attention_mask: Tensor | None  # None when every token is real
    lengths: Tensor  # [B] real tokens per row
    last_index: Tensor | None  # [B] for right-padded decoder prompts, else None
    eos: list[int]
    pad: int
    encdec: bool


def infer_attention_mask(input_ids: Tensor, attention_mask: Tensor | None, pad: int | None, eos: list[int]) -> Tensor | None:
    """Hugging Face's rule: with no mask given, a pad id (that is not also EOS) present in the input marks padding."""
    if attention_mask is not None:
        return attention_mask
    if pad is not None and pad not in eos and bool((input_ids == pad).any()):
        return (input_ids != pad).long()
    return None


def prepare(model, input_ids: Tensor, attention_mask: Tensor | None, cfg: GenerationConfig) -> Prepared:
    """Validate shapes and lengths; apply the documented truncation; find each row's last real token."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [batch, length] tensor, got "
                         f"{tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__}")
    if input_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    input_ids = input_ids.long()
    mcfg = model.config
    B, T = input_ids.shape
    if B == 0 or T == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}); a prompt needs at least one token")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= mcfg.vocab_size:
        raise ValueError(f"input_ids hold ids outside the vocabulary [0, {mcfg.vocab_size}): "
                         f"min {int(input_ids.min())}, max {int(input_ids.max())}")
    eos = cfg.eos_ids(mcfg)
    pad = cfg.pad_id(mcfg)
    explicit_pad = cfg.pad_token_id if cfg.pad_token_id is not None else getattr(mcfg, "pad_token_id", None)
    attention_mask = infer_attention_mask(input_ids, attention_mask, explicit_pad, eos)
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
        attention_mask = attention_mask.to(input_ids.device).long()
        if bool(attention_mask.all()):
            attention_mask = None
    lengths = attention_mask.sum(1) if attention_mask is not None else torch.full((B,), T, device=input_ids.device)
    if int(lengths.min()) == 0:
        raise ValueError(f"row {int(lengths.argmin())} of the batch has no real prompt tokens (attention_mask all 0)")

    encdec = is_encoder_decoder(model)
    limit = mcfg.max_seq_len
    longest = int(lengths.max())
    if longest > limit or (not encdec and mcfg.pos == "learned" and longest + cfg.max_new_tokens > limit):
        need = longest if longest > limit else longest + cfg.max_new_tokens
        what = "prompt" if not encdec else "source"
        if not cfg.truncate_prompt:
            size = (f"{longest} tokens" if longest > limit
                    else f"{longest} tokens + max_new_tokens={cfg.max_new_tokens} = {need}")
            raise ValueError(
                f"{what} of {size} exceeds the model's context (ModelConfig.max_seq_len={limit}); shorten it, "
                f"lower max_new_tokens, or set GenerationConfig.truncate_prompt=True to keep the last tokens")
        keep = limit if (encdec or mcfg.pos != "learned") else limit - cfg.max_new_tokens
        if keep < 1:
            raise ValueError(f"max_new_tokens={cfg.max_new_tokens} leaves no room for a prompt in the context "
                             f"(ModelConfig.max_seq_len={limit})")
        if attention_mask is not None and not bool(attention_mask[:, -1].all()):
            raise ValueError("truncate_prompt needs left-padded (or unpadded) prompts")
        input_ids = input_ids[:, -keep:]
        attention_mask = attention_mask[:, -keep:] if attention_mask is not None else None
        lengths = lengths.clamp(max=keep)

    if encdec and getattr(mcfg, "pos", None) == "learned" and 1 + cfg.max_new_tokens > limit:
        raise ValueError(f"max_new_tokens={cfg.max_new_tokens} + the decoder start token exceeds the decoder's "
                         f"learned positions (ModelConfig.max_seq_len={limit})")
    last_index = None
    if not encdec and attention_mask is not None and not bool(attention_mask[:, -1].all()):
        cols = torch.arange(input_ids.shape[1], device=input_ids.device)
        last_index = (attention_mask * (cols + 1)).argmax(dim=1)  # right padding: the last real column per row
    return Prepared(input_ids, attention_mask, lengths, last_index, eos, pad, encdec)


class TextTracker:
    """Incremental detokenization per row, for streaming text and stop strings.

    Decodes the row's generated ids so far and emits what was added since last time; holds back text that
    ends in U+FFFD (an incomplete UTF-8 byte sequence that the next token will complete).
    """

    def __init__(self, tokenizer, batch_size: int, stop_strings: list[str]):
        self.tokenizer = tokenizer
        self.ids: list[list[int]] = [[] for _ in range(batch_size)]
        self.emitted = [0] * batch_size
        self.stop_strings = stop_strings
        self.text = [""] * batch_size

    def push(self, row: int, tokens: list[int]) -> tuple[str, bool]:
        """Append tokens to ``row``; return (new text piece, whether a stop string now occurs)."""
        self.ids[row].extend(tokens)
        text = self.tokenizer.decode(self.ids[row])
        self.text[row] = text
        stopped = any(s in text for s in self.stop_strings)
        if text.endswith("\ufffd") and not stopped:
            return "", False
        piece = text[self.emitted[row]:]
        self.emitted[row] = len(text)
        return piece, stopped


@dataclass
class StreamChunk:
    """What one step (or speculative round) added: per original row, the new token ids and text piece."""

    step: int
    tokens: list[list[int]]
    texts: list[str] | None = None
    finished: list[bool] = field(default_factory=list)


@dataclass
class GenerationOutput:
    sequences: Tensor  # [B, T_prompt + new] (encoder-decoder: [B, 1 + new], starting with the start token)
    metrics: GenerationMetrics
    scores: Tensor | None = None  # beam search: the length-penalised score of each returned sequence


def strategy_of(cfg: GenerationConfig, draft_model) -> str:
    if draft_model is not None:
        return "speculative"
    if cfg.num_beams > 1:
        return "beam"
    return "greedy" if cfg.greedy else "sample"


def make_generator(cfg: GenerationConfig, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    if cfg.seed is None:
        g.seed()
    else:
        g.manual_seed(int(cfg.seed))
    return g


# ----------------------------------------------------------------------------------------------------------
# Greedy / sampling loop.


def _sample_loop(model, prep: Prepared, cfg: GenerationConfig, tokenizer, metrics: GenerationMetrics,
                 want_chunks: bool) -> Iterator[StreamChunk]:
    """Prefill + decode for greedy and sampling; yields chunks, returns the new-token block [B, steps]."""
    device = prep.input_ids.device
    B, T = prep.input_ids.shape
    max_new = cfg.max_new_tokens
    proc = LogitsProcessor(cfg.sampling())
    gen = None if proc.greedy else make_generator(cfg, device)
    dtype = next(model.parameters()).dtype

    clock = timing.Stopwatch(device)
    if prep.encdec:
        cache = model.new_cache(B, 1 + max_new, dtype=dtype, device=device)
        logits = prefill(model, prep.input_ids, cache, prep.attention_mask)
        pos_ids = torch.ones(B, 1, dtype=torch.long, device=device)
        context = torch.full((B, 1), decoder_start_token_id(model), dtype=torch.long, device=device)
        seen = seen_mask(context, None, model.config.vocab_size) if cfg.repetition_penalty != 1.0 else None
    else:
        cache = model.new_cache(B, T + max_new, dtype=dtype, device=device)
        logits = prefill(model, prep.input_ids, cache, prep.attention_mask, last_index=prep.last_index)
        pos_ids = prep.lengths.view(B, 1).clone()
        seen = (seen_mask(prep.input_ids, prep.attention_mask, model.config.vocab_size)
                if cfg.repetition_penalty != 1.0 else None)
    metrics.kv_cache_bytes = cache.nbytes

    out = torch.full((B, max_new), prep.pad, dtype=torch.long, device=device)
    rows = torch.arange(B, device=device)  # original row of each live cache row
    unfinished = torch.ones(B, dtype=torch.bool, device=device)
    eos = torch.tensor(prep.eos, dtype=torch.long, device=device) if prep.eos else None
    tracker = TextTracker(tokenizer, B, cfg.stop_strings) if (tokenizer is not None and (want_chunks or cfg.stop_strings)) else None
    if cfg.stop_strings and tokenizer is None:
        raise ValueError("GenerationConfig.stop_strings needs a tokenizer (pass tokenizer=...)")
    new_tokens = 0
    steps = 0
    step_call = step_fn(model, cfg.compile)
    for step in range(max_new):
        if step > 0:
            logits = step_call(tok, cache, pos_ids)
            pos_ids += 1
            steps += 1
        tok = proc.select(logits, seen, gen)
        if not cfg.compact_finished:
            tok = tok.masked_fill(~unfinished, prep.pad)
        out[rows, step] = tok
        if seen is not None:
            mark_seen(seen, tok)
        hit = torch.isin(tok, eos) if eos is not None else None
        texts = None
        if tracker is not None:
            tok_list, row_list, live = tok.tolist(), rows.tolist(), unfinished.tolist()
            texts = [""] * B
            stop_hits = []
            for i, (r, t) in enumerate(zip(row_list, tok_list)):
                if not live[i]:
                    stop_hits.append(False)
                    continue
                piece, stopped = tracker.push(r, [t])
                texts[r] = piece
                stop_hits.append(stopped)
            if cfg.stop_strings:
                s = torch.tensor(stop_hits, device=device)
                hit = s if hit is None else hit | s
        new_tokens += len(rows) if cfg.compact_finished else int(unfinished.sum())
        if step == 0:
            metrics.ttft_s = clock.lap("prefill")
        if want_chunks:
            toks = [[] for _ in range(B)]
            fin = [True] * B
            for i, (r, t) in enumerate(zip(rows.tolist(), tok.tolist())):
                if bool(unfinished[i]):
                    toks[r] = [t]
            if hit is not None:
                still = unfinished & ~hit
            else:
                still = unfinished
            for i, r in enumerate(rows.tolist()):
                fin[r] = not bool(still[i])
            yield StreamChunk(step, toks, texts, fin)
        if hit is not None:
            unfinished = unfinished & ~hit
            if not bool(unfinished.any()):
                break
            if cfg.compact_finished and not bool(unfinished.all()):
                keep = unfinished.nonzero().squeeze(1)
                cache.reorder(keep)
                rows, tok, pos_ids, unfinished = rows[keep], tok[keep], pos_ids[keep], unfinished[keep]
                if seen is not None:
                    seen = seen[keep]
    clock.lap("decode")
    metrics.decode_s = clock.laps.get("decode", 0.0)
    metrics.steps = steps
    metrics.new_tokens = new_tokens
    metrics.finish(new_tokens - B)  # the first token of each row belongs to the prefill (TTFT)
    n = step + 1 if max_new else 0
    return out[:, :n]


# ----------------------------------------------------------------------------------------------------------
# Public entry points.


def _run(model, input_ids, attention_mask, cfg: GenerationConfig, draft_model=None, tokenizer=None,
         want_chunks: bool = False) -> Iterator[StreamChunk]:
    """Every strategy, as a generator of stream chunks whose return value is the GenerationOutput."""
    strategy = strategy_of(cfg, draft_model)
    device = input_ids.device if isinstance(input_ids, Tensor) else None
    timing.reset_peak_memory(device)
    t0 = timing.now(device)
    prep = prepare(model, input_ids, attention_mask, cfg)
    metrics = GenerationMetrics(strategy=strategy, batch_size=prep.input_ids.shape[0],
                                prompt_tokens=int(prep.lengths.sum()))
    was_training = model.training
    model.eval()
    try:
        # inference_mode skips autograd bookkeeping on every small op of the decode loop; the returned tensors
        # are cloned outside it below, so callers may use them in autograd later (e.g. as training inputs).
        with torch.inference_mode():
            if cfg.max_new_tokens == 0:
                new = torch.empty(prep.input_ids.shape[0], 0, dtype=torch.long, device=device)
                scores = None
            elif strategy == "beam":
                from seqlab.generate.beam import beam_search

                new, scores = beam_search(model, prep, cfg, metrics)
                if want_chunks:
                    yield StreamChunk(0, new.tolist(), None, [True] * new.shape[0])
            elif strategy == "speculative":
                from seqlab.generate.speculative import speculative_loop

                scores = None
                new = yield from speculative_loop(model, draft_model, prep, cfg, tokenizer, metrics, want_chunks)
            else:
                scores = None
                new = yield from _sample_loop(model, prep, cfg, tokenizer, metrics, want_chunks)
    finally:
        model.train(was_training)
    if prep.encdec:
        start = torch.full((new.shape[0], 1), decoder_start_token_id(model), dtype=torch.long, device=new.device)
        sequences = torch.cat([start, new], dim=1)
    else:
        sequences = torch.cat([prep.input_ids, new], dim=1)
    sequences = sequences.clone()  # a normal tensor (new/scores were created under inference_mode)
    scores = scores.clone() if scores is not None else None
    metrics.total_s = timing.now(device) - t0
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


def generate(model, input_ids: Tensor, attention_mask: Tensor | None = None, max_new_tokens: int = 32,
             do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             min_p: float = 0.0, num_beams: int = 1, length_penalty: float = 1.0, draft_model=None,
             eos_token_id: int | list[int] | None = None, seed: int | None = 0, *,
             config: GenerationConfig | None = None, tokenizer=None, **kwargs) -> Tensor:
    """Generate continuations; returns ``LongTensor [B, T_prompt + new]`` in the Hugging Face layout.

    Each row is the prompt as given (padding included) followed by its new tokens, padded (pad id, else EOS)
    after a row's EOS. Encoder-decoders: ``input_ids`` is the source and the result holds the decoder ids,
    starting with the decoder start token. ``eos_token_id=None`` uses ``model.config.eos_token_id``.
    Any other :class:`GenerationConfig` field can be passed as a keyword (``repetition_penalty=1.2``,
    ``stop_strings=[...]`` with ``tokenizer=``), or a whole ``config=``.
    """
    fields = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                  top_p=top_p, min_p=min_p, num_beams=num_beams, length_penalty=length_penalty,
                  eos_token_id=eos_token_id, seed=seed, **kwargs)
    if config is not None:
        defaults = GenerationConfig()
        fields = {k: v for k, v in fields.items() if k in kwargs or getattr(defaults, k) != v}
    cfg = _config_from(config, fields)
    return generate_output(model, input_ids, attention_mask, cfg, draft_model, tokenizer).sequences


class Stream:
    """Iterate to receive :class:`StreamChunk` s as they are produced; afterwards ``.output`` holds the result.

    >>> s = stream(model, ids, max_new_tokens=20, tokenizer=tok)
    >>> for chunk in s: print(chunk.texts[0], end="", flush=True)
    >>> s.output.metrics.ttft_s
    """

    def __init__(self, it: Iterator[StreamChunk]):
        self._it = it
        self.output: GenerationOutput | None = None

    def __iter__(self) -> Iterator[StreamChunk]:
        if self.output is not None:
            raise RuntimeError("this Stream was already consumed; call stream(...) again")
        self.output = yield from self._it
        return self.output


def stream(model, input_ids: Tensor, attention_mask: Tensor | None = None, config: GenerationConfig | None = None,
           draft_model=None, tokenizer=None, **overrides) -> Stream:
    """Like :func:`generate_output`, but yields each step's new tokens (and text pieces with a tokenizer)."""
    cfg = _config_from(config, overrides)
    return Stream(_run(model, input_ids, attention_mask, cfg, draft_model, tokenizer, want_chunks=True))
