"""bigbatch.check against models whose exactness we know, and the `bigbatch check` command."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import (
    causal_lm,
    classification_batch,
    cnn,
    lm_token_loss,
    mean_ce,
    mlp,
    padded_lm_batch,
)

import bigbatch
from bigbatch.check import NotExactError, check
from bigbatch.cli import main


class CountingBlock(nn.Module):
    """A block whose output depends on how often it ran: a checkpoint recompute differs."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.linear(x) * self.calls)  # tanh saves its output: recomputed


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


class BatchCentre(nn.Module):
    """Subtracts the batch mean: not a known class, found only by probing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(dim=0, keepdim=True)


def test_exact_models_are_exact(gen):
    x, y = classification_batch(10, torch.float64, gen)
    xi, yi = classification_batch(10, torch.float64, gen, image=True)
    for model, batch, loss in [
        (mlp(), (x, y), mean_ce),
        (cnn(), (xi, yi), mean_ce),
        (causal_lm(), padded_lm_batch(10, gen), lm_token_loss),
    ]:
        report = check(model, batch, loss, micro_batch_size=4)
        assert report.exact, report.summary()
        assert report.diagnoses == [] and report.max_difference < 1e-10


def test_dropout_with_the_same_seed_is_exact(gen):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.Linear(16, 3))
    assert check(model, classification_batch(10, torch.float64, gen), mean_ce).exact


def test_batchnorm_is_not_exact_and_named(gen):
    report = check(bn_model(), classification_batch(10, torch.float32, gen), mean_ce)
    assert not report.exact
    kinds = {d.kind: d for d in report.diagnoses}
    assert kinds["batch-statistics"].modules == ("1",)
    assert "'1' (BatchNorm1d) change one sample's output" in kinds["batch-statistics"].message


def test_custom_batch_coupled_module_found_by_probing(gen):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Sequential(nn.Tanh(), BatchCentre()), nn.Linear(8, 3))
    report = check(model, classification_batch(10, torch.float64, gen), mean_ce)
    assert not report.exact
    assert report.diagnoses[0].kind == "batch-statistics"
    assert report.diagnoses[0].modules == ("1.1",)


def test_mean_returned_as_sum_is_diagnosed(gen):
    def wrong(model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y), y.shape[0]  # a mean passed as loss_sum

    report = check(mlp(), classification_batch(10, torch.float64, gen), wrong)
    assert not report.exact
    assert [d.kind for d in report.diagnoses] == ["mean-as-sum"]


def test_in_batch_negatives_loss_is_diagnosed(gen):
    def contrastive(model, batch):
        x, _ = batch
        z = F.normalize(model(x), dim=1)
        logits = z @ z.roll(1, 0).T / 0.1  # every sample against every other of the batch
        targets = torch.arange(x.shape[0])
        return F.cross_entropy(logits, targets, reduction="sum"), x.shape[0]

    report = check(mlp(), classification_batch(10, torch.float64, gen), contrastive)
    assert not report.exact
    assert [d.kind for d in report.diagnoses] == ["batch-coupled-loss"]


def test_non_determinism_is_diagnosed(gen):
    import random

    def noisy(model, batch):
        x, y = batch
        return F.cross_entropy(model(x + random.random()), y)  # Python RNG: not seeded by check

    report = check(mlp(), classification_batch(10, torch.float64, gen), noisy)
    assert "non-deterministic" in [d.kind for d in report.diagnoses]


def test_groupnorm_policy_is_exact(gen):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 25, 3))
    bigbatch.batchnorm(model, "groupnorm")
    assert check(model, classification_batch(10, torch.float64, gen, image=True), mean_ce).exact


def test_user_model_and_rng_are_unchanged(gen):
    model = bn_model()
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    check(model, classification_batch(10, torch.float32, gen), mean_ce)
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.state_dict().items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters()) and model.training


def test_raise_on_failure_and_small_batch(gen):
    with pytest.raises(NotExactError, match="(?s)NOT exact.*batch-statistics"):
        check(bn_model(), classification_batch(10, torch.float32, gen), mean_ce, raise_on_failure=True)
    with pytest.raises(ValueError, match="at least 2 samples"):
        check(mlp(), classification_batch(1, torch.float64, gen), mean_ce)
    with pytest.raises(ValueError, match="micro_batch_size=10 covers the whole batch of 10 samples"):
        check(mlp(), classification_batch(10, torch.float64, gen), mean_ce, micro_batch_size=10)


TASK = '''
import torch, torch.nn as nn, torch.nn.functional as F
import bigbatch

def _task(norm):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(32, 6), torch.randint(0, 3, (32,)))
    model = nn.Sequential(nn.Linear(6, 8), norm, nn.Linear(8, 3))
    return bigbatch.Task(model=model, train_data=data, loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))

def good():
    return _task(nn.LayerNorm(8))

def bad():
    return _task(nn.BatchNorm1d(8))
'''


def test_cli_check(tmp_path, capsys):
    path = tmp_path / "tasks_for_check.py"
    path.write_text(TASK)
    assert main(["check", f"{path}:good", "--micro-batch-size", "5"]) == 0
    assert "exact: max relative difference" in capsys.readouterr().out
    assert main(["check", f"{path}:bad", "--batch-size", "12"]) == 1
    out = capsys.readouterr().out
    assert "NOT exact" in out and "batch-statistics" in out and "1.weight" in out
    assert main(["check", f"{path}:missing"]) == 2
    assert "bigbatch check: error: task" in capsys.readouterr().err
    assert main(["check", f"{path}:good", "--batch-size", "1"]) == 2
    assert "--batch-size 1 is too small: use at least 2" in capsys.readouterr().err


def test_checkpointing_same_gradient_or_diagnosed(gen):
    batch = classification_batch(10, torch.float64, gen)
    model = mlp()
    bigbatch.enable_checkpointing(model, blocks=["0", "2"])
    assert check(model, batch, mean_ce).exact
    torch.manual_seed(0)
    bad = nn.Sequential(nn.Sequential(CountingBlock(), CountingBlock()), nn.Linear(6, 3))
    bigbatch.enable_checkpointing(bad, blocks=["0.0", "0.1"])
    report = check(bad, batch, mean_ce)
    assert not report.exact
    kinds = {d.kind: d for d in report.diagnoses}
    assert kinds["checkpointing"].modules == ("0.0", "0.1")
