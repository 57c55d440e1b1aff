import os

import pytest
import torch

# Two cores, two xdist workers: one thread each keeps them from fighting over the cores.
torch.set_num_threads(int(os.environ.get("SEQLAB_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
