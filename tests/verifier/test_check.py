"""bigbatch.verifier._check against models whose exactness we know, and the `bigbatch check` command."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import (
    PAD,
    causal_lm,
    classification_batch,
    cnn,
    lm_token_loss,
    mean_ce,
    mlp,
    padded_lm_batch,
)

import bigbatch
from bigbatch.app.cli import main
from bigbatch.verifier._check import NotExactError, check


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
        assert report.compute_dtype == torch.float64 and report.tolerance == 1e-10


class Float32Norm(nn.Module):
    """RMSNorm computed in float32 whatever the input's dtype, as transformers' LlamaRMSNorm."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


def test_float32_island_sets_the_tolerance_and_is_reported(gen):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), Float32Norm(16), nn.Tanh(), nn.Linear(16, 3))
    batch = classification_batch(10, torch.float64, gen)
    report = check(model, batch, mean_ce, tolerance=1e-10)
    assert report.exact, report.summary()
    assert report.compute_dtype == torch.float32 and report.tolerance == 1e-5
    assert report.low_precision_in == ("'1' (Float32Norm)",)
    assert "- tolerance 1e-05: the float64 copy computes partly in float32 (in Float32Norm" in (
        report.summary()
    )

    def wrong(model, batch):
        return mean_ce(model, batch), batch[1].shape[0]  # a mean passed as loss_sum

    assert [d.kind for d in check(model, batch, wrong).diagnoses] == ["mean-as-sum"]


class Dropouts(nn.Module):
    """Dropout three ways: a module, a functional call, and attention's dropout_p."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(6, 16), nn.Dropout(0.3)
        self.attn = nn.MultiheadAttention(16, 2, dropout=0.2, batch_first=True)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.drop(self.lin(x)), p=0.4, training=self.training).unsqueeze(1)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        p = 0.5 if self.training else 0.0  # as transformers' attention calls it
        return self.out(F.scaled_dot_product_attention(h, h, h, dropout_p=p).squeeze(1))


def test_dropout_is_turned_off_and_named(gen):
    """Micro-batches draw other masks than the full batch (here the accumulated gradient differs
    from the full batch's with dropout on); check compares with every dropout off and says so."""
    torch.manual_seed(0)
    model = Dropouts().double()
    batch = classification_batch(10, torch.float64, gen)
    full, acc = copy.deepcopy(model), copy.deepcopy(model)
    torch.manual_seed(1)
    mean_ce(full, batch).backward()
    torch.optim.SGD(full.parameters(), lr=1.0).step()
    torch.manual_seed(1)
    bigbatch.Accumulator(acc, torch.optim.SGD(acc.parameters(), lr=1.0), micro_batch_size=4)\
        .train_step(batch, mean_ce)  # fmt: skip
    assert not torch.allclose(full.lin.weight, acc.lin.weight)  # other masks, other step
    report = check(model, batch, mean_ce, micro_batch_size=4)
    assert report.exact and report.max_difference < 1e-10, report.summary()
    assert report.dropout_off == ("'drop' (Dropout)", "Dropouts", "'attn' (MultiheadAttention)")
    assert report.summary().startswith(
        "exact (dropout off); with dropout on, equal in distribution: max relative difference"
    )
    assert "- dropout off in Dropout, Dropouts, MultiheadAttention (dropout_off names them)" in (
        report.summary()
    )
    assert model.training and model.drop.training  # the user's model is left as it was
    assert check(model.eval(), batch, mean_ce).dropout_off == ()


def test_dropout_off_leaves_batch_statistics_on(gen):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Linear(8, 3))
    report = check(model, classification_batch(10, torch.float64, gen), mean_ce)
    assert not report.exact and report.dropout_off == ("'2' (Dropout)",)
    assert report.summary().startswith("NOT exact (dropout off): max relative difference")
    assert [d.kind for d in report.diagnoses] == ["batch-statistics"]


@pytest.mark.parametrize(
    ("tolerance", "error"),
    [(-1, ValueError), (math.nan, ValueError), (math.inf, ValueError), ("1e-5", TypeError),
     (True, TypeError), (None, TypeError)],
)  # fmt: skip
def test_bad_tolerance_is_one_clear_error(tolerance, error, gen):
    with pytest.raises(
        error,
        match=rf"tolerance={tolerance!r} is not allowed: use a relative difference >= 0, e\.g\. "
        r"tolerance=1e-10",
    ):
        check(mlp(), classification_batch(10, torch.float64, gen), mean_ce, tolerance=tolerance)


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


@pytest.mark.slow  # 2-5 s on 2 cores
def test_token_mean_returned_alone_is_diagnosed(gen):
    def token_mean(model, batch):  # read as a mean over samples
        loss_sum, count = lm_token_loss(model, batch)
        return loss_sum / count

    report = check(causal_lm(), padded_lm_batch(10, gen), token_mean, micro_batch_size=4)
    assert [d.kind for d in report.diagnoses] == ["token-mean"], report.summary()

    def token_mean_as_sum(model, batch):
        loss_sum, count = lm_token_loss(model, batch)
        return loss_sum / count, count

    report = check(causal_lm(), padded_lm_batch(10, gen), token_mean_as_sum, micro_batch_size=4)
    assert [d.kind for d in report.diagnoses] == ["mean-as-sum"], report.summary()


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


def test_seeded_randomness_is_named_not_blamed_on_the_loss(gen):
    """Noise drawn in ``forward`` (``torch.randn_like``): the full batch and its micro-batches draw
    other numbers from the same seed. That is randomness, not a batch-coupled loss."""

    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x):
            return self.net(x + 0.1 * torch.randn_like(x))

    report = check(Noisy(), classification_batch(10, torch.float64, gen), mean_ce)
    assert not report.exact and [d.kind for d in report.diagnoses] == ["randomness"]
    assert "torch.randn_like" in report.summary()


def test_groupnorm_policy_is_exact(gen):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 25, 3)
    )
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
        check(
            bn_model(), classification_batch(10, torch.float32, gen), mean_ce, raise_on_failure=True
        )
    with pytest.raises(ValueError, match="at least 2 samples"):
        check(mlp(), classification_batch(1, torch.float64, gen), mean_ce)
    with pytest.raises(
        ValueError,
        match=r"micro_batch_size=10 is not allowed: use a positive integer smaller than the batch "
        r"\(10 samples: one micro-batch leaves nothing to compare\), or None for about a third",
    ):
        check(mlp(), classification_batch(10, torch.float64, gen), mean_ce, micro_batch_size=10)


TASK = """
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
"""


@pytest.mark.needs("rich")
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


@pytest.mark.needs("rich")
def test_cli_check_eval_tolerance_and_a_batch_larger_than_the_data(tmp_path, capsys):
    path = tmp_path / "tasks_for_check_flags.py"
    path.write_text(TASK)
    assert main(["check", f"{path}:bad", "--batch-size", "12"]) == 1  # BatchNorm, train mode
    capsys.readouterr()
    assert main(["check", f"{path}:bad", "--batch-size", "12", "--eval"]) == 0  # running stats
    assert "exact: max relative difference" in capsys.readouterr().out
    assert main(["check", f"{path}:bad", "--batch-size", "12", "--tolerance", "100"]) == 0
    assert main(["check", f"{path}:good", "--tolerance", "-1"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "bigbatch check: error: tolerance=-1.0 is not allowed: use a relative difference >= 0, "
        "e.g. tolerance=1e-10 (float64 rounding).\n"
    )
    assert main(["check", f"{path}:good", "--batch-size", "100"]) == 2
    assert (
        "--batch-size 100 is larger than the task's 32 training samples: the batch measured "
        "would hold only 32. Give --batch-size 32 or less." in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Dropout is turned off in both runs" in out and "--eval" in out and "--tolerance" in out


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
    assert list(kinds) == ["unprobed", "checkpointing"]  # the calls count: a replay differs
    assert kinds["unprobed"].modules == ("0.0", "0.1")


class Log(nn.Module):
    """log of its input: NaN for the negative values a Linear layer produces."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def test_nonfinite_inputs_are_named_not_the_loss(gen):
    x, y = classification_batch(10, torch.float64, gen)
    x[3, 1], x[7, 0], x[7, 2] = float("nan"), float("inf"), float("nan")
    report = check(mlp(), (x, y), mean_ce)
    assert not report.exact and math.isnan(report.max_difference)
    assert [d.kind for d in report.diagnoses] == ["non-finite"], report.summary()
    assert report.diagnoses[0].message.startswith(
        "non-finite inputs: batch[0] holds 2 NaN and 1 inf in samples 3, 7."
    )
    assert report.worst(1)[0][1] != report.worst(1)[0][1]  # NaN listed first


def test_nonfinite_output_of_a_module_is_named(gen):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Sequential(nn.Tanh(), Log()), nn.Linear(8, 3))
    report = check(model, classification_batch(10, torch.float64, gen), mean_ce)
    assert [d.kind for d in report.diagnoses] == ["non-finite"]
    assert report.diagnoses[0].modules == ("1.1",)
    assert "non-finite outputs: '1.1' (Log) is the first module" in report.diagnoses[0].message


def test_nonfinite_weights_loss_and_gradients_are_told_apart(gen):
    batch = classification_batch(10, torch.float64, gen)
    model = mlp()
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    weights = check(model, batch, mean_ce).diagnoses
    assert weights[0].modules == ("2.weight",) and "weights hold NaN or inf" in weights[0].message

    def log_of_zero(model, batch):
        return mean_ce(model, batch) + torch.log(torch.zeros((), dtype=torch.float64))

    loss = check(mlp(), batch, log_of_zero).diagnoses
    assert loss[0].message.startswith("non-finite loss: loss_fn returns a loss of -inf")

    def sqrt_at_zero(model, batch):  # finite forward (0), backward d sqrt(u)/du at 0 = inf
        out = model(batch[0])
        return torch.sqrt((out - out.detach()).pow(2).sum()) + mean_ce(model, batch)

    grads = check(mlp(), batch, sqrt_at_zero).diagnoses
    assert grads[0].kind == "non-finite"
    assert grads[0].message.startswith("non-finite gradients (0.weight")


@pytest.mark.slow  # 2-5 s on 2 cores
def test_mean_over_an_all_padding_micro_batch_is_named(gen):
    batch = padded_lm_batch(10, gen)
    batch["labels"][8:] = PAD  # the last micro-batch (samples 8-9) holds no token

    def token_mean(model, batch):  # a mean over zero tokens is NaN, and NaN * 0 is NaN
        loss_sum, count = lm_token_loss(model, batch)
        return loss_sum / count * count, count

    report = check(causal_lm(), batch, token_mean, micro_batch_size=4)
    assert [d.kind for d in report.diagnoses] == ["non-finite"], report.summary()
    assert "non-finite loss on micro-batch 3 (samples 8-9" in report.diagnoses[0].message
    assert "token_cross_entropy" in report.diagnoses[0].message


def test_no_trainable_parameter_or_no_gradient_is_one_clear_error(gen):
    batch = classification_batch(10, torch.float64, gen)
    with pytest.raises(
        ValueError, match=r"Tanh has none \(it has no parameters\): pass the module"
    ):
        check(nn.Tanh(), batch, lambda m, b: m(b[0]).sum())
    frozen = mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="all 6 of its parameters have requires_grad=False"):
        check(frozen, batch, mean_ce)
    with pytest.raises(ValueError, match="loss does not depend on the model's parameters"):
        check(mlp(), batch, lambda m, b: F.cross_entropy(m(b[0]).detach(), b[1]))
    other = mlp(seed=1)
    with pytest.raises(ValueError, match="no gradient reaches any of the model's trainable"):
        check(mlp(), batch, lambda m, b: mean_ce(other, b))
    with pytest.raises(ValueError, match=r"micro_batch_size=0 is not allowed: use a positive"):
        check(mlp(), batch, mean_ce, micro_batch_size=0)


NONFINITE_TASKS = """
import torch, torch.nn as nn, torch.nn.functional as F
import bigbatch

def _loss(m, b):
    return F.cross_entropy(m(b[0]), b[1])

def _data(bad):
    torch.manual_seed(0)
    x = torch.randn(32, 6)
    if bad:
        x[5, 2] = float("nan")
    return torch.utils.data.TensorDataset(x, torch.randint(0, 3, (32,)))

def nan_data():
    return bigbatch.Task(model=nn.Linear(6, 3), train_data=_data(True), loss_fn=_loss)

def no_parameters():
    return bigbatch.Task(model=nn.Tanh(), train_data=_data(False), loss_fn=_loss)

def detached_loss():
    loss = lambda m, b: F.cross_entropy(m(b[0]).detach(), b[1])
    return bigbatch.Task(model=nn.Linear(6, 3), train_data=_data(False), loss_fn=loss)
"""


@pytest.mark.needs("rich")
def test_cli_check_nonfinite_and_no_gradient(tmp_path, capsys):
    path = tmp_path / "tasks_nonfinite.py"
    path.write_text(NONFINITE_TASKS)
    assert main(["check", f"{path}:nan_data", "--batch-size", "12"]) == 1
    out = capsys.readouterr().out
    assert "non-finite: non-finite inputs: batch[0] holds 1 NaN in sample 5" in out
    for task, line in [
        ("no_parameters", "check needs a model with trainable parameters, and Tanh has none"),
        ("detached_loss", "loss_fn's loss does not depend on the model's parameters"),
    ]:
        assert main(["check", f"{path}:{task}"]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith(f"bigbatch check: error: {line}")
        assert captured.err.count("\n") == 1 and "Traceback" not in captured.err + captured.out
