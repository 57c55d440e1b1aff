"""Self- and cross-attention over PyTorch SDPA, reading and writing a KVCache.

Q, K and V come from one fused projection (one matmul instead of three); grouped-query attention is SDPA's
``enable_gqa`` so K/V are never repeated in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seqlab.config import ModelConfig
from seqlab.model.cache import KVCache
from seqlab.model.layers import RMSNorm, apply_rotary


@dataclass
class AttentionInputs:
    """What every self-attention layer of one forward pass shares: mask, rotary tables and the cache."""

    mask: Tensor | None = None  # bool, True = attend, broadcastable to [B, H, Tq, Tk]
    is_causal: bool = False  # use SDPA's own causal masking (only when queries and keys start together)
    rope: tuple[Tensor, Tensor] | None = None
    cache: KVCache | None = None

    def for_queries(self, queries: Tensor, n_keys: int) -> AttentionInputs:
        """The same pass with one query per row, row b's at position ``queries[b]`` of this pass: its mask row.

        The causal case needs no mask where every row keeps its last position (it sees every key)."""
        B = queries.shape[0]
        if self.mask is not None:
            mask = self.mask
            if mask.shape[2] > 1:
                mask = mask.expand(B, -1, -1, -1)[torch.arange(B, device=mask.device), :, queries].unsqueeze(2)
        elif self.is_causal and bool((queries < n_keys - 1).any()):
            mask = (torch.arange(n_keys, device=queries.device) <= queries[:, None])[:, None, None, :]
        else:
            mask = None
        return AttentionInputs(mask=mask, is_causal=False, rope=self.rope, cache=self.cache)


@dataclass
class CrossInputs:
    memory: Tensor | None  # encoder output [B, S, d]; may be None when the cache already holds cross K/V
    mask: Tensor | None  # [B, 1, 1, S]
    cache: KVCache | None = None


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=cfg.qkv_bias)
        self.out = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.bias)
        # Qwen3: each query/key head is RMS-normalised (over head_dim) before the rotation
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.rotate = apply_rotary  # (x, cos, sin) -> Tensor; seqlab.accel may put a one-pass kernel here
        self.attend = F.scaled_dot_product_attention  # seqlab.accel may put a causal prefill kernel here
        self.attn_dropout = cfg.attn_dropout
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, inputs: AttentionInputs, layer: int, queries: Tensor | None = None) -> Tensor:
        """``queries`` ([B] positions, optional): every position's K/V (and cache entry) but only that position's
        query and output per row, [B, 1, d]; a prefill needs no more of its last layer."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        qk, v = self.qkv(x).split(((H + Hkv) * D, Hkv * D), dim=-1)
        qk = qk.view(B, T, H + Hkv, D)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :, :H]), self.k_norm(qk[:, :, H:])), dim=2)
        if inputs.rope is not None:  # one rotation for queries and keys together
            qk = self.rotate(qk, *inputs.rope)
        q, k = (t.transpose(1, 2) for t in qk.split((H, Hkv), dim=2))  # one split: its backward is one cat
        v = v.view(B, T, Hkv, D).transpose(1, 2)
        if inputs.cache is not None:
            k, v = inputs.cache.update(layer, k, v)
        if queries is not None:
            q, T = pick_rows(q, queries, dim=2), 1
        y = self.attend(
            q, k, v,
            attn_mask=inputs.mask,
            is_causal=inputs.is_causal,
            dropout_p=self.attn_dropout if self.training else 0.0,
            enable_gqa=H != Hkv,
        )
        return self.dropout(self.out(y.transpose(1, 2).reshape(B, T, H * D)))


def pick_rows(x: Tensor, rows: Tensor, dim: int = 1) -> Tensor:
    """Position ``rows[b]`` of each batch row b along ``dim``, kept as a length-1 dimension."""
    index = (torch.arange(x.shape[0], device=x.device),) + (slice(None),) * (dim - 1) + (rows,)
    return x[index].unsqueeze(dim)


class CrossAttention(nn.Module):
    """Decoder queries over encoder memory; K/V of the memory are computed once and kept in the cache."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.kv = nn.Linear(cfg.d_model, 2 * cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.out = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.bias)
        self.attn_dropout = cfg.attn_dropout
        self.dropout = nn.Dropout(cfg.dropout)

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        B, S, _ = memory.shape
        k, v = self.kv(memory).view(B, S, 2, self.n_kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return k, v

    def forward(self, x: Tensor, inputs: CrossInputs, layer: int) -> Tensor:
        B, T, _ = x.shape
        H, D = self.n_heads, self.head_dim
        cache = inputs.cache
        if cache is not None and cache.cross_k[layer] is not None:
            k, v = cache.cross_k[layer], cache.cross_v[layer]
        else:
            if inputs.memory is None:
                raise ValueError("cross-attention needs encoder memory (or a cache that already holds its K/V)")
            k, v = self.memory_kv(inputs.memory)
            if cache is not None:
                cache.cross_k[layer], cache.cross_v[layer] = k, v
        q = self.q(x).view(B, T, H, D).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype),
            attn_mask=inputs.mask,
            dropout_p=self.attn_dropout if self.training else 0.0,
            enable_gqa=H != self.n_kv_heads,
        )
        return self.dropout(self.out(y.transpose(1, 2).reshape(B, T, H * D)))
