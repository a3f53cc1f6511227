"""Out-of-memory: recognised per case, and recovered from for real in a child process under a limit.

The real failures run in ``oom_child.py`` under ``RLIMIT_DATA`` (see its docstring for the model):
on the CPU build the failure is the allocator's ``RuntimeError``, in forward or in backward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from refusals import assert_refused
from seeds import seed_for

import bigbatch
from bigbatch.core.oom import MemoryBudgetExceeded, is_out_of_memory

TESTS = Path(__file__).resolve().parents[1]
SRC = TESTS.parent / "src"
CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
    "tried to allocate 134217728 bytes. Error code 12 (Cannot allocate memory)"
)


def _raised_from(
    cause: BaseException, implicit: bool = False, suppress: bool = False
) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as inner:
            if suppress:
                raise ValueError("wrapped") from None
            if implicit:
                raise ValueError("wrapped")  # noqa: B904 (the implicit __context__ is the point)
            raise ValueError("wrapped") from inner
    except ValueError as outer:
        return outer


@pytest.mark.parametrize(
    "exc,expected",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (torch.cuda.OutOfMemoryError("CUDA out of memory."), True),
        (RuntimeError(CPU_OOM), True),
        (RuntimeError(CPU_OOM, "a second argument"), True),
        (RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be ..."), True),
        (MemoryBudgetExceeded("micro_batch_size=8 used 3 GiB, over memory_budget=2 GiB"), True),
        (MemoryError(), True),
        (RuntimeError("not enough memory: you tried to allocate 0 bytes"), False),
        (RuntimeError("the memory format is wrong: out of memory of patience"), False),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (
            ValueError("DefaultCPUAllocator: can't allocate memory"),
            False,
        ),  # the text alone is not enough
        (KeyboardInterrupt(), False),
    ],
)
def test_is_out_of_memory(exc, expected):
    assert is_out_of_memory(exc) is expected


def test_is_out_of_memory_follows_the_chain():
    assert is_out_of_memory(_raised_from(torch.OutOfMemoryError("CUDA out of memory.")))
    assert is_out_of_memory(_raised_from(RuntimeError(CPU_OOM), implicit=True))
    assert not is_out_of_memory(_raised_from(RuntimeError(CPU_OOM), suppress=True))  # `from None`
    assert not is_out_of_memory(_raised_from(RuntimeError("shape mismatch")))
    loop = RuntimeError("a")
    loop.__context__ = RuntimeError("b")
    loop.__context__.__context__ = loop
    assert not is_out_of_memory(loop)


def test_a_real_cpu_allocation_failure_is_recognised():
    try:
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as exc:
        assert is_out_of_memory(exc), str(exc)
    else:
        pytest.fail("allocating 4 EiB did not fail")


# ----------------------------------------------------------------------------- real OOM in a child

SCENARIOS = [  # margins measured: each lands well inside the range that gives the wanted failures
    {"name": "forward", "model": "forward", "n": 16, "margin_mib": 120},
    {"name": "backward", "model": "backward", "n": 16, "margin_mib": 160},
    {"name": "fixed", "model": "backward", "n": 16, "margin_mib": 160, "micro_batch_size": 8},
    {"name": "budget", "model": "forward", "n": 16, "budget": "64MiB"},
]


def _run_child(scenarios: list[dict]) -> dict:
    """Run the scenarios in one child (torch imported once); a crash or hang fails the tests."""
    seed = seed_for("tests/core/test_oom.py")
    print(f"oom child seed={seed}")
    scenarios = [{**s, "seed": seed} for s in scenarios]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)]),
        "MALLOC_ARENA_MAX": "2",  # fewer malloc arenas: the data segment is predictable
    }
    proc = subprocess.run(
        [sys.executable, str(TESTS / "oom_child.py"), json.dumps(scenarios)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(scenarios), proc.stdout + proc.stderr[-3000:]
    return {s["name"]: out for s, out in zip(scenarios, lines, strict=True)}


@pytest.fixture(scope="module")
def child_results() -> dict:
    # One fresh child per scenario: the heap an earlier scenario freed would give a later one
    # headroom under the same limit (a "fixed" micro-batch that should fail would then fit).
    return {s["name"]: _run_child([s])[s["name"]] for s in SCENARIOS}


def _completed_exactly(out: dict) -> None:
    assert out["raised"] is None, out
    assert out["samples"] == 16 and out["count"] == 16  # the effective batch is unchanged
    assert out["micro_batch_size"] < 16 and out["micro_batches"] == -(
        -16 // out["micro_batch_size"]
    )
    assert out["oom_retries"] == len(out["events"]) or not out["events"]
    assert out["equal_to_same_split"], out  # bitwise: the failed tries left nothing behind
    assert out["error_to_full_batch"] < 1e-10, out


@pytest.mark.slow  # one ~10 s child process shared by the four tests
def test_real_oom_in_forward_recovers(child_results):
    out = child_results["forward"]
    _completed_exactly(out)
    assert out["oom_retries"] > 0
    assert out["events"][0] == {"where": "forward", "size": 16, "oom": True}


@pytest.mark.slow  # one ~10 s child process shared by the four tests
def test_real_oom_in_backward_after_accumulating_discards_partial_grads(child_results):
    out = child_results["backward"]
    _completed_exactly(out)
    assert all(e["where"] == "backward" and e["oom"] for e in out["events"]), out
    # a micro-batch failed in backward after an earlier one of its window was accumulated:
    # the window's .grad held part of it, and the result is still bitwise the clean run's
    assert any(e["accumulated"] >= 1 for e in out["events"]), out


@pytest.mark.slow  # one ~10 s child process shared by the four tests
def test_real_oom_with_fixed_micro_batch_reraises_and_changes_nothing(child_results):
    out = child_results["fixed"]
    assert out["raised"] == "RuntimeError" and out["is_oom"], out
    assert out["events"] == [{"where": "backward", "accumulated": 1, "oom": True}], out
    assert out["unchanged"], "parameters or optimizer state changed"
    assert out["grads_none"], ".grad kept part of the failed window"


@pytest.mark.slow  # one ~10 s child process shared by the four tests
def test_memory_budget_shrinks_without_a_real_oom(child_results):
    out = child_results["budget"]
    _completed_exactly(out)
    assert out["oom_retries"] > 0 and out["events"] == []  # the budget, not the allocator, said no


@pytest.mark.gpu
def test_real_cuda_oom_recovers():
    """The same on a GPU, capped by ``set_per_process_memory_fraction``: ``torch.OutOfMemoryError``."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cuda = [{**s, "device": "cuda"} for s in SCENARIOS if s["name"] in ("forward", "backward")]
    results = _run_child(cuda)
    _completed_exactly(results["forward"])
    assert results["forward"]["events"][0] == {"where": "forward", "size": 16, "oom": True}
    _completed_exactly(results["backward"])
    # which micro-batch fails depends on the caching allocator's rounding: only the CPU test pins
    # the failure after accumulation; here every failure must still be a real OOM in backward
    assert results["backward"]["events"], results["backward"]
    assert all(e["where"] == "backward" and e["oom"] for e in results["backward"]["events"])


# ----------------------------------------------------------------------------- the engine's policy
# Injected failures (a torch.OutOfMemoryError raised where a real one would be): the real ones are
# above; these pin the policy around them deterministically.


def _dropout_net() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 3)
    )
    return net.double().train()


def _ce_failing_above(limit: int):
    def loss_fn(model, batch):
        x, y = batch
        logits = model(x)  # the dropout mask is drawn before the failure, as in a real OOM
        if len(x) > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return torch.nn.functional.cross_entropy(logits, y)

    return loss_fn


def test_redone_window_draws_the_same_dropout_masks(gen):
    """RNG restored before the retry: the result does not depend on whether an OOM happened."""
    auto_net, fixed_net = _dropout_net(), _dropout_net()
    auto = bigbatch.Accumulator(auto_net, torch.optim.AdamW(auto_net.parameters()), "auto")
    fixed = bigbatch.Accumulator(fixed_net, torch.optim.AdamW(fixed_net.parameters()), 2)
    loss_fn = _ce_failing_above(2)
    for step in range(3):
        batch = (torch.randn(10, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (10,)))
        torch.manual_seed(100 + step)
        result = auto.train_step(batch, loss_fn)
        torch.manual_seed(100 + step)
        fixed.train_step(batch, loss_fn)
        assert result.oom_retries == (2 if step == 0 else 0)  # 10 -> 5 -> 2, then stays at 2
        assert (result.micro_batch_size, result.micro_batches, result.samples) == (2, 5, 10)
    for a, b in zip(auto_net.parameters(), fixed_net.parameters(), strict=True):
        assert torch.equal(a, b)


def test_other_errors_are_not_retried(gen):
    net = _dropout_net()
    acc = bigbatch.Accumulator(net, torch.optim.SGD(net.parameters(), lr=0.1), "auto")

    def broken(model, batch):
        model(batch[0]).sum().backward()  # leaves .grad behind
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    batch = (torch.randn(4, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (4,)))
    with assert_refused(net, RuntimeError, match="shapes cannot be multiplied"):
        acc.train_step(batch, broken)
    assert acc.current_micro_batch_size is None  # no shrinking: still the whole batch next
    assert acc.train_step(batch, _ce_failing_above(4)).oom_retries == 0  # usable afterwards


def test_oom_in_the_optimizer_step_is_not_retried(gen):
    net = _dropout_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    acc = bigbatch.Accumulator(net, opt, "auto")

    def step_out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    opt.step = step_out_of_memory  # type: ignore[method-assign]
    batch = (torch.randn(4, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (4,)))
    with assert_refused(net, torch.OutOfMemoryError):
        acc.train_step(batch, _ce_failing_above(4))
    assert acc.current_micro_batch_size is None  # a smaller micro-batch would not help


def test_fixed_micro_batch_over_budget_raises_and_changes_nothing(gen):
    net = torch.nn.Sequential(torch.nn.Linear(256, 4096), torch.nn.Tanh(), torch.nn.Linear(4096, 3))
    net = net.double()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    # 12 MiB: above the gradients (8.1 MiB; below them the budget is refused as impossible)
    acc = bigbatch.Accumulator(net, opt, micro_batch_size=512, memory_budget="12MiB")
    before = [p.detach().clone() for p in net.parameters()]
    batch = (
        torch.randn(1024, 256, generator=gen, dtype=torch.float64),
        torch.randint(0, 3, (1024,)),
    )
    ce = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    with pytest.raises(
        MemoryBudgetExceeded,
        match=r'micro_batch_size=512 used [0-9.]+ MiB, over memory_budget=12\.00 MiB; use micro_batch_size="auto"',
    ):
        acc.train_step(batch, ce)  # 512 x 4096 float64 activations: 16 MiB each
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    assert all(p.grad is None for p in net.parameters()) and not opt.state
