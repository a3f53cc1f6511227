"""Auto micro-batch under a REAL memory budget on the CPU: it keeps what it learned, fails fast
when nothing can fit, and reports the adopted configuration's peak.

The budget runs are in fresh child processes (as a user's run would be): the readings are the
process's resident-set high-water marks, and what earlier tests left in a pytest process's heap
would change them.
"""

from __future__ import annotations

import os
from pathlib import Path

import fresh
import pytest
import torch
import torch.nn as nn
from refusals import assert_refused

import bigbatch
from bigbatch.core._sizing import AutoState, after_oom, after_success
from bigbatch.core.peak import small_mmap_threshold

MiB = 2**20


def in_a_fresh_process(call: str, out: Path) -> object:
    """Run ``test_auto_budget.<call>`` (e.g. ``"train(123)"``) in a new Python process; read
    back its result."""
    return fresh.in_a_fresh_process(Path(__file__), call, out)


class Block(nn.Module):
    def __init__(self, dim: int = 128) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(4)])


def square_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


# ---------------------------------------------------------------------------- keeps what it learned
BATCH, STEPS = 16, 24


def make_batch() -> torch.Tensor:
    return torch.randn(BATCH, 256, 128, generator=torch.Generator().manual_seed(0))


def window_peaks() -> dict[int, int]:
    """The peak a window adds at micro-batch 4, 5 and 16, read as under a budget (a budget
    nothing reaches), with the malloc settings the planner uses (Note [honest CPU peaks])."""
    torch.set_num_threads(1)
    peaks = {}
    with small_mmap_threshold():
        for m in (4, 5, BATCH):
            model = make_model()
            acc = bigbatch.Accumulator(
                model, torch.optim.AdamW(model.parameters()), m, memory_budget="1TiB"
            )
            acc.train_step(make_batch(), square_loss)  # warm-up: the optimizer state exists
            peaks[m] = acc.train_step(make_batch(), square_loss).peak_bytes
    return peaks


def train_under(budget: int) -> dict:
    """The peer benchmark's setting in a fresh process, as a user's run starts: auto from the
    first step under ``budget``; every attempt over it is recorded (wiring only: the policy
    runs unchanged)."""
    torch.set_num_threads(1)
    batch, model = make_batch(), make_model()
    acc = bigbatch.Accumulator(
        model, torch.optim.AdamW(model.parameters()), micro_batch_size="auto", memory_budget=budget
    )
    failed: list[tuple[int, int, bool]] = []
    after_oom_ = acc._runner.sizing.after_oom

    def recorded(size: int, measured: bool = False, floor: int = 1, used=None) -> None:
        failed.append((len(steps), size, measured))
        after_oom_(size, measured, floor, used)

    acc._runner.sizing.after_oom = recorded  # type: ignore[method-assign]
    steps = []
    for _ in range(STEPS):
        result = acc.train_step(batch, square_loss)
        steps.append((result.micro_batch_size, result.oom_retries, result.peak_bytes))
    return {"budget": budget, "steps": steps, "failed": failed}


@pytest.fixture(scope="module")
def budget(tmp_path_factory) -> int:
    """Half-way between micro-batch 4's window and 5's (the full batch's is about 3x), measured
    in a process of its own: the training child then starts with glibc's settings untouched,
    as a user's run does. Auto settles at 4, and its growth probes (6, then 5) run over."""
    peaks = in_a_fresh_process("window_peaks()", tmp_path_factory.mktemp("auto") / "peaks.pt")
    assert peaks[BATCH] > 2.5 * peaks[5] and peaks[5] > 1.1 * peaks[4], peaks
    return (peaks[4] + peaks[5]) // 2


@pytest.fixture(scope="module")
def learned(tmp_path_factory, budget):
    out = tmp_path_factory.mktemp("auto") / "learned.pt"
    return in_a_fresh_process(f"train_under({budget})", out)


@pytest.mark.slow  # a child process training 24 steps under a real budget
def test_a_size_that_completed_windows_is_kept_after_a_failed_growth_probe(learned):
    sizes = [size for size, _, _ in learned["steps"]]
    completed = {size: i for i, size in reversed(list(enumerate(sizes)))}  # first step at each
    probes = [(step, size) for step, size, _ in learned["failed"] if step > 0]
    assert probes, f"no growth probe ran over the budget: {learned}"
    for step, size in probes:  # each a size above one that had completed windows
        assert any(done < size and first < step for done, first in completed.items()), learned
    # Never smaller again than a size that completed a window (the probes only go up).
    assert sizes[1:] == sorted(sizes[1:]), learned
    assert all(size >= sizes[1] for size in sizes[1:]), learned


@pytest.mark.slow
def test_readings_of_a_size_repeat_from_window_to_window(learned):
    """Note [honest CPU peaks]: with a budget on the CPU the failed attempts' pages leave the
    resident set, so the same size reads the same. (Before, under glibc's dynamic mmap
    threshold, this run settled at micro-batch 1, whose readings went from 10 to 13 MiB, more
    than micro-batch 4 reads now.)"""
    by_size: dict[int, list[int]] = {}
    for size, _, peak in learned["steps"][1:]:  # after the first step (one-time allocations)
        by_size.setdefault(size, []).append(peak)
    for size, peaks in by_size.items():
        assert max(peaks) <= 1.05 * min(peaks), (size, peaks)


@pytest.mark.slow
def test_every_step_reports_the_peak_of_its_adopted_attempt(learned):
    budget = learned["budget"]
    assert all(peak is not None and peak <= budget for _, _, peak in learned["steps"]), learned
    redone = [peak for _, retries, peak in learned["steps"] if retries]
    assert redone, "no step was redone"


def test_a_failed_probe_falls_back_to_the_size_that_fit_and_re_measures_it_once():
    """Note [re-measure before shrinking]: right after a failed probe the reading still carries
    the probe's pages; the size that fit is measured once more before it is given up."""
    state = AutoState(size=24, ceiling=32, clean_windows=0, fits=16)
    state = after_oom(state, 24, measured=True)  # the growth probe ran over the budget
    assert (state.size, state.ceiling, state.fits) == (16, 24, 16)
    again = after_oom(state, 16, measured=True)  # one bad reading at the size that fit
    assert (again.size, again.ceiling, again.fits, again.rechecked) == (16, 24, 16, True)
    assert after_success(again, 16).size == 16  # it fit this time: kept
    given_up = after_oom(again, 16, measured=True)  # over twice in a row: shrink
    assert (given_up.size, given_up.ceiling, given_up.fits) == (8, 16, None)
    real = after_oom(state, 16, measured=False)  # an allocator failure is not a reading
    assert (real.size, real.ceiling) == (8, 16)


# ---------------------------------------------------------------------------- honest peaks
def fit_under(budget: int, out: str) -> tuple:
    """``bigbatch.fit`` with auto micro-batch under ``budget``: the summary and metrics.csv."""
    from bigbatch.app.log import read_csv

    torch.set_num_threads(1)
    data = torch.utils.data.TensorDataset(torch.cat([make_batch()] * 3))
    task = bigbatch.Task(model=make_model(), train_data=data, loss_fn=first_square_loss)
    summary = bigbatch.fit(
        task, batch_size=BATCH, micro_batch_size="auto", memory_budget=budget, steps=3, out=out,
        quiet=True, device="cpu", shuffle=False,
    )  # fmt: skip
    return summary, read_csv(os.path.join(out, "metrics.csv"))


def first_square_loss(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    return square_loss(model, batch[0])


@pytest.mark.slow  # a child process training 3 steps
def test_the_step_peak_is_the_adopted_attempts_and_the_attempts_are_apart(tmp_path, budget):
    """The first step runs the whole batch (over the budget), then smaller: metrics.csv and
    the summary report the adopted attempt's peak as the step's, the attempts' apart."""
    summary, rows = in_a_fresh_process(f"fit_under({budget}, {str(tmp_path)!r})", tmp_path / "s.pt")
    first = rows[0]
    assert int(first["oom_retries"]) >= 1 and int(first["micro_batch_size"]) < BATCH
    assert int(first["step_peak_bytes"]) <= budget < int(first["retry_peak_bytes"])
    assert all(int(r["step_peak_bytes"]) <= budget for r in rows), rows
    assert summary.step_peak_bytes <= budget < summary.retry_peak_bytes
    assert summary.retry_peak_bytes == int(first["retry_peak_bytes"])


# ---------------------------------------------------------------------------- a budget too small
def test_a_budget_below_the_gradients_fails_at_the_first_overrun_naming_them():
    """An MLP whose gradients alone (16 MiB) exceed the budget: no micro-batch can fit, and
    auto says so after one attempt instead of walking 1024 -> 1."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024))
    acc = bigbatch.Accumulator(
        net, torch.optim.AdamW(net.parameters()), micro_batch_size="auto", memory_budget="12MiB"
    )
    forwards = []

    def loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        forwards.append(len(batch))
        return model(batch).pow(2).mean()

    with assert_refused(
        net,
        ValueError,
        match=r"memory_budget=12\.00 MiB is below what any micro-batch needs: the gradients alone "
        r"take 16\.01 MiB.*the trained parameters \(16\.01 MiB\) and the optimizer state, .* are not "
        r"counted.*Raise the budget",
    ):
        acc.train_step(torch.randn(1024, 1024), loss)
    assert forwards == [1024]  # one attempt: the first micro-batch of the whole batch


# ---------------------------------------------------------------------------- garbage from before
def test_a_cpu_budget_collects_the_garbage_left_from_before_the_run():
    """A CPU reading is the high-water mark over the resident set at the window's start, so a
    reference cycle from before the run, freed by the collector inside a window, would hide as
    much of the window's own memory (Note [honest CPU peaks]): the budget's meter collects such
    garbage once, when the Accumulator is built."""
    import gc
    import weakref

    class Cycle:
        pass

    gc.disable()  # no automatic collection: only the meter's may free the cycle
    try:
        left = Cycle()
        left.me, left.tensor = left, torch.ones(2**20)
        gone = weakref.ref(left)
        del left
        net = nn.Linear(4, 2)
        bigbatch.Accumulator(net, torch.optim.SGD(net.parameters(), lr=0.1))
        assert gone() is not None  # without a budget nothing is collected
        bigbatch.Accumulator(net, torch.optim.SGD(net.parameters(), lr=0.1), memory_budget="1GiB")
        assert gone() is None
    finally:
        gc.enable()
