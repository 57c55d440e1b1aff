"""The two model calls every strategy is built on: ``prefill`` once, then ``decode_step`` one position per row.

    prompt [B, T] --prefill--> cache filled with T positions per layer, logits for position T
              token_1 --decode_step--> cache += 1 position, logits for position T+1
              token_2 --decode_step--> ...

``prefill`` is the training forward pass without gradients (all known positions in parallel); ``decode_step`` feeds
one new token per row and reads the history from the KV cache. Both work for seqlab decoders and encoder-decoders
(the encoder runs once inside ``prefill``; the cache keeps the cross-attention K/V). The engine never knows whether
tokens are words or orbitals: the NNQS sampler calls these two functions directly.
"""
from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch import Tensor

from seqlab.runtime.cpu import compile_keyed_by_isa


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
    if last_index is None and not is_encoder_decoder(model):
        last_index = torch.full((input_ids.shape[0],), input_ids.shape[1] - 1, dtype=torch.long,
                                device=input_ids.device)
    cast = getattr(model, "prefill_cast", None)  # installed from outside (seqlab.accel): a long prompt's products
    with cast.context(input_ids.numel()) if cast is not None else contextlib.nullcontext():
        if is_encoder_decoder(model):
            memory = model.encode(input_ids, attention_mask)
            if decoder_input_ids is None:
                start = decoder_start_token_id(model)
                decoder_input_ids = torch.full((input_ids.shape[0], 1), start, dtype=torch.long,
                                               device=input_ids.device)
            h = model.decode_body(decoder_input_ids, memory, attention_mask, cache=cache)
        else:  # the last layer runs on each row's last real position only: nothing else reaches the logits
            h = model.body(input_ids, attention_mask, cache=cache, keep=last_index)
    with cast.head_context(input_ids.numel()) if cast is not None else contextlib.nullcontext():
        return model.head(h[:, -1])


def decode_step(model, tokens: Tensor, cache, position_ids: Tensor | None = None) -> Tensor:
    """Feed one token per row (``tokens`` [B]) and return the next-token logits ``[B, V]``.

    ``position_ids`` ([B, 1]) may be passed by a loop that tracks them, which saves recomputing them from the
    cache's fill level every step; left as None the model derives them (the same values).
    """
    fused = getattr(model, "fused_decode", None)  # a whole-step kernel installed from outside (seqlab.accel)
    if fused is not None and not torch.compiler.is_compiling():
        logits = fused(tokens, cache, position_ids)
        if logits is not None:  # None: a case it does not handle (gradients, another device or cache)
            return logits
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
    serves every step and batch size, and the whole step is one graph. Worth it when per-step Python/dispatch
    overhead is a large part of the step (small models, CPU). On CPU the graph is called through Inductor's C++
    wrapper, because the Python wrapper's per-kernel launch cost is most of what a one-token step would save.
    """
    fn = _COMPILED.get(model)
    if fn is None:
        device = next(model.parameters()).device
        options = {"cpp_wrapper": True} if device.type == "cpu" else None
        fn = compile_keyed_by_isa(functools.partial(decode_step, model), dynamic=True, options=options)
        _COMPILED[model] = fn
    return fn


def step_fn(model, use_compile: bool):
    """The decode step a loop should call: ``fn(tokens, cache, position_ids) -> logits``."""
    return compiled_decode_step(model) if use_compile else functools.partial(decode_step, model)
