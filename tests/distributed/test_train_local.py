"""``bigbatch train --local-steps λ`` under a real ``torchrun --nproc_per_node 2`` (gloo, CPU).

Note [local rounds] in ``bigbatch.app.loop``. The trained model is checked against the
algorithm written out plainly in this file (``simulate``: two model copies in one process, each
taking full-batch AdamW steps on its share of each global batch, then the count-weighted mean
of the normalised updates and the outer rule by hand), float64, to ~1e-10, with its collectives
counted (two all-reduces per round, none per inner step). A run killed mid-round
(SIGKILL) or signalled mid-round (SIGTERM) resumes bitwise equal to an uninterrupted one. The
errors: a sharded (FSDP) task model; one process and local_steps < 1 are in
tests/app/test_rounds.py.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import signal
import sys

import pytest
import torch
import torch.nn.functional as F
from torchrun_runs import BIGBATCH, FORKED, HERE, TORCHRUN, launch, start_and_stop_rank0

from bigbatch.app.log import read_csv
from bigbatch.core import _rng

pytestmark = pytest.mark.slow

TASKS = HERE.parent / "app" / "tasks.py"
SEED, LR = 3, 0.01


def simulate(local_steps: int, outer_lr: float, momentum: float, nesterov: bool, batch: int,
             epochs: int) -> tuple[dict, list[float]]:  # fmt: skip
    """What ``bigbatch train tasks.py:classify`` with these settings must compute on 2 ranks:
    the final state dict and the round losses (Σ loss sum / Σ count over the round, all ranks)."""
    sys.path.insert(0, str(TASKS.parent))
    import tasks

    _rng.seed_all(SEED)  # as the CLI does before calling the task function
    task = tasks.classify()
    x, y = task.train_data.tensors
    replicas = [copy.deepcopy(task.model) for _ in range(2)]
    inner = [torch.optim.AdamW(m.parameters(), lr=LR) for m in replicas]  # the trainer's default
    start = [p.detach().clone() for p in task.model.parameters()]
    outer = torch.optim.SGD(start, lr=outer_lr, momentum=momentum, nesterov=nesterov)
    per_epoch = math.ceil(len(x) / batch)
    total, counts, loss_sum, taken, round_losses = per_epoch * epochs, [0, 0], 0.0, 0, []
    for step in range(1, total + 1):
        epoch, i = divmod(step - 1, per_epoch)
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED + epoch))
        indices = order[i * batch : (i + 1) * batch]
        for rank, (model, optimizer) in enumerate(zip(replicas, inner, strict=True)):
            share = indices[rank::2]  # distributed.deal
            loss = F.cross_entropy(model(x[share]), y[share])  # the share in one piece
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            counts[rank] += len(share)
            loss_sum += loss.item() * len(share)
        taken += 1
        if step % local_steps and step != total:
            continue
        with torch.no_grad():  # the outer step on the count-weighted normalised update
            for s, *params in zip(start, *(m.parameters() for m in replicas), strict=True):
                update = sum(c * (p - s) for c, p in zip(counts, params, strict=True))
                s.grad = -update / (sum(counts) * taken)
            outer.step()
            for model in replicas:
                for p, s in zip(model.parameters(), start, strict=True):
                    p.copy_(s)
        round_losses.append(loss_sum / sum(counts))
        counts, loss_sum, taken = [0, 0], 0.0, 0
    return replicas[0].state_dict(), round_losses


def test_local_steps_train_as_written_out_and_rank0_alone_writes(tmp_path):
    """λ = 4 over 10 steps: rounds of 4 + 4 + 2 (the short last one closed at the end), the
    outer rule with Nesterov momentum; evaluation every 3 steps and the end of epoch 1 (step 5)
    wait for the round's end."""
    out = tmp_path / "run"
    flags = ["--batch-size", "10", "--micro-batch-size", "3", "--epochs", "2", "--lr", str(LR),
             "--local-steps", "4", "--outer-lr", "2", "--outer-momentum", "0.5",
             "--outer-nesterov", "--eval-every", "3"]  # fmt: skip
    done = launch(
        [*FORKED, str(HERE / "train_child.py"), "train", f"{TASKS}:classify", "--out", str(out),
         "--quiet", "--seed", str(SEED), *flags], COUNT_COLLECTIVES="1",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    want, round_losses = simulate(4, 2.0, 0.5, True, batch=10, epochs=2)
    got = torch.load(out / "model.pt")
    assert max(float((got[k] - v).abs().max() / v.abs().max()) for k, v in want.items()) < 1e-10
    rows = read_csv(str(out / "metrics.csv"))
    assert [int(r["step"]) for r in rows] == list(range(1, 11))
    ends = [r for r in rows if r["round_loss"]]
    assert [int(r["step"]) for r in ends] == [4, 8, 10]
    assert [float(r["round_loss"]) for r in ends] == pytest.approx(round_losses, rel=1e-10)
    assert [float(r["round_count"]) for r in ends] == [40, 40, 20]  # samples, all ranks
    assert {float(r["count"]) for r in rows} == {5.0}  # rank 0's share of each batch of 10
    assert [int(r["step"]) for r in rows if r["eval_loss"]] == [4, 8, 10]
    assert torch.load(out / "snapshot.pt", weights_only=True)["step"] == 10
    assert (out / "snapshot-00000008.pt").exists()  # the end of epoch 1 (step 5), at step 8
    summary = (out / "summary.json").read_text()
    assert f'"final_loss": {float(ends[-1]["round_loss"])}' in summary  # the round's, all ranks
    # rank 0 alone writes: one header (read_csv would choke on a second), one event file
    if importlib.util.find_spec("tensorboard") is not None:
        assert len(os.listdir(out / "tensorboard")) == 1
    for rank in (0, 1):
        assert (out / f"teardown-rank{rank}").read_text() == "left"
        # per round: the outer step's all-reduce and the ranks' agreement on a stop signal
        # (which carries the round's sums too); nothing per inner step; one more at the end, the
        # agreement after the final evaluation (the rest: the start-up broadcast, snapshot and
        # lock gathers)
        collectives = json.loads((out / f"collectives-rank{rank}.json").read_text())
        assert collectives["c10d::allreduce_"] == 2 * 3 + 1, collectives
        assert collectives["c10d::broadcast_"] == 1, collectives


def test_a_step_skipped_on_one_rank_is_counted(tmp_path):
    """Sample 1 holds a NaN; unshuffled, it is in rank 1's share of step 1, so rank 1 alone
    skips that inner step (--nonfinite skip) and rank 0 sees nothing. The round's end says it:
    ``round_skipped`` 1, ``skipped_steps`` 1 in summary.json, and the round's loss over the
    three inner steps applied (before: skipped 0, round loss NaN, final loss null)."""
    out = tmp_path / "run"
    done = launch(
        [*FORKED, BIGBATCH, "train", f"{TASKS}:nan_data", "--out", str(out), "--quiet",
         "--seed", str(SEED), "--batch-size", "10", "--micro-batch-size", "4", "--steps", "4",
         "--lr", str(LR), "--local-steps", "2", "--nonfinite", "skip", "--no-shuffle"],
        NAN_SAMPLE="1",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = read_csv(str(out / "metrics.csv"))
    assert [r["skipped"] for r in rows] == ["0"] * 4  # rank 0's own steps
    assert [(r["step"], r["round_skipped"]) for r in rows if r["round_loss"]] == [
        ("2", "1"), ("4", "0")
    ]  # fmt: skip
    # rank 1 took step 2 from the initial model (its step 1 changed nothing): its loss on
    # samples 11, 13, ..., 19, the initial model's
    sys.path.insert(0, str(TASKS.parent))
    import tasks

    _rng.seed_all(SEED)
    task = tasks.classify()  # nan_data's model and data, but for sample 1
    x, y = task.train_data.tensors
    with torch.no_grad():
        rank1 = float(F.cross_entropy(task.model(x[11:20:2]), y[11:20:2]))
    want = (5 * float(rows[0]["loss"]) + 5 * float(rows[1]["loss"]) + 5 * rank1) / 15
    assert float(rows[1]["round_loss"]) == pytest.approx(want, rel=1e-10)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] == 1
    assert summary["final_loss"] == float(rows[3]["round_loss"])


# batch 9 on 2 ranks: shares of 5 and 4; 50 samples = 6 steps per epoch (the last of 5 samples),
# 12 steps, rounds end at 4, 8, 12. Dropout, so each rank's random state must come back too.
KILLABLE = ["train", f"{TASKS}:killable", "--quiet", "--seed", str(SEED), "--batch-size", "9",
            "--micro-batch-size", "4", "--epochs", "2", "--lr", "0.05", "--save-every", "4",
            "--local-steps", "4", "--outer-lr", "4", "--outer-momentum", "0.5"]  # fmt: skip
# rank 0 starts micro-batches 4+1 per step (step 6: its 3 samples in one): the 12th is the first
# of step 7, the third step of round 2; the last snapshot then is the one of step 4
STOP_AT = 12


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "whole"
    done = launch([*FORKED, BIGBATCH, *KILLABLE, "--out", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _assert_samerun(got, want) -> None:
    a, b = torch.load(got / "model.pt"), torch.load(want / "model.pt")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "weights differ from the uninterrupted run"
    rows, ref = read_csv(str(got / "metrics.csv")), read_csv(str(want / "metrics.csv"))
    keys = ("step", "loss", "grad_norm", "round_loss", "round_count")
    assert [[r[k] for k in keys] for r in rows] == [[r[k] for k in keys] for r in ref]


def test_killed_mid_round_resumes_bitwise_equal(tmp_path, uninterrupted):
    run = tmp_path / "run"
    proc, workers = start_and_stop_rank0([*KILLABLE, "--out", str(run)], tmp_path, STOP_AT)
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    assert proc.wait(timeout=60) != 0
    snapshot = torch.load(run / "snapshot.pt", weights_only=True)
    assert snapshot["step"] == 4
    assert len(snapshot["local"]["optimizers"]) == 2  # each rank's own AdamW state
    assert snapshot["local"]["outer"]["outer_steps"] == 1

    done = launch([*FORKED, BIGBATCH, *KILLABLE, "--out", str(run), "--resume"])
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_samerun(run, uninterrupted)


def test_a_signal_mid_round_finishes_the_round_then_stops(tmp_path, uninterrupted):
    """SIGTERM to rank 0 in step 7: the ranks run to the round's end (step 8), snapshot there,
    stop with 143, and ``--resume`` ends bitwise equal to the uninterrupted run."""
    run, err = tmp_path / "run", tmp_path / "err"
    args = [*KILLABLE, "--out", str(run)]
    proc, (rank0, _) = start_and_stop_rank0(args, tmp_path, STOP_AT, stderr=err)
    os.kill(rank0, signal.SIGTERM)
    os.kill(rank0, signal.SIGCONT)
    assert proc.wait(timeout=120) != 0
    assert "stopped by SIGTERM after step 8 of 12" in err.read_text()
    assert torch.load(run / "snapshot.pt", weights_only=True)["step"] == 8
    assert [int(r["step"]) for r in read_csv(str(run / "metrics.csv"))] == list(range(1, 9))

    done = launch([*FORKED, BIGBATCH, *args, "--resume"])
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_samerun(run, uninterrupted)


def test_a_sharded_task_model_is_refused(tmp_path):
    # New interpreters: a forked rank inherits the agent's SIGTERM handler (it raises), so a rank
    # stopped by torchrun while it shards would say that in a line of its own
    done = launch([*TORCHRUN, "-m", "bigbatch", "train", f"{TASKS}:fsdp_classify", "--out",
                 str(tmp_path / "run"), "--local-steps", "4", "--quiet"])  # fmt: skip
    assert done.returncode != 0
    want = (
        "bigbatch train: error: --local-steps 4 steps a whole plain replica of the model on each "
        "rank, and the task's model is sharded with FSDP: return the plain module from the task"
    )
    # each rank says it in one line (torchrun may stop the second rank before it prints)
    lines = [line for line in done.stderr.splitlines() if line.startswith("bigbatch train:")]
    assert 1 <= len(lines) <= 2, done.stderr[-3000:]
    assert all(line.startswith(want) for line in lines), done.stderr[-3000:]
    assert "TypeError" not in done.stderr  # no worker traceback (torchrun's own report apart)
    assert not (tmp_path / "run").exists()  # refused before the run folder is made
