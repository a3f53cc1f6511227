import os
import zlib

import pytest
import torch


@pytest.fixture(autouse=True)
def _threads():
    # The thread count changes float summation order; keep one setting for every test.
    torch.set_num_threads(2)
    yield


@pytest.fixture
def gen(request):
    """A seeded generator for the test's random inputs.

    Fixed by default (the seed is derived from the test's name, so every run draws the same
    inputs and a failure replays). ``BIGBATCH_TEST_SEED=<n>`` uses seed n for every test;
    ``BIGBATCH_TEST_SEED=random`` draws a fresh seed per test (printed, to replay a failure).
    """
    chosen = os.environ.get("BIGBATCH_TEST_SEED")
    if chosen == "random":
        seed = int.from_bytes(os.urandom(4), "little")
    elif chosen:
        seed = int(chosen)
    else:
        seed = zlib.crc32(request.node.nodeid.encode())
    print(f"BIGBATCH_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


def pytest_ignore_collect(collection_path, config):
    """Under ``--doctest-modules`` only the package's modules and the test files are collected:
    the helpers and child scripts in tests/ (models.py, oom_child.py, ...) are not imported."""
    if collection_path.suffix != ".py" or collection_path.name == "conftest.py":
        return None
    try:
        in_tests = collection_path.relative_to(config.rootpath).parts[0] == "tests"
    except ValueError:
        return None
    return in_tests and not collection_path.name.startswith("test_")
