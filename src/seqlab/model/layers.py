"""Norms, MLPs, embeddings and position encodings: the small parts every block is built from."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seqlab.config import ModelConfig


class RMSNorm(nn.Module):
    """Llama's RMSNorm, computed in fp32 (as the reference does) so bf16 runs stay stable."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.normalize = rms_norm  # (x, weight, eps) -> Tensor; seqlab.accel may put a one-pass kernel here

    def forward(self, x: Tensor) -> Tensor:
        return self.normalize(x, self.weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension, in fp32 for bf16 inputs."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # mean(x^2) as |x|^2 / d: on CPU, F.rms_norm is a chain of small ops (pow, mean, two dtype copies...),
        # and a decode step calls the norm twice per layer on one row, where per-op overhead is the cost
        ms = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square().mul_(1.0 / x.shape[-1])
        return x * torch.rsqrt(ms.add_(eps)) * weight
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters, same state dict) whose function is an attribute, as RMSNorm's is."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__(dim, eps=eps)
        self.normalize = F.layer_norm  # F.layer_norm's signature; seqlab.accel may put a one-pass kernel here

    def forward(self, x: Tensor) -> Tensor:
        return self.normalize(x, self.normalized_shape, self.weight, self.bias, self.eps)


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    dim = dim or cfg.d_model
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, cfg.norm_eps)
    return LayerNorm(dim, eps=cfg.norm_eps)


def activation_fn(name: str):
    if name == "gelu":
        return F.gelu
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    return F.silu


class MLP(nn.Module):
    """Position-wise feed-forward. ``swiglu`` fuses gate and up projections into one matmul (``up`` = [gate; up])."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gated = cfg.mlp == "swiglu"
        self.d_ff = cfg.d_ff
        self.up = nn.Linear(cfg.d_model, (2 if self.gated else 1) * cfg.d_ff, bias=cfg.bias)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.act = activation_fn(cfg.activation)
        self.gate = gated_activation  # (act, h, d_ff) -> Tensor; seqlab.accel may put a one-pass kernel here
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.up(x)
        h = self.gate(self.act, h, self.d_ff) if self.gated else self.act(h)
        return self.dropout(self.down(h))


def gated_activation(act, h: Tensor, d_ff: int) -> Tensor:
    """act(gate) * up, for ``h`` = [gate | up] along the last dimension (``d_ff`` each): SwiGLU with SiLU."""
    gate, up = h.split(d_ff, dim=-1)
    return act(gate) * up


class Rotary(nn.Module):
    """Rotary position embedding, rotate-half convention (as Hugging Face Llama).

    cos/sin for every position of the context are tabulated once (computed in fp32, like the reference) and
    gathered by explicit position ids, so padded rows and cache decoding use exactly the positions a single
    unpadded sequence would, and a decode step costs one gather instead of rebuilding the tables.
    """

    def __init__(self, head_dim: int, base: float, max_len: int):
        super().__init__()
        self.head_dim, self.base = head_dim, base
        cos, sin = self._table(max_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _table(self, n: int, device=None) -> tuple[Tensor, Tensor]:
        d = self.head_dim
        probe = torch.empty(0, device=device)
        if probe.is_meta:  # a meta build (quantised loads) has no values; torch's meta kernels here are Python
            return torch.empty(n, d, device=probe.device), torch.empty(n, d, device=probe.device)
        inv_freq = 1.0 / (self.base ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
        freqs = torch.arange(n, dtype=torch.int64, device=device).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def ensure(self, n: int) -> None:
        """Grow the tables to ``n`` positions (rotary positions are not limited to the trained context)."""
        if n > self.cos.shape[0]:
            cos, sin = self._table(n, self.cos.device)
            self.cos, self.sin = cos.to(self.cos.dtype), sin.to(self.sin.dtype)

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """[B, T] positions -> cos, sin of shape [B, T, 1, head_dim] (broadcast over heads)."""
        return self.cos[position_ids][:, :, None].to(dtype), self.sin[position_ids][:, :, None].to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` [B, T, heads, head_dim] by the angles in cos/sin [B, T, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def sinusoidal_embedding(position_ids: Tensor, dim: int) -> Tensor:
    """The fixed encoding of "Attention Is All You Need": sin on even channels, cos on odd ones."""
    half = dim // 2
    freq = torch.exp(-math.log(10000.0) * torch.arange(half, device=position_ids.device).float() * 2 / dim)
    angles = position_ids[..., None].float() * freq
    out = torch.zeros(*position_ids.shape, dim, device=position_ids.device)
    out[..., 0 : 2 * half : 2] = angles.sin()
    out[..., 1 : 2 * half : 2] = angles.cos()
    return out


class Embeddings(nn.Module):
    """Token (+ learned/sinusoidal position, + token type) embeddings, optional scale, norm and dropout.

    ``tok`` may be passed in so that encoder and decoder of an encoder-decoder share one token table.
    """

    def __init__(self, cfg: ModelConfig, tok: nn.Embedding | None = None):
        super().__init__()
        self.cfg = cfg
        self.tok = tok if tok is not None else nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len + cfg.pos_offset, cfg.d_model) if cfg.pos == "learned" else None
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
        self.norm = make_norm(cfg) if cfg.embed_norm else None
        self.dropout = nn.Dropout(cfg.dropout)
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0

    def forward(self, input_ids: Tensor, position_ids: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        x = self.tok(input_ids)
        if self.scale != 1.0:
            x = x * self.scale
        if self.pos is not None:  # positions < max_seq_len: the Stack bounds sequence and cache lengths
            x = x + self.pos(position_ids + self.cfg.pos_offset if self.cfg.pos_offset else position_ids)
        elif self.cfg.pos == "sinusoidal":
            x = x + sinusoidal_embedding(position_ids, self.cfg.d_model).to(x.dtype)
        if self.token_type is not None:
            if token_type_ids is None:
                x = x + self.token_type.weight[0]
            else:
                x = x + self.token_type(token_type_ids)
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)
