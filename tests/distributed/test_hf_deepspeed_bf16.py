"""``bigbatch.hf.Trainer`` under ZeRO 3 in bf16 (``bf16=True``, the config's ``"bf16": "auto"``),
the chunked head included, on 2 gloo ranks: the setting most GPU users run.

DeepSpeed casts the model to bf16 and keeps float32 masters. The stock Trainer (right on GPT-2's
own loss) is run beside it: bigbatch's Trainer ends where it ends, and with ``chunked_head=True``
as close to one float64 process on the union as it is (bf16's rounding: about 2e-2 after two
steps). transformers refuses ``bf16=True`` without a GPU unless ``use_cpu=True``, which turns
DeepSpeed off: these ranks tell it bf16 is available (DeepSpeed's CPU accelerator runs bf16).
"""

from __future__ import annotations

import os

import pytest
import torch
from ranks import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from test_hf_deepspeed import CONFIGURED, _deepspeed_on_cpu, _reference, config  # noqa: E402
from token_lm import environment, gathered, relative_error  # noqa: E402

pytestmark = pytest.mark.slow  # gloo ranks that start DeepSpeed and transformers


def _rank(rank: int, world: int, tmp: str) -> dict:
    import transformers
    import transformers.training_args
    from integrations.hf_models import arguments, collate, gpt2, texts

    import bigbatch.hf

    transformers.training_args.is_torch_bf16_gpu_available = lambda: True  # see the docstring
    environment(rank, world)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29519")
    runs = {
        "stock": (transformers.Trainer, {}),
        "bigbatch": (bigbatch.hf.Trainer, {}),
        "chunked": (bigbatch.hf.Trainer, {"chunked_head": True}),
    }
    out = {}
    for name, (cls, extra) in runs.items():
        _deepspeed_on_cpu()
        ds = {**config(3), "bf16": {"enabled": "auto"}}
        settings = dict(use_cpu=False, deepspeed=ds, accelerator_config=CONFIGURED, bf16=True)
        trainer = cls(
            model=gpt2().float(),
            args=arguments(f"{tmp}/{name}", 2, 3, ddp_backend="gloo", **settings),
            train_dataset=texts(12),
            data_collator=collate,
            optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
            **extra,
        )
        trainer.train()
        engine = trainer.model_wrapped
        assert engine.bfloat16_enabled()
        assert engine.managed_gradient_accumulation() == (name == "stock")
        out[name] = {k: v.float() for k, v in gathered(engine).items()}
    return out


def test_bf16_zero3_trains_as_the_stock_trainer(tmp_path):
    got = run_ranks(_rank, str(tmp_path), timeout_s=900)
    _, want = _reference("gpt2")
    want = {k: v.float() for k, v in want.named_parameters()}
    for rank in got:
        far = {name: relative_error(params, want) for name, params in rank.items()}
        print(f"bf16 ZeRO 3, from one float64 process: {far}")
        assert 1e-3 < far["stock"] < 5e-2  # bf16's rounding, not a wrong step
        assert relative_error(rank["bigbatch"], rank["stock"]) < 1e-3
        assert far["chunked"] < 1.1 * far["stock"]
