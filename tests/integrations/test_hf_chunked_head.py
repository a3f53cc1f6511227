"""``bigbatch.hf.Trainer(chunked_head=True)`` (Note [chunked head in a trainer]) in float64.

The chunked Trainer accumulates 5 + 5 + 2 per window; it must equal its own one-batch run and
the causal LM's loss written plainly in float64 (token cross-entropy of the logits, label
smoothing as ``F.cross_entropy``'s) to 1e-10. transformers' own loss (``ForCausalLMLoss``,
``LabelSmoother``) upcasts the logits with ``.float()``, which in a float64 model is a cast
*down* to float32: against it the agreement is float32's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import transformers  # noqa: E402
from integrations.hf_models import (  # noqa: E402
    Wrapper,
    adamw,
    arguments,
    collate,
    distance,
    gpt2,
    llama,
    sgd,
    texts,
)
from integrations.test_hf import MODELS, plain, train  # noqa: E402

import bigbatch.hf  # noqa: E402
from bigbatch.core.head import HeadLogits, with_chunked_head  # noqa: E402
from bigbatch.core.loss import token_cross_entropy  # noqa: E402

FLOAT32 = 1e-5  # transformers' loss, and Llama's RMSNorm, compute in float32


def formula(eps: float, every_label: bool = False):
    """The causal LM's loss from the logits in float64: what the chunked head must equal. Over
    the shifted labels, divided by what transformers counts as ``num_items_in_batch``: every label
    for a model whose ``loss_type`` it does not know (GPT-2), the shifted ones otherwise."""

    def loss(m, b):
        logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        labels = b["labels"][:, 1:].flatten()
        flat = logits[:, :-1].flatten(0, 1)
        count = (b["labels"] != -100).sum() if every_label else (labels != -100).sum()
        return F.cross_entropy(flat, labels, label_smoothing=eps, reduction="sum"), count

    return loss


CASES = [  # model, optimizers, label smoothing
    ("gpt2", sgd, 0.0), ("llama", adamw, 0.0), ("gpt2", adamw, 0.1),
    pytest.param("llama", sgd, 0.1, marks=pytest.mark.slow),
]  # fmt: skip


@pytest.mark.parametrize("name, optimizers, eps", CASES)
def test_chunked_head_equals_the_one_batch_step(tmp_path, name, optimizers, eps):
    base = MODELS[name]()
    args = {"label_smoothing_factor": eps}
    ours, one = copy.deepcopy(base), copy.deepcopy(base)
    made = []  # what the output layer returned: never logits
    ours.get_output_embeddings().register_forward_hook(lambda m, a, out: made.append(type(out)))
    trainer = train(
        bigbatch.hf.Trainer, ours, 5, 3, optimizers, tmp=tmp_path, args=args, chunked_head=True
    )
    assert trainer.bigbatch_window.last.micro_batches == 3
    assert made and set(made) == {HeadLogits}
    train(bigbatch.hf.Trainer, one, 12, 1, optimizers, tmp=tmp_path, args=args, chunked_head=True)
    assert distance(ours, one, base) < 1e-10
    reference = plain(base, formula(eps, name == "gpt2"), optimizers)  # the logits' loss
    assert distance(ours, reference, base) < (1e-10 if name == "gpt2" else FLOAT32)
    if name == "llama":  # transformers' one-batch run, its own loss (GPT-2's: test_hf.py)
        own = copy.deepcopy(base)
        train(transformers.Trainer, own, 12, 1, optimizers, tmp=tmp_path, args=args)
        assert distance(ours, own, base) < FLOAT32


def tiny(kind: str, **settings):
    """A tiny float64 causal LM of another family, from its config."""
    config_class = getattr(transformers, f"{kind}Config")
    model_class = getattr(transformers, f"{kind}ForCausalLM")
    config = config_class(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=8, pad_token_id=0, **settings,
    )  # fmt: skip
    torch.manual_seed(0)
    return model_class(config).to(torch.float64)


def test_a_logit_scale_is_applied_exactly(tmp_path):
    """Cohere multiplies its logits by ``logit_scale``: the chunked head scales the hidden states."""
    base = tiny("Cohere", logit_scale=0.5)
    ours = copy.deepcopy(base)
    train(bigbatch.hf.Trainer, ours, 5, 3, tmp=tmp_path, chunked_head=True)
    reference = plain(base, formula(0.0), sgd)
    assert distance(ours, reference, base) < FLOAT32  # (its LayerNorm computes in float32)
    unscaled = copy.deepcopy(base)
    unscaled.logit_scale = 1.0
    assert distance(ours, plain(unscaled, formula(0.0), sgd), base) > 0.01


def classifier():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, num_labels=2)
    return transformers.GPT2ForSequenceClassification(config).to(torch.float64)


def loss_func(outputs, labels, num_items_in_batch=None):
    return outputs.logits.sum()


class Custom(bigbatch.hf.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs).loss


REFUSED = [  # (model, trainer class, trainer kwargs, message)
    (gpt2, bigbatch.hf.Trainer, {"compute_loss_func": loss_func}, "a loss_fn or compute_loss_func"),
    (gpt2, bigbatch.hf.Trainer, {"loss_fn": lambda m, b: m(**b).loss}, "a loss_fn or compute_loss_func"),
    (gpt2, Custom, {}, "Custom.compute_loss is not transformers'"),
    (classifier, bigbatch.hf.Trainer, {}, "GPT2ForSequenceClassification is not a causal LM"),
    (lambda: tiny("Mixtral", output_router_logits=True, num_local_experts=2), bigbatch.hf.Trainer,
     {}, "output_router_logits=True adds an MoE auxiliary loss"),
]  # fmt: skip


@pytest.mark.parametrize("make, cls, kwargs, message", REFUSED)
def test_what_it_cannot_compute_is_refused(tmp_path, make, cls, kwargs, message):
    model = make()
    with pytest.raises(ValueError, match=f"chunked_head=True cannot compute .*: {message}"):
        cls(model=model, args=arguments(tmp_path, 2, 2), chunked_head=True, **kwargs)


def test_a_wrapper_that_indexes_its_logits_is_refused_when_it_runs(tmp_path):
    model = Wrapper(gpt2())
    trainer = bigbatch.hf.Trainer(
        model=model, args=arguments(tmp_path, 5, 3), train_dataset=texts(12),
        data_collator=collate, optimizers=sgd(model), chunked_head=True,
    )  # fmt: skip
    with pytest.raises(TypeError, match="so indexing cannot be applied to them"):
        trainer.train()
    assert "forward" not in model.inner.get_output_embeddings().__dict__  # given back


def float64_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Gemma 2's RMSNorm computes in float32 even in a float64 model: its own formula in float64,
    so that the steps compared differ only by the head (its weight's gradient is a float32 sum
    over the batch otherwise, 2e-7 off between micro-batches and the full batch); its weight
    starts at 0.25, not 0 (a step of 7e-4 from 0 is 1.6e-10 off: the attention's float32 softmax)."""
    for norm in (m for m in model.modules() if type(m).__name__ == "Gemma2RMSNorm"):
        norm.forward = lambda x, n=norm: n._norm(x) * (1.0 + n.weight)
        torch.nn.init.constant_(norm.weight, 0.25)
    return model


@pytest.mark.parametrize("kind, settings", [("Gemma2", {"final_logit_softcapping": 0.5}),
                                             ("OPT", {"ffn_dim": 32, "dropout": 0.0, "enable_bias": False})])  # fmt: skip
def test_soft_capping_and_contiguous_logits_are_computed_exactly(kind, settings):
    """Gemma 2 soft-caps its logits (cap · tanh(logits / cap)), OPT calls ``.contiguous()`` on
    them: the deferred head computes both, loss and gradients to 1e-10, and under accumulation
    (4 + 4 + 2, momentum) the step equals the full batch's."""
    from cases import OPTIMIZERS
    from reference import full_batch_step, max_relative_error

    model, ref, ours = (float64_norms(tiny(kind, **settings)) for _ in range(3))
    batch = collate(texts(10))
    logits = lambda m, b: m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits  # noqa: E731
    loss = lambda m, b: token_cross_entropy(logits(m, b), b["labels"], shift=True)  # noqa: E731
    (got, count), (want, want_count) = (
        with_chunked_head(loss, model)(model, batch),
        loss(model, batch),
    )
    params = list(model.parameters())
    flat = lambda loss: torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])  # noqa: E731
    assert int(count) == int(want_count) and abs(float(got / want) - 1) < 1e-10
    grad, want_grad = flat(got), flat(want)
    assert float((grad - want_grad).norm() / want_grad.norm()) < 1e-10
    full_batch_step(ref, OPTIMIZERS["sgd_momentum"](ref.parameters()), loss, batch)
    opt = OPTIMIZERS["sgd_momentum"](ours.parameters())
    # untrimmed: Gemma 2's float32 attention softmax rounds with the padded width (1.6e-9 off)
    acc = bigbatch.Accumulator(ours, opt, 4, trim_padding=False)
    assert acc.train_step(batch, with_chunked_head(loss, ours)).micro_batches == 3
    assert max_relative_error(ref, ours) < 1e-10


def test_sft_trainer_with_the_chunked_head(tmp_path):
    """TRL's SFT loss (its own fused head, float32) computed by ours: exact under accumulation."""
    trl, datasets = pytest.importorskip("trl"), pytest.importorskip("datasets")
    from integrations.test_trl import sentences
    from integrations.test_trl import train as train_trl

    data, base = datasets.Dataset.from_dict({"text": sentences(12, 1)}), llama()
    made = []  # what the output layer returned (copies share the hook)
    base.get_output_embeddings().register_forward_hook(lambda m, a, out: made.append(type(out)))
    chunked = bigbatch.hf.exact(trl.SFTTrainer)
    trl_one, _ = train_trl(trl.SFTTrainer, base, 12, 1, tmp_path, data)
    ours, audit = train_trl(chunked, base, 5, 3, tmp_path, data, chunked_head=True)
    one, _ = train_trl(chunked, base, 12, 1, tmp_path, data, chunked_head=True)
    assert audit.exact and set(made) == {HeadLogits}  # (the audit's replay included)
    assert distance(ours, one, base) < 1e-10 and distance(ours, trl_one, base) < FLOAT32
    with pytest.raises(ValueError, match="loss_type='dft' is not the token cross-entropy"):
        train_trl(chunked, base, 5, 3, tmp_path, data, chunked_head=True, args={"loss_type": "dft"})


def float64_attention(module, query, key, value, attention_mask, scaling, softcap=None, **kwargs):
    """Gemma 2's eager attention with its softmax in the model's dtype (transformers' computes it
    in float32), so that a float64 Gemma 2 computes in float64 (no dropout: it is off here)."""
    from transformers.models.gemma2.modeling_gemma2 import repeat_kv

    key, value = (repeat_kv(t, module.num_key_value_groups) for t in (key, value))
    scores = query @ key.transpose(2, 3) * scaling
    scores = scores if softcap is None else softcap * torch.tanh(scores / softcap)
    weights = (scores if attention_mask is None else scores + attention_mask).softmax(-1)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def gemma2(cap: float | None = 0.5) -> torch.nn.Module:
    """A tiny float64 Gemma 2 whose final logits are soft-capped at ``cap``, computing in float64
    end to end: its RMSNorm (``float64_norms``) and attention softmax (``float64_attention``)."""
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    transformers.AttentionInterface.register("float64_eager", float64_attention)
    AttentionMaskInterface.register("float64_eager", eager_mask)
    model = tiny("Gemma2", final_logit_softcapping=cap, attn_implementation="float64_eager")
    return float64_norms(model)


def test_gemma2_soft_capping_through_the_trainer(tmp_path):
    """Gemma 2's final-logit soft-capping (``cap · tanh(logits / cap)``, refused before) computed
    by the chunked head through the Trainer, 5 + 5 + 2 per window: the float64 logits' loss to
    1e-10 (float64 norms and attention: Gemma 2 computes both in float32 otherwise), the stock
    Trainer's one-batch run at float32's rounding (its loss upcasts the logits with ``.float()``,
    which casts a float64 model's down); the uncapped model's step is 22% away."""
    base = gemma2()
    ours, stock, uncapped = (copy.deepcopy(base) for _ in range(3))
    train(bigbatch.hf.Trainer, ours, 5, 3, adamw, tmp=tmp_path, chunked_head=True)
    assert distance(ours, plain(base, formula(0.0), adamw), base) < 1e-10
    train(transformers.Trainer, stock, 12, 1, adamw, tmp=tmp_path)
    assert distance(ours, stock, base) < FLOAT32
    uncapped.config.final_logit_softcapping = None
    assert distance(ours, plain(uncapped, formula(0.0), adamw), base) > 0.01


BF16 = torch.finfo(torch.bfloat16).eps  # 7.8e-3: bf16's rounding of a step


def test_bf16_through_the_trainer(tmp_path):
    """``bf16=True`` (accelerate's autocast, and its ``convert_to_fp32`` reading the logits'
    ``.dtype``: the chunked Trainer failed at its first step): a float32 Llama, chunked, equals
    the stock Trainer's bf16 one-batch run at bf16's rounding (2.3e-3 apart; float32's run is as
    far), the hidden states reaching the head in bf16."""
    base = llama().float()
    ours, stock = copy.deepcopy(base), copy.deepcopy(base)
    dtypes = []  # what the output layer returned: bf16 logits, never computed
    ours.get_output_embeddings().register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    args = {"bf16": True}
    train(bigbatch.hf.Trainer, ours, 5, 3, tmp=tmp_path, args=args, chunked_head=True)
    train(transformers.Trainer, stock, 12, 1, tmp=tmp_path, args=args)
    assert set(dtypes) == {torch.bfloat16} and distance(ours, stock, base) < BF16


def test_sft_trainer_with_trls_defaults(tmp_path):
    """``exact(SFTTrainer)(..., chunked_head=True)`` with SFTConfig's own default ``bf16=True``
    (it never trained: accelerate's ``convert_to_fp32``), a float32 model: stock SFT's one-batch
    run at bf16's rounding."""
    trl, datasets = pytest.importorskip("trl"), pytest.importorskip("datasets")
    from integrations.test_trl import sentences
    from integrations.test_trl import train as train_trl

    data, base = datasets.Dataset.from_dict({"text": sentences(12, 1)}), llama().float()
    defaults = {"args": {"bf16": None}}  # None: TRL's default, True where fp16 is not set
    one, _ = train_trl(trl.SFTTrainer, base, 12, 1, tmp_path, data, **defaults)
    chunked = bigbatch.hf.exact(trl.SFTTrainer)
    ours, _ = train_trl(chunked, base, 5, 3, tmp_path, data, chunked_head=True, **defaults)
    assert distance(ours, one, base) < BF16


def renamed(key):
    """``collate`` with its labels under ``key`` (``None``: no labels)."""

    def collator(samples):
        batch = collate(samples)
        labels = batch.pop("labels")
        return {**batch, **({key: labels} if key else {})}

    return collator


@pytest.mark.parametrize("key, names", [("label", None), (None, None), ("targets", ["targets"])])
def test_a_batch_without_labels_is_named(tmp_path, key, names):
    """No ``labels`` in the batch (``KeyError: 'labels'`` before): one line naming ``labels``
    and, where given, ``label_names`` (which transformers reads in evaluation, not in training:
    the stock Trainer does not train on ``targets`` either); nothing changed."""
    model = gpt2()
    before = copy.deepcopy(model)
    trainer = bigbatch.hf.Trainer(
        model=model, args=arguments(tmp_path, 5, 3, label_names=names), train_dataset=texts(12),
        data_collator=renamed(key), optimizers=sgd(model), chunked_head=True,
    )  # fmt: skip
    named = r" \(label_names=\['targets'\] is read in evaluation only\)" if names else ""
    with pytest.raises(ValueError, match=f"chunked_head=True: the batch has no 'labels' .*{named}"):
        trainer.train()
    assert all(
        torch.equal(p, q) for p, q in zip(model.parameters(), before.parameters(), strict=True)
    )
    assert all(p.grad is None for p in model.parameters())
