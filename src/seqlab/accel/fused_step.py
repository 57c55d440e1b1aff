"""The fused decode step: a Llama-family decoder's whole one-token step in one C call (``fused_step.c``).

Why: a batch-1 decode step is bound by streaming the weights once, but in eager PyTorch each block also runs about
45 small ops whose dispatch adds a quarter of the step (measured on SmolLM2-135M). :class:`FusedDecodeStep` reads
the model's own tensors (no copy: fp32 or bf16 ``nn.Linear`` weights, or the int4/int8 buffers of
:class:`~seqlab.quant.QuantLinear`), so installing it costs no memory, and removing it leaves the plain model.

It is installed from outside by :func:`seqlab.accel.accelerate` (``model.fused_decode``) only where a timed step
beats the plain one on this machine; :func:`seqlab.generate.engine.decode_step` calls it and falls back to the
model whenever it returns ``None`` (a shape, cache or mode it does not handle: training, gradients, another device).
The token embeddings are looked up by the model itself, so any embedding (quantised, scaled) works unchanged.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor, nn

from seqlab.model import masks
from seqlab.model.cache import KVCache
from seqlab.model.layers import RMSNorm
from seqlab.model.slot_cache import SlotKVCache
from seqlab.quant import kernels as quant_kernels
from seqlab.quant.linear import QuantLinear
from seqlab.runtime import native

SOURCE = Path(__file__).with_name("fused_step.c")
_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_Q4, _Q8 = 2, 3
SIMD = Path(__file__).with_name("simd.h")
SOURCES = [SOURCE, quant_kernels.SOURCE, SIMD]  # fused_step.c includes the int products' row bodies and simd.h
i64, ptr = ctypes.c_int64, ctypes.c_void_p


class _Mat(ctypes.Structure):
    _fields_ = [("kind", i64), ("n", i64), ("k", i64), ("g", i64), ("w", ptr), ("scales", ptr), ("mins", ptr),
                ("bias", ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ptr), ("mlp_norm", ptr), ("q_norm", ptr), ("k_norm", ptr), ("qkv", _Mat), ("out", _Mat),
                ("up", _Mat), ("down", _Mat)]


class _Model(ctypes.Structure):
    _fields_ = [("n_layers", i64), ("d", i64), ("n_heads", i64), ("n_kv", i64), ("head_dim", i64), ("d_ff", i64),
                ("max_len", i64), ("cache_bf16", i64), ("eps", ctypes.c_double), ("layers", ctypes.POINTER(_Layer)),
                ("final_norm", ptr), ("head", _Mat)]


def library(isa: str) -> ctypes.CDLL | None:
    """The fused-step library built for ``isa`` ("avx2" or "avx512"), or None where it cannot be built or run."""
    return native.optional_library("fused_step", SOURCE, isa, SOURCES[1:], _signatures,
                                   "seqlab.accel: fused decode step")


def _signatures(dll: ctypes.CDLL) -> None:
    dll.seqlab_fused_decode.argtypes = [ctypes.POINTER(_Model), i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr,
                                        ptr, ptr, ctypes.c_int]
    dll.seqlab_fused_decode.restype = None


def available_isas() -> list[str]:
    return native.runnable_isas(library)


def unsupported(model: nn.Module) -> str | None:
    """Why ``model`` cannot run the fused step (None: it can)."""
    cfg = getattr(model, "config", None)
    if cfg is None or cfg.arch != "decoder":
        return "only decoder models (not encoders or encoder-decoders)"
    wanted = {"norm": "rmsnorm", "pos": "rope", "mlp": "swiglu", "activation": "silu", "pre_norm": True}
    for name, value in wanted.items():
        if getattr(cfg, name) != value:
            return f"config.{name} is {getattr(cfg, name)!r}; the fused step implements {value!r}"
    if cfg.mlm_head_transform:
        return "config.mlm_head_transform: the head has a transform"
    if cfg.n_heads % cfg.n_kv_heads:
        return "n_heads is not a multiple of n_kv_heads"
    if cfg.head_dim % 2:
        return "rotary needs an even head_dim"
    for name, m in _linears(model):
        if _mat_kind(m) is None:
            return f"{name} is a {type(m).__name__} with weights the fused step does not read"
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    if any(n.eps != cfg.norm_eps for n in norms):
        return "the norms do not share config.norm_eps"
    dev = {t.device.type for t in model.parameters()} | {t.device.type for t in model.buffers()}
    if dev != {"cpu"}:
        return "the model is not on the CPU"
    return None


def _linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    names = [f"stack.blocks.{i}.{p}" for i in range(len(model.stack.blocks)) for p in ("attn.qkv", "attn.out", "mlp.up",
                                                                                    "mlp.down")]
    return [(n, model.get_submodule(n)) for n in [*names, "lm_head.proj"]]


def _mat_kind(m: nn.Module) -> int | None:
    if type(m) is nn.Linear:
        return _KINDS.get(m.weight.dtype)
    if isinstance(m, QuantLinear):
        g = m.group_size or m.in_features
        if m.bits == 4 and g % 32 == 0:
            return _Q4
        if m.bits == 8 and g % 8 == 0:
            return _Q8
    return None


class FusedDecodeStep:
    """``step(tokens [B], cache, position_ids [B, 1] | None) -> logits [B, vocab]``, or None where it does not apply.

    Holds references to the tensors it points into; if the model's tensors are replaced (``model.to``, a quantised
    swap) the next call sees it and rebuilds its tables from the model (or returns None if it no longer fits).
    """

    def __init__(self, model: nn.Module, isa: str = "avx2"):
        reason = unsupported(model)
        if reason:
            raise ValueError(f"fused decode step: {reason}")
        self.model, self.isa = model, isa
        lib = library(isa)
        if lib is None:
            raise RuntimeError(f"fused decode step: the {isa} library is not available here")
        self._fn = lib.seqlab_fused_decode
        self._build()

    def __deepcopy__(self, memo):  # a copied model must not call into the original's tensors
        return None

    def _fingerprint(self) -> tuple:
        m = self.model
        return (m.stack.rotary.cos.data_ptr(), *(_first_tensor(lin).data_ptr() for _, lin in self._lins))

    def _build(self) -> None:
        m, cfg = self.model, self.model.config
        self._lins = _linears(m)
        keep: list[Tensor] = []

        def f32(t: Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.detach().float().contiguous()
            keep.append(t)
            return t.data_ptr()

        def mat(lin: nn.Module) -> _Mat:
            kind = _mat_kind(lin)
            if isinstance(lin, QuantLinear):
                w = lin.qweight.contiguous()
                keep.append(w)
                return _Mat(kind, lin.out_features, lin.in_features, lin.group_size or lin.in_features, w.data_ptr(),
                            f32(lin.scales), f32(lin.mins), f32(lin.bias))
            w = lin.weight.detach().contiguous()
            keep.append(w)
            return _Mat(kind, lin.out_features, lin.in_features, 0, w.data_ptr(), None, None, f32(lin.bias))

        layers = (_Layer * len(m.stack.blocks))()
        for i, blk in enumerate(m.stack.blocks):
            a = blk.attn
            layers[i] = _Layer(f32(blk.attn_norm.weight), f32(blk.mlp_norm.weight),
                               f32(a.q_norm.weight) if a.q_norm is not None else None,
                               f32(a.k_norm.weight) if a.k_norm is not None else None,
                               mat(a.qkv), mat(a.out), mat(blk.mlp.up), mat(blk.mlp.down))
        norm = m.stack.norm
        self._cos, self._sin = (t.float().contiguous() for t in (m.stack.rotary.cos, m.stack.rotary.sin))
        self._desc = _Model(len(m.stack.blocks), cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, 0, 0,
                            cfg.norm_eps, layers, f32(norm.weight) if isinstance(norm, RMSNorm) else None,
                            mat(m.lm_head.proj))
        self._layers, self._keep = layers, keep
        self.dtype = next(p.dtype for p in m.parameters() if p.is_floating_point())
        self._seen = self._fingerprint()

    def fresh(self) -> bool:
        """Rebuild if the model's tensors were replaced since the tables were made; False if it no longer fits."""
        if self._fingerprint() == self._seen:
            return True
        if unsupported(self.model):
            return False
        self._build()
        return True

    def __call__(self, tokens: Tensor, cache, position_ids: Tensor | None = None) -> Tensor | None:
        m = self.model
        if m.training or (torch.is_grad_enabled() and any(p.requires_grad for p in m.lm_head.parameters())):
            return None
        if not isinstance(cache, KVCache) or tokens.device.type != "cpu" or not self.fresh():
            return None
        k0, v0, B, cfg = cache.k[0], cache.v[0], tokens.numel(), m.config
        shape = (cfg.n_kv_heads, k0.shape[2], cfg.head_dim)  # the C code trusts every layout it is given
        if (k0.dtype not in _KINDS or B != cache.batch_size or len(cache.k) != cfg.n_layers or k0.shape[0] < B
                or any(t.shape[1:] != shape or t.dtype != k0.dtype or not t.is_contiguous() for t in (k0, v0))):
            return None
        ids = tokens.reshape(B, 1)
        if position_ids is None:
            position_ids = masks.cached_positions(cache, B, 1, None, device=ids.device)
        slot = cache.pos  # before reserve: the slot this step writes (a slot cache's longest row)
        cache.reserve(1)
        slots = cache.fill[:B].contiguous() if isinstance(cache, SlotKVCache) else None
        valid = None if cache.dense else cache.valid.contiguous()
        x = m.stack.embed(ids, position_ids).reshape(B, -1).float().contiguous()
        pos = position_ids.reshape(B).contiguous()
        if int(pos.max()) >= self._cos.shape[0] or int(pos.min()) < 0:  # the C code trusts its table rows
            raise IndexError(f"position {int(pos.max())} is outside the rotary table ({self._cos.shape[0]} rows)")
        logits = torch.empty(B, cfg.vocab_size)
        n = len(cache.k)
        kp = (ctypes.c_void_p * n)(*(t.data_ptr() for t in cache.k))
        vp = (ctypes.c_void_p * n)(*(t.data_ptr() for t in cache.v))
        self._desc.max_len, self._desc.cache_bf16 = k0.shape[2], int(k0.dtype == torch.bfloat16)
        self._fn(ctypes.byref(self._desc), B, x.data_ptr(), slot, None if slots is None else slots.data_ptr(),
                 pos.data_ptr(), self._cos.data_ptr(), self._sin.data_ptr(),
                 None if valid is None else valid.data_ptr(), slot + 1, kp, vp, logits.data_ptr(),
                 torch.get_num_threads())
        cache.advance(1)
        return logits if self.dtype == torch.float32 else logits.to(self.dtype)


def _first_tensor(m: nn.Module) -> Tensor:
    return m.qweight if isinstance(m, QuantLinear) else m.weight
