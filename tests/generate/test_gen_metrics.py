"""The request metrics measure what they are named: TTFT from the request's start (input checks included), the
decode speed over decoding only (not the time a streaming caller spends between chunks), and the same token count
for every strategy (the returned tokens after each row's first)."""
from __future__ import annotations

import time

import pytest
import torch
from gen_helpers import tiny_decoder

import seqlab.generate.api as api
from seqlab.generate import generate_output, stream


def test_a_slow_stream_reader_does_not_slow_the_measured_decode():
    model = tiny_decoder(seed=3)
    ids = torch.tensor([[5, 9, 13, 2]])
    fast = generate_output(model, ids, max_new_tokens=6, eos_token_id=[]).metrics
    s = stream(model, ids, max_new_tokens=6, eos_token_id=[])
    for _ in s:
        time.sleep(0.1)  # 0.6 s in all, five of them after the first token: counted before the fix
    slow = s.output.metrics
    assert slow.decode_s < 0.25, (slow.decode_s, fast.decode_s)
    assert slow.total_s >= 0.5  # the request's wall time is the caller's too


def test_ttft_counts_the_input_checks(monkeypatch):
    model = tiny_decoder(seed=3)
    checks = api.prepare

    def slow_checks(*args, **kwargs):
        time.sleep(0.2)
        return checks(*args, **kwargs)

    monkeypatch.setattr(api, "prepare", slow_checks)
    for strategy in ({}, {"num_beams": 2}):
        m = generate_output(model, torch.tensor([[5, 9, 13]]), max_new_tokens=3, eos_token_id=[], **strategy).metrics
        assert m.ttft_s >= 0.2, (strategy, m.ttft_s)


@pytest.mark.parametrize("strategy", [{}, {"num_beams": 3}])
def test_decode_speed_counts_the_returned_tokens_after_the_first(strategy):
    """With EOS as the greedy first token the best beam is one token long while the search runs on: its speed
    counted the search's steps (11 tokens for 1)."""
    model = tiny_decoder(seed=3)
    ids = torch.tensor([[5, 9, 13, 2], [7, 1, 4, 8]])
    first = generate_output(model, ids, max_new_tokens=1, eos_token_id=[]).sequences[0, -1].item()
    m = generate_output(model, ids, max_new_tokens=6, eos_token_id=[first], **strategy).metrics
    assert m.decode_tokens_per_s * m.decode_s == pytest.approx(m.new_tokens - 2)
