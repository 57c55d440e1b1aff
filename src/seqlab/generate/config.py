"""GenerationConfig: every decoding knob in one validated dataclass (a bad value fails here, with its name)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from seqlab.generate.sampling import SamplingKnobs, SamplingParams


@dataclass
class GenerationConfig(SamplingKnobs):
    """How to turn a prompt into new tokens.

    Strategy is chosen by the fields, as in Hugging Face: ``num_beams > 1`` -> beam search; a draft model passed
    to :func:`seqlab.generate.generate` -> speculative decoding; else ``do_sample`` (and ``temperature > 0``)
    -> sampling; else greedy.

    ``eos_token_id`` / ``pad_token_id`` of ``None`` fall back to the model config's ids (then pad falls back to
    EOS, as Hugging Face does); ids outside the model's vocabulary are refused when generation starts.
    ``stop_strings`` need a tokenizer (anything with ``decode(list[int]) -> str``).
    """

    max_new_tokens: int = 32
    do_sample: bool = False  # the sampling knobs (temperature, top_k, top_p, min_p, ...) come from SamplingKnobs

    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # beam search: True | False | "never" (see seqlab.generate.beam)

    num_speculative_tokens: int = 4  # draft tokens proposed per speculative round

    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    stop_strings: list[str] = field(default_factory=list)
    seed: int | None = 0

    truncate_prompt: bool = False  # keep the last tokens of an over-long prompt instead of raising
    compact_finished: bool = True  # drop finished rows from the batch (and the cache) so they stop costing compute
    compile: bool = False  # torch.compile the decode step (seqlab.generate.engine.compiled_decode_step)

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"GenerationConfig.{name} must be {rule} (got {getattr(self, name)!r})")

        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise bad("max_new_tokens", "an int >= 0")
        self.check_knobs("GenerationConfig")
        if isinstance(self.num_beams, bool) or not isinstance(self.num_beams, int) or self.num_beams < 1:
            raise bad("num_beams", "an int >= 1")
        if not isinstance(self.length_penalty, (int, float)) or not math.isfinite(self.length_penalty):
            raise bad("length_penalty", "a finite number")
        if self.early_stopping not in (True, False, "never"):
            raise bad("early_stopping", 'True, False or "never"')
        if self.num_beams > 1 and self.do_sample and self.temperature > 0:
            raise ValueError("GenerationConfig: beam search with sampling (num_beams > 1, do_sample=True) is not "
                             "supported; set do_sample=False or num_beams=1")
        if isinstance(self.num_speculative_tokens, bool) or not isinstance(self.num_speculative_tokens, int) \
                or self.num_speculative_tokens < 1:
            raise bad("num_speculative_tokens", "an int >= 1")
        def bad_id(value) -> bool:
            return isinstance(value, bool) or not isinstance(value, int) or value < 0

        eos = [self.eos_token_id] if isinstance(self.eos_token_id, int) else (self.eos_token_id or [])
        if any(bad_id(e) for e in eos):
            raise bad("eos_token_id", "None, a token id >= 0 or a list of them")
        if self.pad_token_id is not None and bad_id(self.pad_token_id):
            raise bad("pad_token_id", "None or a token id >= 0")
        if isinstance(self.stop_strings, str):
            self.stop_strings = [self.stop_strings]
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise bad("stop_strings", "a list of non-empty strings")
        if self.num_beams > 1 and self.stop_strings:
            raise ValueError("GenerationConfig: beam search does not stop at stop_strings (its beams are ranked on "
                             "whole sequences); use num_beams=1, or cut the returned text yourself")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0

    def sampling(self) -> SamplingParams:
        return SamplingParams(**self.knobs(), do_sample=self.do_sample)

    def eos_ids(self, model_config=None) -> list[int]:
        eos = self.eos_token_id
        if eos is None and model_config is not None:  # all a Hugging Face config listed, else the one id
            eos = (getattr(model_config, "extra", None) or {}).get("eos_token_ids") or getattr(
                model_config, "eos_token_id", None)
        if eos is None:
            return []
        return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]

    def pad_id(self, model_config=None) -> int:
        if self.pad_token_id is not None:
            return int(self.pad_token_id)
        pad = getattr(model_config, "pad_token_id", None) if model_config is not None else None
        if pad is not None:
            return int(pad)
        eos = self.eos_ids(model_config)
        return eos[0] if eos else 0

    def updated(self, **changes) -> "GenerationConfig":
        return replace(self, **changes)
