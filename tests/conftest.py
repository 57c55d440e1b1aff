import os

import pytest
import torch

from tests.forked_cli import ForkedCli

# Two cores, two xdist workers: one thread each keeps them from fighting over the cores; the processes the tests
# start (the docs' commands, torchrun's ranks, the forked CLI) take the same one thread from the environment, since a
# worker whose command ran two OpenMP threads beside the other worker's took the docs' pages 20 % longer.
TEST_THREADS = os.environ.get("SEQLAB_TEST_THREADS", "1")
torch.set_num_threads(int(TEST_THREADS))
os.environ["OMP_NUM_THREADS"] = TEST_THREADS


@pytest.fixture(scope="session")
def forked_cli() -> ForkedCli:
    """``seqlab ARGS`` in a process forked from one that has imported seqlab (tests/forked_cli.py)."""
    return ForkedCli()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked slow run first (a stable sort: the rest keep their order). Why: with two xdist workers, the docs
    pages (up to a minute and a half each) were collected near the end, so one worker could still be running them
    long after the other ran out of tests. Started first, they are what the short tests fill in around."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
