"""``bigbatch.hf.Trainer`` under DeepSpeed with the settings GPU users run, on 2 gloo ranks:
clipping (``max_grad_norm``, the config's ``"gradient_clipping": "auto"``) under ZeRO 1, 2 and 3,
and ZeRO 3 in bf16 (``bf16=True``, the config's ``"bf16": "auto"``), the chunked head included.

Clipping is the engine's, at the norm of the window's whole gradient: the run equals one float64
process clipping its one-batch gradient, and the logged ``grad_norm`` is that process's norm
before clipping (float32's 1e-6).

In bf16 DeepSpeed casts the model to bf16 and keeps float32 masters. The stock Trainer (right on GPT-2's
own loss) is run beside it: bigbatch's Trainer ends where it ends, and with ``chunked_head=True``
as close to one float64 process on the union as it is (bf16's rounding: about 2e-2 after two
steps). transformers refuses ``bf16=True`` without a GPU unless ``use_cpu=True``, which turns
DeepSpeed off: these ranks tell it bf16 is available (DeepSpeed's CPU accelerator runs bf16).
"""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from integrations.hf_models import collate, gpt2, texts  # noqa: E402
from integrations.test_hf import counted  # noqa: E402
from test_hf_deepspeed import _reference, config, zero_trainer  # noqa: E402
from token_lm import environment, gathered, relative_error  # noqa: E402

pytestmark = pytest.mark.slow  # gloo ranks that start DeepSpeed and transformers


def _rank(rank: int, world: int, tmp: str) -> dict:
    import transformers
    import transformers.training_args

    import bigbatch.hf

    transformers.training_args.is_torch_bf16_gpu_available = lambda: True  # see the docstring
    environment(rank, world, port=29519)
    runs = {
        "stock": (transformers.Trainer, {}),
        "bigbatch": (bigbatch.hf.Trainer, {}),
        "chunked": (bigbatch.hf.Trainer, {"chunked_head": True}),
    }
    out = {}
    for name, (cls, extra) in runs.items():
        ds = {**config(3), "bf16": {"enabled": "auto"}}
        trainer = zero_trainer(cls, f"{tmp}/{name}", ds, args={"bf16": True}, **extra)
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


CLIP = 0.05  # well under the gradient's norm (about 0.62): every step clips


def _clipped(rank: int, world: int, tmp: str) -> dict:
    import bigbatch.hf

    environment(rank, world, port=29521)
    out = {}
    for stage in (1, 2, 3):
        args = dict(max_grad_norm=CLIP, logging_strategy="steps", logging_steps=1)
        trainer = zero_trainer(bigbatch.hf.Trainer, f"{tmp}/zero{stage}", config(stage), args=args)
        trainer.train()
        norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
        out[stage] = {"params": gathered(trainer.model_wrapped), "norms": norms}
    return out


def _clipped_reference() -> tuple[dict, list[float]]:
    """One process, float64: two steps on the whole batch, clipped at ``CLIP``."""
    model = gpt2().float().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batch, norms = collate(texts(12)), []
    for _ in range(2):
        optimizer.zero_grad()
        counted(model, batch).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
    return {k: v.detach() for k, v in model.named_parameters()}, norms


def test_the_engine_clips_the_windows_gradient_and_the_trainer_logs_its_norm(tmp_path):
    got = run_ranks(_clipped, str(tmp_path), timeout_s=900)
    want, norms = _clipped_reference()
    assert min(norms) > 10 * CLIP
    for rank in got:
        for stage, run in rank.items():
            error = relative_error({k: v.double() for k, v in run["params"].items()}, want)
            print(f"ZeRO-{stage} clipped at {CLIP}: {error:.1e}, grad_norm {run['norms']}")
            assert error < 1e-6
            assert run["norms"] == pytest.approx(norms, rel=1e-6)
