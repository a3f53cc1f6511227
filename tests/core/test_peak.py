"""measure_peak really measures: known tensors inside, baseline subtracted, nested and sequential use."""

from __future__ import annotations

import pytest
import torch

import bigbatch
from bigbatch.core.peak import PeakProbe

MiB = 2**20
SLACK = 16 * MiB  # page granularity, Python objects, allocator bookkeeping


def _tensor(mib: int, device: str = "cpu") -> torch.Tensor:
    return torch.ones(mib * MiB // 8, dtype=torch.float64, device=device)  # written: resident


def _near(measured: int, mib: int) -> bool:
    return mib * MiB * 0.98 <= measured <= mib * MiB + SLACK


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _skip_without(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.parametrize("device", DEVICES)
def test_a_known_tensor_is_measured(device):
    _skip_without(device)
    with bigbatch.measure_peak(device) as peak:
        x = _tensor(128, device)
    del x
    assert _near(peak.peak_bytes, 128), peak
    assert peak.exact and str(peak).endswith(f"peak on {peak.device}")


@pytest.mark.parametrize("device", DEVICES)
def test_baseline_is_subtracted_and_freed_memory_still_counts(device):
    _skip_without(device)
    kept = _tensor(96, device)
    with bigbatch.measure_peak(device) as peak:
        a = _tensor(128, device)
        del a  # the peak was reached before the free
        b = _tensor(16, device)
    assert _near(peak.peak_bytes, 128), peak
    assert peak.baseline_bytes >= 96 * MiB
    del kept, b


@pytest.mark.parametrize("device", DEVICES)
def test_sequential_measurements_are_independent(device):
    _skip_without(device)
    with bigbatch.measure_peak(device) as first:
        x = _tensor(192, device)
        del x
    with bigbatch.measure_peak(device) as second:
        y = _tensor(64, device)
        del y
    assert _near(first.peak_bytes, 192) and _near(second.peak_bytes, 64), (first, second)


@pytest.mark.parametrize("device", DEVICES)
def test_nested_measurements_both_right(device):
    _skip_without(device)
    with bigbatch.measure_peak(device) as outer:
        x = _tensor(192, device)
        del x
        with bigbatch.measure_peak(device) as inner:  # resets the process-wide counter
            y = _tensor(32, device)
            del y
        z = _tensor(16, device)
        del z
    assert _near(inner.peak_bytes, 32), inner
    assert _near(outer.peak_bytes, 192), outer  # the peak before the inner reset is not lost


def test_engine_budget_probe_inside_a_measurement():
    """A train_step with memory_budget resets the counter every window; the outer reading survives."""
    model = torch.nn.Linear(4, 1).double()
    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), 4, memory_budget="1GiB"
    )
    batch = (torch.randn(10, 4, dtype=torch.float64), torch.randn(10, 1, dtype=torch.float64))
    with bigbatch.measure_peak("cpu") as peak:
        x = _tensor(128)
        del x
        acc.train_step(batch, lambda m, b: bigbatch.sample_mse(m(b[0]), b[1]))
    assert _near(peak.peak_bytes, 128), peak


def test_probe_reads_while_running():
    probe = PeakProbe(torch.device("cpu"))
    record = probe.reset()
    x = _tensor(64)
    assert _near(probe.peak_bytes(record), 64)
    del x
    assert _near(probe.finish(record).peak_bytes, 64)


def test_unsupported_device():
    with pytest.raises(
        ValueError, match=r"device='meta' is not allowed: use one of 'cpu', 'cuda'\."
    ):
        with bigbatch.measure_peak("meta"):
            pass
