"""The planner: its choice fits and is the fastest that fits, beats the naive choice, and says why.

The model is big enough (a few MiB of activations per sample) that the CPU's resident-set
readings separate the configurations clearly, and small enough that a plan takes a few seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from bigbatch import Accumulator, MemoryBudgetExceeded, measure_peak
from bigbatch.cli import main
from bigbatch.memory import planner
from bigbatch.memory.peak import small_mmap_threshold
from bigbatch.memory.planner import fit_memory, plan

BATCH = 32
SIZES = [4, 16, 32]


class Block(nn.Module):
    def __init__(self, dim: int = 128) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(4)])


def square_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def plain_peak(model: nn.Module, batch: torch.Tensor, micro_batch_size: int) -> int:
    """Peak of one plain step (the reference the planner's numbers are checked against)."""
    opt = torch.optim.AdamW(model.parameters())
    with measure_peak("cpu") as peak:
        Accumulator(model, opt, micro_batch_size=micro_batch_size).train_step(batch, square_loss)
    return peak.peak_bytes


def _measure_in_this_process() -> tuple:
    """Plan under a budget between micro-batch 16's peak and the full batch's, in this process.

    Runs in a fresh child (see `setting`): the CPU readings are resident-set high-water marks,
    and a process that earlier tests have used (large allocations move glibc's dynamic mmap
    threshold and leave free heap behind) reads peaks too low to separate the configurations.
    """
    torch.set_num_threads(2)
    with small_mmap_threshold():  # Note [honest CPU peaks], also for the reference readings
        return _measure()


def _measure() -> tuple:
    batch = torch.randn(BATCH, 128, 128, generator=torch.Generator().manual_seed(1))
    plain_peak(make_model(), batch, 16)  # warm-up
    # A budget that micro-batch 16 fits and the full batch does not (without checkpointing).
    low, high = plain_peak(make_model(), batch, 16), plain_peak(make_model(), batch, BATCH)
    assert high > 1.4 * low, (low, high)
    budget = (low + high) // 2
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = plan(
        model,
        batch,
        square_loss,
        memory_budget=budget,
        micro_batch_sizes=SIZES,
        checkpointing=(0, 1),
        steps=1,
    )
    untouched = {
        "weights": all(torch.equal(before[k], v) for k, v in model.state_dict().items()),
        "grads": all(p.grad is None for p in model.parameters()),
        "not checkpointed": "forward" not in model[0].__dict__,
    }
    return result, budget, untouched


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """`_measure_in_this_process`, run in a fresh Python process; its result read back."""
    out = tmp_path_factory.mktemp("plan") / "setting.pt"
    here = Path(__file__).parent
    code = (
        "import torch, test_planner; "
        f"torch.save(test_planner._measure_in_this_process(), {str(out)!r})"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parents[1] / "src"), str(here)])}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.mark.slow  # one plan measured in a child process
def test_choice_fits_and_is_the_fastest_fitting(setting):
    result, budget, _ = setting
    assert result.memory_budget == budget
    assert result.choice.fits and result.choice.peak_bytes <= budget
    fitting = [c for c in result.candidates if c.fits and c.seconds_per_step is not None]
    assert all(result.choice.seconds_per_step <= c.seconds_per_step for c in fitting)
    assert not any(
        c.fits for c in result.candidates if c.micro_batch_size == BATCH and c.checkpointing == 0
    )


@pytest.mark.slow  # one plan measured in a child process
def test_says_why_and_compares_with_the_naive_choice(setting):
    # No assertion on which configuration is faster: that is a timing, for benchmarks/memory.py.
    result, budget, _ = setting
    assert (result.naive.micro_batch_size, result.naive.checkpointing) == (4, 1.0)
    assert result.reason.startswith(f"{result.choice.describe()} is the fastest that fits")
    if result.choice is not result.naive:
        naive = "the speed of the naive micro-batch 4 x 8 steps with every block checkpointed"
        assert naive in result.reason
        assert result.speedup_over_naive == pytest.approx(
            result.naive.seconds_per_step / result.choice.seconds_per_step
        )


@pytest.mark.slow  # one plan measured in a child process
def test_users_model_is_untouched(setting):
    _, _, untouched = setting
    assert untouched == {"weights": True, "grads": True, "not checkpointed": True}


@pytest.mark.slow  # one plan measured in a child process
def test_fit_predicts_the_peak(setting):
    result, budget, _ = setting
    measured = [c for c in result.candidates if c.checkpointing == 0 and c.measured]
    fit = fit_memory(measured[:-1], 0.0)  # from the smaller sizes only
    last = measured[-1]
    assert fit.predict(last.micro_batch_size) == pytest.approx(last.peak_bytes, rel=0.2)
    assert fit.bytes_per_sample > 0
    # Checkpointing every block keeps less per sample than none.
    by_fraction = {f.checkpointing: f for f in result.fits}
    assert by_fraction[1.0].bytes_per_sample < by_fraction[0.0].bytes_per_sample
    assert by_fraction[0.0].largest_fitting(budget) < BATCH


def test_sizes_above_one_that_does_not_fit_are_predicted_not_run():
    def fake(m: int, peak: int, fits: bool) -> planner.Candidate:
        return planner.Candidate(
            micro_batch_size=m, gradient_accumulation_steps=32 // m, checkpointing=0.0,
            peak_bytes=peak, seconds_per_step=1.0, samples_per_s=32.0, fits=fits,
        )  # fmt: skip

    fit = fit_memory([fake(2, 300, True), fake(4, 500, False)], 0.0)
    assert (fit.base_bytes, fit.bytes_per_sample) == pytest.approx((100, 100))
    [predicted] = planner._predicted([8], 32, 0.0, fit, fake(4, 500, False))
    assert (predicted.peak_bytes, predicted.measured, predicted.fits) == (900, False, False)
    assert fit.largest_fitting(400) == 3


def test_nothing_fits_names_the_budget_and_the_smallest_peak():
    batch = torch.randn(8, 64, 128)
    with pytest.raises(
        MemoryBudgetExceeded,
        match=r"no configuration fits memory_budget=1.00 MiB: the smallest peak measured was "
        r"[0-9.]+ MiB \(micro-batch 2 x 4 steps with every block checkpointed\)\. Raise memory_budget",
    ):
        plan(
            make_model(),
            batch,
            square_loss,
            memory_budget="1MiB",
            micro_batch_sizes=[2],
            checkpointing=(1,),
            steps=1,
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"micro_batch_sizes": [0, 2]},
            r"micro_batch_sizes=\[0, 2\] is not allowed: use integers from 1 to the batch size 8",
        ),
        (
            {"checkpointing": (0, 2)},
            r"checkpointing=\[0, 2\] is not allowed: use fractions of the blocks in \[0, 1\]",
        ),
        ({"batch_size": 16}, r"batch_size=16 but the batch has 8 samples"),
        ({"steps": 0}, r"steps=0 is not allowed: use a positive integer"),
        ({"memory_budget": "lots"}, r"memory_budget='lots' is not a size"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan(make_model(), torch.randn(8, 4, 128), square_loss, **kwargs)


def test_batch_function_needs_batch_size():
    with pytest.raises(ValueError, match=r"batch is a function: pass batch_size"):
        plan(make_model(), lambda n: torch.randn(n, 4, 128), square_loss)


TASK = """
import torch
import torch.nn as nn
from bigbatch import Task

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)
    def forward(self, x):
        return x + torch.tanh(self.lin(x))

def loss(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)

def task():
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(40, 8, 64), torch.randn(40, 8, 64))
    return Task(model=nn.Sequential(Block(), Block()), train_data=data, loss_fn=loss)
"""


@pytest.mark.slow  # measures a plan
def test_cli_prints_the_table_and_the_choice(tmp_path, capsys):
    (tmp_path / "plan_task.py").write_text(textwrap.dedent(TASK))
    path = f"{tmp_path / 'plan_task.py'}:task"
    args = ["plan", path, "--batch-size", "16", "--micro-batch-sizes", "4,16", "--steps", "1"]
    assert main(args + ["--checkpointing", "0,1"]) == 0
    out = capsys.readouterr().out
    assert "bigbatch plan: batch 16 on cpu" in out and "<- chosen" in out
    assert "choice: micro-batch" in out and "is the fastest that fits" in out
    assert main(args + ["--memory-budget", "1KiB"]) == 2
    assert (
        "bigbatch plan: error: no configuration fits memory_budget=1.00 KiB"
        in capsys.readouterr().err
    )


def test_cli_help_says_what_it_measures(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "peak memory" in out and "--memory-budget" in out and "--micro-batch-sizes" in out


def test_plan_gives_the_malloc_threshold_back(monkeypatch):
    """plan() fixes glibc's mmap threshold while it measures (Note [honest CPU peaks]) and puts
    it back when it returns (wiring: the calls glibc receives are recorded)."""
    from bigbatch.memory import peak

    calls: list[int] = []
    monkeypatch.setattr(peak, "_mallopt_mmap_threshold", calls.append)
    plan(
        make_model(),
        torch.randn(4, 8, 128),
        square_loss,
        micro_batch_sizes=[2],
        checkpointing=(0,),
        steps=1,
        memory_budget="8GiB",
    )
    assert calls == [64 * 1024, 128 * 1024]
