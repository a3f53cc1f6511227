"""The rank harness of the transformers Trainer tests: each rank trains the same named runs.

Each rank reads the torchrun variables accelerate reads (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` / ``MASTER_PORT``); the process group is the one ``run_ranks``
already opened. Every run: 12 variable-length samples, 2 per micro-batch, 3 micro-batches per
window on each of 2 ranks, audited at steps 1 and 2 unless its name says "not audited".
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from integrations.hf_models import arguments, collate, sgd, texts


def trainer_runs(
    rank: int,
    world: int,
    tmp: str,
    runs: dict[str, tuple[type, Callable[[], Any]]],
    port: int,
    prepare: Callable[[Any], None] | None = None,
    check: Callable[[Any], None] | None = None,
    data: list | None = None,
    **args: Any,
) -> dict[str, tuple[dict, list]]:
    """``{name: (the trained model's full state dict, the audit's results)}`` on this rank.

    Args:
        rank: this rank.
        world: the number of ranks (each run checks that accelerate sees them all).
        tmp: a folder for the runs' output.
        runs: ``{name: (trainer class, a function making the model)}``.
        port: ``MASTER_PORT`` (each test module its own).
        prepare: called with each trainer before it trains (e.g. an accelerator state).
        check: called with each trainer after it trained.
        data: the samples (``collate``'s), else ``texts(12)``.
        **args: more ``TrainingArguments``.
    """
    import torch
    from torch.distributed.tensor import DTensor

    import bigbatch.hf

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.simplefilter("ignore")
    out = {}
    for name, (cls, make) in runs.items():
        model = make()
        trainer = cls(
            model=model,
            args=arguments(f"{tmp}/{name}", 2, 3, ddp_backend="gloo", **args),
            train_dataset=texts(12) if data is None else data,
            data_collator=collate,
            optimizers=sgd(model),
        )
        assert trainer.accelerator.num_processes == world  # really distributed
        if prepare is not None:
            prepare(trainer)
        audited = "not audited" not in name
        report = bigbatch.hf.audit(trainer, steps=(1, 2)) if audited else None
        trainer.train()
        if check is not None:
            check(trainer)
        state = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in trainer.model.state_dict().items()
        }
        out[name] = (state, report.results if report is not None else [])
        del trainer
        torch.distributed.barrier()
    return out
