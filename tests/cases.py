"""Scenarios shared by several test files: one place, instead of tests importing each other.

* Distributed: the optimizers, models and unequal per-rank windows of the DDP / FSDP / auto /
  several-forwards tests (``rank_windows``: rank 0 holds 10 samples cut 4 + 4 + 2, rank 1 holds
  7 cut 4 + 3; the padded LM gives rank 1 far fewer real tokens) and ``cat``, their union.
* fp16: the padded, low-entropy LM on which a loss scaler loses steps (``lm_batches``), with the
  plain fp16 full-batch loop it is compared with (``plain_full_batch``).
"""

from __future__ import annotations

import copy

import torch
from models import (
    PAD,
    TinyCausalLM,
    causal_lm,
    classification_batch,
    lm_token_loss,
    mean_ce,
    mlp,
    padded_lm_batch,
)

import bigbatch
from bigbatch.core.loss import token_cross_entropy

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
}
MODELS = {"mlp": (mlp, mean_ce), "causal_lm": (causal_lm, lm_token_loss)}
SAMPLES = (10, 7)  # per rank: 4 + 4 + 2 and 4 + 3 at micro_batch_size=4
MICRO = 4
STEPS = 3  # optimizer steps per distributed case
CASES = [(m, o, path) for m in MODELS for o in OPTIMIZERS for path in ("train_step", "low_level")]


def rank_windows(model_name: str, seed: int, samples: tuple[int, ...] = SAMPLES) -> list[list]:
    """``STEPS`` windows, each a list of one batch per rank."""
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(STEPS):
        per_rank = []
        for rank, n in enumerate(samples):
            if model_name == "mlp":
                per_rank.append(classification_batch(n, torch.float64, gen))
            else:
                batch = padded_lm_batch(n, gen)
                if rank == 1:  # far fewer real tokens on rank 1
                    batch["labels"][:, 4:] = PAD
                per_rank.append(batch)
        steps.append(per_rank)
    return steps


def cat(batches: list):
    if isinstance(batches[0], dict):
        return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    return tuple(torch.cat(parts) for parts in zip(*batches, strict=True))


LM_VOCAB, LM_CTX, LM_N, LM_MICRO, LM_STEPS = 50, 64, 16, 2, 6


def lm_batches(seed: int = 1) -> list[dict]:
    """Low-entropy padded sequences; the first micro-batch holds 5 real (shifted) tokens."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(LM_STEPS):
        ids = torch.randint(0, LM_VOCAB, (LM_N, LM_CTX), generator=gen)
        ids[torch.rand(LM_N, LM_CTX, generator=gen) < 0.5] = 0  # a very frequent token
        lengths = torch.randint(LM_CTX - 10, LM_CTX + 1, (LM_N,), generator=gen)
        lengths[:LM_MICRO] = torch.tensor([3, 4])
        labels = ids.clone()
        labels[torch.arange(LM_CTX)[None] >= lengths[:, None]] = PAD
        batches.append({"input_ids": ids, "labels": labels})
    return batches


def lm_loss(model, batch):
    logits = model(batch["input_ids"])
    return token_cross_entropy(logits, batch["labels"], ignore_index=PAD, shift=True)


def lm_count(batch):
    return (batch["labels"][:, 1:] != PAD).sum()


def make_lm() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyCausalLM(vocab=LM_VOCAB, dim=64, heads=4, blocks=2, ctx=LM_CTX)


def plain_full_batch(init, batches, fp16: bool):
    """A plain loop: the token mean of the whole batch, GradScaler, clip, AdamW."""
    model = copy.deepcopy(init)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if fp16 else None
    skipped = []
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss_sum, count = lm_loss(model, batch)
        loss = loss_sum / count
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            skipped.append(False)
        else:
            before = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < before)
        opt.zero_grad(set_to_none=True)
    return model, skipped


def fp16_accumulated(init, batches, low_level: bool = False, mode: str = "count_fn", loss=None):
    """fp16 accumulation; ``mode``: ``count_fn``, ``labels`` (no count_fn, a labels batch) or
    ``tuple`` (no count_fn, an (ids, labels) batch: nothing to count before the window);
    ``loss``: another loss of a labels batch (the chunked head's)."""
    model = copy.deepcopy(init)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = bigbatch.Accumulator(
        model, opt, micro_batch_size=LM_MICRO, max_grad_norm=1.0, precision="fp16"
    )
    skipped = []
    for batch in batches:
        if not low_level:
            if mode == "tuple":
                pair = (batch["input_ids"], batch["labels"])
                loss = lambda m, b: lm_loss(m, {"input_ids": b[0], "labels": b[1]})  # noqa: E731
                skipped.append(acc.train_step(pair, loss).skipped)
            else:
                count_fn = lm_count if mode == "count_fn" else None
                result = acc.train_step(batch, loss or lm_loss, count_fn=count_fn)
                skipped.append(result.skipped)
            continue
        pieces = bigbatch.split(batch, LM_MICRO)
        for i, piece in enumerate(pieces):
            with acc.micro_batch(last=i == len(pieces) - 1):
                acc.backward(*lm_loss(model, piece))
        skipped.append(acc.step().skipped)
    return model, skipped


def distance(a: torch.nn.Module, b: torch.nn.Module) -> float:
    squares = [
        float((p - q).detach().pow(2).sum())
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    ]
    return sum(squares) ** 0.5
