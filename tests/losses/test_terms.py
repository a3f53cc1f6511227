"""Ready-made terms (``bigbatch.losses.terms``, issue 24 item 4) against plain full-batch losses.

One table: each loss is written twice, once with the ready-made terms (the ``loss_fn`` the
engine accumulates) and once plainly over the whole batch, the way its paper states it (the
reference). Every row trains in float64 under uneven micro-batches (10 samples as 4 + 4 + 2,
unequal tokens) and under a token budget, with SGD (momentum) and AdamW; the parameters must
agree with one full-batch step to 1e-10. The 2-rank version is in
tests/distributed/test_terms_ranks.py.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from cases import OPTIMIZERS
from models import VOCAB, TinyCausalLM
from reference import full_batch_step, max_relative_error
from refusals import assert_refused

import bigbatch
from bigbatch.losses import terms

CTX, BETA, ALPHA, CLIP = 12, 0.5, 0.3, 0.2


# make_batch's per-token keys beyond transformers' (Note [per-token tensors]), trimmed with them
PER_TOKEN = {"aux_labels": -100, "rejected_ids": 0, "rejected_labels": -100, "old_logps": 0}


def make_batch(n: int, gen: torch.Generator, short: bool = False) -> dict[str, torch.Tensor]:
    """Right-padded text with per-sample extras every loss below may need."""
    lengths = torch.randint(3, (5 if short else CTX) + 1, (n,), generator=gen)
    mask = torch.arange(CTX)[None] < lengths[:, None]
    ids = torch.randint(0, VOCAB, (n, CTX), generator=gen) * mask
    rejected = torch.randint(0, VOCAB, (n, CTX), generator=gen) * mask
    return {
        "input_ids": ids,
        "attention_mask": mask.long(),
        "labels": ids.masked_fill(~mask, -100),
        "aux_labels": ids.masked_fill(~mask | (torch.arange(CTX)[None] > 3), -100),  # a prefix
        "rejected_ids": rejected,
        "rejected_labels": rejected.masked_fill(~mask, -100),
        "ref_chosen": torch.randn(n, generator=gen, dtype=torch.float64),
        "ref_rejected": torch.randn(n, generator=gen, dtype=torch.float64),
        "old_logps": -torch.rand(n, CTX, generator=gen, dtype=torch.float64) * 3,
        "advantages": torch.randn(n, generator=gen, dtype=torch.float64),
    }


def _token_logps(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of the next token, and the completion mask, ``[n, CTX - 1]``."""
    logits = model(batch["input_ids"])[:, :-1]
    target = batch["labels"][:, 1:]
    picked = logits.log_softmax(-1).gather(-1, target.clamp_min(0)[..., None]).squeeze(-1)
    return picked, (target != -100).to(picked.dtype)


# ---------------------------------------------------------------- each loss, ready-made and plain
def sft_aux(model, mb):
    logits = model(mb["input_ids"])
    return {
        **terms.token_nll(logits, mb["labels"]),
        **terms.token_nll(logits, mb["aux_labels"], name="aux", weight=ALPHA),
    }


def sft_aux_plain(model, b):
    logits = model(b["input_ids"])[:, :-1].flatten(0, 1)
    main = F.cross_entropy(logits, b["labels"][:, 1:].flatten())  # mean over all tokens
    aux = F.cross_entropy(logits, b["aux_labels"][:, 1:].flatten())
    return main + ALPHA * aux


def ce_z_smoothing(model, mb):
    logits = model(mb["input_ids"])
    return {
        **terms.token_nll(logits, mb["labels"], label_smoothing=0.1),
        **terms.z_loss(logits, mb["labels"], weight=1e-2),
    }


def ce_z_smoothing_plain(model, b):
    logits = model(b["input_ids"])[:, :-1].flatten(0, 1)
    target = b["labels"][:, 1:].flatten()
    kept = target != -100
    return (
        F.cross_entropy(logits, target, label_smoothing=0.1)
        + 1e-2 * (logits[kept].logsumexp(-1) ** 2).mean()
    )


def dpo_rpo(model, mb):
    chosen_logits = model(mb["input_ids"])
    chosen = terms.sequence_logps(chosen_logits, mb["labels"])
    rejected = terms.sequence_logps(model(mb["rejected_ids"]), mb["rejected_labels"])
    return {
        **terms.dpo(chosen, rejected, mb["ref_chosen"], mb["ref_rejected"], beta=BETA),
        **terms.token_nll(chosen_logits, mb["labels"], name="rpo_nll", weight=ALPHA),
    }


def dpo_rpo_plain(model, b):
    def logp(ids, labels):
        lp = model(ids)[:, :-1].log_softmax(-1)
        kept = labels[:, 1:] != -100
        return (lp.gather(-1, labels[:, 1:].clamp_min(0)[..., None]).squeeze(-1) * kept).sum(-1)

    margin = (logp(b["input_ids"], b["labels"]) - b["ref_chosen"]) - (
        logp(b["rejected_ids"], b["rejected_labels"]) - b["ref_rejected"]
    )
    nll = F.cross_entropy(model(b["input_ids"])[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten())
    return -F.logsigmoid(BETA * margin).mean() + ALPHA * nll


def _pg(unit):
    def loss(model, mb):
        logps, mask = _token_logps(model, mb)
        return terms.policy_gradient(
            logps, mb["old_logps"][:, 1:], mb["advantages"], mask, unit=unit, clip=CLIP,
            max_len=CTX - 1,
        )  # fmt: skip

    return loss


def _pg_plain(unit):
    def loss(model, b):
        logps, mask = _token_logps(model, b)
        ratio = (logps - b["old_logps"][:, 1:]).exp()
        a = b["advantages"][:, None]
        per_token = -torch.minimum(ratio * a, ratio.clamp(1 - CLIP, 1 + CLIP) * a) * mask
        if unit == "token":  # DAPO: the mean over every token of the batch
            return per_token.sum() / mask.sum()
        if unit == "sequence":  # GRPO: each sequence's token mean, averaged over sequences
            return (per_token.sum(-1) / mask.sum(-1)).mean()
        return per_token.sum() / (len(mask) * (CTX - 1))  # Dr. GRPO: a constant length

    return loss


CASES = {
    "sft_aux": (sft_aux, sft_aux_plain),
    "ce_z_smoothing": (ce_z_smoothing, ce_z_smoothing_plain),
    "dpo_rpo": (dpo_rpo, dpo_rpo_plain),
    "grpo_sequence": (_pg("sequence"), _pg_plain("sequence")),
    "dapo_token": (_pg("token"), _pg_plain("token")),
    "dr_grpo_constant": (_pg("constant"), _pg_plain("constant")),
}
CUTS = {"samples": {"micro_batch_size": 4}, "tokens": {"micro_batch_tokens": 30}}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("cut", sorted(CUTS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_ready_made_terms_equal_the_plain_full_batch_loss(case, cut, optimizer, gen):
    loss_fn, plain = CASES[case]
    torch.manual_seed(0)
    init = TinyCausalLM().double()
    ref, model = copy.deepcopy(init), copy.deepcopy(init)
    ref_opt, opt = (
        OPTIMIZERS[optimizer](ref.parameters()),
        OPTIMIZERS[optimizer](model.parameters()),
    )
    acc = bigbatch.Accumulator(model, opt, **CUTS[cut], pad_values=PER_TOKEN)
    for _ in range(2):
        batch = make_batch(10, gen)
        full_batch_step(ref, ref_opt, plain, batch)
        result = acc.train_step(batch, loss_fn)
        assert result.micro_batches > 1 and len(result.terms) == len(loss_fn(model, batch))
    assert max_relative_error(ref, model) < 1e-10


@pytest.mark.parametrize("case", sorted(CASES))
def test_compile_buckets_take_token_terms_and_refuse_counts_of_rows(case, gen):
    """Found by tests/fuzz: the pad rows of ``pad_to_multiple_of`` were counted by a term of
    rows (a sequence, a pair) and added their losses (GRPO's sequence unit 1.5% off, silently).
    A count that is a number is refused there; token terms, counted from the labels, are exact."""
    loss_fn, plain = CASES[case]
    torch.manual_seed(0)
    init = TinyCausalLM().double()
    ref, model = copy.deepcopy(init), copy.deepcopy(init)
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), pad_values=PER_TOKEN,
                               micro_batch_tokens=30, pad_to_multiple_of=4)  # fmt: skip
    batch = make_batch(10, gen)
    try:
        acc.train_step(batch, loss_fn)
    except ValueError as exc:  # only where a micro-batch had pad rows: then refused, unchanged
        assert case in ("dpo_rpo", "grpo_sequence", "dr_grpo_constant")  # pairs, sequences
        assert re.search(r"term '\w+' has a count that is a number .* pad rows", str(exc))
        assert max_relative_error(init, model) == 0 and all(
            p.grad is None for p in model.parameters()
        )
        return
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), plain, batch)
    assert max_relative_error(ref, model) < 1e-10


def test_dividing_a_term_per_micro_batch_is_what_the_table_catches(gen):
    """The failure the terms exist for: the aux term normalised inside each micro-batch (and
    averaged over micro-batches) is not the full batch's; the table above would fail on it."""
    torch.manual_seed(0)
    init = TinyCausalLM().double()
    ref, model = copy.deepcopy(init), copy.deepcopy(init)
    batch = make_batch(10, gen)
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.5), sft_aux_plain, batch)

    def local_aux(m, mb):  # the aux term as a per-micro-batch mean, counted as one "item"
        out = sft_aux(m, mb)
        s, c, w = out.pop("aux")
        return {**out, "aux": (s / c, 1.0, w)}

    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.5), 4, pad_values=PER_TOKEN
    )
    acc.train_step(batch, local_aux)
    assert max_relative_error(ref, model) > 1e-6


def test_constant_unit_needs_its_length():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"unit='constant', max_len=None is not allowed"):
        terms.policy_gradient(x, x, torch.zeros(2), x, unit="constant")
    with pytest.raises(ValueError, match=r"unit='mean'"):
        terms.policy_gradient(x, x, torch.zeros(2), x, unit="mean")


def test_named_terms_in_a_cached_batch_loss(gen):
    """``cached_loss``'s batch loss may return named terms (all over the whole batch), one of
    which counts nothing (its mean was 0 / 0: NaN, and the window refused as non-finite)."""
    torch.manual_seed(0)
    init = TinyCausalLM().double()
    ref, model = copy.deepcopy(init), copy.deepcopy(init)

    def encode(m, mb):
        return m(mb["input_ids"]).mean(1)  # one vector per sequence

    def batch_loss(reps, batch):
        scores = reps @ reps.T
        target = torch.arange(len(reps))
        return {
            "nce": (F.cross_entropy(scores, target, reduction="sum"), float(len(reps))),
            "norm": ((reps**2).sum(), float(reps.numel()), 0.1),
            "empty": ((reps**2).sum() * 0, 0.0),  # counts nothing, adds nothing (was NaN)
        }

    def plain(m, b):  # the same loss written out over the whole batch
        reps = encode(m, b)
        return F.cross_entropy(reps @ reps.T, torch.arange(len(reps))) + 0.1 * (reps**2).mean()

    loss = bigbatch.cached_loss(encode, batch_loss)
    batch = make_batch(10, gen)
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.5), plain, batch)
    # encode averages over the padded width (it reads the padding): keep that width
    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.5), 4, trim_padding=False
    )
    acc.train_step(batch, loss)
    assert max_relative_error(ref, model) < 1e-10


def test_a_term_counted_in_fractions_below_one_is_exact(gen):
    """Counts are sums of sample weights (below 1 over the whole window), beside a token term."""
    torch.manual_seed(0)
    init = TinyCausalLM().double()
    ref, model = copy.deepcopy(init), copy.deepcopy(init)
    batch = make_batch(10, gen)
    batch["w"] = torch.rand(10, generator=gen, dtype=torch.float64) / 20  # Σ w < 1

    def loss(m, mb):
        logits = m(mb["input_ids"])
        per_sample = terms.sequence_logps(logits, mb["labels"])
        return {**terms.token_nll(logits, mb["labels"]),
                "weighted": (-(mb["w"] * per_sample).sum(), mb["w"].sum(), 0.5)}  # fmt: skip

    def plain(m, b):
        logits = m(b["input_ids"])
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten())
        weighted = -(b["w"] * terms.sequence_logps(logits, b["labels"])).sum() / b["w"].sum()
        return nll + 0.5 * weighted

    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.5), plain, batch)
    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.5), 4, pad_values=PER_TOKEN
    )
    acc.train_step(batch, loss)
    assert max_relative_error(ref, model) < 1e-10


def test_one_term_of_any_name_needs_no_count_pass(gen):
    calls = []
    model = TinyCausalLM().double()

    def loss(m, mb):
        calls.append(len(mb["input_ids"]))
        return terms.token_nll(m(mb["input_ids"]), mb["labels"], name="lm")

    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), 4, pad_values=PER_TOKEN
    )
    for _ in range(2):
        result = acc.train_step(make_batch(10, gen), loss)
    assert calls == [4, 4, 2] * 2 and set(result.terms) == {"lm"}


def test_a_term_with_no_item_adds_nothing_and_the_others_stay_exact(gen):
    """A term whose window count is 0 and whose sum is 0 has nothing to average: it adds
    nothing, as in the full batch, and the other terms' step is the full batch's. Its sum is
    written as ``x - x.detach()`` (0, with a gradient) to see that none of it reaches the step:
    before, it was back-propagated unnormalised (scale 1, not 1 / 0)."""
    torch.manual_seed(0)
    init = TinyCausalLM().double()
    ref, model = copy.deepcopy(init), copy.deepcopy(init)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    acc = bigbatch.Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 4)

    def loss(m, mb):
        logits = m(mb["input_ids"])
        empty = logits.sum() - logits.sum().detach()
        return {**terms.token_nll(logits, mb["labels"]), "empty": (empty, 0.0, 0.5)}

    def plain(m, b):
        logits = m(b["input_ids"])
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten())

    for _ in range(2):
        batch = make_batch(10, gen)
        full_batch_step(ref, ref_opt, plain, batch)
        result = acc.train_step(batch, loss)
        assert result.terms["empty"] == 0.0
    assert max_relative_error(ref, model) < 1e-10


def test_a_term_with_no_item_and_a_sum_is_refused_naming_it(gen):
    model = TinyCausalLM().double()
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 4)

    def loss(m, mb):
        logits = m(mb["input_ids"])
        return {**terms.token_nll(logits, mb["labels"]), "aux": (logits.pow(2).sum(), 0)}

    with assert_refused(model, ValueError, match=r"^term 'aux' sums to [\d.e+]+ over a count of 0: with "
                       r"no item to average over it has no full-batch value \(sum / 0\)"):  # fmt: skip
        acc.train_step(make_batch(10, gen), loss)


@pytest.mark.parametrize("names", [(1, "1"), ("1", 1)])
def test_term_names_that_are_the_same_text_are_refused(names, gen):
    """Silent before: ``str(name)`` made one term of two, the second replacing the first."""
    model = TinyCausalLM().double()
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 4)

    def loss(m, mb):
        nll = terms.token_nll(m(mb["input_ids"]), mb["labels"])["nll"]
        return {names[0]: nll, names[1]: (nll[0] * 2, nll[1])}

    with assert_refused(
        model,
        ValueError,
        match=rf"^loss_fn's term names \[{names[0]!r}, {names[1]!r}\] hold '1' twice as text: "
        r"give each term a name of its own\.$",
    ):
        acc.train_step(make_batch(10, gen), loss)


def test_count_fn_keyed_by_the_terms_names_as_given(gen):
    """Found by tests/fuzz: a term named ``1`` (an int) with ``count_fn -> {1: count}`` was refused
    with a raw ``'<' not supported`` (the loss's names are kept as text, count_fn's were not)."""
    torch.manual_seed(0)
    ref, model = TinyCausalLM().double(), TinyCausalLM().double()
    model.load_state_dict(ref.state_dict())

    def loss(m, mb):
        logits = m(mb["input_ids"])
        aux = (logits.pow(2).mean((1, 2)).sum(), len(logits))  # per sample
        return {1: terms.token_nll(logits, mb["labels"])["nll"], "aux": aux}

    def count_fn(mb):
        return {1: (mb["labels"][:, 1:] != -100).sum(), "aux": len(mb["labels"])}

    def plain(m, batch):  # the full batch: each term over its own whole-batch count
        out = loss(m, batch)
        return sum(t[0] / t[1] for t in out.values())

    batch = make_batch(10, gen)
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), plain, batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = bigbatch.Accumulator(model, opt, 4)
    with pytest.raises(ValueError, match=r"count_fn's names \[1, '1'\] hold the same text twice"):
        acc.train_step(batch, loss, count_fn=lambda mb: {1: 1, "1": 1})
    acc.train_step(batch, loss, count_fn=count_fn)
    assert max_relative_error(ref, model) < 1e-10
