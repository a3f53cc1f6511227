"""``check`` on losses of named terms (issue 24 item 3): it compares each term's accumulated
gradient with the full batch's and names the term that is normalised inside a micro-batch, or
that depends on a batch statistic computed per micro-batch (where ``stats_fn`` is needed)."""

from __future__ import annotations

import pytest
import torch
from models import TinyCausalLM
from test_check import TASK
from test_stats import TinyMoE, moe_loss, routing, text
from test_terms import ce_z_smoothing, dpo_rpo, make_batch, sft_aux

from bigbatch.app.cli import main
from bigbatch.losses import terms
from bigbatch.verifier._check import check


def lm() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyCausalLM().double()


def z_per_micro_batch(model, mb):
    """The z-loss term divided by its own tokens inside the micro-batch, returned as (mean, 1)."""
    out = ce_z_smoothing(model, mb)
    s, c, w = out.pop("z_loss")
    return {**out, "z_loss": (s / c, 1.0, w)}


def advantages_per_micro_batch(model, mb):
    """Advantages normalised by the micro-batch's own reward mean and std."""
    logits = model(mb["input_ids"])
    a = mb["advantages"]
    a = (a - a.mean()) / (a.std(unbiased=False) + 1e-6)
    score = terms.sequence_logps(logits, mb["labels"])
    return {**terms.token_nll(logits, mb["labels"]), "pg": (-(a * score).sum(), float(len(a)))}


def test_correct_compound_losses_are_exact(gen):
    batch = make_batch(10, gen)
    for loss_fn in (ce_z_smoothing, sft_aux, dpo_rpo):
        report = check(lm(), batch, loss_fn, micro_batch_size=4)
        assert report.exact and not report.diagnoses, report.summary()


def test_a_term_normalised_inside_the_micro_batch_is_named(gen):
    report = check(lm(), make_batch(10, gen), z_per_micro_batch, micro_batch_size=4)
    assert not report.exact
    assert [(d.kind, d.modules) for d in report.diagnoses] == [("term-mean", ("z_loss",))]
    assert "term 'z_loss' is normalised inside each micro-batch" in report.summary()
    assert "Return its sum and count" in report.summary()
    assert report.term_differences["nll"] < 1e-10 < 1e-3 < report.term_differences["z_loss"]


def test_advantages_normalised_per_micro_batch_are_named_with_stats_fn(gen):
    report = check(lm(), make_batch(10, gen), advantages_per_micro_batch, micro_batch_size=4)
    assert [(d.kind, d.modules) for d in report.diagnoses] == [("term-batch-statistic", ("pg",))]
    summary = report.summary()
    assert "term 'pg' of a sample depends on the other samples of its micro-batch" in summary
    assert "stats_fn=stats_fn" in summary
    assert report.term_differences["nll"] < 1e-10 < 1e-3 < report.term_differences["pg"]


def test_moe_balance_over_the_micro_batch_routing_is_named(gen):
    torch.manual_seed(0)
    per_micro = lambda m, mb: moe_loss(m, mb, routing(m, mb))  # noqa: E731
    report = check(TinyMoE().double(), text(10, gen), per_micro, micro_batch_size=4)
    assert [(d.kind, d.modules) for d in report.diagnoses] == [
        ("term-batch-statistic", ("balance",))
    ], report.summary()


@pytest.mark.slow  # 2-5 s on 2 cores
def test_a_term_without_gradient_does_not_stop_the_comparison(gen):
    def with_metric(model, mb):  # a logged term no gradient reaches
        out = z_per_micro_batch(model, mb)
        return {**out, "seen": (mb["attention_mask"].sum().double(), float(len(mb["labels"])))}

    report = check(lm(), make_batch(10, gen), with_metric, micro_batch_size=4)
    assert report.term_differences["seen"] == 0.0
    assert [d.modules for d in report.diagnoses] == [("z_loss",)]


TERM_TASK = (
    TASK
    + """
def z_loss_per_micro_batch():
    def loss(m, b):
        logits = m(b[0])
        ce = F.cross_entropy(logits, b[1], reduction="sum")
        return {"ce": (ce, len(b[1])), "z": ((logits.logsumexp(-1) ** 2).mean(), 1)}

    task = _task(nn.LayerNorm(8))
    task.loss_fn = loss
    return task
"""
)


@pytest.mark.needs("rich")
def test_cli_check_shows_the_named_term(tmp_path, capsys):
    path = tmp_path / "tasks_for_check_terms.py"
    path.write_text(TERM_TASK)
    assert main(["check", f"{path}:z_loss_per_micro_batch", "--micro-batch-size", "5"]) == 1
    out = capsys.readouterr().out
    assert "term 'z'" in out and "term 'ce'" in out and "term / parameter" in out
    assert "term-mean: term 'z' is normalised inside each micro-batch" in " ".join(out.split())
