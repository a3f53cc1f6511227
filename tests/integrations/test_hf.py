"""bigbatch.hf.Trainer against transformers' one-batch run and a plain full-batch step (float64).

Each case trains two optimizer steps on 12 variable-length, right-padded samples: bigbatch's
Trainer with ``per_device_train_batch_size`` × ``gradient_accumulation_steps`` (5 × 3 cuts each
window 5 + 5 + 2), transformers' Trainer with the whole window as one batch, and (where the loss
can be written plainly) ``tests/reference.full_batch_step``.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import transformers  # noqa: E402
from integrations.hf_models import (  # noqa: E402
    VOCAB,
    Wrapper,
    adamw,
    arguments,
    collate,
    distance,
    gpt2,
    llama,
    sgd,
    tagger,
    tags,
    texts,
    wrapper_loss,
)
from reference import full_batch_step  # noqa: E402

import bigbatch.hf  # noqa: E402
from bigbatch.core.loss import token_cross_entropy  # noqa: E402

MODELS = {"gpt2": gpt2, "llama": llama}
TOLERANCE = {
    "gpt2": 1e-10,
    "llama": 1e-5,
}  # Llama's RMSNorm computes in float32 (Note [float32 islands])


def train(cls, model, batch, steps, optimizers=sgd, n=12, args=None, **kwargs):
    """Train ``model`` in place with ``cls`` (two optimizer steps); return the trainer."""
    args = args or {}
    trainer = cls(
        model=model, args=arguments(kwargs.pop("tmp"), batch, steps, **args),
        train_dataset=kwargs.pop("data", None) or texts(n),
        data_collator=kwargs.pop("data_collator", collate),
        optimizers=optimizers(model), **kwargs,
    )  # fmt: skip
    trainer.train()
    return trainer


class SumCount(bigbatch.hf.Trainer):
    """A custom loss returning ``(loss_sum, count)``."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logits = model(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
        ).logits
        return token_cross_entropy(logits, inputs["labels"], shift=True)


class Terms(bigbatch.hf.Trainer):
    """Named terms: the token loss and a per-sequence term of weight 0.1 (Note [named terms])."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return terms(model, inputs)


def terms(model, inputs):
    logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    mask = inputs["attention_mask"]
    per_sequence = (logits.pow(2).mean(-1) * mask).sum(-1) / mask.sum(-1)
    lm = token_cross_entropy(logits, inputs["labels"], shift=True)
    return {"lm": lm, "aux": (per_sequence.sum(), len(per_sequence), 0.1)}


def plain(base, loss, optimizers, n=12, steps=2):
    """Two full-batch steps of ``loss(model, batch)`` (a mean, a pair or named terms)."""
    model = copy.deepcopy(base)
    optimizer = optimizers(model)[0]
    batch = collate(texts(n))

    def mean(m, b):
        out = loss(m, b)
        return (
            sum(w * s / c for s, c, w in ((*v, 1.0)[:3] for v in out.values()))
            if isinstance(out, dict)
            else out
        )

    for _ in range(steps):
        full_batch_step(model, optimizer, mean, batch)
    return model


def model_loss(m, b):
    return m(**b).loss


def counted(m, b):
    """GPT-2's loss as transformers' one-batch run computes it: ``num_items_in_batch`` counts
    every label (its ``loss_type`` is None), the loss sums the shifted ones."""
    return m(**b, num_items_in_batch=(b["labels"] != -100).sum()).loss


def smoothing(m, b):
    out = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
    return transformers.trainer_pt_utils.LabelSmoother(0.1)(out, b["labels"], shift_labels=True)


def loss_func(outputs, labels, num_items_in_batch=None):
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(outputs.logits, labels, VOCAB, num_items_in_batch=num_items_in_batch)


def sum_count(m, b):
    logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    return token_cross_entropy(logits, b["labels"], shift=True)


# (name, bigbatch trainer class, trainer kwargs, TrainingArguments kwargs, plain loss)
LOSSES = {
    "model": (bigbatch.hf.Trainer, {}, {}, model_loss),
    "smoothing": (bigbatch.hf.Trainer, {}, {"label_smoothing_factor": 0.1}, smoothing),
    "compute_loss_func": (bigbatch.hf.Trainer, {"compute_loss_func": loss_func}, {}, model_loss),
    "sum_count": (SumCount, {}, {}, sum_count),
    "terms": (Terms, {}, {}, terms),
}
SLOW = pytest.mark.slow
CASES = [  # model, optimizer, (per device, accumulation steps), loss
    ("gpt2", sgd, (5, 3), "model"), ("llama", adamw, (5, 3), "model"),
    pytest.param("llama", sgd, (4, 3), "model", marks=SLOW),
    pytest.param("gpt2", adamw, (5, 3), "smoothing", marks=SLOW),
    ("llama", sgd, (5, 3), "smoothing"),
    pytest.param("gpt2", sgd, (5, 3), "compute_loss_func", marks=SLOW),
    ("gpt2", adamw, (5, 3), "sum_count"),
    pytest.param("llama", sgd, (4, 3), "sum_count", marks=SLOW),
    pytest.param("gpt2", sgd, (5, 3), "terms", marks=SLOW), ("llama", adamw, (5, 3), "terms"),
]  # fmt: skip


@pytest.mark.parametrize("name, optimizers, split, loss", CASES)
def test_equals_the_one_batch_step(tmp_path, name, optimizers, split, loss):
    base = MODELS[name]()
    cls, kwargs, args, plain_loss = LOSSES[loss]
    ours = copy.deepcopy(base)
    train(cls, ours, *split, optimizers, tmp=tmp_path, args=args, **kwargs)
    if cls is not bigbatch.hf.Trainer or name == "llama":  # (GPT-2's num_items_in_batch counts
        # every label, the first of each row too, as transformers does: test_hf_audit.py)
        assert distance(ours, plain(base, plain_loss, optimizers), base) < TOLERANCE[name]
    if cls is bigbatch.hf.Trainer:  # transformers' own one-batch run
        one = copy.deepcopy(base)
        train(transformers.Trainer, one, 12, 1, optimizers, tmp=tmp_path, args=args, **kwargs)
        assert distance(ours, one, base) < 1e-10  # the same float32 roundings as transformers


@pytest.mark.parametrize(
    "name, tolerance", [("gpt2", 1e-10), pytest.param("llama", 1e-5, marks=SLOW)]
)
def test_a_model_without_loss_kwargs(tmp_path, name, tolerance):
    """A wrapper whose loss is a token mean: the stock Trainer averages micro-batch means; bigbatch
    counts the tokens (Llama's RMSNorm computes in float32 in a float64 model: Note [float32
    islands])."""
    base = MODELS[name]()
    ours, stock = Wrapper(copy.deepcopy(base)), Wrapper(copy.deepcopy(base))
    train(bigbatch.hf.Trainer, ours, 5, 3, tmp=tmp_path)
    train(transformers.Trainer, stock, 5, 3, tmp=tmp_path)
    reference = plain(Wrapper(base), wrapper_loss, sgd)
    assert distance(ours, reference, Wrapper(base)) < tolerance
    assert distance(stock, reference, Wrapper(base)) > 0.1  # 24% and more after two steps


@pytest.mark.parametrize("settings", [
    {"micro_batch_tokens": 40}, pytest.param({"micro_batch_tokens": 24, "pad_to_multiple_of": 8}, marks=SLOW),
    pytest.param({"micro_batch_size": "auto", "memory_budget": "1GiB"}, marks=SLOW), {"micro_batch_size": 2},
])  # fmt: skip
def test_token_windows_and_auto(tmp_path, settings):
    base = gpt2()
    ours = copy.deepcopy(base)
    trainer = train(bigbatch.hf.Trainer, ours, 6, 2, tmp=tmp_path, **settings)
    assert distance(ours, plain(base, counted, sgd), base) < 1e-10
    last = trainer.bigbatch_window.last
    assert last.samples == 12 and (last.micro_batches > 1 or "auto" in settings.values())


@pytest.mark.slow  # 2-5 s on 2 cores
def test_the_backward_runs_at_the_full_batch_scale(tmp_path):
    """fp16's concern (Note [backward scale]): what each micro-batch back-propagates adds up to the
    full batch's mean loss, not to a sum of means, so the loss scaler sees the full batch's range."""
    model = llama()
    trainer = bigbatch.hf.Trainer(
        model=model, args=arguments(tmp_path, 5, 3, max_steps=1), train_dataset=texts(12),
        data_collator=collate, optimizers=sgd(model),
    )  # fmt: skip
    seen, backward = [], trainer.accelerator.backward
    trainer.accelerator.backward = lambda loss, **kw: (
        seen.append(float(loss)),
        backward(loss, **kw),
    )
    trainer.train()
    whole = float(copy.deepcopy(llama())(**collate(texts(12))).loss)
    assert len(seen) == 3 and abs(sum(seen) - whole) < 1e-6 * whole


class RegressionConfig(transformers.PretrainedConfig):
    model_type = "bigbatch-regression"


class Regression(transformers.PreTrainedModel):
    """transformers' own ``RegressionPreTrainedModel`` (its tests/trainer): ``forward`` takes
    ``**kwargs``, so the Trainer passes it ``num_items_in_batch``, and returns a mean, ignoring it
    (transformers #47688: the stock Trainer then adds the micro-batch means up, k× the step)."""

    config_class = RegressionConfig

    def __init__(self, config):
        super().__init__(config)
        self.w = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64))
        self.b = torch.nn.Parameter(torch.tensor(0.25, dtype=torch.float64))
        self.post_init()

    def forward(self, input_x, labels=None, **kwargs):
        y = input_x @ self.w + self.b
        return (torch.nn.functional.mse_loss(y, labels), y)


def regression_data(n=12):
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randn(n, generator=g)
    return [{"input_x": x[i], "labels": y[i].double()} for i in range(n)]


@pytest.mark.parametrize("name", ["regression", "gpt2"])
def test_a_loss_that_ignores_num_items_is_a_mean(tmp_path, name):
    """Whether the loss honours ``num_items_in_batch`` is read from what it returns (``loss_form``),
    not from the signature: the regression model's mean and GPT-2's sum / N (which honours it)
    both equal transformers' one-batch run, in float64."""
    make, data = (
        (lambda: Regression(RegressionConfig()), regression_data)
        if name == "regression"
        else (gpt2, texts)
    )
    collator = transformers.default_data_collator if name == "regression" else collate
    base = make()
    runs = {}
    for key, cls, batch, steps in [
        ("one", transformers.Trainer, 12, 1),
        ("stock", transformers.Trainer, 5, 3),
        ("ours", bigbatch.hf.Trainer, 5, 3),
    ]:
        runs[key] = copy.deepcopy(base)
        cls(
            model=runs[key], args=arguments(tmp_path, batch, steps), train_dataset=data(),
            data_collator=collator, optimizers=sgd(runs[key]),
        ).train()  # fmt: skip
    assert distance(runs["ours"], runs["one"], base) < 1e-10
    if name == "regression":
        assert distance(runs["stock"], runs["one"], base) > 0.5  # 3 micro-batch means added up


def test_training_step_outside_train_is_the_stock_step(tmp_path):
    """transformers' own tests call ``training_step`` before ``train()`` (no optimizer yet): the
    drop-in does what the stock Trainer does there, the batch's loss back-propagated."""
    batch = collate(texts(4))
    n = torch.tensor(int((batch["labels"][:, 1:] != -100).sum()))
    runs = []
    for cls in (transformers.Trainer, bigbatch.hf.Trainer):
        model = llama()
        trainer = cls(model=model, args=arguments(tmp_path, 4, 2), data_collator=collate)
        loss = trainer.training_step(model, dict(batch), num_items_in_batch=n)
        runs.append((float(loss), [p.grad for p in model.parameters()]))
    (stock, stock_grads), (ours, our_grads) = runs
    assert stock == ours and all(map(torch.equal, stock_grads, our_grads))


def test_a_window_that_counts_nothing_is_trained_on(tmp_path):
    """Every label ignored (a third of wikitext's lines are empty): transformers' Trainer takes
    the step on a zero gradient (AdamW still decays the weights), and so does bigbatch's, with
    one warning for its two such windows; before, it raised and aborted ``train()``."""

    def nothing_counted(samples):
        return {**collate(samples), "labels": torch.full_like(collate(samples)["labels"], -100)}

    base = gpt2()
    ours, stock = copy.deepcopy(base), copy.deepcopy(base)
    with pytest.warns(bigbatch.BigBatchWarning, match="total count is 0") as warned:
        train(bigbatch.hf.Trainer, ours, 5, 3, adamw, tmp=tmp_path, data_collator=nothing_counted)
    assert len([w for w in warned if w.category is bigbatch.BigBatchWarning]) == 1
    train(transformers.Trainer, stock, 12, 1, adamw, tmp=tmp_path, data_collator=nothing_counted)
    plain = copy.deepcopy(base)
    optimizer = adamw(plain)[0]
    for _ in range(2):
        full_batch_step(plain, optimizer, sum_count, nothing_counted(texts(12)))
    assert distance(ours, plain, base) < 1e-10 and distance(stock, plain, base) < 1e-10
    pairs = zip(plain.parameters(), base.parameters(), strict=True)
    moved = [not torch.equal(p, q) for p, q in pairs]
    assert any(moved)  # AdamW's weight decay: the step was taken


def test_errors(tmp_path):
    with pytest.raises(TypeError, match="exact\\(\\) takes a transformers.Trainer subclass"):
        bigbatch.hf.exact(torch.nn.Module)
    with pytest.raises(ValueError, match="micro_batch_size=0 is not allowed"):
        bigbatch.hf.Trainer(model=gpt2(), args=arguments(tmp_path, 2, 2), micro_batch_size=0)
    with pytest.raises(TypeError, match="audit\\(\\) takes a transformers.Trainer"):
        bigbatch.hf.audit(torch.nn.Linear(1, 1))
    trainer = transformers.Trainer(model=gpt2(), args=arguments(tmp_path, 2, 2))
    with pytest.raises(ValueError, match="steps=0 is not allowed"):
        bigbatch.hf.audit(trainer, steps=0)
    with pytest.raises(ValueError, match="steps=1.5 is not allowed: use positive ints"):
        bigbatch.hf.audit(trainer, steps=1.5)
    assert bigbatch.hf.exact(bigbatch.hf.Trainer) is bigbatch.hf.Trainer


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"chunked_head": "no"}, "chunked_head='no' is not allowed: use True or False"),
        ({"chunked_head": 1}, "chunked_head=1 is not allowed"),
        ({"loss_fn": "abc"}, "loss_fn='abc' is not allowed: use a function loss_fn.model, batch."),
        ({"loss_fn": lambda model: 0.0}, "loss_fn=<function .*> is not allowed"),
    ],
)
def test_settings_are_refused_when_the_trainer_is_made(tmp_path, settings, message):
    """A string turned the chunked head on, and a loss_fn that is not a function of (model,
    batch) failed at the first step: each is one line, before the trainer is built."""
    with pytest.raises(TypeError, match=message):
        bigbatch.hf.Trainer(model=gpt2(), args=arguments(tmp_path, 2, 2), **settings)


def test_the_trainers_methods_are_a_module_level_class(tmp_path):
    """``bigbatch.hf.Trainer.__init__`` and ``training_step`` are ``Exact``'s, a class defined at
    module level that a reader can open ("go to definition" landed nowhere while ``exact`` made
    the class inside itself); ``chunked_head=True``'s loss is a module-level function too. What
    ``exact`` makes keeps the trainer class's name and is made once: ``exact`` of an exact
    subclass adds ``Exact`` to it no second time."""
    import inspect

    from bigbatch.integrations.hf import Exact, head_loss

    trainer = bigbatch.hf.Trainer
    for method in (trainer.__init__, trainer.training_step):
        assert method.__qualname__ == f"Exact.{method.__name__}"  # not exact.<locals>.Exact
        assert inspect.getsourcefile(method) == inspect.getsourcefile(bigbatch.integrations.hf)
    names = trainer.__name__, trainer.__qualname__, trainer.__module__
    assert names == ("Trainer", "Trainer", "bigbatch.integrations.hf")
    assert trainer.__mro__[1:3] == (Exact, transformers.Trainer)

    class Mine(trainer):
        pass

    again = bigbatch.hf.exact(Mine)
    assert (again.__name__, again.__mro__[1]) == ("Mine", Mine) and again.__mro__.count(Exact) == 1
    assert "``Mine`` with bigbatch's exact accumulation" in again.__doc__
    made = trainer(model=gpt2(), args=arguments(tmp_path, 2, 2), chunked_head=True)
    assert made.bigbatch_window.loss_fn.func is head_loss


@pytest.mark.parametrize(
    ("missing", "module", "extra"),
    [
        ("transformers", "bigbatch.hf", "hf"),
        ("lightning.pytorch", "bigbatch.lightning", "lightning"),
    ],
)
def test_import_without_the_extra_names_the_install(missing, module, extra, monkeypatch) -> None:
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` now fails as if absent
    for name in (module, module.replace("bigbatch.", "bigbatch.integrations.")):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(
        ImportError, match=rf'{missing} is missing: pip install "bigbatch\[{extra}\]"'
    ):
        importlib.import_module(module)


def test_pad_values_declare_a_per_token_key_of_the_trainers_batches(tmp_path):
    """A per-token key beyond transformers' (token weights) is declared with ``pad_values``, as
    the ``Accumulator``'s: the micro-batches are trimmed with it, nothing is warned, the step is
    the one-batch step. Before, the Trainer took no ``pad_values``: the warning's advice could
    not be followed, and no micro-batch was trimmed."""
    import warnings

    def weighted_collate(samples):
        batch = collate(samples)
        return {**batch, "weights": batch["attention_mask"].double() * 0.5 + 0.25}

    def weighted(m, b):
        logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
        labels, w = b["labels"][:, 1:], b["weights"][:, 1:]
        ce = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), reduction="none"
        )
        return (ce * w.flatten()).sum(), (labels != -100).sum()

    base = gpt2()
    ours, ref = copy.deepcopy(base), copy.deepcopy(base)
    with warnings.catch_warnings():
        warnings.simplefilter("error", bigbatch.BigBatchWarning)
        trainer = train(
            bigbatch.hf.Trainer, ours, 4, 3, tmp=tmp_path, data_collator=weighted_collate,
            loss_fn=weighted, pad_values={"weights": 0},
        )  # fmt: skip
    assert trainer.bigbatch_window.last.padded_tokens < 12 * 19  # trimmed
    optimizer = sgd(ref)[0]
    for _ in range(2):
        full_batch_step(ref, optimizer, weighted, weighted_collate(texts(12)))
    assert distance(ours, ref, base) < 1e-10


def test_a_token_tagger_counts_every_label(tmp_path):
    """A model of one's own whose ``loss_type`` transformers does not know (its ``loss_function``
    defaults to the causal LM's) and whose loss is a mean over every label: the window counts
    every label, as the loss does (they were counted shifted: 0.9% off the one-batch step); the
    stock Trainer adds 3 micro-batch means; the audit finds the step exact."""
    base = tagger()
    runs = {}
    for name, cls, batch, steps in [
        ("one", transformers.Trainer, 12, 1),
        ("stock", transformers.Trainer, 5, 3),
        ("ours", bigbatch.hf.Trainer, 5, 3),
    ]:
        runs[name] = copy.deepcopy(base)
        trainer = cls(
            model=runs[name], args=arguments(tmp_path, batch, steps), train_dataset=texts(12),
            data_collator=tags, optimizers=sgd(runs[name]),
        )  # fmt: skip
        report = bigbatch.hf.audit(trainer)
        trainer.train()
    assert report.results[0].exact, report.results[0]
    assert distance(runs["ours"], runs["one"], base) < 1e-10
    assert distance(runs["stock"], runs["one"], base) > 0.05


def test_token_budget_alone_caps_no_rows(tmp_path):
    """Only a token budget given: ``per_device_train_batch_size`` (4) is the Trainer's batch,
    not a cap on a micro-batch's rows (``micro_batch_size`` stays None): 40 samples of 10 tokens
    under 8,192 tokens are one micro-batch of 40 rows. (Samples of unequal lengths are grouped by
    length, Note [token windows], which may cut the window into several.)"""
    model, rows = gpt2(), []
    trainer = bigbatch.hf.Trainer(
        model=model, args=arguments(tmp_path, 4, 10, max_steps=1),
        train_dataset=texts(40, low=10, high=11), data_collator=collate, optimizers=sgd(model),
        micro_batch_tokens=8192,
    )  # fmt: skip
    model.register_forward_pre_hook(
        lambda m, a, kw: rows.append(len(kw["input_ids"])), with_kwargs=True
    )
    trainer.train()
    assert trainer.bigbatch_window.cut.micro_batch_size is None
    assert trainer.bigbatch_window.last.micro_batches == 1 and rows[-1] == 40


def test_first_rows_that_count_nothing(tmp_path):
    """Each window starts with two one-token rows (empty lines and a BOS): the loss's form, read
    on them, stays undecided; it is a sum (as transformers assumes) counted before the window, so
    each backward runs at the one-batch run's scale and rounds as it does (2.5e-8 off before)."""
    data = [{"input_ids": [5]}, {"input_ids": [7]}, *texts(12)[2:]]
    base = gpt2()
    ours, one = copy.deepcopy(base), copy.deepcopy(base)
    args = {"train_sampling_strategy": "sequential"}
    trainer = train(bigbatch.hf.Trainer, ours, 4, 3, tmp=tmp_path, args=args, data=data)
    train(transformers.Trainer, one, 12, 1, tmp=tmp_path, args=args, data=data)
    assert trainer.bigbatch_window.form is None and distance(ours, one, base) < 1e-10


def test_the_trainers_logs_hold_the_step_ledger_beside_transformers_numbers(tmp_path):
    """Issue 38: each training log holds the real and computed tokens, the padding computed and
    the model FLOPs since the last log (Note [step ledger]), beside transformers' own numbers."""
    data = texts(12)
    trainer = train(
        bigbatch.hf.Trainer, gpt2(), 2, 3, tmp=tmp_path, data=data,
        args={"logging_strategy": "steps", "logging_steps": 1},
    )  # fmt: skip
    logs = [log for log in trainer.state.log_history if "loss" in log]
    real = sum(int(collate([d])["attention_mask"].sum()) for d in data)  # 2 steps: every sample
    assert sum(log["real_tokens"] for log in logs) == real
    assert all(0 <= log["padding"] < 1 and log["model_flos"] > 0 for log in logs), logs
    assert all(log["computed_tokens"] >= log["real_tokens"] for log in logs)
