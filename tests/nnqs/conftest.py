"""Shared fixtures: PySCF systems are built once per test session (SCF + FCI take ~1 s each)."""

from __future__ import annotations

import functools

import pytest

import pyscf  # noqa: F401  (the [dev] extra installs it; fail loudly, never skip, if it is missing)


@functools.lru_cache(maxsize=None)
def _system(name: str):
    from seqlab.nnqs.molecules import get_molecule, prepare

    return prepare(get_molecule(name), cc=False)


@pytest.fixture(scope="session")
def system():
    return _system
