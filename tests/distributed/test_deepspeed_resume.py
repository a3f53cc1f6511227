"""Resume under DeepSpeed: killed after a checkpoint, restarted in new processes, bitwise.

The engine's own checkpoint holds the model, the optimizer (ZeRO's float32 partitions and their
moments) and the scheduler; ``Accumulator.state_dict()`` (the micro-batch sizing) rides in its
``client_state``. Two gloo ranks train four windows uninterrupted; two others train two, save,
and die by ``os._exit`` (no cleanup); two fresh processes build a model from OTHER weights, load
the checkpoint and train the last two windows. The parameters equal the uninterrupted run's bit
for bit, and so do the last windows' losses and the learning rate. The same for
``bigbatch.hf.Trainer`` under accelerate's DeepSpeed plugin, whose checkpoints are transformers'
(``save_steps``, ``train(resume_from_checkpoint=...)``), and, for comparison, on one process
without DeepSpeed. Needs DeepSpeed (``pip install -e ".[deepspeed]"``; skipped without it).
"""

from __future__ import annotations

import os

import pytest
import torch
from ranks import killed_ranks, run_ranks

pytest.importorskip("deepspeed")

from token_lm import MICRO, engine, environment, gathered, model, token_loss, windows  # noqa: E402

import bigbatch  # noqa: E402

pytestmark = pytest.mark.slow  # gloo ranks that start DeepSpeed, killed and started again

KILLED = 17  # the exit code of a rank killed after the checkpoint
SAMPLES = (10, 6, 8, 9)  # per rank, window by window
SAVED_AT = 2  # windows (optimizer steps) before the checkpoint
STAGES = (1, 2, 3)


def _accumulator(stage: int, seed: int):
    """A ZeRO engine over AdamW with an LR schedule of its own, cut by tokens (a count pass)."""
    m = model(seed)
    optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.7**step)
    eng, optimizer = engine(m, optimizer, stage, scheduler=scheduler, gradient_clipping=1.0)
    return eng, bigbatch.Accumulator(eng, optimizer, micro_batch_tokens=5 * MICRO)


def _train_accumulator(rank: int, world: int, folder: str, phase: str) -> dict:
    """Each ZeRO stage in turn in the same processes (its own engine and checkpoint folder)."""
    environment(rank, world)
    out = {stage: _windows(rank, world, stage, f"{folder}/zero{stage}", phase) for stage in STAGES}
    if phase == "killed":
        torch.distributed.barrier()
        os._exit(KILLED)
    return out


def _windows(rank: int, world: int, stage: int, folder: str, phase: str) -> dict | None:
    eng, acc = _accumulator(stage, seed=1 if phase == "resumed" else 0)
    start, stop = 0, SAVED_AT if phase == "killed" else len(SAMPLES)
    if phase == "resumed":
        _, client = eng.load_checkpoint(folder)
        acc.load_state_dict(client["bigbatch"])
        start = client["windows"]
    data = windows(seed=stage, world=world, samples=SAMPLES)[start:stop]
    losses = [acc.train_step(per_rank[rank], token_loss).loss for per_rank in data]
    if phase == "killed":
        eng.save_checkpoint(folder, client_state={"bigbatch": acc.state_dict(), "windows": stop})
        return None
    lr = eng.get_lr()[0]
    return {"params": gathered(eng), "losses": losses, "steps": eng.global_steps, "lr": lr}


def _resumed(fn, folder, *args, world: int = 2):
    """The uninterrupted run, then the killed one and its restart in new processes."""
    ranks = dict(world_size=world, timeout_s=600)
    whole = run_ranks(fn, *args, f"{folder}/whole", "whole", **ranks)
    killed_ranks(fn, *args, f"{folder}/run", "killed", **ranks)
    return whole, run_ranks(fn, *args, f"{folder}/run", "resumed", **ranks)


def _assert_bitwise(whole: dict, resumed: dict) -> None:
    for name, want in whole["params"].items():
        assert torch.equal(resumed["params"][name], want), name
    assert resumed["losses"] == whole["losses"][SAVED_AT:]
    assert resumed["steps"] == whole["steps"] and resumed["lr"] == whole["lr"]


@pytest.fixture(scope="module")
def accumulators(tmp_path_factory):
    return _resumed(_train_accumulator, str(tmp_path_factory.mktemp("accumulators")))


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"zero{s}")
def test_the_accumulator_resumes_from_the_engines_checkpoint_bitwise(accumulators, stage):
    whole, resumed = accumulators
    for w, r in zip(whole, resumed, strict=True):
        assert w[stage]["steps"] == len(SAMPLES)
        assert w[stage]["lr"] == pytest.approx(1e-2 * 0.7 ** len(SAMPLES))
        _assert_bitwise(w[stage], r[stage])


def _train_trainer(rank: int, world: int, stage: int | None, folder: str, phase: str):
    """``bigbatch.hf.Trainer`` on GPT-2 cut by tokens, AdamW with a linear schedule, a
    checkpoint every 2 steps; killed in ``on_save`` at step 2, resumed from ``checkpoint-2``."""
    from integrations.hf_models import gpt2
    from test_hf_deepspeed import config, zero_trainer
    from transformers import TrainerCallback

    import bigbatch.hf

    environment(rank, world, port=29517)
    settings = dict(max_steps=4, save_strategy="steps", save_steps=SAVED_AT)
    settings.update(lr_scheduler_type="linear", max_grad_norm=1.0)
    trainer = zero_trainer(
        bigbatch.hf.Trainer,
        folder,
        None if stage is None else config(stage),
        model=gpt2(seed=1 if phase == "resumed" else 0).float(),
        optimizer=(torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
        args=settings,
        micro_batch_tokens=20,
    )
    losses: list = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            losses.append(trainer.bigbatch_window.last.loss)

        def on_save(self, args, state, control, **kwargs):
            if phase == "killed" and state.global_step == SAVED_AT:
                torch.distributed.barrier()
                os._exit(KILLED)

    trainer.add_callback(Record())
    trainer.train(resume_from_checkpoint=f"{folder}/checkpoint-2" if phase == "resumed" else None)
    engine = trainer.model_wrapped
    params = gathered(engine) if stage is not None else dict(trainer.model.named_parameters())
    params = {k: v.detach().clone() for k, v in params.items()}
    lr = trainer.lr_scheduler.get_last_lr()[0]
    return {"params": params, "losses": losses, "steps": trainer.state.global_step, "lr": lr}


@pytest.mark.parametrize(("stage", "world"), [(3, 2), (None, 1)], ids=["zero3", "one process"])
def test_the_trainer_resumes_from_its_checkpoint_bitwise(stage, world, tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    whole, resumed = _resumed(_train_trainer, str(tmp_path), stage, world=world)
    for w, r in zip(whole, resumed, strict=True):
        assert w["steps"] == 4 and len(w["losses"]) == 4
        _assert_bitwise(w, r)
