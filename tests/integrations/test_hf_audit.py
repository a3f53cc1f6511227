"""The accumulation bugs the peers shipped, reproduced on transformers' Trainer in float64:
``bigbatch.hf.audit`` flags each wrong configuration with its cause, raises no false alarm on a
right one, and bigbatch's Trainer is exact on every one (against the plain full batch)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import transformers  # noqa: E402
from integrations.hf_models import (
    Wrapper,
    arguments,
    collate,
    distance,
    gpt2,
    llama,
    sgd,
    tagger,
    texts,
)  # noqa: E402
from integrations.test_hf import model_loss, plain, terms  # noqa: E402
from reference import full_batch_step  # noqa: E402

import bigbatch.hf  # noqa: E402
from bigbatch import cached_loss  # noqa: E402


def audited(cls, model, batch=5, steps=3, n=12, audit_steps=1, data=None, **kwargs):
    trainer = cls(
        model=model, args=arguments(kwargs.pop("tmp"), batch, steps, **kwargs.pop("args", {})),
        train_dataset=data or texts(n), data_collator=kwargs.pop("collator", collate),
        optimizers=sgd(model), **kwargs,
    )  # fmt: skip
    report = bigbatch.hf.audit(trainer, steps=audit_steps)
    trainer.train()
    return report.results


class IgnoresCount(transformers.Trainer):
    """transformers #45305: accepts ``num_items_in_batch`` and ignores it (a mean per micro-batch)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs).loss


class DividesAgain(transformers.Trainer):
    """Divides by the accumulation steps itself, on top of the Trainer (transformers #35808)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs)["loss"] / self.current_gradient_accumulation_steps


class AuxPerMicroBatch(transformers.Trainer):
    """A per-sequence auxiliary term averaged inside each micro-batch beside a token loss
    normalised over the window: summed once per micro-batch (NeMo RL PR #3791: 32×)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = terms(model, inputs)
        (s, _), (a, n, w) = out["lm"], out["aux"]
        return s / num_items_in_batch + w * a / n


class AuxTerms(bigbatch.hf.Trainer):
    """The same loss as named terms, each with its own count."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return terms(model, inputs)


class LastWindowByArgs(transformers.Trainer):
    """Scales by ``args.gradient_accumulation_steps`` (as the Trainer did before 4.46), so a
    short last window is too small."""

    loss_is_scaled_for_ga = True

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs)["loss"] / self.args.gradient_accumulation_steps


def encode(model, batch):
    hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    mask = batch["attention_mask"].unsqueeze(-1)
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def in_batch(reps, batch=None):
    """Each sequence's own embedding against the others' (in-batch negatives)."""
    scores = reps @ reps.roll(1, 0).T * 5
    return torch.nn.functional.cross_entropy(scores, torch.arange(len(reps)))


class Contrastive(transformers.Trainer):
    loss_is_scaled_for_ga = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return in_batch(encode(model, inputs))


def unlabelled(samples):
    """Sequences for a contrastive loss: no labels (a sample is the unit)."""
    batch = collate(samples)
    del batch["labels"]
    return batch


def test_no_false_alarm_on_the_stock_trainer(tmp_path):
    for model in (llama(), Wrapper(gpt2())):
        cls = (
            transformers.Trainer
            if isinstance(model, transformers.PreTrainedModel)
            else bigbatch.hf.Trainer
        )
        results = audited(cls, model, tmp=tmp_path, audit_steps=(1, 2))
        assert [r.exact for r in results] == [True, True] and results[
            0
        ].loss_ratio == pytest.approx(1)
    smoothing = audited(
        transformers.Trainer, llama(), tmp=tmp_path, args={"label_smoothing_factor": 0.1}
    )
    # float32 islands in float64 (Llama's RMSNorm): float32's rounding over the window's tokens
    assert smoothing[0].exact and 1e-6 < smoothing[0].tolerance < 1e-4
    assert "float32 rounding over 210 items" in str(smoothing[0])


class Bf16Metric(transformers.Trainer):
    """The stock loss of a model without loss kwargs (a mean of micro-batch means) and a metric
    computed in bf16 without gradient, as TRL's SFT computes its entropy."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        with torch.no_grad():
            self.entropy = torch.special.entr(out["logits"].bfloat16().softmax(-1)).sum(-1).mean()
        return out["loss"]


def test_the_tolerance_follows_the_gradient_path(tmp_path):
    """Nearly equal lengths (40 or 41 tokens, 4 + 4 + 4): the mean of micro-batch means is 0.3%
    off. A bf16 metric off the gradient path leaves the tolerance at float64's (it was bf16's
    5e-2, which called the step exact), and the line says which rounding it allows."""
    data = texts(12, low=40, high=42)
    found = audited(Bf16Metric, Wrapper(gpt2()), batch=4, data=data, tmp=tmp_path)[0]
    assert not found.exact and found.diagnosis == "per-micro-batch mean on padded data", found
    assert 1e-4 < found.difference < 1e-2 and found.tolerance == 1e-10
    assert "tolerance 1e-10: float64 rounding over 492 items" in str(found)


@pytest.mark.parametrize(
    "loss_type", [None, pytest.param("ForSomethingNew", marks=pytest.mark.slow)]
)
def test_a_loss_type_transformers_does_not_know(tmp_path, loss_type):
    """GPT-2's ``loss_type`` is None (and a model's may name a loss transformers does not know):
    its loss falls back to ``ForCausalLMLoss`` and shifts, but transformers counts
    ``num_items_in_batch`` over every label, the first of each row too (``LOSS_MAPPING`` has no
    such type), in its one-batch run as well. The drop-in passes the loss what transformers
    passes: its step is the stock one-batch step, not the plain token mean's."""
    base = gpt2()
    base.loss_type = loss_type
    one, ours = copy.deepcopy(base), copy.deepcopy(base)
    audited(transformers.Trainer, one, batch=12, steps=1, tmp=tmp_path)
    assert audited(bigbatch.hf.Trainer, ours, tmp=tmp_path)[0].exact
    assert (
        distance(ours, one, base)
        < 1e-10
        < 1e-2
        < distance(ours, plain(base, model_loss, sgd), base)
    )


CLASSES = {  # name: (wrong trainer, model, its diagnosis, bigbatch's trainer, kwargs)
    "wrapper": (transformers.Trainer, lambda: Wrapper(gpt2()), "per-micro-batch mean on padded data", bigbatch.hf.Trainer, {}),
    "ignores num_items": (IgnoresCount, llama, "÷ accumulation steps missing", bigbatch.hf.exact(IgnoresCount), {}),
    "divides twice": (DividesAgain, lambda: Wrapper(gpt2()), "÷ accumulation steps applied twice", bigbatch.hf.exact(DividesAgain), {}),
    "aux term": (AuxPerMicroBatch, gpt2, "loss term normalised locally", AuxTerms, {}),
    "contrastive": (Contrastive, gpt2, "loss couples samples across micro-batches", bigbatch.hf.Trainer, {"loss_fn": cached_loss(encode, in_batch), "collator": unlabelled}),
}  # fmt: skip


SLOW_CLASSES = ("ignores num_items", "contrastive", "aux term", "wrapper", "divides twice")  # 2-6 s


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CLASSES else n for n in CLASSES],
)
def test_each_bug_is_flagged_and_bigbatch_is_exact(tmp_path, name):
    wrong, make, diagnosis, ours, kwargs = CLASSES[name]
    batch = 4 if name == "contrastive" else 5  # contrastive: equal micro-batches, only the coupling
    collator = {"collator": kwargs["collator"]} if "collator" in kwargs else {}
    found = audited(wrong, make(), batch=batch, tmp=tmp_path, **collator)[0]
    assert not found.exact and found.diagnosis == diagnosis, found
    mine = audited(ours, make(), batch=batch, tmp=tmp_path, **kwargs)[0]
    assert mine.exact and mine.loss_ratio == pytest.approx(1), mine


def test_a_step_never_reached_is_named(tmp_path, caplog):
    """Auditing step 50 of a 2-step run audits nothing there: said at the end of ``train()``."""
    trainer = transformers.Trainer(
        model=llama(), args=arguments(tmp_path, 5, 3), train_dataset=texts(12),
        data_collator=collate,
    )  # fmt: skip
    report = bigbatch.hf.audit(trainer, steps=(1, 50))
    trainer.train()
    assert [r.step for r in report.results] == [1] and report.not_reached == (50,)
    assert "step 50 not audited: training ended at step 2" in caplog.text


class MeanAsSum(bigbatch.hf.Trainer):
    """bigbatch's Trainer given a token mean as the sum of ``(loss_sum, count)``: ``(mean, 1)``,
    the micro-batch means added up (a mean of means), as the stock Trainer does on a wrapper."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs)["loss"], 1


def test_bigbatch_trainers_get_the_real_diagnosis(tmp_path):
    """The audit reads what each of bigbatch's micro-batches added to the window's loss, as it
    reads the stock trainer's backwards: not always "loss couples samples"."""
    found = audited(MeanAsSum, Wrapper(gpt2()), tmp=tmp_path)[0]
    assert not found.exact and found.diagnosis == "per-micro-batch mean on padded data", found


def test_a_count_mismatch_is_named(tmp_path):
    """A causal LM of one's own that does not generate and whose ``loss_type`` transformers
    does not know: nothing says its loss shifts, so bigbatch's window weighs its micro-batch
    means by every label, and the loss averages the shifted ones. The audit names the count (it
    said "gradients differ where the losses agree" of the same mismatch on a token tagger)."""
    found = audited(bigbatch.hf.Trainer, tagger(shift=True), tmp=tmp_path)[0]
    assert not found.exact and found.diagnosis.startswith("count mismatch: labels counted"), found


def test_last_window_mis_scaled(tmp_path):
    """10 samples of equal length, 2 per micro-batch, 3 per window: the second window has 2."""
    data = texts(10, low=8, high=9)
    found = audited(LastWindowByArgs, Wrapper(gpt2()), 2, 3, data=data, audit_steps=2, tmp=tmp_path)
    assert not found[0].exact and found[0].diagnosis == "last window mis-scaled"
    assert found[0].grad_norm_ratio == pytest.approx(2 / 3)
    base = gpt2()
    model = Wrapper(copy.deepcopy(base))
    ours = audited(
        bigbatch.hf.exact(LastWindowByArgs), model, 2, 3, data=data, audit_steps=2, tmp=tmp_path
    )
    assert ours[0].exact

    def full(m, b):  # the full-batch steps: 6 samples, then 4
        return m(**b)["loss"]

    reference = Wrapper(copy.deepcopy(base))
    optimizer = sgd(reference)[0]
    order = list(torch.utils.data.RandomSampler(data, generator=torch.Generator().manual_seed(0)))
    for rows in (order[:6], order[6:]):
        full_batch_step(reference, optimizer, full, collate([data[i] for i in rows]))
    assert distance(model, reference, Wrapper(base)) < 1e-10


class MeanPerMicroBatch(transformers.Trainer):
    """A custom loss: the micro-batch's token mean, ``num_items_in_batch`` ignored, which the
    Trainer divides by the accumulation steps (``loss_is_scaled_for_ga``): a mean of micro-batch
    means."""

    loss_is_scaled_for_ga = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs).loss


@pytest.mark.parametrize(
    "cls, diagnosis",
    [
        (transformers.Trainer, ""),
        (bigbatch.hf.Trainer, ""),
        (MeanPerMicroBatch, "per-micro-batch mean on padded data"),
        pytest.param(bigbatch.hf.exact(MeanPerMicroBatch), "", marks=pytest.mark.slow),
    ],
)
def test_dropout_on(tmp_path, cls, diagnosis):
    """GPT-2 with its config's dropout (0.1): both sides are computed with dropout off, the
    trainer's own window replayed (Note [audit dropout]). The stock Trainer on its stock model and
    bigbatch's are exact (both were "NOT exact: loss term normalised locally"); a mean of
    micro-batch means is still found, with its cause."""
    found = audited(cls, gpt2(dropout=True), tmp=tmp_path, audit_steps=(1, 2))
    assert [r.exact for r in found] == [not diagnosis] * 2, found
    assert found[0].diagnosis == diagnosis, found[0]
    assert diagnosis or found[0].loss_ratio == pytest.approx(1)


@pytest.mark.parametrize(
    "cls", [pytest.param(MeanPerMicroBatch, marks=pytest.mark.slow), bigbatch.hf.Trainer]
)
def test_the_audit_leaves_training_as_it_was(tmp_path, cls):
    """With dropout on, the audited steps' extra runs (the one batch, the replay, the diagnosis)
    put the gradients, the random state and the trainer's counters back: the audited run ends
    bit for bit where the plain one does, its logged loss and step ledger too."""
    runs = []
    for audit in (False, True):
        model = gpt2(dropout=True)
        args = arguments(tmp_path, 5, 3, logging_strategy="steps", logging_steps=1)
        trainer = cls(
            model=model, args=args, train_dataset=texts(12), data_collator=collate,
            optimizers=sgd(model),
        )  # fmt: skip
        report = bigbatch.hf.audit(trainer, steps=(1, 2)) if audit else None
        out = trainer.train()
        logs = [{k: v for k, v in log.items() if "token" in k} for log in trainer.state.log_history]
        runs.append((model.state_dict(), torch.get_rng_state(), out.training_loss, logs))
    (plain, rng, loss, logs), (ours, audited_rng, audited_loss, audited_logs) = runs
    assert len(report.results) == 2 and torch.equal(rng, audited_rng) and loss == audited_loss
    assert all(torch.equal(plain[k], ours[k]) for k in plain)
    assert logs == audited_logs


@pytest.mark.slow  # 1.3 s
def test_neftune_noise_is_off_too(tmp_path):
    """NEFTune's embedding noise (a stock ``TrainingArguments`` option) is a rate the audit sets to
    0 as it does dropout's: the stock Trainer is exact, a mean of micro-batch means named."""
    for cls, exact in ((transformers.Trainer, True), (MeanPerMicroBatch, False)):
        found = audited(cls, gpt2(), tmp=tmp_path, args={"neftune_noise_alpha": 5.0})[0]
        assert found.exact is exact, found
        assert exact or found.diagnosis == "per-micro-batch mean on padded data", found


class Noisy(transformers.Trainer):
    """Noise added to the loss's input (as NEFTune adds to the embeddings): random numbers that
    are not dropout, drawn in another order by the micro-batches than by the one batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        embeds = model.get_input_embeddings()(inputs["input_ids"])
        embeds = embeds + 0.1 * torch.randn_like(embeds)
        out = model(
            inputs_embeds=embeds, attention_mask=inputs["attention_mask"], labels=inputs["labels"]
        )
        return out.loss * inputs["labels"][:, 1:].ne(-100).sum() / num_items_in_batch


def test_random_numbers_besides_dropout_are_not_a_verdict(tmp_path):
    """Noise drawn in the loss at a constant scale cannot be turned off: where the gradients differ
    and the loss changes with the numbers drawn, the audit says "not checked", and why, rather
    than blaming the accumulation."""
    found = audited(Noisy, gpt2(), tmp=tmp_path)[0]
    assert found.exact is None and "random numbers besides dropout" in found.diagnosis, found
    assert str(found).startswith("bigbatch audit, step 1: not checked: the loss draws random")
