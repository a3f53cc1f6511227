"""``bigbatch train --chunked-head`` and the ``check`` / ``plan`` commands with it (issue 31): the
run equals the same run with the plain head in one micro-batch (float64); a model without an
output layer is refused in one line."""

from __future__ import annotations

import pytest
import tasks
import torch

import bigbatch
from bigbatch.app import cli
from bigbatch.app.cli import main
from bigbatch.core.head import HeadLogits

SETTINGS = {"batch_size": 10, "epochs": 2, "lr": 0.05, "seed": 3, "quiet": True}


def test_a_chunked_run_equals_the_plain_whole_batch_run(tmp_path):
    bigbatch.fit(tasks.text(), out=str(tmp_path / "whole"), micro_batch_size=10, **SETTINGS)
    task = tasks.text()
    made = []  # what the output layer returned: never logits
    task.model.head.register_forward_hook(lambda m, a, out: made.append(type(out)))
    bigbatch.fit(task, out=str(tmp_path / "chunked"), micro_batch_tokens=20, chunked_head=True,
                 **SETTINGS)  # fmt: skip
    assert made and set(made) == {HeadLogits}
    whole, ours = (torch.load(tmp_path / d / "model.pt", weights_only=True) for d in ("whole", "chunked"))  # fmt: skip
    for name, value in whole.items():
        assert torch.allclose(ours[name], value, rtol=1e-10, atol=1e-13), name


@pytest.mark.needs("rich")
def test_check_and_plan_run_the_chunked_loss(tmp_path, capsys, monkeypatch):
    task = f"{tasks.__file__}:text"
    assert main(["check", task, "--batch-size", "10", "--chunked-head"]) == 0
    assert "NOT exact" not in capsys.readouterr().out
    seen = {}

    def plan(model, batch, loss_fn, **kwargs):  # wiring: the loss plan measures
        with torch.no_grad():
            seen["logits"] = []
            model.head.register_forward_hook(lambda m, a, out: seen["logits"].append(out))
            loss_fn(model, batch)
        raise SystemExit(0)

    monkeypatch.setattr(cli, "plan", plan)
    try:
        main(["plan", task, "--batch-size", "10", "--chunked-head"])
    except SystemExit:
        pass
    assert seen["logits"] and all(isinstance(x, HeadLogits) for x in seen["logits"])


def test_a_model_without_an_output_layer_is_refused(tmp_path, capsys):
    code = main(["train", f"{tasks.__file__}:tiny_lm", "--batch-size", "8", "--chunked-head",
                 "--out", str(tmp_path / "run"), "--quiet"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "chunked_head needs the model's output layer: Sequential has no get_output_em" in err
    assert not (tmp_path / "run").exists()
