"""Logits processors: turn a row of next-token logits into the distribution we sample from.

Order (the same as Hugging Face ``generate``, so the two can be compared token for token):

    logits --repetition penalty--> --temperature--> --top-k--> --top-p--> --min-p--> softmax -> sample

Each step is a small pure function on ``[B, V]`` float logits; filtered tokens get ``-inf``.
:class:`SamplingParams` validates the knobs once, and :class:`LogitsProcessor` applies the chain.

Semantics worth pinning down (tests in ``tests/generate/test_sampling.py`` check each):

* ``temperature == 0`` means greedy (argmax; ties go to the lowest token id, ``torch.argmax``'s rule).
  Greedy ignores top-k/top-p/min-p (they never remove the argmax) but honours the repetition penalty.
* ``top_k == 0`` keeps everything. Otherwise tokens whose logit is below the k-th largest are removed;
  **ties with the k-th are kept**, so the kept set never depends on sort order.
* ``top_p`` keeps the smallest prefix of tokens, in order of decreasing probability, whose mass *reaches*
  ``top_p``: token i is kept iff the mass strictly before it is ``< top_p``. A prefix whose mass equals
  ``top_p`` (up to ``TOP_P_TOL`` of float rounding) therefore stops there. ``top_p == 1`` keeps all.
  **Ties with the last kept token are kept too** (same reason as for top-k).
* ``min_p`` keeps tokens with ``p >= min_p * p_max`` (probabilities after temperature).
* ``min_tokens_to_keep`` is a floor for top-k, top-p and min-p.
* Repetition penalty (CTRL, Keskar et al. 2019): for every token already present in the context
  (prompt and generated so far, padding excluded) a positive logit is divided by the penalty and a
  negative one multiplied by it. ``1.0`` is a no-op.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

TOP_P_TOL = 1e-6  # float32 softmax + cumsum rounding; a mass within this of top_p counts as reaching it.


@dataclass
class SamplingKnobs:
    """The logits-processor knobs, declared once: :class:`SamplingParams` and ``GenerationConfig`` both carry them."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens_to_keep: int = 1

    def knobs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(SamplingKnobs)}

    def check_knobs(self, owner: str) -> None:
        check_sampling_values(**self.knobs(), owner=owner)


@dataclass
class SamplingParams(SamplingKnobs):
    """The sampling knobs, validated on construction (a bad value fails here, not deep in a decode loop)."""

    do_sample: bool = True

    def __post_init__(self) -> None:
        self.check_knobs("SamplingParams")

    @property
    def greedy(self) -> bool:
        return (not self.do_sample) or self.temperature == 0.0


def check_sampling_values(*, temperature: float, top_k: int, top_p: float, min_p: float,
                          repetition_penalty: float, min_tokens_to_keep: int, owner: str = "SamplingParams") -> None:
    """Raise ``ValueError`` naming the offending field; shared by SamplingParams and GenerationConfig."""

    def bad(field: str, rule: str, value: object) -> ValueError:
        return ValueError(f"{owner}.{field} must be {rule} (got {value!r})")

    if not isinstance(temperature, (int, float)) or not temperature >= 0.0 or temperature == float("inf"):
        raise bad("temperature", ">= 0 and finite (0 means greedy)", temperature)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise bad("top_k", "an int >= 0 (0 disables top-k)", top_k)
    if not isinstance(top_p, (int, float)) or not (0.0 < top_p <= 1.0):
        raise bad("top_p", "in (0, 1] (1 disables top-p)", top_p)
    if not isinstance(min_p, (int, float)) or not (0.0 <= min_p <= 1.0):
        raise bad("min_p", "in [0, 1] (0 disables min-p)", min_p)
    if not isinstance(repetition_penalty, (int, float)) or not (0.0 < repetition_penalty < float("inf")):
        raise bad("repetition_penalty", "> 0 and finite (1 disables it)", repetition_penalty)
    if isinstance(min_tokens_to_keep, bool) or not isinstance(min_tokens_to_keep, int) or min_tokens_to_keep < 1:
        raise bad("min_tokens_to_keep", "an int >= 1", min_tokens_to_keep)


# ----------------------------------------------------------------------------------------------------------
# The individual warps. Each takes float logits [..., V] and returns new logits (never modifies its input).


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL penalty on tokens marked in ``seen`` ([..., V] bool)."""
    if penalty == 1.0:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


# Below this temperature a finite float32 logit divided by it can overflow to inf (it takes |logit| > 3.4e18 above
# it), and softmax over an inf is NaN: the row's largest logit is subtracted first there, which leaves the
# distribution as it is (softmax is shift-invariant) and makes every scaled logit <= 0.
_SHIFT_BELOW = 1e-20


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    if temperature <= 0:
        raise ValueError("apply_temperature needs temperature > 0; temperature 0 is greedy, use argmax")
    if temperature == 1.0:
        return logits
    if temperature < _SHIFT_BELOW:  # (and no smaller than the dtype's least normal: as float32 1e-46 is 0, 0/0 NaN)
        logits = logits - logits.amax(dim=-1, keepdim=True)
        temperature = max(temperature, torch.finfo(logits.dtype).tiny)
    return logits / temperature


def top_k_filter(logits: Tensor, k: int, min_tokens_to_keep: int = 1) -> Tensor:
    """Keep tokens whose logit is >= the k-th largest (ties with the k-th are kept)."""
    k = max(k, min_tokens_to_keep)
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, top_p: float, min_tokens_to_keep: int = 1) -> Tensor:
    """Nucleus filter; see the module docstring for the threshold and tie rules."""
    if top_p >= 1.0:
        return logits
    probs = torch.softmax(logits.float(), dim=-1)
    sorted_p, _ = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_p.double(), dim=-1) - sorted_p.double()
    keep_sorted = mass_before < (top_p - TOP_P_TOL)
    keep_sorted[..., :min_tokens_to_keep] = True
    n_keep = keep_sorted.sum(dim=-1, keepdim=True)
    threshold = sorted_p.gather(-1, n_keep - 1)  # probability of the last kept token
    return logits.masked_fill(probs < threshold, float("-inf"))


def min_p_filter(logits: Tensor, min_p: float, min_tokens_to_keep: int = 1) -> Tensor:
    """Keep tokens with p >= min_p * max p."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits.float(), dim=-1)
    threshold = min_p * probs.amax(dim=-1, keepdim=True)
    if min_tokens_to_keep > 1:
        kth = torch.topk(probs, min(min_tokens_to_keep, probs.shape[-1]), dim=-1).values[..., -1:]
        threshold = torch.minimum(threshold, kth)
    return logits.masked_fill(probs < threshold, float("-inf"))


# ----------------------------------------------------------------------------------------------------------


class LogitsProcessor:
    """The whole chain for one request. Cheap to call once per decode step.

    ``warp`` returns filtered float32 logits; ``probs`` the distribution actually sampled from (a one-hot
    at the argmax when greedy, which is what speculative decoding needs to reduce to greedy exactly);
    ``select`` picks the next token.
    """

    def __init__(self, params: SamplingParams):
        self.params = params

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def penalise(self, logits: Tensor, seen: Tensor | None) -> Tensor:
        logits = logits.float()
        if seen is not None and self.params.repetition_penalty != 1.0:
            logits = apply_repetition_penalty(logits, seen, self.params.repetition_penalty)
        return logits

    def warp(self, logits: Tensor, seen: Tensor | None = None) -> Tensor:
        p = self.params
        logits = self.penalise(logits, seen)
        if p.greedy:
            return logits
        logits = apply_temperature(logits, p.temperature)
        if p.top_k:
            logits = top_k_filter(logits, p.top_k, p.min_tokens_to_keep)
        if p.top_p < 1.0:
            logits = top_p_filter(logits, p.top_p, p.min_tokens_to_keep)
        if p.min_p > 0.0:
            logits = min_p_filter(logits, p.min_p, p.min_tokens_to_keep)
        return logits

    def probs(self, logits: Tensor, seen: Tensor | None = None) -> Tensor:
        if self.greedy:
            idx = self.penalise(logits, seen).argmax(dim=-1, keepdim=True)
            return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, idx, 1.0)
        return torch.softmax(self.warp(logits, seen), dim=-1)

    def select(self, logits: Tensor, seen: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:
        """Next token ids ``[B]`` from logits ``[B, V]``."""
        if self.greedy:
            return self.penalise(logits, seen).argmax(dim=-1)
        return sample_from(torch.softmax(self.warp(logits, seen), dim=-1), generator)


def sample_from(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw per row of ``probs`` [B, V] -> [B] (seeded through ``generator``)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def seen_mask(input_ids: Tensor, attention_mask: Tensor | None, vocab_size: int) -> Tensor:
    """[B, V] bool: which tokens occur in each row (padding excluded); the repetition penalty's memory.

    Kept as a mask updated in place each step (``mark_seen``) instead of re-scanning the whole sequence.
    """
    B = input_ids.shape[0]
    seen = torch.zeros(B, vocab_size + 1, dtype=torch.bool, device=input_ids.device)
    ids = input_ids if attention_mask is None else input_ids.masked_fill(attention_mask == 0, vocab_size)
    seen.scatter_(1, ids, True)
    return seen[:, :vocab_size]


def mark_seen(seen: Tensor, tokens: Tensor) -> None:
    seen.scatter_(1, tokens.view(-1, 1), True)
