import importlib.util

import pytest
import torch
from alone import pytest_runtest_protocol  # noqa: F401 (@pytest.mark.alone)
from seeds import seed_for

THREADS = 1


@pytest.fixture(autouse=True)
def _threads():
    # The thread count changes float summation order: one setting for every test. One thread: the
    # suite runs one test process per core (pytest -n 2), and OpenMP threads that outnumber the
    # cores spin against each other (measured: a 0.03 s test took 5-9 s under -n 2 at 2 threads).
    torch.set_num_threads(THREADS)
    yield


@pytest.fixture
def gen(request):
    """A generator for the test's random inputs, seeded by ``seeds.seed_for`` (fixed by default;
    ``BIGBATCH_TEST_SEED=<n>`` or ``=random`` to change it)."""
    return torch.Generator().manual_seed(seed_for(request.node.nodeid))


def pytest_ignore_collect(collection_path, config):
    """Under ``--doctest-modules`` only the package's modules and the test files are collected:
    the helpers and child scripts in tests/ (models.py, oom_child.py, ...) are not imported (the
    package's modules that need an extra: ../conftest.py)."""
    if collection_path.name == "conftest.py":  # a plugin, loaded as such; not a doctest module
        return True  # (two of them would both be imported as the module "conftest")
    if collection_path.suffix != ".py":
        return None
    try:
        parts = collection_path.relative_to(config.rootpath).parts
    except ValueError:
        return None
    return parts[0] == "tests" and not collection_path.name.startswith("test_")


EXTRAS = {"rich": "cli", "matplotlib": "plot", "sklearn": "demo", "transformers": "hf"}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.needs("rich", ...)``: skipped, saying what to install, where a module of an
    optional extra is missing (the suite runs with torch alone).

    A test that uses a module-scoped fixture joins its module's ``xdist_group``: under
    ``pytest -n 2 --dist loadgroup`` one worker computes the fixture (a reference run, ranks
    spawned once for every row), instead of each worker that gets one of the module's tests."""
    for item in items:
        defs = getattr(item, "_fixtureinfo", None)
        defs = defs.name2fixturedefs.values() if defs is not None else ()
        if any(d[-1].scope == "module" for d in defs) and not item.get_closest_marker(
            "xdist_group"
        ):
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
        for mark in item.iter_markers("needs"):
            missing = [m for m in mark.args if importlib.util.find_spec(m) is None]
            if missing:
                extras = ",".join(sorted({EXTRAS.get(m, m) for m in missing}))
                reason = f"needs {', '.join(missing)}: pip install -e '.[{extras}]'"
                item.add_marker(pytest.mark.skip(reason=reason))
