"""The decode step is one graph for torch.compile: no graph break, no recompilation as the cache fills."""
import functools

import torch
from torch._dynamo.utils import counters

from seqlab.config import ModelConfig
from seqlab.generate.engine import decode_step, prefill
from seqlab.model import build_model


def test_decode_step_compiles_to_one_graph_with_dynamic_shapes():
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                                    max_seq_len=64)).eval()
    torch._dynamo.reset()
    counters.clear()
    # the "eager" backend traces exactly what Inductor would receive, without paying for code generation
    step = torch.compile(functools.partial(decode_step, model), dynamic=True, backend="eager")
    cache = model.new_cache(2, 24)
    with torch.inference_mode():
        tok = prefill(model, torch.randint(0, 61, (2, 5)), cache).argmax(-1)
        pos = torch.full((2, 1), 5)
        for _ in range(6):  # growing cache: the filled length is symbolic, never a reason to recompile
            logits = step(tok, cache, pos)
            pos += 1
            tok = logits.argmax(-1)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
