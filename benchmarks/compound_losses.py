"""Compound losses under accumulation: the peers' failure factors beside bigbatch's, and what the
statistics pass costs.

Part 1 (float64, gradients only): the gradient each method would step on, against the full
batch's, for three failures filed in 2025-26, each reproduced with the hand loop that has it:

* NeMo RL PR #3791 — an auxiliary NLL term averaged per micro-batch and summed over the window:
  its weight is multiplied by the number of micro-batches (32 here). Measured: the auxiliary
  term's weight as trained, fitted from the gradient (``g = g_main + c · g_aux``), over the weight
  asked for.
* ms-swift #10117 — DAPO's token-mean loss normalised by the window's tokens and then divided by
  the 4 accumulation steps again: ``g/4``. Measured: ``‖g‖ / ‖g_full‖``.
* torchtitan PR #3000 / plain accumulation of an MoE load-balancing loss — the routed fractions
  taken per micro-batch, not over the global batch. Measured: ``‖g − g_full‖ / ‖g_full‖``.

bigbatch computes each with named terms (``bigbatch.losses.terms``) and, for the MoE balance, a
statistics pass (``train_step(..., stats_fn=...)``).

Part 2 (float32, time): the MoE step with the statistics pass (exact) against the same
accumulation without it (micro-batch fractions), timed round-robin, median ratio reported.

Run: PYTHONPATH=src python benchmarks/compound_losses.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn as nn
from _measure import device_name, print_table

import bigbatch
from bigbatch.losses import terms

VOCAB, EXPERTS = 64, 8


class MoELM(nn.Module):
    """Token embeddings, a top-1 routed expert layer, a vocabulary head."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.router = nn.Linear(dim, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(EXPERTS))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(ids)
        probs = self.router(h).softmax(-1)
        choice = probs.argmax(-1, keepdim=True)
        mixed = torch.stack([e(h) for e in self.experts], -2)
        out = mixed.gather(-2, choice[..., None].expand(*choice.shape, h.shape[-1])).squeeze(-2)
        return self.head(torch.tanh(out) * probs.gather(-1, choice)), probs


def make_batch(n: int, ctx: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    lengths = torch.randint(4, ctx + 1, (n,), generator=gen)
    mask = torch.arange(ctx)[None] < lengths[:, None]
    ids = torch.randint(0, VOCAB, (n, ctx), generator=gen)
    prefix = torch.arange(ctx)[None] < 6
    return {
        "input_ids": ids, "mask": mask, "labels": ids.masked_fill(~mask, -100),
        "aux_labels": ids.masked_fill(~(mask & prefix), -100),
    }  # fmt: skip


def grad_of(model: nn.Module, fn) -> torch.Tensor:
    """The flat gradient that ``fn(model)`` back-propagates (summed over its backward calls)."""
    model.zero_grad(set_to_none=True)
    fn(model)
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def bigbatch_grad(model: nn.Module, batch, loss_fn, micro: int, **kwargs) -> torch.Tensor:
    """The gradient ``Accumulator.train_step`` steps on (a recording optimizer)."""
    grads: list[torch.Tensor] = []

    class Record(torch.optim.SGD):
        def step(self, closure=None):
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))

    work = copy.deepcopy(model)
    model = work
    acc = bigbatch.Accumulator(work, Record(work.parameters(), lr=0.0), micro_batch_size=micro)
    acc.train_step(batch, loss_fn, **kwargs)
    return grads[0]


def pieces(batch, micro):
    return bigbatch.split(batch, micro)


# ---------------------------------------------------------------- part 1: failure factors
ALPHA = 0.1


def aux_case(model, batch) -> list[object]:
    """NeMo RL #3791: the auxiliary NLL, a per-micro-batch mean, summed over 32 micro-batches."""

    def main_only(m, b):
        return terms.token_nll(m(b["input_ids"])[0], b["labels"])["nll"]

    def plain_full(m):
        logits = m(batch["input_ids"])[0]
        s, c, _ = terms.token_nll(logits, batch["labels"])["nll"]
        a, ac, _ = terms.token_nll(logits, batch["aux_labels"])["nll"]
        (s / c + ALPHA * a / ac).backward()

    tokens = (batch["labels"][:, 1:] != -100).sum()

    def hand(m):  # main normalised globally, the auxiliary term per micro-batch and not divided
        for mb in pieces(batch, 2):
            logits = m(mb["input_ids"])[0]
            s, _, _ = terms.token_nll(logits, mb["labels"])["nll"]
            a, ac, _ = terms.token_nll(logits, mb["aux_labels"])["nll"]
            (s / tokens + ALPHA * a / ac).backward()

    def ours(m, mb):
        logits = m(mb["input_ids"])[0]
        return {**terms.token_nll(logits, mb["labels"]),
                **terms.token_nll(logits, mb["aux_labels"], name="aux", weight=ALPHA)}  # fmt: skip

    g_main = bigbatch_grad(model, batch, main_only, micro=len(batch["labels"]))
    g_aux = (grad_of(copy.deepcopy(model), plain_full) - g_main) / ALPHA
    weight = lambda g: float((g - g_main) @ g_aux / (g_aux @ g_aux)) / ALPHA  # noqa: E731
    g_ours = bigbatch_grad(model, batch, ours, micro=2)
    return [
        "NeMo RL #3791: aux NLL, 32 micro-batches",
        "aux weight trained / asked",
        f"{weight(grad_of(copy.deepcopy(model), hand)):.3f}",
        f"{weight(g_ours):.3f}",
    ]


def dapo_case(model, batch) -> list[object]:
    """ms-swift #10117: DAPO's token mean over the window, then divided by GA = 4 again."""
    k, micro = 4, len(batch["labels"]) // 4
    tokens = (batch["labels"][:, 1:] != -100).sum()

    def full(m):
        s, c, _ = terms.token_nll(m(batch["input_ids"])[0], batch["labels"])["nll"]
        (s / c).backward()

    def hand(m):
        for mb in pieces(batch, micro):
            s, _, _ = terms.token_nll(m(mb["input_ids"])[0], mb["labels"])["nll"]
            (s / tokens / k).backward()  # the trainer's own ÷GA on top of the token mean

    def ours(m, mb):
        return terms.token_nll(m(mb["input_ids"])[0], mb["labels"])

    g_full = grad_of(copy.deepcopy(model), full)
    ratio = lambda g: float(g.norm() / g_full.norm())  # noqa: E731
    g_hand, g_ours = grad_of(copy.deepcopy(model), hand), bigbatch_grad(model, batch, ours, micro)
    return [
        "ms-swift #10117: DAPO, 4 accumulation steps",
        "‖g‖ / ‖g_full‖",
        f"{ratio(g_hand):.3f}",
        f"{ratio(g_ours):.3f}",
    ]


def moe_losses(batch):
    def stats_fn(m, mb):
        return terms.load_balance_stats(m(mb["input_ids"])[1], mb["mask"])

    def loss(m, mb, stats):
        logits, probs = m(mb["input_ids"])
        return {**terms.token_nll(logits, mb["labels"], name="lm"),
                **terms.load_balance(probs, mb["mask"], stats, weight=ALPHA)}  # fmt: skip

    def local(m, mb):  # what frameworks approximate: the micro-batch's fractions, one forward
        logits, probs = m(mb["input_ids"])
        stats = terms.load_balance_stats(probs.detach(), mb["mask"])
        return {**terms.token_nll(logits, mb["labels"], name="lm"),
                **terms.load_balance(probs, mb["mask"], stats, weight=ALPHA)}  # fmt: skip

    return stats_fn, loss, local


def moe_case(model, batch) -> list[object]:
    """The MoE balance with micro-batch routed fractions (plain accumulation)."""
    stats_fn, loss, local = moe_losses(batch)

    def full(m):
        with torch.no_grad():
            stats = stats_fn(m, batch)
        sum(s * w / c for s, c, w in loss(m, batch, stats).values()).backward()

    g_full = grad_of(copy.deepcopy(model), full)
    error = lambda g: f"{float((g - g_full).norm() / g_full.norm()):.1e}"  # noqa: E731
    g_plain = bigbatch_grad(model, batch, local, micro=8)
    g_ours = bigbatch_grad(model, batch, loss, micro=8, stats_fn=stats_fn)
    return [
        "MoE balance (torchtitan #3000), 8 micro-batches",
        "‖g − g_full‖ / ‖g_full‖",
        error(g_plain),
        error(g_ours),
    ]


# ---------------------------------------------------------------- part 2: the pass's cost
def cost(rounds: int) -> list[list[object]]:
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    model = MoELM(dim=128)
    batch = make_batch(64, 96, gen)
    stats_fn, loss, local = moe_losses(batch)

    def counts(mb):  # both runs count their terms before the window (no count pass)
        return {"lm": (mb["labels"][:, 1:] != -100).sum(), "balance": mb["mask"].sum()}

    runs = {
        "accumulation, micro-batch fractions": lambda acc: acc.train_step(
            batch, local, count_fn=counts
        ),
        "accumulation + statistics pass (exact)": lambda acc: acc.train_step(
            batch, loss, stats_fn=stats_fn, count_fn=counts
        ),
    }
    accs = {}
    for name, run in runs.items():
        work = copy.deepcopy(model)
        accs[name] = bigbatch.Accumulator(work, torch.optim.AdamW(work.parameters(), lr=1e-4), 8)
        run(accs[name])  # warm up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in list(runs)[r % 2 :] + list(runs)[: r % 2]:
            start = time.perf_counter()
            runs[name](accs[name])
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["accumulation, micro-batch fractions"])
    return [
        [name, f"{statistics.median(t):.3f}", f"{statistics.median(t) / base:.2f}x"]
        for name, t in times.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds for part 2")
    args = parser.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = MoELM().double()
    batch = make_batch(64, 24, gen)
    rows = [aux_case(model, batch), dapo_case(model, batch), moe_case(model, batch)]
    print(f"device: {device_name('cpu')}")
    print_table(
        "Part 1: what the step trains on, against the full batch (float64; 1.000 / 0 is exact)",
        ["failure (peer issue)", "measured", "hand loop", "bigbatch"],
        rows,
    )
    print_table(
        f"Part 2: time per step, MoE LM (64 x 96 tokens, micro-batch 8), median of {args.rounds}",
        ["run", "s/step", "vs without the pass"],
        cost(args.rounds),
    )


if __name__ == "__main__":
    main()
