"""The floor under every driver: knows no model, objective or molecule, and takes plain arguments.

The Trainer and VMC both stand on it, so files, schedules, logs, checkpoints and process groups exist once.
"""

from seqlab.runtime.errors import CheckpointError
from seqlab.runtime.files import atomic_write_bytes, atomic_write_json, atomic_write_text
from seqlab.runtime.progress import progress
from seqlab.runtime.rng import capture_rng, restore_rng
from seqlab.runtime.schedule import cosine_decay, warmup_cosine

__all__ = ["CheckpointError", "atomic_write_bytes", "atomic_write_json", "atomic_write_text", "capture_rng",
           "cosine_decay", "progress", "restore_rng", "warmup_cosine"]
