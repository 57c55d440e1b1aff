"""Decoder, Encoder and EncoderDecoder: one block, three arrangements.

- ``Decoder`` (GPT / Llama): causal self-attention, LM head. Serves language modelling, generation and NNQS.
- ``Encoder`` (BERT): bidirectional self-attention, masked-LM head.
- ``EncoderDecoder`` (BART / T5): an encoder, and a decoder whose blocks add cross-attention over its output.

Every model splits into ``body`` (ids -> final hidden states) and ``head`` (hidden -> logits), so callers that need
only the last position's logits (decoding) or only hidden states (embeddings, the NNQS phase head) pay for nothing
else. The model never knows which objective it serves.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor, nn

from seqlab.config import ModelConfig
from seqlab.model import masks
from seqlab.model.attention import AttentionInputs, CrossAttention, CrossInputs, SelfAttention, pick_rows
from seqlab.model.cache import KVCache
from seqlab.model.layers import MLP, Embeddings, Rotary, activation_fn, make_norm


class Block(nn.Module):
    """Self-attention (+ cross-attention) + MLP, each a residual branch, with pre- or post-norm."""

    def __init__(self, cfg: ModelConfig, cross: bool = False):
        super().__init__()
        self.pre_norm = cfg.pre_norm
        self.attn_norm = make_norm(cfg)
        self.attn = SelfAttention(cfg)
        self.cross_norm = make_norm(cfg) if cross else None
        self.cross_attn = CrossAttention(cfg) if cross else None
        self.mlp_norm = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, inputs: AttentionInputs, layer: int, cross: CrossInputs | None = None,
                queries: Tensor | None = None) -> Tensor:
        """``queries`` ([B] positions): only those rows go on past the attention (see ``SelfAttention``)."""
        residual = x if queries is None else pick_rows(x, queries)
        if self.pre_norm:
            x = residual + self.attn(self.attn_norm(x), inputs, layer, queries)
            if self.cross_attn is not None:
                x = x + self.cross_attn(self.cross_norm(x), cross, layer)
            return x + self.mlp(self.mlp_norm(x))
        x = self.attn_norm(residual + self.attn(x, inputs, layer, queries))
        if self.cross_attn is not None:
            x = self.cross_norm(x + self.cross_attn(x, cross, layer))
        return self.mlp_norm(x + self.mlp(x))


def _all_true(mask: Tensor) -> bool:
    return bool(mask.all())


class Stack(nn.Module):
    """Embeddings -> blocks -> final norm, with the masks and positions of one pass prepared once."""

    def __init__(self, cfg: ModelConfig, n_layers: int, causal: bool, cross: bool, tok: nn.Embedding | None = None):
        super().__init__()
        self.cfg, self.causal = cfg, causal
        self.embed = Embeddings(cfg, tok)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_base, cfg.max_seq_len) if cfg.pos == "rope" else None
        self.blocks = nn.ModuleList(Block(cfg, cross) for _ in range(n_layers))
        self.norm = make_norm(cfg) if cfg.final_norm else nn.Identity()

    def new_cache(self, batch_size: int, max_len: int, dtype=None, device=None,
                  positions: int | None = None) -> KVCache:
        """A cache of ``max_len`` slots per row. ``positions``: the most positions a row reaches, where fewer than the
        slots (a speculative batch leaves holes that positions skip); the model's length limits apply to them."""
        self._check_length(max_len if positions is None else positions)
        # dtype and device from a stored tensor: a swapped-in embedding may compute ``weight`` (a whole-table copy)
        p = next(t for t in itertools.chain(self.parameters(), self.buffers()) if t.is_floating_point())
        return KVCache(len(self.blocks), batch_size, self.cfg.n_kv_heads, self.cfg.head_dim, max_len,
                       dtype=dtype or p.dtype, device=device or p.device)

    def _check_length(self, n: int) -> None:
        """Learned positions end at max_seq_len; rotary ones extend (their table grows, outside the decode loop) up to
        a sliding-window model's window, past which full attention is no longer that model."""
        window = self.cfg.attention_window
        if window is not None and n > window:
            raise ValueError(f"{n} positions exceed this model's attention window ({window}): it attends to the last "
                             f"{window} positions only, which seqlab's full attention equals only up to {window}")
        if n > self.cfg.max_seq_len:
            if self.cfg.pos == "learned":
                raise ValueError(f"{n} positions exceed the learned position table (max_seq_len={self.cfg.max_seq_len})")
            if self.rotary is not None:
                self.rotary.ensure(n)

    def _prepare(self, input_ids, attention_mask, position_ids, cache, document_ids) -> tuple[AttentionInputs, Tensor]:
        B, T = input_ids.shape
        device = input_ids.device
        if cache is None:
            self._check_length(T)
            if document_ids is not None or (attention_mask is not None and _all_true(attention_mask)):
                attention_mask = None  # packed documents bring their own mask; an all-ones mask masks nothing
            if position_ids is None:
                position_ids = masks.positions(B, T, attention_mask, document_ids, device=device)
            mask = masks.self_attention_mask(T, self.causal, attention_mask, document_ids)
            return AttentionInputs(mask=mask, is_causal=self.causal and mask is None), position_ids
        if not self.causal:
            raise ValueError("a KV cache only makes sense for causal (decoder) self-attention")
        if cache.batch_size != B:
            raise ValueError(f"cache holds {cache.batch_size} rows but the input has {B}")
        if position_ids is None:
            position_ids = masks.cached_positions(cache, B, T, attention_mask, device=device)
        cache.reserve(T, attention_mask)
        mask, is_causal = masks.cached_attention(cache, T)
        return AttentionInputs(mask=mask, is_causal=is_causal, cache=cache), position_ids

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: KVCache | None = None,
        document_ids: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        cross: CrossInputs | None = None,
        keep: Tensor | None = None,
    ) -> Tensor:
        """Final hidden states [B, T, d]; with ``keep`` ([B] positions) only row b's position ``keep[b]``,
        [B, 1, d]: every layer but the last still runs on every position (the cache needs their K/V), the last
        one's queries, output and MLP only on the kept ones (a prefill needs no more; docs/generation.md)."""
        inputs, position_ids = self._prepare(input_ids, attention_mask, position_ids, cache, document_ids)
        x = self.embed(input_ids, position_ids, token_type_ids)
        if self.rotary is not None:
            inputs.rope = self.rotary(position_ids, x.dtype)
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            if keep is not None and i == last:
                x = block(x, inputs.for_queries(keep, input_ids.shape[1]), i, cross, keep)
            else:
                x = block(x, inputs, i, cross)
        if cache is not None:
            cache.advance(input_ids.shape[1])
        return self.norm(x)


class LMHead(nn.Module):
    """Output projection (optionally tied to the token table), with BERT's optional transform and a logit bias."""

    def __init__(self, cfg: ModelConfig, tok: nn.Embedding):
        super().__init__()
        self.transform = None
        if cfg.mlm_head_transform:
            self.transform = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_model), _Activation(cfg.activation), make_norm(cfg))
        self.proj = nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.lm_head_bias)
        if cfg.tie_embeddings:
            self.proj.weight = tok.weight

    def forward(self, h: Tensor) -> Tensor:
        if self.transform is not None:
            h = self.transform(h)
        return self.proj(h)


class _Activation(nn.Module):
    def __init__(self, name: str):
        super().__init__()
        self.fn = activation_fn(name)

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x)


class _Model(nn.Module):
    config: ModelConfig
    lm_head: LMHead

    def head(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)

    def _init_weights(self) -> None:
        """GPT-2 initialisation: N(0, std) weights, zero biases, residual projections scaled by 1/sqrt(2L)."""
        std = self.config.init_std
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                scale = 1 / math.sqrt(2 * self.config.n_layers) if name.endswith(("out.weight", "down.weight")) else 1
                nn.init.normal_(p, 0.0, std * scale)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        seen = {id(p): p for p in self.parameters()}
        n = sum(p.numel() for p in seen.values())
        if exclude_embeddings:
            n -= sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Embedding))
        return n


class _OneStack(_Model):
    """Decoder and Encoder: one stack of blocks (causal or not) under an LM head that may share its embedding."""

    causal: bool

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.stack = Stack(cfg, cfg.n_layers, causal=self.causal, cross=False)
        self.lm_head = LMHead(cfg, self.stack.embed.tok)
        self._init_weights()

    @property
    def blocks(self) -> nn.ModuleList:
        return self.stack.blocks


class Decoder(_OneStack):
    causal = True

    def new_cache(self, batch_size: int, max_len: int | None = None, dtype=None, device=None,
                  positions: int | None = None) -> KVCache:
        return self.stack.new_cache(batch_size, max_len or self.config.max_seq_len, dtype, device, positions)

    def body(self, input_ids, attention_mask=None, position_ids=None, cache=None, document_ids=None,
             keep=None) -> Tensor:
        return self.stack(input_ids, attention_mask, position_ids, cache, document_ids, keep=keep)

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, document_ids=None) -> Tensor:
        return self.head(self.body(input_ids, attention_mask, position_ids, cache, document_ids))


class Encoder(_OneStack):
    causal = False

    def body(self, input_ids, attention_mask=None, position_ids=None, token_type_ids=None, document_ids=None) -> Tensor:
        return self.stack(input_ids, attention_mask, position_ids, None, document_ids, token_type_ids)

    def forward(self, input_ids, attention_mask=None, position_ids=None, token_type_ids=None, document_ids=None) -> Tensor:
        return self.head(self.body(input_ids, attention_mask, position_ids, token_type_ids, document_ids))


class EncoderDecoder(_Model):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = Stack(cfg, cfg.n_layers, causal=False, cross=False, tok=self.shared)
        self.decoder = Stack(cfg, cfg.n_decoder_layers, causal=True, cross=True, tok=self.shared)
        self.lm_head = LMHead(cfg, self.shared)
        self._init_weights()

    @property
    def blocks(self) -> nn.ModuleList:
        return nn.ModuleList([*self.encoder.blocks, *self.decoder.blocks])

    def new_cache(self, batch_size: int, max_len: int | None = None, dtype=None, device=None) -> KVCache:
        return self.decoder.new_cache(batch_size, max_len or self.config.max_seq_len, dtype, device)

    def encode(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.encoder(input_ids, attention_mask)

    def decode_body(self, decoder_input_ids, memory, memory_mask=None, cache=None,
                    decoder_attention_mask=None, position_ids=None) -> Tensor:
        if cache is not None and cache.memory_mask is None and memory_mask is not None:
            cache.memory_mask = memory_mask.bool()
        key_valid = cache.memory_mask if cache is not None and cache.memory_mask is not None else memory_mask
        mask = None
        if key_valid is not None and not _all_true(key_valid):
            mask = masks.ensure_attendable(masks.padding_mask(key_valid))
        cross = CrossInputs(memory=memory, mask=mask, cache=cache)
        return self.decoder(decoder_input_ids, decoder_attention_mask, position_ids, cache, cross=cross)

    def decode(self, decoder_input_ids, memory, memory_mask=None, cache=None,
               decoder_attention_mask=None, position_ids=None) -> Tensor:
        return self.head(self.decode_body(decoder_input_ids, memory, memory_mask, cache, decoder_attention_mask, position_ids))

    def forward(self, input_ids, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                cache=None, encoder_hidden=None) -> Tensor:
        if decoder_input_ids is None:
            raise ValueError("encoder_decoder models need decoder_input_ids")
        memory = encoder_hidden if encoder_hidden is not None else self.encode(input_ids, attention_mask)
        return self.decode(decoder_input_ids, memory, attention_mask, cache, decoder_attention_mask)


def build_model(cfg: ModelConfig) -> Decoder | Encoder | EncoderDecoder:
    """The one constructor: the architecture comes from ``cfg.arch``."""
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"build_model takes a ModelConfig (ModelConfig(...), or ModelConfig.from_dict(d) for a "
                        f"dict), got {type(cfg).__name__}")
    return {"decoder": Decoder, "encoder": Encoder, "encoder_decoder": EncoderDecoder}[cfg.arch](cfg)
