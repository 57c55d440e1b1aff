"""The one error type for checkpoints, whichever layer finds the problem."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupted, or does not match what it is loaded into."""
