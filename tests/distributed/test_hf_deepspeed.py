"""transformers' Trainer under DeepSpeed (ZeRO-2, its CPU accelerator over gloo): refused in one line.

DeepSpeed's engine runs its own accumulation: ``accelerator.backward`` divides every backward by
the engine's ``gradient_accumulation_steps`` and calls ``engine.step()`` at each boundary, and
ZeRO keeps the gradients in its own partitioned buffers, not in ``.grad``. bigbatch's window (all
of the window's backwards inside its last ``training_step``, normalised in ``.grad`` before the
Trainer's step) would fight it: the engine would step after every micro-batch of the window.
So ``bigbatch.hf.Trainer`` refuses at construction and says what to use, and so does
``bigbatch.hf.audit`` (it reads ``.grad`` after the window); the stock Trainer with the same
arguments is built (DeepSpeed is really on: ``is_deepspeed_enabled``).

``accelerate`` turns DeepSpeed off with ``use_cpu=True``, so these runs pass ``use_cpu=False`` on
a machine without GPUs, which picks DeepSpeed's CPU accelerator. Needs ``pip install -e
".[deepspeed]"`` (skipped without it).
"""

from __future__ import annotations

import os
import warnings

import pytest
from ranks import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from integrations.hf_models import arguments, collate, gpt2, sgd, texts  # noqa: E402

pytestmark = pytest.mark.slow  # a gloo rank with DeepSpeed started in it

ZERO2 = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
         "zero_optimization": {"stage": 2}}  # fmt: skip


def _rank(rank: int, world: int, tmp: str) -> dict:
    import transformers

    import bigbatch.hf

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29503")
    warnings.simplefilter("ignore")
    out: dict = {}
    for name, cls in (("stock", transformers.Trainer), ("bigbatch", bigbatch.hf.Trainer)):
        model = gpt2()
        args = arguments(f"{tmp}/{name}", 2, 3, ddp_backend="gloo", use_cpu=False, deepspeed=ZERO2)
        try:
            trainer = cls(model=model, args=args, train_dataset=texts(12), data_collator=collate,
                          optimizers=sgd(model))  # fmt: skip
        except ValueError as exc:
            out[name] = str(exc)
            continue
        out[name] = trainer.is_deepspeed_enabled
        try:
            bigbatch.hf.audit(trainer)
        except ValueError as exc:
            out["audit"] = str(exc)
    return out


@pytest.fixture(scope="module")
def rank(tmp_path_factory):
    return run_ranks(_rank, str(tmp_path_factory.mktemp("ds")), world_size=1, timeout_s=600)[0]


def test_the_stock_trainer_is_built_with_deepspeed_on(rank):
    assert rank["stock"] is True


def test_bigbatch_trainer_refuses_deepspeed_at_construction(rank):
    assert rank["bigbatch"] == (
        "bigbatch.hf.exact(Trainer) does not run under DeepSpeed: its engine divides every "
        "backward by its own gradient_accumulation_steps, steps inside training_step and keeps "
        "ZeRO's gradients out of .grad (transformers#45305, accelerate#3552). Use FSDP "
        '(fsdp=True, fsdp_config={"version": 2}) or DDP with bigbatch.hf.Trainer, or DeepSpeed '
        "with the stock transformers.Trainer."
    )


def test_the_audit_refuses_deepspeed(rank):
    assert rank["audit"].startswith("bigbatch.hf.audit() does not run under DeepSpeed: ")
