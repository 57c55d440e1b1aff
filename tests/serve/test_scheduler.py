"""Continuous batching must not change results: requests that join and leave a shared batch get exactly what
``seqlab.generate.generate`` gives each of them alone (float64 model, so batching cannot flip a near-tie)."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from seqlab.generate import generate
from seqlab.serve.scheduler import Engine, Event, QueueFullError, Request
from tests.generate.gen_helpers import tiny_decoder


class LetterTokenizer:
    """Token i is the letter chr(97 + i % 26): enough text for stop strings and streaming."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids)


TOK = LetterTokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_decoder(max_seq_len=96).double()


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 48, (n,), generator=g).tolist() for n in lengths]


def _alone(model, prompt, n, **kw):
    return generate(model, torch.tensor([prompt]), max_new_tokens=n, eos_token_id=[], **kw)[0, len(prompt):].tolist()


def _run_staggered(engine, requests, arrivals):
    """Submit requests[i] before step arrivals[i]; step until all are done."""
    for step in range(1000):
        for i, at in enumerate(arrivals):
            if at == step:
                engine.submit(requests[i])
        if step > max(arrivals) and not engine.busy:
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def test_eight_staggered_greedy_requests_equal_generate_alone(model):
    lengths = [3, 17, 9, 30, 1, 12, 25, 6]
    prompts = _prompts(lengths)
    news = [14, 9, 20, 5, 16, 11, 7, 18]
    events = [[] for _ in prompts]
    reqs = [Request(p, n, events[i].append, TOK, temperature=0) for i, (p, n) in enumerate(zip(prompts, news))]
    engine = Engine(model, max_batch=4, max_queue=8, context=96, prefill_chunk=8)  # chunked prefill, a queue
    _run_staggered(engine, reqs, arrivals=[0, 0, 1, 3, 4, 4, 7, 12])
    for p, n, r, ev in zip(prompts, news, reqs, events):
        assert r.generated == _alone(model, p, n)
        assert ev[-1].finish_reason == "length" and ev[-1].completion_tokens == n
        assert "".join(e.text for e in ev) == TOK.decode(r.generated)
    assert engine.stats()["active"] == 0 and engine.cache.active == 0


def test_seeded_sampled_request_is_the_same_alone_or_among_others(model):
    prompt = _prompts([10], seed=5)[0]
    kw = dict(temperature=0.9, top_p=0.8, seed=1234)
    alone = Request(prompt, 24, lambda ev: None, TOK, **kw)
    _run_staggered(Engine(model, max_batch=4, context=96), [alone], [0])
    assert alone.generated == _alone(model, prompt, 24, do_sample=True, temperature=0.9, top_p=0.8, seed=1234)

    others = [Request(p, 20, lambda ev: None, TOK, temperature=t, seed=s)
              for p, t, s in zip(_prompts([4, 22, 7, 13], seed=9), (0, 1.0, 0.7, 0), (None, 1, 2, None))]
    crowd = Request(prompt, 24, lambda ev: None, TOK, **kw)
    _run_staggered(Engine(model, max_batch=4, context=96, prefill_chunk=6), [*others, crowd], [0, 0, 1, 2, 3])
    assert crowd.generated == alone.generated


def test_threaded_engine_with_concurrent_submitters(model):
    prompts = _prompts([5, 19, 2, 11, 27, 8, 33, 14])
    engine = Engine(model, max_batch=3, max_queue=8, context=96, prefill_chunk=16)
    engine.start()
    results: dict[int, list[Event]] = {}

    def client(i):
        time.sleep(0.01 * i)
        q: queue.Queue[Event] = queue.Queue()
        r = Request(prompts[i], 12, q.put, TOK, temperature=0)
        engine.submit(r)
        evs = [q.get(timeout=60)]
        while evs[-1].finish_reason is None:
            evs.append(q.get(timeout=60))
        results[i] = (r, evs)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    engine.stop(timeout=5)
    for i, p in enumerate(prompts):
        r, evs = results[i]
        assert r.generated == _alone(model, p, 12)
    assert engine.cache.active == 0


def test_stop_strings_and_eos_end_a_reply(model):
    prompt = _prompts([6])[0]
    ref = _alone(model, prompt, 30)
    text = TOK.decode(ref)
    stop = text[7:9]
    cut = text.find(stop)
    evs = []
    r = Request(prompt, 30, evs.append, TOK, temperature=0, stop=[stop])
    _run_staggered(Engine(model, max_batch=2, context=96), [r], [0])
    assert evs[-1].finish_reason == "stop" and "".join(e.text for e in evs) == text[:cut]
    # an end-of-turn id ends the reply too, and is neither text nor a counted token
    evs2 = []
    r2 = Request(prompt, 30, evs2.append, TOK, temperature=0, stop_ids=[ref[4]])
    _run_staggered(Engine(model, max_batch=2, context=96), [r2], [0])
    first = ref.index(ref[4])
    assert r2.generated == ref[:first] and evs2[-1].finish_reason == "stop"
    assert evs2[-1].completion_tokens == first


def test_cancel_frees_the_slot_and_the_queue_is_bounded(model):
    engine = Engine(model, max_batch=1, max_queue=2, context=96)
    running = Request([1, 2, 3], 80, lambda ev: None, TOK, temperature=0)
    engine.submit(running)
    for _ in range(3):
        engine.step()
    assert engine.cache.active == 1
    waiting = [Request([4], 5, lambda ev: None, TOK, temperature=0) for _ in range(2)]
    for w in waiting:
        engine.submit(w)
    with pytest.raises(QueueFullError, match="--max-queue 2"):
        engine.submit(Request([5], 5, lambda ev: None, TOK))
    running.cancel()
    engine.step()  # the cancelled row leaves at this step boundary; the first waiting request takes its slot
    assert len(running.generated) < 80 and engine.cache.active == 1 and engine.rows == [waiting[0]]
    with pytest.raises(ValueError, match="context holds 96"):
        engine.submit(Request(list(range(96)), 5, lambda ev: None, TOK))


def test_a_burst_fills_the_free_slots_before_the_queue(model):
    """Requests the worker has not picked up yet but a free slot will take are not "waiting for a slot": a burst of
    max_batch + max_queue requests is accepted before any step runs, and the next one is refused."""
    engine = Engine(model, max_batch=4, max_queue=2, context=96)
    burst = [Request([1, 2], 3, lambda ev: None, TOK, temperature=0) for _ in range(6)]
    for r in burst:
        engine.submit(r)
    with pytest.raises(QueueFullError, match="2 requests are already waiting for a slot"):
        engine.submit(Request([3], 3, lambda ev: None, TOK))
    while engine.busy:
        engine.step()
    assert all(len(r.generated) == 3 for r in burst)


def test_a_failing_request_fails_alone(model):
    class Broken(LetterTokenizer):
        def decode(self, ids, skip_special_tokens=False):
            if len(ids) == 4:  # the third new token, behind the prompt's last one (a completion reads on from it)
                raise RuntimeError("detokeniser exploded")
            return super().decode(ids)

    def bad_sink(ev):
        raise OSError("client socket gone")

    prompts = _prompts([4, 9, 6])
    evs = []
    good = Request(prompts[0], 10, lambda ev: None, TOK, temperature=0)
    broken = Request(prompts[1], 10, evs.append, Broken(), temperature=0)
    gone = Request(prompts[2], 10, bad_sink, TOK, temperature=0)
    engine = Engine(model, max_batch=3, context=96)
    _run_staggered(engine, [good, broken, gone], [0, 0, 1])
    assert good.generated == _alone(model, prompts[0], 10)
    assert evs[-1].error == "RuntimeError: detokeniser exploded" and len(broken.generated) == 3
    assert gone.cancelled and engine.cache.active == 0


def test_products_see_few_row_counts_and_pads_change_nothing(model):
    """Prefill chunks are padded to a multiple of PREFILL_BUCKET (or to the context's end), so the linear products
    see a handful of row counts, not every prompt length; the replies still equal generate() alone."""
    seen = set()
    hooks = [m.register_forward_pre_hook(lambda _, args: seen.add(args[0].shape[:-1].numel()))
             for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        lengths = [3, 17, 40, 70, 33, 9]
        prompts = _prompts(lengths, seed=4)
        reqs = [Request(p, 6, lambda e: None, TOK, temperature=0) for p in prompts]
        engine = Engine(model, max_batch=4, max_queue=8, context=96, prefill_chunk=64)
        _run_staggered(engine, reqs, arrivals=[0, 0, 1, 2, 2, 5])
    finally:
        for h in hooks:
            h.remove()
    assert all(r.generated == _alone(model, p, 6) for p, r in zip(prompts, reqs))
    decode_rows = set(range(1, engine.max_batch + 1))
    assert seen - decode_rows <= {32, 64}, sorted(seen)  # prefill widths: multiples of 32 (70 = 64 + a padded 6)
    assert seen & {32, 64}
