"""The floor under every driver: knows no model, objective or molecule, and takes plain arguments.

The Trainer and VMC both stand on it, so files, schedules, logs, checkpoints and process groups exist once.
"""

from seqlab.runtime.errors import CheckpointError
from seqlab.runtime.files import atomic_write_bytes, atomic_write_json, atomic_write_text
from seqlab.runtime.progress import progress

__all__ = ["CheckpointError", "atomic_write_bytes", "atomic_write_json", "atomic_write_text", "progress"]
