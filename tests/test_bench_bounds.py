"""The TTFT rows' arithmetic bound counts the FLOPs a prefill really does (bench/decode_bench.py)."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from seqlab.config import ModelConfig
from seqlab.generate.engine import prefill
from seqlab.model import build_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from decode_bench import prefill_flops  # noqa: E402


@pytest.mark.parametrize("mlp,n_kv_heads", [("swiglu", 2), ("gelu", 4)])
def test_prefill_flops_match_the_products_a_prefill_runs(mlp: str, n_kv_heads: int):
    """Counted by torch's FlopCounterMode on a real prefill: every product but the attention (which the counter does
    not see inside SDPA), plus the one thing seqlab computes beyond the floor: its fused QKV product also forms the
    last layer's queries for the positions before the last."""
    cfg = ModelConfig(vocab_size=1000, d_model=64, n_layers=3, n_heads=4, n_kv_heads=n_kv_heads, d_ff=96, mlp=mlp,
                      max_seq_len=256)
    model, T = build_model(cfg).eval(), 40
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        prefill(model, torch.randint(0, 1000, (1, T)), model.new_cache(1, 64))
    hd = cfg.head_dim
    attention = 2 * 2 * cfg.n_heads * hd * ((cfg.n_layers - 1) * T * (T + 1) // 2 + T)
    last_layer_queries = 2 * (T - 1) * cfg.d_model * cfg.n_heads * hd
    assert counter.get_total_flops() == prefill_flops(cfg, T) - attention + last_layer_queries


@pytest.mark.parametrize("args, message", [
    (["train_throughput.py", "--reps", "0"], "--reps must be >= 1, got 0"),
    (["train_throughput.py", "--precisions", "fp16"], "--precisions: unknown fp16"),
    (["real_models_smollm2.py", "--batches", "0"], "--batches: every count must be >= 1"),
    (["quant_speed.py", "--new-tokens", "0"], "--new-tokens must be >= 1, got 0"),
    (["serve_load.py", "--concurrency", "0"], "--concurrency: every count must be >= 1"),
])
def test_bad_bench_options_are_refused_before_any_work(args, message):
    """These failed minutes in (a median of nothing, a KeyError, a reshape of 0 rows) or, for --concurrency 0,
    sent no request and read the "no failed request" target as met."""
    bench = Path(__file__).resolve().parents[1] / "bench"
    done = subprocess.run([sys.executable, str(bench / args[0]), *args[1:]], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and message in done.stderr
