"""A DeepSpeed ZeRO step through bigbatch's window against DeepSpeed's own accumulation, 2 gloo ranks.

Both sides run in the same two processes, interleaved, on the same model, data and ZeRO stage:

* ``deepspeed``: DeepSpeed's managed accumulation, what users write: ``gradient_accumulation_steps
  = k`` and, per micro-batch, ``engine.backward(token mean)`` then ``engine.step()`` (the engine
  divides by k and steps at its boundary);
* ``bigbatch``: ``Accumulator(engine, optimizer).train_step(window, loss, count_fn=...)`` on an
  engine with ``"managed_gradient_accumulation": false``: one ``engine.backward(W · loss_sum / C,
  scale_wrt_gas=False)`` per micro-batch, one ``engine.step()`` (Note [DeepSpeed windows]);
* ``by hand``: that exact loop written out (the count all-reduced, then the same backwards and
  step), to tell DeepSpeed's unmanaged mode from bigbatch's own bookkeeping.

The work is the same k micro-batches of the same shape per step; the time is the median wall time
of an optimizer step on rank 0. DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``).

Usage:
    python benchmarks/deepspeed_windows.py [--steps 8] [--micro 8] [--k 4] [--width 256]
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import queue
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]  # this file is "deepspeed"
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

import bigbatch  # noqa: E402

VOCAB, LENGTH, STAGES = 512, 64, (1, 2, 3)


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mlp = [torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)]
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, width), *mlp, torch.nn.Linear(width, VOCAB)
    )


def _loss(model, batch):
    logits = model(batch["input_ids"]).reshape(-1, VOCAB)
    labels = batch["labels"].reshape(-1)
    loss_sum = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    return loss_sum, (labels != -100).sum()


def _engine(width: int, stage: int, managed: bool, k: int, micro: int):
    import deepspeed

    model = _model(width)
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": k if managed else 1,
        "zero_optimization": {"stage": stage},
        "managed_gradient_accumulation": managed,
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine, optimizer


def _deepspeed_step(engine, pieces: list[dict]) -> None:
    """What users write: each micro-batch's token mean; the engine divides by k, steps at k."""
    for piece in pieces:
        loss_sum, count = _loss(engine, piece)
        engine.backward(loss_sum / count)
        engine.step()


def _by_hand_step(engine, pieces: list[dict]) -> None:
    """The exact window without bigbatch: the global count first, then W · loss_sum / C."""
    count = sum((p["labels"] != -100).sum() for p in pieces).double()
    dist.all_reduce(count)
    for piece in pieces:
        loss_sum, _ = _loss(engine, piece)
        engine.backward(loss_sum * (2 / count), scale_wrt_gas=False)
    engine.step()


def _bigbatch_step(acc, batch: dict) -> None:
    acc.train_step(batch, _loss, count_fn=lambda mb: (mb["labels"] != -100).sum())


def _rank(rank: int, init: str, args, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    os.environ.update(DS_ACCELERATOR="cpu")
    warnings.simplefilter("ignore")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    gen = torch.Generator().manual_seed(rank)
    n = args.k * args.micro
    ids = torch.randint(0, VOCAB, (n, LENGTH), generator=gen)
    labels = ids.masked_fill(torch.rand(n, LENGTH, generator=gen) < 0.3, -100)
    batch = {"input_ids": ids, "labels": labels}
    pieces = [
        {key: v[i : i + args.micro] for key, v in batch.items()} for i in range(0, n, args.micro)
    ]
    rows = []
    for stage in STAGES:
        managed, _ = _engine(args.width, stage, True, args.k, args.micro)
        engine, optimizer = _engine(args.width, stage, False, args.k, args.micro)
        acc = bigbatch.Accumulator(engine, optimizer, micro_batch_size=args.micro)
        by_hand, _ = _engine(args.width, stage, False, args.k, args.micro)
        order = [
            ("deepspeed", functools.partial(_deepspeed_step, managed, pieces)),
            ("bigbatch", functools.partial(_bigbatch_step, acc, batch)),
            ("by_hand", functools.partial(_by_hand_step, by_hand, pieces)),
        ]
        times: dict = {name: [] for name, _ in order}
        for i in range(args.steps + 2):
            for name, step in order[i % 3 :] + order[: i % 3]:  # interleaved, rotating
                dist.barrier()
                t0 = time.perf_counter()
                step()
                if i >= 2:  # warm-up
                    times[name].append(time.perf_counter() - t0)
        rows.append((stage, *(statistics.median(times[name]) for name, _ in order)))
    if rank == 0:
        results.put((rows, sum(p.numel() for p in _model(args.width).parameters())))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_rank, args=(r, init, args, results)) for r in range(2)]
        for p in procs:
            p.start()
        while True:  # a rank that dies (its traceback printed) ends the wait
            try:
                rows, params = results.get(timeout=5)
                break
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise SystemExit("a rank failed") from None
        for p in procs:
            p.join()
    import deepspeed

    print(
        f"2 gloo ranks on CPU ({os.cpu_count()} cores), torch {torch.__version__}, deepspeed "
        f"{deepspeed.__version__} (CPU accelerator), MLP LM of {params / 1e6:.2f} M float32 "
        f"parameters, {args.k} micro-batches of {args.micro} x {LENGTH} tokens per step, AdamW, "
        f"clipping 1.0, median of {args.steps} steps"
    )
    print()
    print(
        "| ZeRO | ms/step DeepSpeed managed | ms/step bigbatch window | ratio (bigbatch / "
        "DeepSpeed) | ms/step exact loop by hand | ratio (by hand / DeepSpeed) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for stage, t_ds, t_bb, t_hand in rows:
        print(
            f"| {stage} | {t_ds * 1e3:.1f} | {t_bb * 1e3:.1f} | {t_bb / t_ds:.3f} "
            f"| {t_hand * 1e3:.1f} | {t_hand / t_ds:.3f} |"
        )


if __name__ == "__main__":
    main()
