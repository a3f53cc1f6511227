"""bigbatch.lightning: Lightning's accumulate_grad_batches (÷ k, Lightning #20350) against the
full batch in float64, the Exact callback, and the audit's verdicts."""

from __future__ import annotations

import copy

import pytest
import torch
from integrations.hf_models import distance, gpt2, texts

import bigbatch  # bigbatch.lightning: imported with Lightning by lightning_cases (fixture lc)

# One worker runs the module and imports Lightning, in the fixture (~5 s with torchmetrics)
pytestmark = [pytest.mark.needs("lightning", "transformers"), pytest.mark.xdist_group("lightning")]


@pytest.fixture
def lc():
    """lightning_cases.py: the modules, ``fit`` and ``regress``."""
    from integrations import lightning_cases

    return lightning_cases


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_exact_on_padded_tokens(lc, optimizer):
    optimizer = getattr(lc, optimizer)
    base = gpt2()
    plain, ours = copy.deepcopy(base), copy.deepcopy(base)
    found = lc.fit(plain, 4, 3, optimizer=optimizer)[0]
    assert not found.exact and found.diagnosis == "per-micro-batch mean on padded data"
    mine = lc.fit(ours, 5, 3, pair=True, exact=True, optimizer=optimizer)[0]  # 5 + 5 + 2
    assert mine.exact and mine.loss_ratio == pytest.approx(1)
    reference = lc.full(base, optimizer, [texts(12)] * 2)
    assert distance(ours, reference, base) < 1e-10 < 0.05 < distance(plain, reference, base)


def test_a_module_fitted_twice(lc):
    """Each fit wraps the module's own ``training_step``, not the last fit's wrappers (the second
    fit was 6% off): two fits with ``Exact``, each equal to its full-batch steps."""
    base = gpt2()
    ours, reference = copy.deepcopy(base), base
    module = lc.LM(ours, True, lc.sgd)
    for _ in range(2):
        assert lc.fit(None, 5, 3, exact=True, module=module)[0].exact
        reference = lc.full(reference, lc.sgd, [texts(12)] * 2)  # a fresh optimizer, as each fit
        assert distance(ours, reference, base) < 1e-10


def test_exact_gets_the_real_diagnosis(lc):
    """With ``Exact`` the audit reads what each micro-batch added to the window's loss, as it
    reads Lightning's own backwards: a mean returned as the sum is named, not "loss couples"."""
    found = lc.fit(None, 5, 3, exact=True, module=lc.MeanAsSum(gpt2(), True, lc.sgd))[0]
    assert not found.exact and found.diagnosis == "per-micro-batch mean on padded data", found


def test_last_window(lc):
    """10 equal-length samples, 2 per batch, 3 batches per step: Lightning scales the last
    window (2 batches) by 2/3."""
    data, base = texts(10, low=8, high=9), gpt2()
    plain, ours = copy.deepcopy(base), copy.deepcopy(base)
    found = lc.fit(plain, 2, 3, data=data, steps=2)[0]
    assert not found.exact and found.diagnosis == "last window mis-scaled"
    assert found.grad_norm_ratio == pytest.approx(2 / 3)
    assert lc.fit(ours, 2, 3, pair=True, exact=True, data=data, steps=2)[0].exact
    reference = lc.full(base, lc.sgd, [data[:6], data[6:]] * 2)
    assert distance(ours, reference, base) < 1e-10


def test_dropout_on(lc):
    """GPT-2's default dropout (``nn.Dropout`` modules, attention's ``dropout_p``): the audit
    compares both sides with dropout off, replaying Lightning's window (Note [audit dropout]).
    Lightning's ÷ k is still found and named, ``Exact`` called exact (it was "NOT exact")."""
    found = lc.fit(gpt2(dropout=True), 4, 3, steps=(1, 2))
    assert [r.exact for r in found] == [False] * 2, found
    assert found[0].diagnosis == "per-micro-batch mean on padded data", found[0]
    mine = lc.fit(gpt2(dropout=True), 5, 3, pair=True, exact=True, steps=(1, 2))
    assert [r.exact for r in mine] == [True] * 2 and mine[0].loss_ratio == pytest.approx(1), mine


def test_audit_joins_list_batches_per_position(lc):
    """``[x, y]`` lists are joined as ``[x1 + x2 + x3, y1 + y2 + y3]``, not ``[x1, y1, x2, ...]``:
    equal micro-batches of a mean are exact under Lightning's ÷ k (no false alarm), with
    ``nn.Dropout`` on too."""
    for module in (lc.Regression(), lc.Regression(torch.nn.Tanh(), torch.nn.Dropout(0.3))):
        found = lc.regress(module)[0][0]
        assert found.exact, found


def test_the_audit_leaves_training_as_it_was(lc):
    """BatchNorm and dropout: the audit's extra runs (the one batch, the replay with dropout off,
    the diagnosis's losses) put the gradients, BatchNorm's statistics and the random state back:
    the audited fit ends bit for bit where the plain one does (BatchNorm couples the samples,
    which the audit names)."""
    layers = torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Dropout(0.3)
    plain, audited = lc.Regression(*layers), lc.Regression(*copy.deepcopy(layers))
    _, rng = lc.regress(plain, audit=False, epochs=2)
    found, audited_rng = lc.regress(audited, epochs=2)
    assert [r.diagnosis for r in found] == ["loss couples samples across micro-batches"] * 2
    assert torch.equal(rng, audited_rng)
    for (name, a), b in zip(plain.state_dict().items(), audited.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # weights, running mean and variance, batches tracked


def test_errors(lc):
    with pytest.raises(TypeError, match="audit\\(\\) takes a lightning Trainer"):
        bigbatch.lightning.audit(object())
    trainer = lc.L.Trainer(logger=False, accelerator="cpu", devices=1)
    with pytest.raises(ValueError, match="steps=\\(\\) is not allowed"):
        bigbatch.lightning.audit(trainer, steps=())
    with pytest.raises(ValueError, match="steps=1.5 is not allowed"):
        bigbatch.lightning.audit(trainer, steps=1.5)


def test_a_step_never_reached_is_named(lc, caplog):
    """12 samples, 4 per batch, 3 batches per step, 2 epochs: steps 1 and 2, not 9."""
    results = lc.fit(gpt2(), 4, 3, steps=(2, 9))
    assert [r.step for r in results] == [2]
    assert "step 9 not audited: training ended at step 2" in caplog.text


def test_exact_refuses_manual_optimization_and_a_loss_it_cannot_read(lc):
    trainer = lc.L.Trainer(logger=False, accelerator="cpu", devices=1)

    class Manual(lc.L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ValueError, match=r"Exact needs automatic optimization; with manual"):
        bigbatch.lightning.Exact().setup(trainer, Manual(), "fit")

    class Words(lc.L.LightningModule):
        def training_step(self, batch, idx):
            return "a loss"

    module = Words()
    bigbatch.lightning.Exact().setup(trainer, module, "fit")
    with pytest.raises(TypeError, match=r"training_step returned str: with bigbatch.lightning"):
        module.training_step(torch.zeros(2, 1), 0)


def test_deepspeed_is_refused_in_one_line(lc):
    """Lightning's DeepSpeed strategy (CUDA only; built here, not fitted): ZeRO 2 and 3 keep
    the gradients out of ``.grad``, where ``Exact`` would rescale nothing, a silent wrong step."""
    pytest.importorskip("deepspeed")
    from lightning.pytorch.strategies import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(stage=2)
    trainer = lc.L.Trainer(logger=False, accelerator="cpu", devices=1, strategy=strategy)
    refused = r"cannot run under Lightning's DeepSpeedStrategy \(ZeRO keeps the gradients out"
    with pytest.raises(ValueError, match="bigbatch.lightning.Exact " + refused):
        bigbatch.lightning.Exact().setup(trainer, lc.L.LightningModule(), "fit")
    with pytest.raises(ValueError, match="bigbatch.lightning.audit " + refused):
        bigbatch.lightning.audit(trainer)


def test_a_window_that_counts_nothing_takes_a_zero_step(lc):
    """Issue 37: a window whose count is 0 gave NaN weights and fit ended normally; the engine,
    fit, Keras and the Trainer take a zero-gradient step with one warning."""
    module = lc.Counted(count=lambda idx: torch.zeros((), dtype=torch.float64))
    before = copy.deepcopy(module.net.state_dict())
    warned, _ = lc.fit_counted(module, bigbatch.lightning.Exact())
    assert any("total count is 0" in w for w in warned), warned
    for k, v in module.net.state_dict().items():
        assert torch.equal(v, before[k]), k  # SGD (momentum, no decay) on a zero gradient


@pytest.mark.parametrize(
    "count, error, match",
    [
        (lambda idx: -1, ValueError, r"training_step's count=-1 is negative"),
        (lambda idx: torch.tensor(-1.0), ValueError, r"a count that is negative or not finite"),
        (lambda idx: torch.tensor(float("nan")), ValueError, r"negative or not finite"),
        (lambda idx: "2", TypeError, r"training_step's count='2' is not a number"),
    ],
    ids=["int", "tensor", "nan", "str"],
)
def test_a_bad_count_is_refused_before_the_optimizer_steps(lc, count, error, match):
    """Issue 37: a negative count stepped; a count "2" gave ``new(): invalid data type 'str'``."""
    module = lc.Counted(count=count)
    before = copy.deepcopy(module.net.state_dict())
    with pytest.raises(error, match=match):
        lc.fit_counted(module, bigbatch.lightning.Exact())
    for k, v in module.net.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_an_exact_reused_after_a_fit_that_raised_mid_window(lc):
    """Issue 37: the callback kept the failed window's counts and scale: the next fit was
    5.6e-2 off. Each fit starts from an empty window."""
    exact = bigbatch.lightning.Exact()
    with pytest.raises(RuntimeError, match="stopped mid-window"):
        lc.fit_counted(lc.Counted(fail_at=(1,)), exact)
    module, fresh = lc.Counted(), lc.Counted()
    _, (x, y) = lc.fit_counted(module, exact)
    lc.fit_counted(fresh, bigbatch.lightning.Exact())
    for (k, a), b in zip(module.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
