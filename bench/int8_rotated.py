"""Whether rotating SmolLM2 first (QuaRot's trick) makes an int8 prefill as faithful as a bf16 one.

    python bench/int8_rotated.py                 # natively and under the AVX2 caps (where the CPU has more)
    python bench/int8_rotated.py --isa avx2      # one instruction set

Why: ``bench/int8_prefill.py`` found int8 products fast enough for 1.3x HF's TTFT under the AVX2 caps, but too
lossy, because one scale per token cannot cover SmolLM2's outlier channels. An orthogonal rotation of the
residual stream spreads those outliers over every channel and leaves the fp32 model's function unchanged
(RMSNorm is rotation-invariant once its gain is folded into the next product), so per-token int8 loses less.
This measures how much less, and what is left.

The rotated twin (the model itself is untouched; the twin is a probe, not a route):

* every RMSNorm gain folded into the products that read it (QKV, gate/up, LM head), the gains set to 1;
* the residual stream rotated by ``Q`` = kron(random orthogonal 9x9, random-sign Hadamard 64x64) (576 wide):
  embedding ``E Q``, input products ``W Q``, output products ``Q^T W``, LM head untied;
* online block Hadamards where no residual rotation reaches: on each head's values before the attention output
  product, and on blocks of 128 of the SwiGLU output before the down product (folded into those weights too).
  Keys and values come out unrotated, so the twin's KV cache is the plain model's.

Variants, against the plain fp32 model over ``--chunks`` x 512 tokens of the validation play:

* ``rotated w8a8``: the twin with every product int8 (``torch._int_mm``, weights per output channel in the range
  probed as in ``int8_prefill.py``, activations per token), timed as a 512-token TTFT against fp32 and HF;
* ``rotated a8``: the twin with activations rounded to int8 per token and fp32 weights (simulated), the error
  that activations alone leave after the rotation;
* ``rotated w8 (+-N)``: the twin with weights rounded to int8 per output channel in the probed range and fp32
  activations (simulated), the error that the weights alone leave;
* ``plain a8``: the activations' rounding on the plain model (gains folded, nothing rotated), the error before it;
* ``rotated fp32``: the twin unquantised, which must match the plain model to fp32 rounding.

Simplified against QuaRot: plain round-to-nearest weights (no GPTQ), no clipping, 128-wide Hadamard blocks on
the SwiGLU output instead of one over all of it.

Writes ``bench/results/int8_rotated.json``.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int8_prefill import (  # noqa: E402
    Int8Products, converted, load_probe, per_isa_parent, probe_options, quality, quantize_rows, ttft,
)

from seqlab.runtime import atomic_write_json  # noqa: E402

RESIDUAL_HADAMARD = 64  # the Hadamard factor of the residual rotation (576 = 9 x 64)
DOWN_BLOCK = 128  # the online Hadamard's block on the SwiGLU output (1536 = 12 x 128)


def random_orthogonal(n: int, g: torch.Generator) -> Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    # QR returns a column-major Q, and torch.kron fails on it ("view size is not compatible"): hence contiguous
    return (q * torch.sign(torch.diagonal(r))).float().contiguous()


def random_hadamard(n: int, g: torch.Generator) -> Tensor:
    """Sylvester's Hadamard matrix (n a power of two), normalised, with random column signs: orthogonal."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power of two, not {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    signs = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
    return h * signs / n ** 0.5


def fold_gains(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with each RMSNorm gain folded into the products that read it, and the gains set to 1:
    the same function. The LM head is untied from the embedding (it takes the final gain)."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        stack = twin.stack
        twin.lm_head.proj.weight = nn.Parameter(twin.lm_head.proj.weight * stack.norm.weight)
        stack.norm.weight.fill_(1.0)
        for block in stack.blocks:
            for norm, reader in ((block.attn_norm, block.attn.qkv), (block.mlp_norm, block.mlp.up)):
                reader.weight.mul_(norm.weight)
                norm.weight.fill_(1.0)
    return twin


def rotated_twin(model: nn.Module, seed: int = 0) -> tuple[nn.Module, dict[int, Tensor]]:
    """A copy of ``model`` computing the same function in a rotated basis, and the online rotation to apply to
    the input of each product that needs one (keyed by the id of its weight)."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    llama_like = (cfg.norm == "rmsnorm" and cfg.pre_norm and cfg.final_norm and cfg.pos == "rope"
                  and not cfg.embed_norm and not cfg.mlm_head_transform and cfg.mlp == "swiglu")
    if not llama_like or cfg.d_model % RESIDUAL_HADAMARD or cfg.d_ff % DOWN_BLOCK:
        sys.exit("this probe rotates pre-norm RMSNorm/RoPE/SwiGLU decoders whose widths fit its blocks (SmolLM2)")
    twin = fold_gains(model)
    q = torch.kron(random_orthogonal(cfg.d_model // RESIDUAL_HADAMARD, g), random_hadamard(RESIDUAL_HADAMARD, g))
    online: dict[int, Tensor] = {}
    with torch.no_grad():
        twin.lm_head.proj.weight.copy_(twin.lm_head.proj.weight @ q)
        twin.stack.embed.tok.weight.copy_(twin.stack.embed.tok.weight @ q)
        for block in twin.stack.blocks:
            for reader in (block.attn.qkv, block.mlp.up):
                reader.weight.copy_(reader.weight @ q)
            # per head before the output product: folding it into W_v instead would cost nothing at run time, but
            # would rotate the values in the KV cache, which the plain model then reads
            for writer, width in ((block.attn.out, cfg.head_dim), (block.mlp.down, DOWN_BLOCK)):
                h = random_hadamard(width, g)
                writer.weight.copy_(q.t() @ writer.weight @ torch.block_diag(*[h] * (writer.weight.shape[1] // width)))
                online[id(writer.weight)] = h  # applied per block of ``width``: a dense block_diag would cost more
                if writer.bias is not None:
                    writer.bias.copy_(writer.bias @ q)
    return twin, online


class Rotating(TorchFunctionMode):
    """Applies the online rotations; ``inner`` (an int8 mode, or None) then computes the product."""

    def __init__(self, online: dict[int, Tensor], inner: TorchFunctionMode | None):
        super().__init__()
        self.online, self.inner = online, inner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            h = self.online.get(id(args[1]))
            if h is not None:
                x = args[0]
                args = ((x.unflatten(-1, (-1, h.shape[0])) @ h).flatten(-2), *args[1:])
            if self.inner is not None:
                return self.inner.__torch_function__(func, types, args, kwargs)
        return func(*args, **kwargs)


def rounded(t: Tensor, limit: int) -> Tensor:
    """``t`` rounded to symmetric int8 per row and back to fp32 (simulated quantisation)."""
    t2 = t.reshape(-1, t.shape[-1])
    q, scale = quantize_rows(t2, limit)
    return (q.float() * scale[:, None]).reshape(t.shape)


class Int8Rounding(TorchFunctionMode):
    """One side of the converted products rounded to int8 (simulated in fp32), the other kept fp32: the
    activations per token (``side="activations"``), or the weights per output channel in ``weight_limit``."""

    def __init__(self, vocab: int, side: str, weight_limit: int = 127):
        super().__init__()
        self.vocab, self.side, self.weight_limit = vocab, side, weight_limit
        self.weights: dict[tuple[int, int], Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and converted(args, self.vocab):
            x, w = args[0], args[1]
            if self.side == "activations":
                x = rounded(x, 127)
            else:
                key = (id(w), w._version)
                if key not in self.weights:
                    self.weights[key] = rounded(w, self.weight_limit)
                w = self.weights[key]
            args = (x, w, *args[2:])
        return func(*args, **kwargs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    probe_options(ap, "int8_rotated.json")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random rotations")
    args = ap.parse_args(argv)
    if per_isa_parent(__file__, args, argv):
        return 0
    pr = load_probe(args)
    vocab, limit = pr.vocab, pr.weight_limit
    twin, online = rotated_twin(pr.model, args.seed)
    rotated_w8a8 = Rotating(online, Int8Products(vocab, limit))
    modes = {"rotated w8a8": rotated_w8a8,
             "rotated a8": Rotating(online, Int8Rounding(vocab, "activations")),
             f"rotated w8 (+-{limit})": Rotating(online, Int8Rounding(vocab, "weights", limit)),
             "plain a8": Int8Rounding(vocab, "activations"), "rotated fp32": Rotating(online, None)}
    twins = {name: twin for name in modes} | {"plain a8": fold_gains(pr.model)}
    atomic_write_json(args.out, pr.meta | {
        "seed": args.seed,
        "quality": quality(pr.model, pr.ids, modes, args.chunks, twins=twins),
        "ttft": ttft(pr.model, pr.hf, pr.ids[:, :args.ttft_len], {"rotated w8a8": rotated_w8a8}, args.repeats,
                     twins=twins)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
