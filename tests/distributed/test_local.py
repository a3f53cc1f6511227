"""LocalAccumulation (bigbatch.distributed.local) on 2 real gloo ranks, and its errors.

The ranks hold deliberately unequal shares (10 and 7 samples, or sizes that change every step).
Checked against two references written here:

* λ = 1, plain outer rule: the exact data-parallel step, i.e. the ``Accumulator`` on a DDP model
  in the same rank processes, and one plain full-batch step on the union of the ranks' data;
* λ > 1: ``simulate``, the algorithm written out plainly in ONE process (W model copies, each
  taking full-batch steps on its rank's data, then the count-weighted mean of the normalised
  updates and the outer rule written by hand), float64, to ~1e-10.

Collectives are counted with torch's profiler: every ``c10d::`` event (all-reduce, broadcast,
barrier, ...) dispatched during each inner step, so a collective from any path, Python or C++,
counts. All cases run in one pair of rank processes (spawning is the slow part).
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from models import classification_batch, mean_ce, mlp
from ranks import run_ranks
from reference import full_batch_step, max_relative_error
from seeds import seed_for
from torch.nn.parallel import DistributedDataParallel as DDP

import bigbatch
from bigbatch.core.loss import as_sum_and_count
from bigbatch.core.split import batch_size, split
from bigbatch.distributed import LocalAccumulation

MICRO = 4
VARYING = [(10, 7), (5, 9), (8, 3)]  # unequal shares whose sizes change every step
INNER = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01
    ),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
}
# (name, inner optimizer, λ, outer_lr, outer_momentum, nesterov, steps): 7 steps at λ = 3 are
# rounds of 3 + 3 + 1, the last ended early by outer_step() (normalised by 1, not 3).
SIMULATED = [
    ("sgdm-plain", "sgd_momentum", 3, 1.0, 0.0, False, 7),
    ("adamw-nesterov", "adamw", 3, 2.0, 0.9, True, 7),
    ("sgd-momentum-outer", "sgd", 2, 1.5, 0.5, False, 6),
]
BN = ("bn", "sgd_momentum", 2, 1.0, 0.0, False, 4)


def bn_mlp(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3)).to(
        dtype
    )


def _steps(seed: int, n: int, shares=VARYING) -> list[list]:
    """``n`` steps, each a list of one batch per rank (sizes cycle through ``shares``)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        [classification_batch(k, torch.float64, gen) for k in shares[i % len(shares)]]
        for i in range(n)
    ]


def _cat(batches: list):
    return tuple(torch.cat(parts) for parts in zip(*batches, strict=True))


def _collectives(fn) -> tuple[object, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, sum(e.name.startswith("c10d::") for e in prof.events())


def _snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


# ---------------------------------------------------------------------------- in the ranks
def _dp_equivalence(rank: int, inner: str, steps: list) -> dict:
    """λ = 1, plain: LocalAccumulation beside the Accumulator on a DDP model, step by step."""
    plain, ddp_model = mlp(torch.float64), DDP(mlp(torch.float64))
    local = LocalAccumulation(plain, INNER[inner](plain.parameters()), 1, micro_batch_size=MICRO)
    acc = bigbatch.Accumulator(ddp_model, INNER[inner](ddp_model.parameters()), MICRO)
    ours, theirs, losses = [], [], []
    for per_rank in steps:
        result = local.train_step(per_rank[rank], mean_ce)
        acc.train_step(per_rank[rank], mean_ce)
        ours.append(_snapshot(plain))
        theirs.append(_snapshot(ddp_model.module))
        losses.append(result.outer.loss)
    return {"ours": ours, "ddp": theirs, "losses": losses}


def _simulated_case(rank: int, case: tuple, steps: list, make=mlp) -> dict:
    _, inner, lam, lr, mu, nesterov, _ = case
    model = make(torch.float64)
    micro = MICRO if make is mlp else 64  # BatchNorm: one micro-batch is the full batch (exact)
    local = LocalAccumulation(
        model, INNER[inner](model.parameters()), lam, micro_batch_size=micro,
        outer_lr=lr, outer_momentum=mu, nesterov=nesterov,
    )  # fmt: skip
    after_outer, calls, outers = [], [], []
    for i, per_rank in enumerate(steps):
        if i % 2:  # the low-level path on odd steps: backward per micro-batch, then step()
            result, n = _collectives(lambda b=per_rank[rank]: _low_level(local, model, b, micro))
        else:
            result, n = _collectives(lambda b=per_rank[rank]: local.train_step(b, mean_ce))
        calls.append(n)
        if result.outer is not None:
            outers.append(result.outer)
            after_outer.append(_snapshot(model))
    if not local.at_boundary:
        outer, n = _collectives(local.outer_step)
        calls[-1] += n
        outers.append(outer)
        after_outer.append(_snapshot(model))
    return {"after_outer": after_outer, "calls": calls, "outers": outers}


def _low_level(local: LocalAccumulation, model: nn.Module, batch, micro: int):
    pieces = split(batch, micro)
    for i, piece in enumerate(pieces):
        with local.accumulator.micro_batch(last=i == len(pieces) - 1):
            local.accumulator.backward(*as_sum_and_count(mean_ce(model, piece), batch_size(piece)))
    return local.step()


def _teacher_steps(rank: int, n: int) -> list:
    """A learnable task: labels of a fixed random linear teacher, 24 + 8 * rank samples/step."""
    gen = torch.Generator().manual_seed(1234)
    teacher = torch.randn(6, 3, generator=gen)
    out = []
    for _ in range(n):
        xs = [torch.randn(24 + 8 * r, 6, generator=gen) for r in range(2)]
        out.append((xs[rank], (xs[rank] @ teacher).argmax(1)))
    return out


def _trains(rank: int) -> list[float]:
    """λ = 4 with the defaults (plain outer rule, outer_lr = 1), float32: the round losses."""
    model = mlp(torch.float32)
    local = LocalAccumulation(model, torch.optim.SGD(model.parameters(), lr=0.5), 4)
    losses = []
    for batch in _teacher_steps(rank, 4 * 20):
        result = local.train_step((batch[0].float(), batch[1]), mean_ce)
        if result.outer is not None:
            losses.append(result.outer.loss)
    return losses


def _resume(rank: int, steps: list) -> dict:
    """4 rounds straight through, and 2 rounds + snapshot + fresh objects + 2 more rounds."""

    def build(seed: int):
        model = mlp(torch.float64, seed=seed)
        opt = INNER["adamw"](model.parameters())
        local = LocalAccumulation(
            model, opt, 3, micro_batch_size=MICRO, outer_lr=1.5, outer_momentum=0.9, nesterov=True
        )
        return model, opt, local

    model, opt, local = build(0)
    for per_rank in steps:
        local.train_step(per_rank[rank], mean_ce)
    straight = _snapshot(model)

    model, opt, local = build(0)
    for per_rank in steps[:6]:
        local.train_step(per_rank[rank], mean_ce)
    buffer = io.BytesIO()  # through bytes, as a snapshot file would be
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "local": local.state_dict()}, buffer
    )
    local.train_step(steps[6][rank], mean_ce)
    try:
        local.state_dict()
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    model, opt, local = build(7)  # another initialisation: only the snapshot may carry state
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    local.load_state_dict(saved["local"])
    for per_rank in steps[6:]:
        local.train_step(per_rank[rank], mean_ce)
    return {"straight": straight, "resumed": _snapshot(model), "refused": refused}


def _wrapper_errors() -> dict:
    from torch.distributed.fsdp import fully_shard

    out = {}
    for name, wrap in (("ddp", DDP), ("fsdp", fully_shard)):
        model = wrap(mlp(torch.float64))
        try:
            LocalAccumulation(model, torch.optim.SGD(model.parameters(), lr=0.1), 2)
        except TypeError as exc:
            out[name] = str(exc)
    return out


def _nothing_counted(rank: int) -> dict:
    """A round whose every inner step counts nothing on both ranks: zero-gradient steps (weight
    decay still moves them), averaged with equal weights; before, ZeroDivisionError."""
    import warnings

    model = mlp(torch.float64)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5)
    local = LocalAccumulation(model, inner, 2, micro_batch_size=MICRO)
    batch = classification_batch(6 + rank, torch.float64, torch.Generator().manual_seed(rank))
    nothing = lambda m, b: (m(b[0]).sum() * 0, torch.zeros((), dtype=torch.float64))  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [local.train_step(batch, nothing) for _ in range(2)]
    start = [p.detach().clone() for p in mlp(torch.float64).parameters()]
    # each rank: θ_r = θ_start after 2 decay-only steps; the round applies (θ_r - θ_start) / λ
    decayed = [p + (p * (1 - 0.1 * 0.5) ** 2 - p) / 2 for p in start]
    return {
        "outer": results[-1].outer,
        "warned": [
            str(w.message) for w in caught if "counted nothing on any rank" in str(w.message)
        ],
        "distance": max(_relative(a, b) for a, b in zip(decayed, model.parameters(), strict=True)),
    }


def _all_cases(rank: int, world_size: int, seed: int) -> dict:
    out = {
        "nothing": _nothing_counted(rank),
        "dp_varying_sgd": _dp_equivalence(rank, "sgd", _steps(seed, 4)),
        "dp_constant_momentum": _dp_equivalence(rank, "sgd_momentum", _steps(seed, 4, [(10, 7)])),
        "bn": _simulated_case(rank, BN, _steps(seed + 1, BN[-1]), make=bn_mlp),
        "trains": _trains(rank),
        "resume": _resume(rank, _steps(seed + 2, 12)),
        "errors": _wrapper_errors(),
    }
    for case in SIMULATED:
        out[case[0]] = _simulated_case(rank, case, _steps(seed + 3, case[-1]))
    return out


@pytest.fixture(scope="module")
def ranks():
    seed = seed_for("tests/distributed/test_local.py")
    return seed, run_ranks(_all_cases, seed, timeout_s=300)


# ---------------------------------------------------------------------------- references
def simulate(make_model, inner, steps: list, lam, outer_lr, mu, nesterov) -> list[list]:
    """Local accumulation written plainly in one process; the model after each outer step."""
    world = len(steps[0])
    models = [make_model(torch.float64) for _ in range(world)]
    opts = [INNER[inner](m.parameters()) for m in models]
    start = [p.detach().clone() for p in models[0].parameters()]
    momentum, counts, history = None, [0] * world, []
    for i, per_rank in enumerate(steps, start=1):
        for model, opt, batch, r in zip(models, opts, per_rank, range(world), strict=True):
            full_batch_step(model, opt, mean_ce, batch)
            counts[r] += batch_size(batch)
        if i % lam and i < len(steps):
            continue
        k, total = (i - 1) % lam + 1, sum(counts)
        params = [list(m.parameters()) for m in models]
        delta = [
            sum(counts[r] * (params[r][j].detach() - s) for r in range(world)) / total / k
            for j, s in enumerate(start)
        ]
        grad = [-d for d in delta]
        if mu:
            momentum = (
                grad
                if momentum is None
                else [mu * b + g for b, g in zip(momentum, grad, strict=True)]
            )
            grad = (
                [g + mu * b for g, b in zip(grad, momentum, strict=True)] if nesterov else momentum
            )
        start = [s - outer_lr * g for s, g in zip(start, grad, strict=True)]
        buffers = [list(m.buffers()) for m in models]
        with torch.no_grad():
            for j, b in enumerate(buffers[0]):
                if b.is_floating_point():
                    mean = sum(counts[r] * buffers[r][j] for r in range(world)) / total
                else:
                    mean = (sum(buffers[r][j] for r in range(world)) / world).round()
                for r in range(world):
                    buffers[r][j].copy_(mean)
            for m in models:
                for p, s in zip(m.parameters(), start, strict=True):
                    p.copy_(s)
        history.append(_snapshot(models[0]))
        counts = [0] * world
    return history


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()  # integer buffers (num_batches_tracked) too
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(a).clamp_min(1e-30))


# ---------------------------------------------------------------------------- slow tests
@pytest.mark.slow
@pytest.mark.parametrize("case", ["dp_varying_sgd", "dp_constant_momentum"])
def test_one_local_step_equals_the_exact_data_parallel_step_float64(ranks, case):
    seed, results = ranks
    for got in results:
        for ours, ddp in zip(got[case]["ours"], got[case]["ddp"], strict=True):
            assert max(_relative(d, o) for o, d in zip(ours, ddp, strict=True)) < 1e-10
    if case == "dp_varying_sgd":  # and the plain full-batch step on the union of the shares
        ref = mlp(torch.float64)
        opt = INNER["sgd"](ref.parameters())
        losses = [full_batch_step(ref, opt, mean_ce, _cat(b)) for b in _steps(seed, 4)]
        assert results[0][case]["losses"] == pytest.approx(losses, rel=1e-10)
        got = mlp(torch.float64)
        with torch.no_grad():
            for p, q in zip(got.parameters(), results[0][case]["ours"][-1], strict=False):
                p.copy_(q)
        assert max_relative_error(ref, got) < 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("case", [*SIMULATED, BN], ids=lambda c: c[0])
def test_local_steps_equal_the_plain_simulation_float64(ranks, case):
    seed, results = ranks
    make = bn_mlp if case is BN else mlp
    steps = _steps(seed + 1 if case is BN else seed + 3, case[-1])
    expected = simulate(make, case[1], steps, *case[2:6])
    for got in results:
        assert len(got[case[0]]["after_outer"]) == len(expected)
        for ours, ref in zip(got[case[0]]["after_outer"], expected, strict=True):
            assert max(_relative(r, o) for o, r in zip(ours, ref, strict=True)) < 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("case", [*SIMULATED, BN], ids=lambda c: c[0])
def test_ranks_hold_identical_models_after_each_outer_step(ranks, case):
    _, (rank0, rank1) = ranks
    for a, b in zip(rank0[case[0]]["after_outer"], rank1[case[0]]["after_outer"], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))  # bitwise
    if case is BN:  # the buffers are part of it: averaged, not left per rank
        assert any(not t.is_floating_point() for t in rank0["bn"]["after_outer"][0])


@pytest.mark.slow
@pytest.mark.parametrize("case", SIMULATED, ids=lambda c: c[0])
def test_one_all_reduce_per_round(ranks, case):
    _, results = ranks
    lam, n = case[2], case[-1]
    expected = [1 if (i + 1) % lam == 0 or i == n - 1 else 0 for i in range(n)]
    for got in results:
        assert got[case[0]]["calls"] == expected
        rounds = got[case[0]]["outers"]
        assert [o.local_steps for o in rounds] == [lam] * (n // lam) + (
            [n % lam] if n % lam else []
        )


@pytest.mark.slow
def test_a_round_that_counted_nothing_averages_its_ranks_alike(ranks):
    """Issue 37: ``outer_step`` raised ZeroDivisionError when a whole round counted nothing."""
    for rank in ranks[1]:
        found = rank["nothing"]
        assert found["outer"].count == 0 and found["outer"].loss == 0.0, found["outer"]
        assert len(found["warned"]) == 1, found["warned"]
        assert found["distance"] < 1e-12


@pytest.mark.slow
def test_outer_result_reports_the_global_round(ranks):
    seed, results = ranks
    steps = _steps(seed + 3, SIMULATED[0][-1])
    count = sum(batch_size(b) for per_rank in steps[:3] for b in per_rank)
    for got in results:
        first = got[SIMULATED[0][0]]["outers"][0]
        assert first.count == count and first.local_steps == 3 and first.update_norm > 0
    assert results[0]["sgdm-plain"]["outers"] == results[1]["sgdm-plain"]["outers"]


@pytest.mark.slow
def test_more_local_steps_train(ranks):
    _, results = ranks
    for losses in (got["trains"] for got in results):
        assert len(losses) == 20
        assert losses[-1] < 0.6 * losses[0], losses


@pytest.mark.slow
def test_state_dict_round_trip_resumes_bitwise(ranks):
    _, results = ranks
    for got in results:
        resume = got["resume"]
        assert all(
            torch.equal(a, b) for a, b in zip(resume["straight"], resume["resumed"], strict=True)
        )
        assert "state_dict() in the middle of a round (1 of local_steps=3" in resume["refused"]


@pytest.mark.slow
def test_wrapped_models_are_refused(ranks):
    _, results = ranks
    for got in results:
        assert "needs the plain module, not a DistributedDataParallel" in got["errors"]["ddp"]
        assert "Pass ddp.module" in got["errors"]["ddp"]
        assert "does not support FSDP" in got["errors"]["fsdp"]


@pytest.mark.slow
@pytest.mark.needs("sklearn")  # the benchmark trains on the demo's digits
def test_benchmark_quick_runs():
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "local_accumulation.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {
        line.split("|")[1].strip() + line.split("|")[2].strip(): line.split("|")
        for line in done.stdout.splitlines()
        if line.startswith("|")
    }
    assert rows["exact data-parallel (DDP)-"][5].strip() == "1.0x"
    assert rows["local, outer_lr 1 (AGN)4"][5].strip() == "4.0x"  # λ times fewer bytes
    assert rows["PyTorch post-local SGD4"][3].strip() == "0.25"  # one all-reduce per 4 steps


# ---------------------------------------------------------------------------- quick tests
@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "4", None])
def test_local_steps_must_be_a_whole_number_from_one(bad):
    model = mlp(torch.float64)
    with pytest.raises(
        ValueError, match=rf"local_steps={bad!r} is not allowed: use a whole number >= 1"
    ):
        LocalAccumulation(model, torch.optim.SGD(model.parameters(), lr=0.1), bad)


def test_one_process_is_refused():
    model = mlp(torch.float64)
    with pytest.raises(
        RuntimeError, match=r"local_steps=4\) needs several ranks and this is one process"
    ):
        LocalAccumulation(model, torch.optim.SGD(model.parameters(), lr=0.1), 4)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"outer_lr": 0.0}, r"outer_lr=0.0 is not allowed: use a positive finite number"),
        ({"outer_momentum": 1.0}, r"outer_momentum=1.0 is not allowed: use a number in \[0, 1\)"),
        ({"nesterov": True}, r"nesterov=True needs momentum: pass outer_momentum > 0"),
    ],
)
def test_bad_outer_rule_is_refused(kwargs, message):
    model = mlp(torch.float64)
    with pytest.raises(ValueError, match=message):
        LocalAccumulation(model, torch.optim.SGD(model.parameters(), lr=0.1), 2, **kwargs)


def test_optimizer_over_another_model_is_refused():
    model, other = mlp(torch.float64), mlp(torch.float64)
    with pytest.raises(ValueError, match=r"the optimizer holds none of the model's trainable"):
        LocalAccumulation(model, torch.optim.SGD(other.parameters(), lr=0.1), 2)
