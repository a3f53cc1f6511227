"""bigbatch.verifier._check on stock transformers models built from small configs, default settings otherwise.

Each model family is built with tiny sizes (hidden 16, 2 layers, vocab 32) and its config's
defaults for everything else: key/value caches on (``use_cache=True``), the attention
implementation transformers picks, float32 RMSNorm / rotary / attention where the family has them,
dropout where the family has it. Batches are padded sequences of very uneven lengths, labelled
-100 on the padding. The verdicts asked for: a correct token loss is exact (within the float32
rounding the model really computes in, which the report names), a token mean returned as a
``(mean, token_count)`` pair is ``mean-as-sum``, and a module that couples the samples is found
inside the model by replay (the replays see no recorded cache).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import bigbatch
from bigbatch.verifier._check import check
from bigbatch.verifier._runs import copy_float64, probe_coupling, seeded

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: pip install -e '.[test]'"
)

VOCAB, LENGTH, N = 32, 12, 10
CAUSAL = ["gpt2", "llama", "gpt-neo", "mistral"]
FLOAT32_ISLANDS = {  # the modules that cast to float32 in a float64 model, per family
    "llama": "LlamaRMSNorm",
    "gpt-neo": "GPTNeoSelfAttention",
    "mistral": "MistralRMSNorm",
}


def build(name: str) -> nn.Module:
    """A tiny model of the family, in the mode a model built from a config starts in (train)."""
    t = transformers
    small = dict(vocab_size=VOCAB, max_position_embeddings=2 * LENGTH)
    decoder = dict(small, hidden_size=16, intermediate_size=32, num_hidden_layers=2)
    configs = {
        "gpt2": lambda: t.GPT2LMHeadModel(
            t.GPT2Config(vocab_size=VOCAB, n_positions=2 * LENGTH, n_embd=16, n_layer=2, n_head=2)
        ),
        "llama": lambda: t.LlamaForCausalLM(
            t.LlamaConfig(**decoder, num_attention_heads=2, num_key_value_heads=1)
        ),
        "gpt-neo": lambda: t.GPTNeoForCausalLM(
            t.GPTNeoConfig(
                **small,
                hidden_size=16,
                num_layers=2,
                num_heads=2,
                window_size=4,
                attention_types=[[["global", "local"], 1]],
            )
        ),
        "mistral": lambda: t.MistralForCausalLM(
            t.MistralConfig(
                **decoder, num_attention_heads=2, num_key_value_heads=1, sliding_window=6
            )
        ),
        "bert": lambda: t.BertForMaskedLM(
            t.BertConfig(
                **small,
                hidden_size=16,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=32,
            )
        ),
    }
    torch.manual_seed(0)
    return configs[name]()


def padded_batch(gen: torch.Generator, masked_lm: bool = False) -> dict[str, torch.Tensor]:
    """Token ids, attention mask and labels; real lengths from 2 to LENGTH tokens."""
    ids = torch.randint(0, VOCAB, (N, LENGTH), generator=gen)
    lengths = torch.randint(2, LENGTH + 1, (N,), generator=gen)
    lengths[0] = LENGTH
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    if masked_lm:  # predict ~30% of the real tokens (at least one per sequence)
        hidden = torch.rand(N, LENGTH, generator=gen) < 0.3
        hidden[:, 0] = True
        labels = labels.masked_fill(~hidden, -100)
        ids = ids.masked_fill(hidden & (mask == 1), 1)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def shifted_count(batch: dict[str, torch.Tensor], masked_lm: bool) -> torch.Tensor:
    labels = batch["labels"] if masked_lm else batch["labels"][:, 1:]
    return (labels != -100).sum()


def token_loss(masked_lm: bool):
    def loss_fn(model, batch):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return bigbatch.token_cross_entropy(out.logits, batch["labels"], shift=not masked_lm)

    return loss_fn


def own_loss(masked_lm: bool):
    """The model's own ``labels=`` loss (a token mean) turned back into a sum: correct."""

    def loss_fn(model, batch):
        count = shifted_count(batch, masked_lm)
        return model(**batch).loss * count, count

    return loss_fn


def mean_as_sum(masked_lm: bool):
    """The token mean returned as the loss_sum of the pair: wrong."""

    def loss_fn(model, batch):
        return model(**batch).loss, shifted_count(batch, masked_lm)

    return loss_fn


def prepared(name: str) -> nn.Module:
    model = build(name)
    if name in ("gpt2", "bert"):
        model.eval()  # dropout 0.1 by default: train mode in test_train_mode_is_checked_with_dropout_off
    return model


@pytest.mark.parametrize("name", CAUSAL + ["bert"])
@pytest.mark.parametrize("make_loss", [token_loss, own_loss], ids=["token_cross_entropy", "labels"])
def test_correct_token_loss_is_exact(name, make_loss, gen):
    masked_lm = name == "bert"
    report = check(prepared(name), padded_batch(gen, masked_lm), make_loss(masked_lm), 4)
    assert report.exact, report.summary()
    assert report.diagnoses == []
    if name in FLOAT32_ISLANDS:
        assert report.compute_dtype == torch.float32 and report.tolerance == 1e-5
        assert any(FLOAT32_ISLANDS[name] in where for where in report.low_precision_in)
        assert "computes partly in float32" in report.summary()
        assert 1e-10 < report.max_difference < 1e-6  # float32 rounding: the old verdict's wolf
    elif make_loss is token_loss:  # float64 throughout: the float64 tolerance holds
        assert report.compute_dtype == torch.float64 and report.low_precision_in == ()
        assert report.tolerance == 1e-10 and report.max_difference < 1e-10


@pytest.mark.slow  # a transformers model per row, up to 5 s each
@pytest.mark.parametrize("name", CAUSAL + ["bert"])
def test_token_mean_returned_as_sum_is_mean_as_sum(name, gen):
    masked_lm = name == "bert"
    report = check(prepared(name), padded_batch(gen, masked_lm), mean_as_sum(masked_lm), 4)
    assert not report.exact
    assert [d.kind for d in report.diagnoses] == ["mean-as-sum"], report.summary()
    assert "token_cross_entropy" in report.diagnoses[0].message


@pytest.mark.parametrize("name", CAUSAL)
def test_every_module_replays_without_the_recorded_cache(name, gen):
    """The replay that crashed ("size of tensor a (24) must match ... b (12)"): every module of
    the model, caches on, calls again on its recorded inputs and repeats itself."""
    work = copy_float64(build(name).eval())
    batch = padded_batch(gen)

    def run():  # use_cache=True explicitly: a cache object is passed down to every layer
        return work(**batch, use_cache=True).loss

    assert probe_coupling(work, run, N, lambda: seeded(0), 1e-5) == ([], [])  # (coupled, unprobed)


class BatchCentre(nn.Module):
    """Subtracts the batch mean: couples the samples."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(dim=0, keepdim=True)


COUPLING_SITE = {"llama": ("model.layers.1.mlp", "act_fn"), "gpt2": ("transformer.h.1.mlp", "act")}


@pytest.mark.slow  # beyond the per-model verdicts; the quick suite has a plain-model twin
@pytest.mark.parametrize("name", sorted(COUPLING_SITE))
def test_batch_coupling_inside_a_transformers_model_is_named(name, gen):
    model = prepared(name)
    parent, attr = COUPLING_SITE[name]
    mlp = model.get_submodule(parent)
    setattr(mlp, attr, nn.Sequential(getattr(mlp, attr), BatchCentre()))
    report = check(model, padded_batch(gen), token_loss(False), 4)
    assert not report.exact
    assert [d.kind for d in report.diagnoses] == ["batch-statistics"], report.summary()
    assert report.diagnoses[0].modules == (f"{parent}.{attr}.1",)


DROPOUT_IN = {  # with the config's defaults in train mode: dropout 0.1 (GPT-2, BERT), 0 (Llama)
    "gpt2": "Dropout ×5, GPT2Attention ×2",
    "llama": None,
    "bert": "Dropout ×5, BertSelfAttention ×2",
}


@pytest.mark.parametrize("name", sorted(DROPOUT_IN))
def test_train_mode_is_checked_with_dropout_off(name, gen):
    """Built from a config, a model is in train mode with the config's dropout: micro-batches
    draw other masks than the full batch (check said "NOT exact" for every such model). check
    turns dropout off in both runs, names where, and says so in the verdict."""
    masked_lm = name == "bert"
    model = build(name)
    assert model.training
    report = check(model, padded_batch(gen, masked_lm), token_loss(masked_lm), 4)
    assert report.exact and report.diagnoses == [], report.summary()
    if DROPOUT_IN[name] is None:
        assert report.dropout_off == () and "dropout" not in report.summary()
        return
    assert report.summary().startswith(
        "exact (dropout off); with dropout on, equal in distribution: max relative difference"
    )
    assert f"- dropout off in {DROPOUT_IN[name]} (dropout_off names them)" in report.summary()
    assert all(m.training for m in model.modules())  # the user's model is left in train mode


@pytest.mark.slow  # beyond the per-model verdicts; the quick suite has a plain-model twin
def test_sequence_classification(gen):
    t = transformers
    config = t.BertConfig(
        vocab_size=VOCAB,
        max_position_embeddings=2 * LENGTH,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
    )
    torch.manual_seed(0)
    model = t.BertForSequenceClassification(config).eval()
    batch = padded_batch(gen)
    batch["labels"] = torch.randint(0, 3, (N,), generator=gen)
    right = check(model, batch, lambda m, b: m(**b).loss, 4)  # a mean over samples
    assert right.exact and right.max_difference < 1e-10, right.summary()
    wrong = check(model, batch, lambda m, b: (m(**b).loss, b["labels"].shape[0]), 4)
    assert [d.kind for d in wrong.diagnoses] == ["mean-as-sum"]


@pytest.mark.parametrize("name", ["gpt2", pytest.param("bert", marks=pytest.mark.slow)])
def test_the_suggested_token_loss_is_exact_on_the_models_target(name, gen):
    """``check``'s fix for ``m(**b).loss``, copied as it is: exact, and it trains what the model's
    own loss trains (a causal LM's next token: ``shift=True``; a masked LM's own positions)."""
    model, batch = prepared(name), padded_batch(gen, masked_lm=name == "bert")
    message = check(model, batch, lambda m, b: m(**b).loss, 4).diagnoses[0].message
    code = re.search(r"bigbatch\.token_cross_entropy\([^)]*\)", message).group()

    def suggested(m, b):
        logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        return eval(code, {"bigbatch": bigbatch, "logits": logits, "labels": b["labels"]})

    assert check(model, batch, suggested, 4).exact
    loss_sum, count = suggested(model, batch)
    assert torch.allclose(loss_sum / count, model(**batch).loss, rtol=1e-6)
    assert ("shift=True" in code) == (name == "gpt2")


@pytest.mark.slow  # beyond the per-model verdicts; the quick suite has a plain-model twin
@pytest.mark.parametrize("name", ["llama", "bert"])
def test_token_mean_returned_alone_is_token_mean(name, gen):
    """``lambda m, b: m(**b).loss``: a token mean read as a mean over samples."""
    masked_lm = name == "bert"
    report = check(prepared(name), padded_batch(gen, masked_lm), lambda m, b: m(**b).loss, 4)
    assert not report.exact
    assert [d.kind for d in report.diagnoses] == ["token-mean"], report.summary()
    assert "return (loss_sum, token_count)" in report.diagnoses[0].message
