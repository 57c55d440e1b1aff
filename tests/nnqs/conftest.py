"""Shared fixtures: PySCF systems are built once per test session (SCF + FCI take ~1 s each)."""

from __future__ import annotations

import functools

import pytest

import pyscf  # noqa: F401  (the [dev] extra installs it; fail loudly, never skip, if it is missing)

from seqlab.nnqs.molecules import get_molecule
from seqlab.nnqs.references import prepare


@functools.lru_cache(maxsize=None)
def _system(name: str):
    return prepare(get_molecule(name), cc=False)


@pytest.fixture(scope="session")
def system():
    return _system
