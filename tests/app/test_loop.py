"""fit() against a plain full-batch loop written in the test, in float64."""

from __future__ import annotations

import copy
import math
import os

import pytest
import tasks
import torch
from reference import full_batch_step, max_relative_error

import bigbatch
from bigbatch.app.log import read_csv


def sgd_momentum(params, lr):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def plain_loop(task, batch_size, epochs, lr, optimizer, seed, schedule=None, max_grad_norm=None):
    """Epoch e visits randperm(n, seed + e) in batches of batch_size (the documented order)."""
    model = copy.deepcopy(task.model)
    opt = optimizer(model.parameters(), lr=lr)
    n = len(task.train_data)
    steps_per_epoch = math.ceil(n / batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if schedule else None
    losses = []
    for epoch in range(epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        for i in range(steps_per_epoch):
            batch = task.train_data[order[i * batch_size : (i + 1) * batch_size]]
            losses.append(full_batch_step(model, opt, task.loss_fn, batch, sched, max_grad_norm))
    return model, losses


def cosine_after_warmup(total, warmup):
    def factor(step):
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))

    return factor


CASES = {
    "sgd-momentum, 10 = 4+4+2, constant": (sgd_momentum, {}, None),
    "adamw, 10 = 3+3+3+1, warmup+cosine, clipping": (
        torch.optim.AdamW,
        {"micro_batch_size": 3, "lr_schedule": "cosine", "warmup_steps": 2, "max_grad_norm": 0.5},
        cosine_after_warmup(9, 2),
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_fit_equals_plain_full_batch_loop(case, tmp_path):
    optimizer, settings, schedule = CASES[case]
    task = tasks.classify(n=25)  # 25 samples at batch 10: the last batch of an epoch holds 5
    task.optimizer = optimizer
    want, losses = plain_loop(
        task,
        10,
        3,
        0.05,
        optimizer,
        seed=7,
        schedule=schedule,
        max_grad_norm=settings.get("max_grad_norm"),
    )
    summary = bigbatch.fit(
        task, batch_size=10, epochs=3, lr=0.05, seed=7, out=str(tmp_path), quiet=True,
        **{"micro_batch_size": 4, **settings},
    )  # fmt: skip
    assert max_relative_error(want, task.model) < 1e-10
    rows = read_csv(os.path.join(tmp_path, "metrics.csv"))
    assert [int(r["step"]) for r in rows] == list(range(1, 10))  # one row per optimizer step
    assert [float(r["loss"]) for r in rows] == pytest.approx(losses, rel=1e-10)
    assert summary.steps == 9 and summary.samples == 75
    assert summary.metric is not None and 0 <= summary.metric <= 1


def test_a_batch_that_counts_nothing_is_trained_on(tmp_path):
    """A batch whose every label is ignored (a third of wikitext's lines are empty) is the full
    batch's step on a zero gradient, loss 0, as in transformers' Trainer; before, it stopped
    ``fit``. The 2nd batch of epoch 0 (SGD with momentum) and the 3rd of epoch 1 (AdamW)."""
    for optimizer, (epoch, index) in [(sgd_momentum, (0, 1)), (torch.optim.AdamW, (1, 2))]:
        task = tasks.tiny_lm(n=16)
        order = torch.randperm(16, generator=torch.Generator().manual_seed(7 + epoch))
        ids, labels = task.train_data.tensors
        labels[order[4 * index : 4 * index + 4]] = -100
        task.optimizer = optimizer
        want, losses = plain_loop(task, 4, 2, 0.05, optimizer, seed=7)
        out = tmp_path / optimizer.__name__
        with pytest.warns(bigbatch.BigBatchWarning, match="total count is 0"):
            bigbatch.fit(task, batch_size=4, micro_batch_size=3, epochs=2, lr=0.05, seed=7,
                         out=str(out), quiet=True)  # fmt: skip
        assert max_relative_error(want, task.model) < 1e-10
        rows = read_csv(str(out / "metrics.csv"))
        assert [float(r["loss"]) for r in rows] == pytest.approx(losses, rel=1e-10)
        assert (
            float(rows[4 * epoch + index]["loss"]) == 0 == float(rows[4 * epoch + index]["count"])
        )


def test_lr_scaling_and_gradient_accumulation_steps(tmp_path):
    task = tasks.classify(n=20)
    task.optimizer = sgd_momentum
    want, _ = plain_loop(task, 8, 1, 0.01 * 8 / 2, sgd_momentum, seed=0)
    bigbatch.fit(
        task, batch_size=8, gradient_accumulation_steps=4, lr=0.01, lr_scaling="linear",
        reference_batch_size=2, out=str(tmp_path), quiet=True,
    )  # fmt: skip
    assert max_relative_error(want, task.model) < 1e-10
    rows = read_csv(os.path.join(tmp_path, "metrics.csv"))
    assert rows[0]["micro_batch_size"] == "2" and rows[0]["micro_batches"] == "4"
    assert float(rows[0]["lr"]) == pytest.approx(0.04)


@pytest.mark.parametrize("optimizer", [sgd_momentum, torch.optim.AdamW], ids=["sgd", "adamw"])
def test_a_batch_larger_than_the_data_is_said_and_the_lr_scaled_for_what_is_trained(
    optimizer, tmp_path
):
    """20 samples, --batch-size 1000: every step is the full batch of 20, said in a warning, and
    the LR scaled for 20 (linear from 2: x10), not for 1000 (x500): the plain loop on 20."""
    task = tasks.classify(n=20)
    task.optimizer = optimizer
    want, _ = plain_loop(task, 20, 3, 0.01 * 20 / 2, optimizer, seed=0)
    with pytest.warns(
        bigbatch.BigBatchWarning,
        match=r"^--batch-size 1000 is larger than the task's 20 training samples: every step "
        r"trains on all 20 \(full-batch gradient descent\), and --lr is scaled for 20 samples, "
        r"not 1000. Give --batch-size 20 or less",
    ):
        summary = bigbatch.fit(
            task, batch_size=1000, micro_batch_size=6, epochs=3, lr=0.01, lr_scaling="linear",
            reference_batch_size=2, out=str(tmp_path), quiet=True,
        )  # fmt: skip
    assert max_relative_error(want, task.model) < 1e-10
    rows = read_csv(os.path.join(tmp_path, "metrics.csv"))
    assert [float(r["lr"]) for r in rows] == pytest.approx([0.1] * 3)
    assert [(r["samples"], r["micro_batches"]) for r in rows] == [("20", "4")] * 3  # 6+6+6+2
    assert summary.batch_size == 20 and summary.steps == 3


def test_an_lr_beyond_the_models_floats_is_refused(tmp_path):
    """1e300 fits a float64 but not the float32 model's step sizes: torch would fail inside
    its optimizer ("value cannot be converted to type float without overflow")."""
    task = tasks.classify(n=20, dtype=torch.float32)
    with pytest.raises(
        ValueError,
        match=r"^--lr 1e\+300 gives a rate of 1e\+300 at batch 10, and the model's "
        r"torch.float32 parameters hold at most 3.4e\+38: an optimizer step would overflow. Use "
        r"a rate below 3.4e\+35, e.g. 1e-3.$",
    ):
        bigbatch.fit(task, batch_size=10, steps=2, lr=1e300, out=str(tmp_path / "a"), quiet=True)
    assert not (tmp_path / "a").exists()  # refused before the run folder is made
    # below the bound the run starts, and a diverging one stops on NaN with its own clear line
    with pytest.raises(FloatingPointError, match=r"^step 2: the window's loss is nan"):
        bigbatch.fit(task, batch_size=10, steps=2, lr=1e30, out=str(tmp_path / "b"), quiet=True)


def test_steps_run_across_epochs_and_model_pt_is_saved(tmp_path):
    task = tasks.classify(n=20)
    summary = bigbatch.fit(
        task, bigbatch.TrainConfig(batch_size=8, steps=7, out=str(tmp_path), quiet=True)
    )
    assert summary.steps == 7
    assert [r["epoch"] for r in read_csv(os.path.join(tmp_path, "metrics.csv"))] == list("0001112")
    saved = torch.load(os.path.join(tmp_path, "model.pt"))
    assert all(torch.equal(saved[k], v) for k, v in task.model.state_dict().items())


def test_auto_micro_batch_under_the_trainer(tmp_path):
    task = tasks.classify(n=20)
    bigbatch.fit(
        task, batch_size=10, micro_batch_size="auto", steps=2, out=str(tmp_path), quiet=True
    )
    assert read_csv(os.path.join(tmp_path, "metrics.csv"))[0]["micro_batch_size"] == "10"


def test_a_folder_with_a_run_needs_resume(tmp_path):
    bigbatch.fit(tasks.classify(n=20), batch_size=10, steps=1, out=str(tmp_path), quiet=True)
    with pytest.raises(ValueError, match=r"already holds a run \(step 1 of 1\): add --resume"):
        bigbatch.fit(tasks.classify(n=20), batch_size=10, steps=1, out=str(tmp_path), quiet=True)
    with pytest.raises(ValueError, match=r"belongs to another run \(batch_size: 10 -> 5"):
        bigbatch.fit(
            tasks.classify(n=20), batch_size=5, steps=1, out=str(tmp_path), quiet=True, resume=True
        )


def test_bad_task_data_is_named():
    task = tasks.classify()
    task.train_data = iter([1, 2])
    with pytest.raises(bigbatch.app.task.TaskError, match="needs a map-style dataset"):
        bigbatch.fit(task, quiet=True)
