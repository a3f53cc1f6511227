"""In-batch negatives at a big batch: full batch, plain accumulation, cached_loss, sentence-transformers.

One process, one sentence-transformers model (a small BERT built from a transformers config with
random weights and a tokenizer made here: no download), one loss -- sentence-transformers'
MultipleNegativesRankingLoss: cross-entropy of 20 x cos(query, document) over the batch's
documents -- and one optimizer step of a batch of ``--batch`` (query, document) pairs, four ways:

* (a) full batch: the whole batch in one forward and backward (a hand-written loop);
* (b) plain accumulation: ``Accumulator.train_step`` with the loss per micro-batch of ``--micro``:
  each query sees only its micro-batch's documents as negatives -- a different loss, inexact;
* (c) ``bigbatch.cached_loss`` in micro-batches of ``--micro``: exact;
* (d) ``CachedMultipleNegativesRankingLoss(mini_batch_size=--micro)`` of sentence-transformers,
  when it is installed (``pip install "bigbatch[compare]"``; without it the same BERT with mean
  pooling runs (a)-(c)).

Wall-clock and CPU time per step (medians of ``--repeats`` steps after one warm-up, taken
round-robin over the methods, float32, AdamW; CPU time is this process's, so other jobs on a
shared machine disturb it less) and peak memory of a step (``bigbatch.measure_peak``: on the CPU
the resident-set high-water mark above what was in use before the step: activations, gradients,
the loss) are measured side by side. (d) embeds one column (queries, then documents) per
mini-batch, (b) and (c) both towers of a micro-batch at once, hence (d)'s lower peak. The error
column is the relative difference of each method's parameter update from (a)'s after one plain
SGD step in float64 (dropout off, so the comparison is deterministic): the gradient's error.

Run:
    PYTHONPATH=src python benchmarks/contrastive.py            # CPU, batch 512 at 32 (minutes)
    PYTHONPATH=src python benchmarks/contrastive.py --quick    # seconds (the smoke test's size)
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import device_name, mib, peak_bytes, print_table  # noqa: E402

import bigbatch  # noqa: E402
from bigbatch.core.peak import small_mmap_threshold  # noqa: E402

HAS_SENTENCE_TRANSFORMERS = importlib.util.find_spec("sentence_transformers") is not None
SCALE = 20.0  # MultipleNegativesRankingLoss's default (temperature 0.05)
ST_ROW = "(d) sentence-transformers Cached MNRL"
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def build_model(args: argparse.Namespace, folder: str) -> nn.Module:
    """A SentenceTransformer (BERT + mean pooling) saved to and loaded from ``folder``, offline."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    from transformers import BertConfig, BertModel, BertTokenizerFast
    from transformers.utils import logging

    logging.disable_progress_bar()

    words = SPECIAL + [f"w{i}" for i in range(args.vocab)]
    Path(folder, "vocab.txt").write_text("\n".join(words) + "\n")
    BertTokenizerFast(vocab_file=str(Path(folder, "vocab.txt"))).save_pretrained(folder)
    config = BertConfig(
        vocab_size=len(words), hidden_size=args.dim, num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.dim // 32), intermediate_size=4 * args.dim,
        max_position_embeddings=max(64, args.seq), hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    BertModel(config).save_pretrained(folder)
    if not HAS_SENTENCE_TRANSFORMERS:
        return MeanPooled(BertModel.from_pretrained(folder))
    from sentence_transformers import SentenceTransformer, models

    transformer = models.Transformer(folder, max_seq_length=args.seq)
    pooling = models.Pooling(transformer.get_word_embedding_dimension(), "mean")
    return SentenceTransformer(modules=[transformer, pooling], device="cpu")


class MeanPooled(nn.Module):
    """BERT + mean pooling, called like a SentenceTransformer (when that is not installed)."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, features: dict) -> dict:
        mask = features["attention_mask"]
        hidden = self.bert(input_ids=features["input_ids"], attention_mask=mask).last_hidden_state
        weights = mask[..., None].to(hidden.dtype)
        return {"sentence_embedding": (hidden * weights).sum(1) / weights.sum(1).clamp_min(1e-9)}


def make_batch(args: argparse.Namespace, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Token ids of ``--batch`` queries and documents sharing words, padded to ``--seq``."""
    n, seq, first = args.batch, args.seq, len(SPECIAL)
    topic = torch.randint(first, first + args.vocab, (n, 8), generator=gen)
    batch = {}
    for side in ("q", "d"):
        words = topic.gather(1, torch.randint(0, 8, (n, seq - 2), generator=gen))
        lengths = torch.randint(seq // 2, seq - 1, (n,), generator=gen)
        mask = torch.arange(seq - 2)[None, :] < lengths[:, None]
        ids = torch.cat([torch.full((n, 1), 2), words.masked_fill(~mask, 0), torch.zeros(n, 1)], 1)
        ids[torch.arange(n), lengths + 1] = 3  # [SEP]
        batch[f"{side}_ids"] = ids.long()
        batch[f"{side}_mask"] = (ids != 0).long()
    return batch


def encode(model: nn.Module, micro: dict) -> tuple[torch.Tensor, torch.Tensor]:
    embed = lambda side: model(  # noqa: E731
        {"input_ids": micro[f"{side}_ids"], "attention_mask": micro[f"{side}_mask"]}
    )["sentence_embedding"]
    return embed("q"), embed("d")


def ranking_loss(reps: tuple[torch.Tensor, torch.Tensor], batch: Any = None) -> torch.Tensor:
    """MultipleNegativesRankingLoss: each query against every document of the batch."""
    q, d = reps
    scores = SCALE * F.normalize(q, dim=-1) @ F.normalize(d, dim=-1).T
    return F.cross_entropy(scores, torch.arange(len(q), device=q.device))


def methods(
    args: argparse.Namespace,
) -> dict[str, Callable[[nn.Module, Any], Callable[[Any], Any]]]:
    """name -> make(model, optimizer) -> step(batch): one optimizer step on the whole batch."""

    def full(model, opt):
        def step(batch):
            opt.zero_grad(set_to_none=True)
            ranking_loss(encode(model, batch)).backward()
            opt.step()

        return step

    def accumulated(loss_fn):
        def make(model, opt):
            acc = bigbatch.Accumulator(model, opt, micro_batch_size=args.micro)
            return lambda batch: acc.train_step(batch, loss_fn)

        return make

    def sentence_transformers(model, opt):
        from sentence_transformers.sentence_transformer.losses import (
            CachedMultipleNegativesRankingLoss,
        )

        loss = CachedMultipleNegativesRankingLoss(model, scale=SCALE, mini_batch_size=args.micro)

        def step(batch):
            opt.zero_grad(set_to_none=True)
            features = [
                {"input_ids": batch[f"{s}_ids"], "attention_mask": batch[f"{s}_mask"]} for s in "qd"
            ]
            loss(features, None).backward()
            opt.step()

        return step

    found = {
        "(a) full batch": full,
        "(b) plain accumulation": accumulated(lambda m, mb: ranking_loss(encode(m, mb))),
        "(c) bigbatch.cached_loss": accumulated(bigbatch.cached_loss(encode, ranking_loss)),
        ST_ROW: sentence_transformers,
    }
    return found if HAS_SENTENCE_TRANSFORMERS else {k: v for k, v in found.items() if k != ST_ROW}


def update_errors(args: argparse.Namespace, model: nn.Module, batch: dict) -> dict[str, float]:
    """Per method: ``‖Δθ − Δθ_full‖ / ‖Δθ_full‖`` after one SGD step (lr 1) in float64."""
    start = copy.deepcopy(model).double()
    before = torch.cat([p.detach().flatten() for p in start.parameters()])
    updates = {}
    for name, make in methods(args).items():
        work = copy.deepcopy(start)
        make(work, torch.optim.SGD(work.parameters(), lr=1.0))(batch)
        updates[name] = torch.cat([p.detach().flatten() for p in work.parameters()]) - before
    want = updates["(a) full batch"]
    return {k: float((u - want).norm() / want.norm()) for k, u in updates.items()}


def measure(
    args: argparse.Namespace, model: nn.Module, batch: dict
) -> dict[str, tuple[float, float, int]]:
    """Per method: median (wall seconds, CPU seconds) per step and the peak bytes of a step.

    The timed steps go round-robin over the methods (a, b, c, d, a, b, ...), so that a change in
    the machine's load hits every method alike; CPU seconds (this process's threads, user +
    system) are what a step costs, whatever else runs on the machine.
    """
    steps, peaks = {}, {}
    for name, make in methods(args).items():
        work = copy.deepcopy(model)
        steps[name] = make(work, torch.optim.AdamW(work.parameters(), lr=1e-4))
        steps[name](batch)  # warm-up: optimizer state, allocator, autograd
        peaks[name] = peak_bytes(lambda step=steps[name]: step(batch), "cpu")
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            started, cpu_started = time.perf_counter(), time.process_time()
            step(batch)
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - cpu_started)
    median = statistics.median
    return {name: (median(wall[name]), median(cpu[name]), peaks[name]) for name in steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--micro", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--quick", action="store_true", help="batch 32 at 8, 1 layer of 32, 1 repeat"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.micro, args.layers, args.dim, args.seq, args.repeats = 32, 8, 1, 32, 12, 1
    small_mmap_threshold().__enter__()  # freed activations go back at once: honest CPU peaks
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as folder:
        model = build_model(args, folder)
    batch = make_batch(args, torch.Generator().manual_seed(1))
    errors = update_errors(args, model, batch)
    timings = measure(args, model, batch)
    report(args, errors, timings)
    return 0


def report(args: argparse.Namespace, errors: dict, timings: dict) -> None:
    full_s, full_cpu, _ = timings["(a) full batch"]
    plain_peak = timings["(b) plain accumulation"][2]
    rows = []
    for name, (seconds, cpu, peak) in timings.items():
        negatives = args.micro - 1 if name.startswith("(b)") else args.batch - 1
        rows.append([name, negatives, f"{seconds:.2f}", f"{seconds / full_s:.2f}x", f"{cpu:.2f}",
                     f"{cpu / full_cpu:.2f}x", mib(peak), f"{peak / max(plain_peak, 1):.2f}x",
                     f"{errors[name]:.1e}"])  # fmt: skip
    if not HAS_SENTENCE_TRANSFORMERS:
        rows.append([ST_ROW, *["-"] * 7, 'not installed: pip install "bigbatch[compare]"'])
    print_table(
        f"Batch {args.batch} at micro-batch {args.micro}, BERT {args.layers} x {args.dim}, "
        f"{args.seq} tokens, on {device_name('cpu')}",
        [
            "method",
            "negatives per query",
            "s / step",
            "vs (a)",
            "CPU s / step",
            "vs (a)",
            "peak",
            "peak vs (b)",
            "update error vs (a), float64",
        ],  # fmt: skip
        rows,
    )
    seconds, cpu, peak = timings["(c) bigbatch.cached_loss"]
    exact = errors["(c) bigbatch.cached_loss"]
    print(f"\n(c) exact to 1e-10 in float64: {'yes' if exact < 1e-10 else 'NO'} ({exact:.1e}); "
          f"peak {peak / max(plain_peak, 1):.2f}x (b)'s (target <= 1.2x); "
          f"time {seconds / full_s:.2f}x (a)'s, CPU time {cpu / full_cpu:.2f}x (target <= 1.5x)")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
