"""The Lightning side of test_lightning.py: its modules and its fitting loops. Imported by the
test (fixture ``lc``), not at collection: Lightning's import (with torchmetrics') costs ~5 s,
which only the worker that runs these tests should pay."""

from __future__ import annotations

import copy
import warnings

import lightning.pytorch as L
import torch
from integrations.hf_models import collate, texts
from reference import full_batch_step

import bigbatch.lightning
from bigbatch.core.loss import token_cross_entropy


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


class MeanAsSum(LM):
    def training_step(self, batch, idx):
        loss_sum, count = tokens(self.model, batch)
        return loss_sum / count, 1  # a mean as the sum: micro-batch means added up


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


class Counted(L.LightningModule):
    """A linear regression whose ``training_step`` returns ``(loss_sum, count(batch_idx))``, and
    raises at the batches in ``fail_at`` (a fit that stops mid-window)."""

    def __init__(self, count=None, fail_at=()):
        super().__init__()
        torch.manual_seed(0)
        self.net, self.count, self.fail_at = torch.nn.Linear(3, 1).double(), count, fail_at

    def training_step(self, batch, idx):
        if idx in self.fail_at:
            raise RuntimeError("stopped mid-window")
        x, y = batch
        loss_sum = (self.net(x) - y).pow(2).sum()
        return loss_sum, len(x) if self.count is None else self.count(idx)

    def configure_optimizers(self):
        return sgd(self.parameters())


def fit_counted(module, callback, epochs=1):
    """``module`` fitted with ``callback`` on 12 samples, 4 per batch, 3 batches per step."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 3, generator=g).double(), torch.randn(12, 1, generator=g).double()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    trainer = L.Trainer(
        max_epochs=epochs, accumulate_grad_batches=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
        callbacks=[callback],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader)
    return [str(w.message) for w in caught], (x, y)
