"""Continuous batching: one engine owns the model; requests join and leave the running decode batch at step boundaries.

One ``step`` of the engine is:

1. drop cancelled requests (their KV slot is freed at once);
2. prefill waiting requests, at most ``prefill_chunk`` prompt tokens in all, in their own one-row cache; a long prompt
   is split over several steps, so the running requests never wait for more than one chunk. Each chunk is padded on
   the right to a multiple of ``PREFILL_BUCKET`` tokens (causal attention: the pads change nothing before them, and
   the cache is cropped back), so the products see a few row counts instead of every length from 1 to the chunk
   size: each new row count costs oneDNN a new primitive, and a server fed every length grows without end. A
   finished prefill samples the request's first token and copies its K/V into a free slot of the shared
   ``SlotKVCache``;
3. one decode step over every live slot (each at its own length), then each request picks its next token with its
   own sampling parameters and its own seeded ``torch.Generator``, so batching never changes what a seeded request
   draws; finished requests leave and free their slot.

The engine runs ``step`` on one worker thread; the HTTP layer talks to it only through ``submit`` / ``Request.cancel``
and the events each request's ``sink`` receives. A request whose handling raises fails alone.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from seqlab.generate.engine import decode_step, prefill
from seqlab.generate.sampling import LogitsProcessor, SamplingParams
from seqlab.model.slot_cache import SlotKVCache
from seqlab.runtime.memory import map_large_blocks, trim_heap, zeros_on_demand
from seqlab.serve.text import ReplyText

_GREEDY = LogitsProcessor(SamplingParams(do_sample=False))
PREFILL_BUCKET = 32
_ids = itertools.count()


class QueueFullError(RuntimeError):
    """More requests are waiting for a slot than the server accepts (HTTP 429)."""


class NotAcceptingError(RuntimeError):
    """The engine is shutting down (HTTP 503)."""


@dataclass
class Event:
    """What one request gained in one step: new reply text, and how it ended once it has."""

    text: str
    completion_tokens: int
    finish_reason: str | None = None  # "stop" | "length" | None (still running)
    error: str | None = None


class Request:
    def __init__(self, prompt_ids: list[int], max_tokens: int, sink: Callable[[Event], None], tokenizer,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None, stop: list[str] = (),
                 stop_ids: list[int] = (), strip: bool = False, top_k: int = 0):
        self.id = next(_ids)
        self.prompt_ids, self.max_tokens, self.sink = list(prompt_ids), max_tokens, sink
        self.processor = LogitsProcessor(SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                                        do_sample=temperature > 0))
        self.generator = None
        if not self.processor.greedy:
            self.generator = torch.Generator()
            if seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(int(seed))
        self.stop_ids = set(stop_ids)
        self.reply = ReplyText(tokenizer, list(stop), strip, context=[] if strip else self.prompt_ids[-1:])
        self.generated: list[int] = []
        self.next_token: int | None = None
        self.cancelled = False
        self.done = False
        self.submitted = time.perf_counter()

    @property
    def greedy(self) -> bool:
        return self.processor.greedy

    def cancel(self) -> None:
        """Ask the engine to drop this request at its next step boundary (thread-safe: a flag)."""
        self.cancelled = True

    def accept(self, token: int) -> Event:
        """Record one sampled token; return the event to send (with a finish reason if the reply is over)."""
        if token in self.stop_ids:
            return self._end("stop")
        self.generated.append(token)
        self.next_token = token
        piece = self.reply.push(token)
        if self.reply.stopped:
            return self._end("stop", piece)
        if len(self.generated) >= self.max_tokens:
            return self._end("length", piece)
        return Event(piece, len(self.generated))

    def _end(self, reason: str, piece: str = "") -> Event:
        self.done = True
        return Event(piece + self.reply.finish(), len(self.generated), reason)


class Engine:
    """Owns the model, a ``SlotKVCache`` of ``max_batch`` slots of ``context`` positions, and the waiting queue."""

    def __init__(self, model, max_batch: int = 16, max_queue: int = 64, context: int | None = None,
                 prefill_chunk: int = 256):
        cfg = model.config
        if getattr(cfg, "arch", "decoder") != "decoder":
            raise ValueError(f"serving needs a decoder (causal LM) model, this one is {cfg.arch!r}")
        for name, value in (("max_batch", max_batch), ("max_queue", max_queue), ("prefill_chunk", prefill_chunk)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.model = model.eval()
        self.context = min(context or cfg.max_seq_len, cfg.max_seq_len) if cfg.pos == "learned" else (context or cfg.max_seq_len)
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        p = next(model.parameters())
        self.scratch = model.new_cache(1, self.context, dtype=p.dtype, device=p.device)  # also grows rotary tables
        self.cache = SlotKVCache(cfg.n_layers, max_batch, cfg.n_kv_heads, cfg.head_dim, self.context,
                                 dtype=p.dtype, device=p.device, storage=zeros_on_demand)  # resident as used
        self.device = p.device
        self.rows: list[Request] = []  # rows[i] is the request in live slot i
        self.waiting: deque[Request] = deque()
        self.prefilling: Request | None = None
        self.prefilled = 0  # prompt tokens of ``prefilling`` already in the scratch cache
        self.accepting = True
        self.steps = 0
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False

    # ------------------------------------------------------------------------------------------ client side
    def submit(self, request: Request) -> None:
        n = len(request.prompt_ids)
        if n < 1:
            raise ValueError("the prompt is empty")
        if n >= self.context:
            raise ValueError(f"the prompt is {n} tokens; the context holds {self.context} (prompt + at least one "
                             f"new token)")
        request.max_tokens = min(request.max_tokens, self.context - n)
        with self._cv:
            if not self.accepting:
                raise NotAcceptingError("the server is shutting down")
            # only the requests no free slot will take count against the queue: a burst of up to max_batch +
            # max_queue requests is accepted, however many of them the worker has not picked up yet
            free = self.max_batch - self.cache.active - (self.prefilling is not None)
            queued = len(self.waiting) - max(free, 0)
            if queued >= self.max_queue:
                raise QueueFullError(f"{queued} requests are already waiting for a slot (--max-queue "
                                     f"{self.max_queue}); retry later")
            self.waiting.append(request)
            self._cv.notify()

    def stats(self) -> dict[str, int]:
        return {"active": self.cache.active, "waiting": len(self.waiting) + (self.prefilling is not None),
                "slots": self.max_batch, "free_slots": self.max_batch - self.cache.active, "steps": self.steps}

    # ------------------------------------------------------------------------------------------ worker thread
    def start(self) -> None:
        map_large_blocks()  # a long-running loop of changing shapes: large buffers must not fragment the heap
        self._thread = threading.Thread(target=self._loop, name="seqlab-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop admitting; let in-flight requests finish for up to ``timeout`` s, cancel the rest, join the worker."""
        with self._cv:
            self.accepting = False
        deadline = time.monotonic() + timeout
        while self.busy and time.monotonic() < deadline and self._thread is not None and self._thread.is_alive():
            time.sleep(0.02)
        with self._cv:
            for r in [*self.rows, *self.waiting, *([self.prefilling] if self.prefilling else [])]:
                r.cancel()
                self._send(r, Event("", len(r.generated), error="the server shut down before the reply finished"))
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting or self.prefilling)

    def _loop(self) -> None:
        while True:
            with self._cv:
                if not self.busy and not self._stop:
                    trim_heap()  # idle: give back what the last burst's shapes left in the heap
                while not self.busy and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
            try:
                self.step()
            except Exception as e:  # a failure of the shared decode step: fail the batch, keep serving
                self._fail_all(f"{type(e).__name__}: {e}")

    # ------------------------------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> None:
        """Drop cancelled requests, prefill up to one chunk of prompt tokens, decode one token for every live slot."""
        self.steps += 1
        self._drop_cancelled()
        budget = self.prefill_chunk
        while budget > 0:
            if self.prefilling is None:
                if self.cache.active >= self.max_batch:
                    break
                with self._cv:
                    if not self.waiting:
                        break
                    self.prefilling, self.prefilled = self.waiting.popleft(), 0
            budget -= self._prefill_chunk(budget)
        if self.rows:
            self._decode()

    def _drop_cancelled(self) -> None:
        with self._cv:
            if any(r.cancelled for r in self.waiting):
                self.waiting = deque(r for r in self.waiting if not r.cancelled)
        if self.prefilling is not None and self.prefilling.cancelled:
            self._end_prefill()
        for row in reversed(range(len(self.rows))):
            if self.rows[row].cancelled:
                self._release(row)

    def _prefill_chunk(self, budget: int) -> int:
        """Prefill the next piece of ``prefilling``'s prompt; return how many tokens it used."""
        req = self.prefilling
        n = len(req.prompt_ids)
        take = min(budget, n - self.prefilled)
        width = min(-(-take // PREFILL_BUCKET) * PREFILL_BUCKET, self.context - self.prefilled)
        try:
            chunk = req.prompt_ids[self.prefilled : self.prefilled + take]
            ids = torch.tensor([chunk + chunk[-1:] * (width - take)], device=self.device)
            logits = prefill(self.model, ids, self.scratch, last_index=torch.tensor([take - 1], device=self.device))
            if width > take:
                self.scratch.crop(self.prefilled + take)  # drop the pads' keys and values
            self.prefilled += take
            if self.prefilled < n:
                return take
            event = req.accept(self._select(req, logits))
            if not req.done:
                row = self.cache.claim_row()
                self.cache.load_row(row, self.scratch, n)
                self.rows.append(req)
            self._send(req, event)
        except Exception as e:
            req.done = True
            self._send(req, Event("", len(req.generated), error=f"{type(e).__name__}: {e}"))
            if req in self.rows:
                self._release(self.rows.index(req))
        self._end_prefill()
        return take

    def _end_prefill(self) -> None:
        self.prefilling, self.prefilled = None, 0
        self.scratch.crop(0)

    def _select(self, req: Request, logits: torch.Tensor) -> int:
        return int(req.processor.select(logits, None, req.generator)[0])

    def _decode(self) -> None:
        tokens = torch.tensor([r.next_token for r in self.rows], device=self.device)
        logits = decode_step(self.model, tokens, self.cache, position_ids=self.cache.positions())
        chosen = [0] * len(self.rows)
        greedy = [i for i, r in enumerate(self.rows) if r.greedy]
        if greedy:
            picked = _GREEDY.select(logits[greedy] if len(greedy) < len(self.rows) else logits).tolist()
            for i, t in zip(greedy, picked):
                chosen[i] = t
        finished = []
        for i, req in enumerate(self.rows):
            try:
                if not req.greedy:
                    chosen[i] = self._select(req, logits[i : i + 1])
                self._send(req, req.accept(chosen[i]))
            except Exception as e:
                req.done = True
                self._send(req, Event("", len(req.generated), error=f"{type(e).__name__}: {e}"))
            if req.done or req.cancelled:
                finished.append(i)
        for row in reversed(finished):
            self._release(row)

    def _release(self, row: int) -> None:
        moved = self.cache.release_row(row)
        last = self.rows.pop()
        if moved is not None:
            self.rows[row] = last

    def _send(self, req: Request, event: Event) -> None:
        if req.cancelled and event.error is None:
            return
        try:
            req.sink(event)
        except Exception:  # the client side of this request is broken: drop the request, not the engine
            req.cancel()

    def _fail_all(self, message: str) -> None:
        for r in list(self.rows):
            self._send(r, Event("", len(r.generated), error=message))
        while self.rows:
            self._release(len(self.rows) - 1)
        if self.prefilling is not None:
            self._send(self.prefilling, Event("", 0, error=message))
            self._end_prefill()
