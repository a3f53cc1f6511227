"""bigbatch.lightning: Lightning's accumulate_grad_batches (÷ k, Lightning #20350) against the
full batch in float64, the Exact callback, and the audit's verdicts."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")

from integrations.hf_models import collate, distance, gpt2, texts  # noqa: E402
from reference import full_batch_step  # noqa: E402

import bigbatch.lightning  # noqa: E402
from bigbatch.core.loss import token_cross_entropy  # noqa: E402


class LM(L.LightningModule):
    def __init__(self, model, pair, optimizer):
        super().__init__()
        self.model, self.pair, self.optimizer = model, pair, optimizer

    def training_step(self, batch, idx):
        logits = self.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits
        loss_sum, count = token_cross_entropy(logits, batch["labels"], shift=True)
        return (loss_sum, count) if self.pair else loss_sum / count

    def configure_optimizers(self):
        return self.optimizer(self.parameters())


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01)


def fit(model, batch, k, pair=False, exact=False, optimizer=sgd, data=None, steps=1, module=None):
    loader = torch.utils.data.DataLoader(data or texts(12), batch_size=batch, collate_fn=collate)
    trainer = L.Trainer(
        max_epochs=2, accumulate_grad_batches=k, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
        callbacks=[bigbatch.lightning.Exact()] if exact else [],
    )  # fmt: skip
    report = bigbatch.lightning.audit(trainer, steps=steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module or LM(model, pair, optimizer), loader)
    return report.results


def tokens(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return token_cross_entropy(logits, batch["labels"], shift=True)


def full(base, optimizer, windows):
    model = copy.deepcopy(base)
    opt = optimizer(model.parameters())
    for rows in windows:
        full_batch_step(model, opt, tokens, collate(rows))
    return model


@pytest.mark.parametrize("optimizer", [sgd, adamw])
def test_exact_on_padded_tokens(optimizer):
    base = gpt2()
    plain, ours = copy.deepcopy(base), copy.deepcopy(base)
    found = fit(plain, 4, 3, optimizer=optimizer)[0]
    assert not found.exact and found.diagnosis == "per-micro-batch mean on padded data"
    mine = fit(ours, 5, 3, pair=True, exact=True, optimizer=optimizer)[0]  # 5 + 5 + 2
    assert mine.exact and mine.loss_ratio == pytest.approx(1)
    reference = full(base, optimizer, [texts(12)] * 2)
    assert distance(ours, reference, base) < 1e-10 < 0.05 < distance(plain, reference, base)


def test_a_module_fitted_twice():
    """Each fit wraps the module's own ``training_step``, not the last fit's wrappers (the second
    fit was 6% off): two fits with ``Exact``, each equal to its full-batch steps."""
    base = gpt2()
    ours, reference = copy.deepcopy(base), base
    module = LM(ours, True, sgd)
    for _ in range(2):
        assert fit(None, 5, 3, exact=True, module=module)[0].exact
        reference = full(reference, sgd, [texts(12)] * 2)  # a fresh optimizer, as each fit
        assert distance(ours, reference, base) < 1e-10


class MeanAsSum(LM):
    def training_step(self, batch, idx):
        loss_sum, count = tokens(self.model, batch)
        return loss_sum / count, 1  # a mean as the sum: micro-batch means added up


def test_exact_gets_the_real_diagnosis():
    """With ``Exact`` the audit reads what each micro-batch added to the window's loss, as it
    reads Lightning's own backwards: a mean returned as the sum is named, not "loss couples"."""
    found = fit(None, 5, 3, exact=True, module=MeanAsSum(gpt2(), True, sgd))[0]
    assert not found.exact and found.diagnosis == "per-micro-batch mean on padded data", found


def test_last_window():
    """10 equal-length samples, 2 per batch, 3 batches per step: Lightning scales the last
    window (2 batches) by 2/3."""
    data, base = texts(10, low=8, high=9), gpt2()
    plain, ours = copy.deepcopy(base), copy.deepcopy(base)
    found = fit(plain, 2, 3, data=data, steps=2)[0]
    assert not found.exact and found.diagnosis == "last window mis-scaled"
    assert found.grad_norm_ratio == pytest.approx(2 / 3)
    assert fit(ours, 2, 3, pair=True, exact=True, data=data, steps=2)[0].exact
    reference = full(base, sgd, [data[:6], data[6:]] * 2)
    assert distance(ours, reference, base) < 1e-10


def test_dropout_on():
    """GPT-2's default dropout (``nn.Dropout`` modules, attention's ``dropout_p``): the audit
    compares both sides with dropout off, replaying Lightning's window (Note [audit dropout]).
    Lightning's ÷ k is still found and named, ``Exact`` called exact (it was "NOT exact")."""
    found = fit(gpt2(dropout=True), 4, 3, steps=(1, 2))
    assert [r.exact for r in found] == [False] * 2, found
    assert found[0].diagnosis == "per-micro-batch mean on padded data", found[0]
    mine = fit(gpt2(dropout=True), 5, 3, pair=True, exact=True, steps=(1, 2))
    assert [r.exact for r in mine] == [True] * 2 and mine[0].loss_ratio == pytest.approx(1), mine


class Regression(L.LightningModule):
    def __init__(self, *layers):
        super().__init__()
        torch.manual_seed(0)
        width = 8 if layers else 3
        body = [torch.nn.Linear(3, 8), *layers] if layers else []
        self.net = torch.nn.Sequential(*body, torch.nn.Linear(width, 1)).double()

    def training_step(self, batch, idx):
        x, y = batch  # a list: TensorDataset's default collate
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return sgd(self.parameters())


def regress(module, audit=True, epochs=1):
    """``module`` fitted on 12 ``[x, y]`` samples, 4 per batch, 3 batches per step; the audit's
    results (of steps 1 and 2) and the global random state after."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 3, generator=g).double(), torch.randn(12, 1, generator=g).double()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    trainer = L.Trainer(
        max_epochs=epochs, accumulate_grad_batches=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
    )  # fmt: skip
    report = bigbatch.lightning.audit(trainer, steps=(1, 2)) if audit else None
    torch.manual_seed(1)  # the masks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    return report and report.results, torch.get_rng_state()


def test_audit_joins_list_batches_per_position():
    """``[x, y]`` lists are joined as ``[x1 + x2 + x3, y1 + y2 + y3]``, not ``[x1, y1, x2, ...]``:
    equal micro-batches of a mean are exact under Lightning's ÷ k (no false alarm), with
    ``nn.Dropout`` on too."""
    for module in (Regression(), Regression(torch.nn.Tanh(), torch.nn.Dropout(0.3))):
        found = regress(module)[0][0]
        assert found.exact, found


def test_the_audit_leaves_training_as_it_was():
    """BatchNorm and dropout: the audit's extra runs (the one batch, the replay with dropout off,
    the diagnosis's losses) put the gradients, BatchNorm's statistics and the random state back:
    the audited fit ends bit for bit where the plain one does (BatchNorm couples the samples,
    which the audit names)."""
    layers = torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Dropout(0.3)
    plain, audited = Regression(*layers), Regression(*copy.deepcopy(layers))
    _, rng = regress(plain, audit=False, epochs=2)
    found, audited_rng = regress(audited, epochs=2)
    assert [r.diagnosis for r in found] == ["loss couples samples across micro-batches"] * 2
    assert torch.equal(rng, audited_rng)
    for (name, a), b in zip(plain.state_dict().items(), audited.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # weights, running mean and variance, batches tracked


def test_errors():
    with pytest.raises(TypeError, match="audit\\(\\) takes a lightning Trainer"):
        bigbatch.lightning.audit(object())
    trainer = L.Trainer(logger=False, accelerator="cpu", devices=1)
    with pytest.raises(ValueError, match="steps=\\(\\) is not allowed"):
        bigbatch.lightning.audit(trainer, steps=())
    with pytest.raises(ValueError, match="steps=1.5 is not allowed"):
        bigbatch.lightning.audit(trainer, steps=1.5)


def test_a_step_never_reached_is_named(caplog):
    """12 samples, 4 per batch, 3 batches per step, 2 epochs: steps 1 and 2, not 9."""
    results = fit(gpt2(), 4, 3, steps=(2, 9))
    assert [r.step for r in results] == [2]
    assert "step 9 not audited: training ended at step 2" in caplog.text


def test_exact_refuses_manual_optimization_and_a_loss_it_cannot_read():
    trainer = L.Trainer(logger=False, accelerator="cpu", devices=1)

    class Manual(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ValueError, match=r"Exact needs automatic optimization; with manual"):
        bigbatch.lightning.Exact().setup(trainer, Manual(), "fit")

    class Words(L.LightningModule):
        def training_step(self, batch, idx):
            return "a loss"

    module = Words()
    bigbatch.lightning.Exact().setup(trainer, module, "fit")
    with pytest.raises(TypeError, match=r"training_step returned str: with bigbatch.lightning"):
        module.training_step(torch.zeros(2, 1), 0)
