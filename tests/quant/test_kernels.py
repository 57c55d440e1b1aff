"""Every product route equals ``F.linear`` on the dequantised weight to fp32 rounding, at decode and prefill sizes."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from seqlab.quant import QuantLinear, Scheme, kernels, routes

SCHEMES = [Scheme(4, 32), Scheme(4, 64), Scheme(4, 128), Scheme(8, 0), Scheme(8, 32)]


def _layer(scheme, n=72, k=256, bias=True):
    torch.manual_seed(2)
    return QuantLinear.from_weight(torch.randn(n, k) * 0.05, scheme, torch.randn(n) if bias else None)


def _close(y, ref, k):
    # fp32 sums of k products in another order: a few ulps of the magnitude of the terms, times sqrt(k)
    scale = ref.abs().max().clamp_min(1e-3)
    assert float((y - ref).abs().max()) <= 1e-6 * k ** 0.5 * 8 * float(scale)


def test_kernel_library_builds_here():
    """This machine has gcc and AVX2: the kernels must build (elsewhere the fallback test covers the other path)."""
    assert kernels.load_kernels() is not None


@pytest.mark.parametrize("route", sorted(routes.ROUTES))
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"int{s.bits}-g{s.group_size}")
@pytest.mark.parametrize("rows", [1, 3, 8, 37])
def test_route_equals_dequantised_matmul(route, scheme, rows):
    layer = _layer(scheme)
    if not routes.available(route):  # the AVX-512 build under ISA caps or on an AVX2-only CPU: it must say why
        assert route == "kernel512" and kernels.isa_allowed("avx512") is not None
        with pytest.raises(RuntimeError, match="not available"):
            routes.ROUTES[route](layer)
        return
    x = torch.randn(rows, layer.in_features)
    ref = F.linear(x, layer.dequantize(), layer.bias)
    _close(routes.ROUTES[route](layer)(x), ref, layer.in_features)


def test_avx512_build_follows_the_cpu_and_its_caps(monkeypatch):
    """The wider build runs only where the CPU has AVX-512 and no ISA cap (an AVX2-only machine's view) hides it."""
    flags = kernels._cpu_flags()
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    assert (kernels.isa_allowed("avx512") is None) == ({"avx512f", "avx512bw"} <= flags)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert kernels.isa_allowed("avx512") is not None


def test_prepared_product_follows_replaced_weights():
    """A layer keeps its prepared product per row count; new buffers (a copy, a reload) must not reuse it."""
    layer = _layer(Scheme(8, 32))
    x = torch.randn(1, layer.in_features)
    with torch.no_grad():
        layer(x)
        other = _layer(Scheme(8, 32))
        other.qweight.neg_()  # a different weight
        layer.qweight = other.qweight.clone()
        y = layer(x)
    _close(y, F.linear(x, layer.dequantize(), layer.bias), layer.in_features)


def test_forward_uses_chosen_route_and_any_batch_shape():
    layer = _layer(Scheme(4, 64), n=3000)  # more rows than one dequantisation block
    routes.clear_routes()
    x = torch.randn(2, 5, layer.in_features)
    with torch.no_grad():
        y = layer(x)
    ref = F.linear(x, layer.dequantize(), layer.bias)
    _close(y, ref, layer.in_features)
    table = routes.route_table()
    assert table and all(r["route"] in routes.ROUTES and r["seconds"] for r in table)


def test_route_decisions_are_cached_on_disk(monkeypatch, tmp_path):
    """A second process (here: a cleared table) reads the decision instead of timing again; another signature
    (here: another thread count) does not see it."""
    monkeypatch.setenv("SEQLAB_CACHE", str(tmp_path))
    layer = _layer(Scheme(8, 32))
    routes.clear_routes()
    first = routes.choose_route(layer, 3)
    assert routes.cache_path().is_file()
    routes.clear_routes()
    monkeypatch.setattr(routes, "time_routes", lambda *a, **k: pytest.fail("timed again despite the cache"))
    assert routes.choose_route(layer, 3) == first
    routes.clear_routes()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        with pytest.raises(pytest.fail.Exception, match="timed again"):
            routes.choose_route(layer, 3)
    finally:
        torch.set_num_threads(threads)
        routes.clear_routes()


def test_pinned_route_is_used():
    layer = _layer(Scheme(8, 0))
    key = routes.key_for(layer, 1)
    routes.set_route(key, "dequant")
    assert routes.choose_route(layer, 1) == "dequant"
    with pytest.raises(ValueError, match="unknown quantised route"):
        routes.set_route(key, "nope")
    routes.set_route(routes.key_for(layer, 256), "dequant")
    [line] = routes.describe([layer])  # what `seqlab info` prints: a pinned route has no timings to show
    assert line.endswith("1 row: dequant (pinned); 256 rows: dequant (pinned)"), line
    routes.clear_routes()


def test_failed_build_falls_back_to_torch_routes(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("SEQLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_STATE", {})
    routes.clear_routes()
    layer = _layer(Scheme(4, 32))
    x = torch.randn(2, layer.in_features)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            y = layer(x)
    assert kernels.load_kernels() is None
    assert any("int kernels unavailable" in str(w.message) for w in caught)
    _close(y, F.linear(x, layer.dequantize(), layer.bias), layer.in_features)
    routes.clear_routes()


def test_gradients_are_refused():
    layer = _layer(Scheme(8, 0))
    with pytest.raises(RuntimeError, match="inference"):
        layer(torch.randn(1, layer.in_features, requires_grad=True))


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"int{s.bits}-g{s.group_size}")
def test_blockwise_dequantisation_is_bit_exact(scheme):
    """The C dequantiser rounds as the torch one does (q * scale, then + min): the prefill route's weights are the
    model's weights, not an approximation of them."""
    layer = _layer(scheme, n=300)
    assert torch.equal(kernels.dequantize_rows(layer, 10, 290), layer.dequantize(slice(10, 290)))


@pytest.mark.parametrize("scheme", [Scheme(4, 32), Scheme(8, 32)], ids=["int4", "int8"])
def test_a_bf16_cast_keeps_the_scales_and_every_route_the_products(scheme):
    """model.to(torch.bfloat16) (what a bf16 plan does to a model) moves a quantised layer but leaves its scales,
    minima and bias at their fp32 values, which every route reads as fp32: bf16 inputs give the fp32 product of
    those inputs. (Cast, the scales were other weights; read by C as fp32 bytes they made NaN.)"""
    layer = _layer(scheme)
    before = {name: buf.clone() for name, buf in layer.named_buffers()}
    layer.to(torch.bfloat16)
    for name, buf in layer.named_buffers():
        assert buf.dtype == before[name].dtype and torch.equal(buf, before[name]), name
    x = torch.randn(37, layer.in_features).bfloat16()
    ref = F.linear(x.float(), layer.dequantize(), layer.bias)
    for route in sorted(routes.ROUTES):
        if routes.available(route):
            _close(routes.ROUTES[route](layer)(x.float()), ref, layer.in_features)
    y = layer(x)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)


def test_the_dequantiser_reads_scales_of_another_dtype_as_what_they_are():
    """kernels.dequantize_rows hands C fp32 scales whatever the buffers hold (a layer whose scales someone set to
    bf16 by hand): the rows are those scales' values, not their bytes read as fp32."""
    layer = _layer(Scheme(4, 32), n=64)
    layer.scales, layer.mins = layer.scales.bfloat16(), layer.mins.bfloat16()
    want = layer.dequantize(slice(0, 64)).float()
    got = kernels.dequantize_rows(layer, 0, 64)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
