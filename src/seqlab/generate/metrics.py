"""Per-request generation metrics: what a serving system would log for every call."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class GenerationMetrics:
    """Timings are wall-clock seconds with the device synchronised (seqlab.eval.timing).

    * ``ttft_s``: time to first token = input preparation + prefill + choosing the first token.
    * ``decode_tokens_per_s``: tokens produced by the decode phase (all rows, after the first token) divided by
      the decode phase's time. For batch B that is B tokens per step while every row is still running.
    * ``kv_cache_bytes``: bytes held by the KV cache(s) of this request (self- and cross-attention, draft too).
    * ``peak_memory_bytes``: peak RSS of the process during the request on CPU (reset at its start when the
      kernel allows, else the process-lifetime peak); ``torch.cuda.max_memory_allocated`` on GPU.
    """

    strategy: str = "greedy"
    batch_size: int = 0
    prompt_tokens: int = 0  # real (non-pad) prompt tokens over the batch
    new_tokens: int = 0  # tokens generated over the batch (EOS included, padding after it excluded)
    steps: int = 0  # model calls after prefill (decode steps, or speculative rounds)
    ttft_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    kv_cache_bytes: int = 0
    peak_memory_bytes: int = 0
    accepted_tokens: int = 0  # speculative decoding only
    drafted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    def finish(self, decode_tokens: int) -> None:
        self.decode_tokens_per_s = decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        return d

    def summary(self) -> str:
        s = (f"{self.strategy}: {self.new_tokens} new tokens, ttft {self.ttft_s * 1e3:.1f} ms, "
             f"decode {self.decode_tokens_per_s:.1f} tok/s, total {self.total_s:.3f} s, "
             f"kv cache {self.kv_cache_bytes / 2**20:.2f} MiB, peak mem {self.peak_memory_bytes / 2**20:.0f} MiB")
        if self.acceptance_rate is not None:
            s += f", acceptance {self.acceptance_rate:.2f}"
        return s
