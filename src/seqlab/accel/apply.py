"""``accelerate(model, for_=...)``: pick routes and a dtype for a built model by measurement, and apply them.

Why from outside: the model is math only (plain ``nn.Linear``), so it stays correct on every machine and under
every tool (autograd, export, compile); the CPU-specific choices live here, are measured on the running machine
(:mod:`seqlab.accel.calibrate`) and can be removed again (:func:`restore_plain`) to get the same, slower model.

``accelerate`` converts **in place** and returns the same model object (as ``model.to`` does): copy first
(``copy.deepcopy``) to keep a plain one. ``seqlab.generate.generate`` never calls it; the CLI does.
"""
from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from seqlab.accel.calibrate import (MIN_GAIN, cache_path, count_measuring, dtype_name, fastest, load_cache, measured,
                                    measuring_time, shape_key, store_cache, time_routes)
from seqlab.accel.cross_entropy import choose_cross_entropy
from seqlab.accel.fused_gelu import choose_gelu
from seqlab.accel.fused_gelu import install as install_gelu
from seqlab.accel.fused_layer_norm import choose_layer_norm
from seqlab.accel.fused_layer_norm import install as install_norm
from seqlab.accel.pointwise import choose_pointwise
from seqlab.accel.pointwise import install as install_pointwise
from seqlab.runtime.cpu import current_signature, native_bf16
from seqlab.runtime.memory import move_to_huge_pages
from seqlab.accel.routes import USES, Route, Use, builtin_routes
from seqlab.accel.prefill import choose_prefill_cast
from seqlab.accel.prefill import install as install_routing
from seqlab.accel.prefill import uninstall as uninstall_routing
from seqlab.accel.prefill_attention import choose_attention
from seqlab.accel.restore import restore_plain, restore_plain_layers
from seqlab.accel.prefill_attention import install as install_attention
from seqlab.accel.step_check import choose_fused
from seqlab.accel.train_attention import choose_train_attention
from seqlab.accel.train_attention import install as install_train_attention
from seqlab.accel.verify import pass_key, time_pass

# bf16 changes the numbers (about 3 significant digits), so "auto" takes it only where it is clearly faster
BF16_MIN_SPEEDUP = 1.25
DISABLE_ENV = "SEQLAB_ACCEL"  # SEQLAB_ACCEL=0: accelerate() leaves every model plain
DEFAULT_BUDGET_S = 10.0
# rows a calibration product uses for prefill / training when the caller does not say (a shape class, not a limit)
DEFAULT_ROWS = {"decode": 1, "prefill": 128, "train": 256}
# longer prefills and bigger training batches are calibrated at this many rows (the choice hardly changes beyond)
MAX_CALIBRATION_ROWS = 256


@dataclass
class ShapeChoice:
    in_features: int
    out_features: int
    count: int  # layers of this shape in the model
    route: str
    timings_s: dict[str, float]  # route -> seconds per product


@dataclass
class AccelPlan:
    """What :func:`accelerate` chose: the compute dtype, and a route per product shape, with the timings."""

    for_: str
    rows: int
    dtype: str
    shapes: dict[str, list[ShapeChoice]] = field(default_factory=dict)  # dtype -> per-shape choices
    dtype_totals_s: dict[str, float] = field(default_factory=dict)  # dtype -> summed best time of every layer
    # seconds spent taking timings now, by accelerate's every step (plan_for alone: its products); 0.0: every
    # timing came from the cache
    calibration_s: float = 0.0
    signature: str = ""
    cache_file: str = ""  # where the timings are kept ("": not cached)
    # the whole-pass check (seqlab.accel.verify): seconds per pass over the converted layers, "dense" and "plan"
    pass_s: dict[str, float] = field(default_factory=dict)
    kept: bool = True  # False: the routes lost the whole-pass check and the model was left plain
    # the fused decode step (seqlab.accel.fused_step): seconds per step, "plain" and each library build timed
    step_s: dict[str, float] = field(default_factory=dict)
    fused: str = ""  # the build installed as model.fused_decode ("" when none: the per-product routes apply)
    # bf16 prefill of an fp32 model (seqlab.accel.prefill): seconds per prefill ("fp32@L", "bf16@L"), and the
    # prompt length from which it is used (0: never)
    prefill_s: dict[str, float] = field(default_factory=dict)
    prefill_from: int = 0
    prefill_route: str = ""  # PrefillCast.label: "64+ tokens in fp32 on oneDNN, 256+ in bf16"; "" when plain
    # a long prompt's causal attention (seqlab.accel.prefill_attention): seconds per attention of one prompt
    # ("sdpa@L", "avx2@L", ...), and what runs ("SDPA", or the kernel's build and the lengths it takes)
    attention_s: dict[str, float] = field(default_factory=dict)
    attention: str = ""
    # RMSNorm, rotary and SwiGLU of many rows (seqlab.accel.pointwise): seconds per layer's worth ("torch@R",
    # "avx2@R", ...), and what runs
    pointwise_s: dict[str, float] = field(default_factory=dict)
    pointwise: str = ""
    huge_page_bytes: int = 0  # weights moved onto 2 MiB pages (seqlab.runtime.memory.move_to_huge_pages)
    # training: the MLP activation (seqlab.accel.fused_gelu), seconds per forward + backward of each candidate
    act_s: dict[str, float] = field(default_factory=dict)
    act: str = ""  # the one installed ("" when torch's stays)
    # training: a pre-norm block's LayerNorms (seqlab.accel.fused_layer_norm), seconds per forward + backward
    # ("fp32 torch", "bf16 avx512", ...), and what runs ("" when torch's stays)
    norm_s: dict[str, float] = field(default_factory=dict)
    norm: str = ""
    # training: the causal self-attention (seqlab.accel.train_attention), seconds per layer's forward + backward
    # ("fp32 sdpa", "fp32 avx2", ...), and what runs ("" when SDPA stays)
    train_attention_s: dict[str, float] = field(default_factory=dict)
    train_attention: str = ""
    # training: the loss's cross-entropy and gradient (seqlab.accel.cross_entropy), seconds per forward + backward
    # ("fp32 torch", "fp32 avx2", ...), and what runs ("" when torch's route stays)
    cross_entropy_s: dict[str, float] = field(default_factory=dict)
    cross_entropy: str = ""

    def route_for(self, in_features: int, out_features: int) -> str:
        if not self.kept or self.fused:
            return "dense"
        for c in self.shapes.get(self.dtype, []):
            if (c.in_features, c.out_features) == (in_features, out_features):
                return c.route
        return "dense"

    def summary(self) -> str:
        where = f"cached in {self.cache_file}" if self.cache_file else "not cached"
        timed = (f"calibrated in {self.calibration_s:.1f} s, {where}" if self.calibration_s or not self.cache_file
                 else f"timings from {self.cache_file} (delete it to measure again)")
        rows = f"{self.rows} row{'s' if self.rows != 1 else ''}/product"
        lines = [f"accel for {self.for_} ({rows}): dtype {self.dtype}; {timed}"]
        for dt, total in self.dtype_totals_s.items():
            if not self.shapes.get(dt):  # no nn.Linear left to route (a quantised model: seqlab.quant times its own)
                continue
            # where the fused step won, _accelerate returned before converting a layer: the routes were only timed
            unused = "; not applied: the fused step runs every decode step on the plain layers" if self.fused else ""
            lines.append(f"  {dt}: all products {total * 1e3:.3f} ms{unused}")
            for c in self.shapes.get(dt, []):
                times = ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in c.timings_s.items())
                kept = c.timings_s.get(c.route)  # a route must win by MIN_GAIN: a closer one leaves the plain one
                margin = (f"; within the {MIN_GAIN:.0%} margin" if kept is not None and c.route == "dense"
                          and min(c.timings_s.values()) < kept else "")
                lines.append(f"    {c.in_features:>6d} -> {c.out_features:<6d} x{c.count:<3d} {c.route:<20s} "
                             f"({times}{margin})")
        if self.huge_page_bytes:
            lines.append(f"  weights on 2 MiB pages: {self.huge_page_bytes / 2**20:.0f} MiB")
        if self.act_s:
            times = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in self.act_s.items())
            lines.append(f"  MLP activation (forward + backward): {times}; {self.act or 'torch'} runs")
        if self.norm_s:
            times = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in self.norm_s.items())
            lines.append(f"  block LayerNorm (forward + backward): {times}; {self.norm or 'torch'} runs")
        if self.train_attention_s:
            times = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in self.train_attention_s.items())
            lines.append(f"  causal attention (one layer, forward + backward): {times}; "
                         f"{self.train_attention or 'SDPA'} runs")
        if self.cross_entropy_s:
            times = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in self.cross_entropy_s.items())
            lines.append(f"  loss cross-entropy (forward + backward): {times}; {self.cross_entropy or 'torch'} runs")
        if self.attention_s:
            times = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in self.attention_s.items())
            lines.append(f"  prefill attention (one prompt, all heads): {times}; {self.attention}")
        if self.pointwise_s:
            times = ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in self.pointwise_s.items())
            lines.append(f"  RMSNorm + rotary + SwiGLU (one layer): {times}; {self.pointwise or 'torch'}")
        if self.prefill_s:
            times = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.prefill_s.items())
            verdict = (f"prompts of {self.prefill_route}" if self.prefill_from
                       else "prefill stays on plain fp32 products")
            lines.append(f"  prefill: {times}; {verdict}")
        if self.step_s:
            times = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in self.step_s.items())
            verdict = f"the fused step ({self.fused}) runs every decode step" if self.fused else "plain step kept"
            lines.append(f"  whole decode step: {times}; {verdict}")
        if self.pass_s:
            verdict = "routes kept" if self.kept else "routes dropped: the model stays plain"
            lines.append(f"  whole pass over the converted layers: plain {self.pass_s['dense'] * 1e3:.3f} ms, "
                         f"routes {self.pass_s['plan'] * 1e3:.3f} ms; {verdict}")
        return "\n".join(lines)


def _linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear and m.weight.device.type == "cpu"]


def _candidate_dtypes(model: nn.Module, for_: str, rows: int, dtype: str | torch.dtype | None) -> list[torch.dtype]:
    current = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if for_ == "train":
        current = torch.float32  # master weights stay fp32; bf16 means autocast
    if dtype is None:
        return [current]
    if isinstance(dtype, torch.dtype):
        return [dtype]
    if dtype != "auto":
        return [{"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]]
    wants_bf16 = for_ in ("prefill", "train") or rows > 1  # batch-1 decode keeps fp32's exact greedy tokens
    if current == torch.float32 and wants_bf16 and native_bf16():
        return [torch.float32, torch.bfloat16]
    return [current]


def plan_for(model: nn.Module, for_: str = "decode", *, rows: int | None = None,
             dtype: str | torch.dtype | None = "auto", routes: Sequence[Route] = (), budget_s: float = DEFAULT_BUDGET_S,
             use_cache: bool = True) -> AccelPlan:
    """Measure (or read from the cache) the routes for every linear shape of ``model``; change nothing."""
    if for_ not in USES:
        raise ValueError(f"accelerate: for_ must be one of {', '.join(USES)}, not {for_!r}")
    rows = int(rows or DEFAULT_ROWS[for_])
    if rows < 1:
        raise ValueError(f"accelerate: rows must be >= 1, not {rows}")
    all_routes = _all_routes(routes)
    sig = current_signature()
    entries = load_cache(sig) if use_cache else {}
    shapes = Counter((m.in_features, m.out_features, m.bias is not None) for _, m in _linears(model))
    dtypes = _candidate_dtypes(model, for_, rows, dtype)
    calib_rows = rows if for_ == "decode" else min(rows, MAX_CALIBRATION_ROWS)
    uses = [Use(for_, calib_rows, dt) for dt in dtypes]
    known = {r.name for r in all_routes}
    extra = known - {r.name for r in builtin_routes()}

    def key(use: Use, shape: tuple[int, int, bool]) -> str:
        return shape_key(use, *shape, extra_routes=extra)

    todo = [(use, s) for use in uses for s in shapes if "dense" not in entries.get(key(use, s), {})]  # (always timed)
    t0 = time.perf_counter()
    measured = {key(use, s): time_routes(use, *s, all_routes, budget_s / len(todo)) for use, s in todo}
    plan = AccelPlan(for_, rows, dtype_name(dtypes[0]), signature=sig.key(),
                     calibration_s=time.perf_counter() - t0 if todo else 0.0)
    count_measuring(plan.calibration_s)
    entries = (store_cache(sig, measured, replace=[k for k in measured if k in entries]) if use_cache else {}) | {
        k: v for k, v in measured.items() if not use_cache}
    if use_cache and cache_path(sig).is_file():  # (an unwritable cache folder costs a recalibration, said so)
        plan.cache_file = str(cache_path(sig))
    for use in uses:
        choices, total = [], 0.0
        for (i, o, b), n in shapes.items():
            # a route the cache names that this process lacks (a newer seqlab's, a hand edit) cannot be chosen
            timings = {r: t for r, t in entries[key(use, (i, o, b))].items() if r in known}
            best = fastest(timings)
            choices.append(ShapeChoice(i, o, n, best, timings))
            total += n * timings[best]
        plan.shapes[dtype_name(use.dtype)] = choices
        plan.dtype_totals_s[dtype_name(use.dtype)] = total
    totals = plan.dtype_totals_s
    if "bf16" in totals and "fp32" in totals and totals["fp32"] > 0:  # no dense product timed (a quantised
        plan.dtype = "bf16" if totals["bf16"] * BF16_MIN_SPEEDUP <= totals["fp32"] else "fp32"  # model): fp32
    return plan


def _all_routes(extra: Sequence[Route]) -> list[Route]:
    """The plain route first, then the caller's, then seqlab's own (names are unique: the first one wins)."""
    ours = builtin_routes()
    routes: dict[str, Route] = {}
    for r in [ours[0], *extra, *ours[1:]]:
        routes.setdefault(r.name, r)
    return list(routes.values())


def accelerate(model: nn.Module, for_: str = "decode", *, rows: int | None = None,
               dtype: str | torch.dtype | None = "auto", routes: Sequence[Route] = (),
               budget_s: float = DEFAULT_BUDGET_S, use_cache: bool = True, verify: bool = True,
               fused: bool = True, seq_len: int | None = None) -> nn.Module:
    """Convert ``model`` in place for ``for_`` (``decode``, ``prefill`` or ``train``) and return it.

    ``rows``: activation rows per product (decode: batch x beams; default per use). ``dtype``: ``"auto"`` (bf16
    where the CPU has it natively and it measures clearly faster; never for batch-1 decode), ``None`` (keep the
    model's), ``"fp32"``/``"bf16"``. For training the parameters stay fp32 and the plan's ``dtype`` is the autocast
    dtype to use. ``routes``: extra :class:`~seqlab.accel.routes.Route`\\ s to consider (e.g. quantised ones).
    ``seq_len``: for training, the tokens per sequence of a step (default: the model's ``max_seq_len``, at most
    ``rows``), the shape its causal attention is timed at.
    ``verify``: for inference, also time one pass over the converted layers before and after, and leave the model
    plain unless the routes win there too (:mod:`seqlab.accel.verify`). For decoding, a fused whole step
    (:mod:`seqlab.accel.fused_step`) is timed against the plain one first; where it wins it is installed as
    ``model.fused_decode`` and the layers stay plain. The chosen plan is kept as ``model.accel_plan``.
    The measurements draw on a forked random generator: a seeded run (dropout masks, data order) is the same
    whether the calibration cache was cold or warm.
    """
    with torch.random.fork_rng(devices=[]), measuring_time() as measured:
        model = _accelerate(model, for_, rows, dtype, routes, budget_s, use_cache, verify, fused, seq_len)
    plan = model.__dict__.get("accel_plan")
    if plan is not None:  # every step's timing, not only the products'
        plan.calibration_s = measured[0]
    return model


def _accelerate(model: nn.Module, for_: str, rows: int | None, dtype: str | torch.dtype | None,
                routes: Sequence[Route], budget_s: float, use_cache: bool, verify: bool, fused: bool,
                seq_len: int | None) -> nn.Module:
    restore_plain(model)
    if os.environ.get(DISABLE_ENV, "").strip() in ("0", "off", "false", "no"):
        return model  # the plain model: the switch that tells a slow route from a wrong one
    plan = plan_for(model, for_, rows=rows, dtype=dtype, routes=routes, budget_s=budget_s, use_cache=use_cache)
    compute = {"fp32": torch.float32, "bf16": torch.bfloat16}[plan.dtype]
    current = next((p.dtype for p in model.parameters() if p.is_floating_point()), compute)
    if for_ != "train" and compute != current:
        model.__dict__.setdefault("accel_plain_dtype", current)  # restore_plain casts back to it
        model.to(compute)
    if for_ != "train":  # weights streamed once per step: on 2 MiB pages where the kernel has them
        plan.huge_page_bytes = move_to_huge_pages([*model.parameters(), *model.buffers()])
    cfg = model.config
    if for_ == "decode" and cfg.arch == "decoder":  # a long prompt's causal attention: the kernel where it wins
        attention = choose_attention(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.max_seq_len, use_cache, compute)
        plan.attention_s, plan.attention = attention.timings_s, attention.label
        if attention.isa is not None:
            install_attention(model, attention)
            model.prefill_attention = attention
    if for_ == "decode" and compute == torch.float32 and cfg.arch == "decoder":  # before the prefill's routes are
        kernels, plan.pointwise_s = choose_pointwise(model, use_cache)          # timed, as the prefill will run
        if kernels is not None:
            install_pointwise(model, kernels)
            plan.pointwise = f"{kernels.min_rows}+ rows on seqlab's kernels ({kernels.isa})"
    if for_ == "decode" and compute == torch.float32 and cfg.arch != "encoder":  # an encoder has no prompt to fill
        # bf16 products only under "auto"; oneDNN's fp32 always (timed with the attention just chosen)
        cast, plan.prefill_s = choose_prefill_cast(model, use_cache=use_cache, allow_bf16=dtype == "auto")
        if cast is not None:  # fp32 weights and decode steps, another route for prompts of min_tokens or more
            model.prefill_cast, plan.prefill_from, plan.prefill_route = cast, cast.min_tokens, cast.label
    if for_ == "decode" and fused:
        step, plan.step_s = choose_fused(model, plan.rows, use_cache=use_cache)
        if step is not None:  # the whole step in one call: it reads the plain layers, so they stay as they are
            model.fused_decode, plan.fused = step, step.isa
            model.accel_plan = plan
            return model
    # the prefill's oneDNN switch, off the layers while they are timed and converted: a routed layer refers to
    # itself (its forward holds it), so a replaced one would wait for the garbage collector instead of going at once
    routed = uninstall_routing(model)
    by_name = {r.name: r for r in _all_routes(routes)}
    use = Use(for_, plan.rows, compute if for_ != "train" else torch.float32)
    # (name, route, shape): names, not modules, so that no list keeps a replaced dense layer alive
    shapes = {name: (m.in_features, m.out_features, m.bias is not None) for name, m in _linears(model)}
    chosen = [(name, by_name[plan.route_for(i, o)], (i, o, b)) for name, (i, o, b) in shapes.items()]
    chosen = [c for c in chosen if c[1].name != "dense"]
    targets = [(name, route) for name, route, _ in chosen]
    checked = verify and use.inference and bool(targets)
    if checked:
        key = pass_key(use, [(*shape, route.name) for _, route, shape in chosen])
        sig = current_signature()
        plan.pass_s = dict(load_cache(sig).get(key, {})) if use_cache else {}
        if not plan.pass_s:
            plan.pass_s["dense"] = measured(lambda: time_pass([model.get_submodule(n) for n, _ in targets], use))
        elif fastest(plan.pass_s) == "dense":
            targets = []  # a cached verdict against these routes: do not convert at all
    # names, not modules: each dense layer can be freed as soon as its replacement exists (peak ~ one layer)
    for name, route in targets:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, route.convert(model.get_submodule(name), use))
    if checked and "plan" not in plan.pass_s:
        plan.pass_s["plan"] = measured(lambda: time_pass([model.get_submodule(n) for n, _ in targets], use))
        if use_cache:
            plan.pass_s = dict(store_cache(sig, {key: plan.pass_s})[key])
    if checked and fastest(plan.pass_s) == "dense":
        restore_plain_layers(model)  # the layers only: the prefill's routes were chosen by their own timings
        plan.kept = False
    if routed:  # the prefill's oneDNN switch, back on the layers that stayed (or came back) plain
        install_routing(model)
    if for_ == "train":  # the MLP activation too, where a fused one measures faster (same Parameters, same math)
        dtypes = (torch.float32, torch.bfloat16) if native_bf16() else (torch.float32,)  # autocast may run bf16
        act, plan.act_s = choose_gelu(model, plan.rows, dtypes, use_cache=use_cache)
        if act is not None:
            install_gelu(model, act)
            plan.act = repr(act)
        length = min(seq_len or cfg.max_seq_len, plan.rows)  # a step is rows // length sequences of length tokens
        norm, plan.norm_s = choose_layer_norm(model, plan.rows, dtypes, use_cache)
        if norm is not None:
            install_norm(model, norm)
            plan.norm = repr(norm)
        attend, plan.train_attention_s = choose_train_attention(model, plan.rows // length, length, dtypes, use_cache)
        if attend is not None:
            install_train_attention(model, attend)
            plan.train_attention = repr(attend)
        loss_kernel, plan.cross_entropy_s = choose_cross_entropy(model, plan.rows, dtypes, use_cache)
        if loss_kernel is not None:
            model.cross_entropy_kernel = loss_kernel  # read by the objectives (seqlab.objectives.loss)
            plan.cross_entropy = repr(loss_kernel)
    model.accel_plan = plan
    return model
