import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _threads():
    # The thread count changes float summation order; keep one setting for every test.
    torch.set_num_threads(2)
    yield


@pytest.fixture
def gen():
    """A generator with a fresh seed per test (printed, so a failure can be replayed).

    Set BIGBATCH_TEST_SEED to replay one.
    """
    seed = int(os.environ.get("BIGBATCH_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"BIGBATCH_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)
