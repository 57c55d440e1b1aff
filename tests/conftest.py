import os

import pytest
import torch

# Two cores, two xdist workers: one thread each keeps them from fighting over the cores.
torch.set_num_threads(int(os.environ.get("SEQLAB_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked slow run first (a stable sort: the rest keep their order). Why: with two xdist workers, the docs
    pages (up to a minute and a half each) were collected near the end, so one worker could still be running them
    long after the other ran out of tests. Started first, they are what the short tests fill in around."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
