"""The statistics pass (``train_step(..., stats_fn=...)``, Note [passes before the window]).

The case it exists for: a mixture-of-experts load-balancing loss over the GLOBAL batch
(``α E Σ_e f_e P_e``, ``f_e`` the fraction of the batch's tokens routed to expert e, held
constant; ``P_e`` the batch's mean router probability, differentiated). ``f`` needs every token
of the window before any backward: the statistics pass totals it, and the step equals the
full-batch step in float64, where plain accumulation balances each micro-batch on its own.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
from cases import OPTIMIZERS
from reference import full_batch_step, max_relative_error
from refusals import assert_refused

import bigbatch
from bigbatch.core.loss import token_cross_entropy

VOCAB, EXPERTS, ALPHA = 13, 4, 0.1


class TinyMoE(nn.Module):
    """Token embeddings, a top-1 router over small experts, a vocabulary head."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.drop = nn.Dropout(dropout)
        self.router = nn.Linear(8, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(EXPERTS))
        self.head = nn.Linear(8, VOCAB)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.drop(self.embed(ids))
        probs = self.router(h).softmax(-1)  # [n, t, E]
        choice = probs.argmax(-1, keepdim=True)
        mixed = torch.stack([e(h) for e in self.experts], -2)  # [n, t, E, d]
        out = mixed.gather(-2, choice[..., None].expand(*choice.shape, 8)).squeeze(-2)
        return self.head(torch.tanh(out) * probs.gather(-1, choice)), probs


def text(n: int, gen: torch.Generator, ctx: int = 10) -> dict[str, torch.Tensor]:
    lengths = torch.randint(2, ctx + 1, (n,), generator=gen)
    mask = torch.arange(ctx)[None] < lengths[:, None]
    ids = torch.randint(0, VOCAB, (n, ctx), generator=gen)
    return {"input_ids": ids, "mask": mask, "labels": ids.masked_fill(~mask, -100)}


def routing(model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    """The statistics: tokens routed to each expert, and the tokens (real ones only)."""
    _, probs = model(batch["input_ids"])
    picked = nn.functional.one_hot(probs.argmax(-1), EXPERTS).to(probs.dtype)
    mask = batch["mask"][..., None].to(probs.dtype)
    return {"routed": (picked * mask).sum((0, 1)), "tokens": mask.sum()}


def moe_loss(model: nn.Module, batch: dict, stats: dict) -> dict:
    """LM loss per token, and the global-batch balance term with ``f`` from the statistics."""
    logits, probs = model(batch["input_ids"])
    lm = token_cross_entropy(logits, batch["labels"], shift=True)
    f = stats["routed"] / stats["tokens"]
    mask = batch["mask"][..., None].to(probs.dtype)
    p_sum = (probs * mask).sum((0, 1))  # Σ over this micro-batch's tokens: P_e's numerator
    return {"lm": lm, "balance": (ALPHA * EXPERTS * (f * p_sum).sum(), mask.sum())}


def full_batch_moe(model: nn.Module, batch: dict):
    """The reference: the statistics of the whole batch, then the loss in one piece."""
    with torch.no_grad():
        stats = routing(model, batch)
    terms = moe_loss(model, batch, stats)
    return sum(s / c for s, c in terms.values())


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize(
    "with_counts",
    [pytest.param(True, marks=pytest.mark.slow), False],  # False: the engine counts in a pass
)  # True took 3 s, False keeps the quick tier's row
def test_moe_global_balance_equals_the_full_batch(optimizer, with_counts, gen):
    torch.manual_seed(0)
    init = TinyMoE().double()
    ref, model = copy.deepcopy(init), copy.deepcopy(init)
    ref_opt, opt = (
        OPTIMIZERS[optimizer](ref.parameters()),
        OPTIMIZERS[optimizer](model.parameters()),
    )
    acc = bigbatch.Accumulator(model, opt, micro_batch_size=4)
    tokens = lambda mb: mb["mask"].sum()  # noqa: E731
    count_fn = (
        (lambda mb: {"lm": (mb["labels"][:, 1:] != -100).sum(), "balance": tokens(mb)})
        if with_counts
        else None
    )  # noqa: E731
    for _ in range(3):
        batch = text(10, gen)  # 4 + 4 + 2, unequal tokens
        full_batch_step(ref, ref_opt, full_batch_moe, batch)
        result = acc.train_step(batch, moe_loss, stats_fn=routing, count_fn=count_fn)
        assert set(result.terms) == {"lm", "balance"} and result.micro_batches == 3
    assert max_relative_error(ref, model) < 1e-10


def test_plain_accumulation_balances_each_micro_batch_instead(gen):
    """Without the pass (f per micro-batch) the step differs: the test above can fail."""
    torch.manual_seed(0)
    init = TinyMoE().double()
    ref, model = copy.deepcopy(init), copy.deepcopy(init)
    batch = text(10, gen)
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.5), full_batch_moe, batch)
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), 4)
    per_micro = lambda m, mb: moe_loss(m, mb, routing(m, mb))  # noqa: E731
    acc.train_step(batch, per_micro)
    assert max_relative_error(ref, model) > 1e-6


def test_both_passes_draw_the_same_dropout_masks_and_batchnorm_moves_once(gen):
    torch.manual_seed(0)
    model = TinyMoE(dropout=0.3).double()
    model.norm = nn.BatchNorm1d(1).double()  # a buffer that forwards move
    seen: dict[str, list] = {"stats": [], "loss": []}

    def stats_fn(m, mb):
        m.norm(mb["mask"].sum(1, keepdim=True).double())
        stats = routing(m, mb)  # the pass's forward, with its dropout mask
        seen["stats"].append(stats["routed"])
        return stats

    def loss(m, mb, stats):
        m.norm(mb["mask"].sum(1, keepdim=True).double())
        seen["loss"].append(routing(m, mb)["routed"].detach())  # the same first draw
        return moe_loss(m, mb, stats)

    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 4)
    counts = lambda mb: {"lm": (mb["labels"][:, 1:] != -100).sum(), "balance": mb["mask"].sum()}  # noqa: E731
    with pytest.warns(bigbatch.BigBatchWarning, match="BatchNorm1d"):
        acc.train_step(text(10, gen), loss, stats_fn=stats_fn, count_fn=counts)
    assert len(seen["stats"]) == len(seen["loss"]) == 3
    for a, b in zip(seen["stats"], seen["loss"], strict=True):
        assert torch.equal(a, b)  # the same dropout masks: the same routing
    assert int(model.norm.num_batches_tracked) == 3  # once per micro-batch, not twice


def test_stats_pass_is_redone_with_the_window_after_out_of_memory(gen):
    torch.manual_seed(0)
    init = TinyMoE().double()
    ref, model = copy.deepcopy(init), copy.deepcopy(init)
    batch = text(10, gen)
    full_batch_step(ref, torch.optim.SGD(ref.parameters(), lr=0.5), full_batch_moe, batch)

    def tight(m, mb, stats):  # an injected out-of-memory error above 4 samples (wiring)
        if len(mb["input_ids"]) > 4:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return moe_loss(m, mb, stats)

    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.5), "auto")
    result = acc.train_step(batch, tight, stats_fn=routing)
    assert result.oom_retries >= 1 and result.micro_batch_size <= 4
    assert max_relative_error(ref, model) < 1e-10


@pytest.mark.parametrize(
    "stats_fn, error, message",
    [
        (3, TypeError, r"stats_fn=3 is not callable"),
        (lambda m, mb: 1.0, TypeError, r"stats_fn must return additive statistics"),
    ],
)
def test_bad_stats_fn_is_refused_and_changes_nothing(stats_fn, error, message, gen):
    model = TinyMoE().double()
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 4)
    with assert_refused(model, error, match=message):
        acc.train_step(text(10, gen), moe_loss, stats_fn=stats_fn)


def test_stats_fn_with_a_loss_fn_of_two_arguments_is_refused_before_the_window(gen):
    """Before: Python's "takes 2 positional arguments but 3 were given", after the pass."""
    model = TinyMoE().double()
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 4)
    calls = []

    def counting(m, mb):
        calls.append(1)
        return routing(m, mb)

    def two(model, batch):
        return model(batch["input_ids"])[0].sum(), 1

    with pytest.raises(
        TypeError,
        match=r"^stats_fn is given, so loss_fn is called as loss_fn\(model, batch, stats\), but "
        r"it takes \(model, batch\): add the stats parameter, or drop stats_fn\.$",
    ):
        acc.train_step(text(10, gen), two, stats_fn=counting)
    assert not calls and all(p.grad is None for p in model.parameters())
    acc.train_step(text(10, gen), lambda m, b, *rest: moe_loss(m, b, *rest), stats_fn=counting)


def test_statistics_are_matched_by_key_in_any_order(gen):
    """Silent before: the pieces' statistics were summed by position, so a dict whose keys came in
    another order added ``tokens`` to ``routed`` (broadcast) and the step was off. Now by key."""
    torch.manual_seed(0)
    init = TinyMoE().double()
    ref, model = copy.deepcopy(init), copy.deepcopy(init)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    acc = bigbatch.Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 4)
    calls = []

    def shuffled(m, mb):  # every other micro-batch: {"tokens": ..., "routed": ...}
        calls.append(1)
        stats = routing(m, mb)
        return stats if len(calls) % 2 else {"tokens": stats["tokens"], "routed": stats["routed"]}

    for _ in range(2):
        batch = text(10, gen)
        full_batch_step(ref, ref_opt, full_batch_moe, batch)
        acc.train_step(batch, moe_loss, stats_fn=shuffled)
    assert max_relative_error(ref, model) < 1e-10


@pytest.mark.parametrize("other", [{"routed"}, {"routed", "experts"}], ids=["fewer", "another"])
def test_statistics_with_other_keys_are_refused_naming_them(other, gen):
    """Silent before for ``another`` (same number of leaves: summed by position)."""
    model = TinyMoE().double()
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 4)
    calls = []

    def stats_fn(m, mb):
        calls.append(1)
        stats = routing(m, mb)
        return stats if len(calls) == 1 else {k: stats["routed"] for k in sorted(other)}

    shown = ", ".join(f"stats[{k!r}]" for k in sorted(other))
    with assert_refused(
        model,
        TypeError,
        match=rf"^stats_fn returned {re.escape(shown)} for micro-batch 2 and stats\['routed'\], "
        r"stats\['tokens'\] for the first: return the same keys for every micro-batch\.$",
    ):
        acc.train_step(text(10, gen), moe_loss, stats_fn=stats_fn)


def test_ready_made_load_balance_terms_equal_the_full_batch(gen):
    """``terms.load_balance_stats`` + ``terms.load_balance``: the same loss as ``moe_loss``."""
    from bigbatch.losses import terms

    def stats_fn(m, mb):
        return terms.load_balance_stats(m(mb["input_ids"])[1], mb["mask"])

    def loss(m, mb, stats):
        logits, probs = m(mb["input_ids"])
        return {
            **terms.token_nll(logits, mb["labels"], name="lm"),
            **terms.load_balance(probs, mb["mask"], stats, weight=ALPHA),
        }

    torch.manual_seed(0)
    init = TinyMoE().double()
    ref, model = copy.deepcopy(init), copy.deepcopy(init)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    acc = bigbatch.Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-2), 4)
    for _ in range(2):
        batch = text(10, gen)
        full_batch_step(ref, ref_opt, full_batch_moe, batch)
        acc.train_step(batch, loss, stats_fn=stats_fn)
    assert max_relative_error(ref, model) < 1e-10


def _logratio(m, mb):
    """A sequence-level log-ratio of the policy against a fixed reference score (the batch's)."""
    logits, _ = m(mb["input_ids"])
    kept = mb["labels"][:, 1:] != -100
    lp = logits[:, :-1].log_softmax(-1).gather(-1, mb["labels"][:, 1:].clamp_min(0)[..., None])
    return (lp.squeeze(-1) * kept).sum(-1) - mb["ref"]


@pytest.mark.parametrize("case", ["kto", "normalised_advantages"])
def test_kto_reference_point_and_batch_normalised_advantages(case, gen):
    from bigbatch.losses import terms

    def stats_fn(m, mb):
        return (
            terms.kto_stats(_logratio(m, mb)) if case == "kto" else terms.reward_stats(mb["reward"])
        )

    def loss(m, mb, stats):
        if case == "kto":
            return terms.kto(_logratio(m, mb), mb["desirable"], stats, beta=0.5)
        adv = terms.normalised_advantages(mb["reward"], stats)
        return {"pg": (-(adv * _logratio(m, mb)).sum(), float(len(adv)))}

    def plain(m, b):  # the whole batch's statistic, in one piece
        r = _logratio(m, b)
        if case == "kto":
            z = r.detach().mean().clamp_min(0)
            sign = b["desirable"].double() * 2 - 1
            return (1 - torch.sigmoid(0.5 * sign * (r - z))).mean()
        adv = (b["reward"] - b["reward"].mean()) / (b["reward"].std(unbiased=False) + 1e-6)
        return -(adv * r).mean()

    torch.manual_seed(0)
    init = TinyMoE().double()
    ref, model = copy.deepcopy(init), copy.deepcopy(init)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), 4)
    for _ in range(2):
        batch = text(10, gen)
        with torch.no_grad():  # a reference scoring each sequence about 1 nat below the policy
            batch["ref"] = torch.zeros(10, dtype=torch.float64)
            batch["ref"] = (
                _logratio(ref, batch) - 1 + torch.randn(10, generator=gen, dtype=torch.float64)
            )
        batch["desirable"] = torch.rand(10, generator=gen) > 0.5
        batch["reward"] = torch.randn(10, generator=gen, dtype=torch.float64)
        full_batch_step(ref, ref_opt, plain, batch)
        acc.train_step(batch, loss, stats_fn=stats_fn)
    assert max_relative_error(ref, model) < 1e-10


@pytest.mark.parametrize("sizes", [(3, 1, 1), (4, 4, 2)], ids=["broadcast", "raw size error"])
def test_statistics_of_another_shape_per_micro_batch_are_refused(sizes, gen):
    """Issue 37: shapes [3], [1], [1] (a value per sample) broadcast silently; [4], [4], [2] gave
    torch's raw size error. A statistic is additive only with one shape in every micro-batch."""
    model = TinyMoE().double()
    acc = bigbatch.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 4)
    calls = iter(sizes)

    def per_sample(m, mb):
        return {**routing(m, mb), "x": torch.ones(next(calls), dtype=torch.float64)}

    i = next(i for i, n in enumerate(sizes) if n != sizes[0])
    shape = rf"\[{sizes[i]}\] for micro-batch {i + 1} and \[{sizes[0]}\] for the first"
    with assert_refused(
        model, ValueError, match=rf"^stats_fn returned stats\['x'\] of shape {shape}"
    ):
        acc.train_step(text(10, gen), moe_loss, stats_fn=per_sample)
