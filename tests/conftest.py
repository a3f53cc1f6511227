import pytest
import torch
from seeds import seed_for


@pytest.fixture(autouse=True)
def _threads():
    # The thread count changes float summation order; keep one setting for every test.
    torch.set_num_threads(2)
    yield


@pytest.fixture
def gen(request):
    """A generator for the test's random inputs, seeded by ``seeds.seed_for`` (fixed by default;
    ``BIGBATCH_TEST_SEED=<n>`` or ``=random`` to change it)."""
    return torch.Generator().manual_seed(seed_for(request.node.nodeid))


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
