"""The CUDA tier: the engine's paths where its users train (``-m gpu``; skipped without CUDA).

Each test runs a path on the GPU and compares it with the same run unaccumulated: exactness in
float64 (~1e-10) and float32 with TF32 off (~1e-5), bf16 and fp16 autocast (the loss scaler) to
their rounding, with a naive accumulation beside them to show the tolerance would catch a wrong
step; ``micro_batch_size="auto"`` against a real CUDA out-of-memory error under a memory cap; peaks
read from the CUDA allocator; checkpoint offload between the GPU and the host; token windows
under Inductor; and one host synchronisation per window (``set_sync_debug_mode``).

Run on a machine with a GPU:

    python -m pytest -m gpu -q -p no:cacheprovider tests/test_cuda.py tests/core tests/memory

``BIGBATCH_GPU_TIER=cpu`` runs this file's tests on the CPU instead (the CUDA-only ones skip):
a check of the tests themselves where no GPU is at hand.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from cases import OPTIMIZERS
from models import (
    PAD,
    VOCAB,
    causal_lm,
    classification_batch,
    lm_token_loss,
    mean_ce,
    mlp,
    padded_lm_batch,
)
from reference import full_batch_step, max_relative_error

import bigbatch

DEVICE = torch.device(os.environ.get("BIGBATCH_GPU_TIER", "cuda"))
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs CUDA"
    ),
]
MODELS = {
    "mlp": (mlp, classification_batch, mean_ce),
    "causal_lm": (causal_lm, None, lm_token_loss),
}


def per_token(dtype: torch.dtype) -> torch.nn.Module:
    """Logits from each token alone (no attention: nothing in the model itself syncs)."""
    torch.manual_seed(0)
    embed = torch.nn.Embedding(VOCAB, 16)
    return torch.nn.Sequential(embed, torch.nn.Tanh(), torch.nn.Linear(16, VOCAB)).to(dtype)


def _token_loss(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return bigbatch.token_cross_entropy(model(batch["input_ids"]), batch["labels"], shift=True)


def _wide(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples of 256 float64 features on the device, 10 classes."""
    x = torch.randn(n, 256, generator=gen, dtype=torch.float64)
    return x.to(DEVICE), torch.randint(0, 10, (n,), generator=gen).to(DEVICE)


def _cuda_only() -> None:
    if DEVICE.type != "cuda":
        pytest.skip("reads CUDA itself (the allocator, its memory cap, its sync debug mode)")


@pytest.fixture(autouse=True)
def _no_tf32():
    """float32 matrix products in float32 (TF32 would round them to 10 bits), restored after."""
    if DEVICE.type != "cuda":
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _batch(name: str, n: int, dtype: torch.dtype, gen: torch.Generator):
    make = MODELS[name][1]
    batch = make(n, dtype, gen) if make is not None else padded_lm_batch(n, gen)
    return _to(batch)


def _to(batch):
    if isinstance(batch, dict):
        return {k: v.to(DEVICE) for k, v in batch.items()}
    return tuple(t.to(DEVICE) for t in batch)


def _update_error(init, ours, theirs) -> float:
    """``‖Δours - Δtheirs‖ / ‖Δtheirs‖`` over all parameters (Δ: the change from ``init``)."""
    diffs, sizes = [], []
    for p0, a, b in zip(init.parameters(), ours.parameters(), theirs.parameters(), strict=True):
        diffs.append((a - b).detach().double().flatten())
        sizes.append((b - p0).detach().double().flatten())
    return float(torch.cat(diffs).norm() / torch.cat(sizes).norm())


# ------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize(
    "model_name, opt_name, dtype, tolerance",
    [
        ("mlp", "sgd_momentum", torch.float64, 1e-10),
        ("mlp", "adamw", torch.float64, 1e-10),
        ("causal_lm", "sgd_momentum", torch.float64, 1e-10),
        ("causal_lm", "adamw", torch.float64, 1e-10),
        ("mlp", "sgd_momentum", torch.float32, 1e-5),
        ("causal_lm", "sgd_momentum", torch.float32, 1e-5),
    ],
)
def test_train_step_equals_the_full_batch(model_name, opt_name, dtype, tolerance, gen):
    """10 samples cut 4 + 4 + 2 (unequal tokens for the LM), three steps, clipping on."""
    make_model, _, loss_fn = MODELS[model_name]
    ref = make_model(dtype).to(DEVICE)
    ours = copy.deepcopy(ref)
    ref_opt, our_opt = (OPTIMIZERS[opt_name](m.parameters()) for m in (ref, ours))
    acc = bigbatch.Accumulator(ours, our_opt, micro_batch_size=4, max_grad_norm=1.0)
    for _ in range(3):
        batch = _batch(model_name, 10, dtype, gen)
        full_batch_step(ref, ref_opt, loss_fn, batch, max_grad_norm=1.0)
        result = acc.train_step(batch, loss_fn)
        assert result.micro_batches == 3
    assert max_relative_error(ref, ours) < tolerance


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_accumulated_equals_the_run_unaccumulated(precision):
    """The same ``Accumulator`` in bf16 / fp16 autocast (fp16: with the loss scaler), the window
    cut 2 + 2 + 2 + 2 + 2 against the window whole: equal to the precision's rounding, where
    averaging the micro-batches' token means (what a plain loop does) is far off."""
    init = causal_lm(torch.float32).to(DEVICE)
    runs = {}
    for name, micro in (("whole", 10), ("accumulated", 2)):
        model = copy.deepcopy(init)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        acc = bigbatch.Accumulator(model, opt, micro_batch_size=micro, precision=precision)
        _low_scale(acc)
        results = [acc.train_step(_lm_text(gen_at(step)), lm_token_loss) for step in range(3)]
        runs[name] = model, [r.skipped for r in results]
    naive = _mean_of_means(init, precision)
    error = _update_error(init, runs["accumulated"][0], runs["whole"][0])
    wrong = _update_error(init, naive, runs["whole"][0])
    assert runs["accumulated"][1] == runs["whole"][1] == [False] * 3, runs
    assert error < 2e-2 and wrong > 10 * error, (error, wrong)


SCALE = 2.0**8  # the loss scale both runs start from: no overflow in either, so none skips


def _low_scale(acc: bigbatch.Accumulator) -> None:
    """Start an fp16 ``Accumulator``'s loss scaler at ``SCALE`` (through its public state)."""
    state = acc.state_dict()
    if state["scaler"] is not None:
        state["scaler"]["scale"] = SCALE
        acc.load_state_dict(state)


def gen_at(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(100 + step)


def _lm_text(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Very uneven real lengths: the first two samples hold 2 tokens, the others 12."""
    batch = padded_lm_batch(10, gen)
    batch["labels"][:2, 2:] = PAD
    batch["labels"][2:] = batch["input_ids"][2:]
    return _to(batch)


def _mean_of_means(init: torch.nn.Module, precision: str) -> torch.nn.Module:
    """A plain loop's accumulation: each micro-batch's token mean / k, in the same autocast."""
    model = copy.deepcopy(init)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=SCALE, enabled=precision == "fp16")
    for step in range(3):
        pieces = bigbatch.split(_lm_text(gen_at(step)), 2)
        for piece in pieces:
            with torch.autocast(DEVICE.type, dtype=dtype):
                loss_sum, count = lm_token_loss(model, piece)
            scaler.scale(loss_sum / count / len(pieces)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return model


# --------------------------------------------------------------------------------- memory
def _mlp64(features: int = 256, hidden: int = 1024) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(features, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, hidden),
        torch.nn.GELU(), torch.nn.Linear(hidden, 10),
    ).to(DEVICE, torch.float64)  # fmt: skip


def test_auto_finds_the_micro_batch_against_a_real_cuda_oom_and_stays_exact(gen):
    """A memory cap (``set_per_process_memory_fraction``) the whole batch cannot run under: the
    allocator raises ``torch.OutOfMemoryError``, ``auto`` redoes the window smaller, and the step
    equals the unaccumulated one."""
    _cuda_only()
    model = _mlp64()
    batches = [_wide(4096, gen) for _ in range(2)]
    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    ref_opt, our_opt = (OPTIMIZERS["sgd_momentum"](m.parameters()) for m in (ref, ours))
    with bigbatch.measure_peak(DEVICE) as peak:
        full_batch_step(ref, ref_opt, mean_ce, batches[0])
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    full_batch_step(ref, ref_opt, mean_ce, batches[1])
    acc = bigbatch.Accumulator(ours, our_opt, micro_batch_size="auto")
    acc.train_step(batches[0], mean_ce)  # uncapped: the momentum buffers exist before the cap
    torch.cuda.empty_cache()
    # the gradients and 30% of the activations (the first step's peak also made the momentum)
    cap = torch.cuda.memory_reserved(DEVICE) + grads + 0.3 * (peak.peak_bytes - 2 * grads)
    total = torch.cuda.get_device_properties(DEVICE).total_memory
    torch.cuda.set_per_process_memory_fraction(cap / total, DEVICE)
    try:
        result = acc.train_step(batches[1], mean_ce)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, DEVICE)
        torch.cuda.empty_cache()
    assert result.oom_retries >= 1 and result.micro_batch_size < 4096, result
    assert max_relative_error(ref, ours) < 1e-10


def test_peaks_come_from_the_cuda_allocator(gen):
    """The window's peak (``StepResult.peak_bytes``, measured with a budget) is the allocator's:
    it matches ``measure_peak`` around the same micro-batches in a plain loop, and grows with
    the micro-batch."""
    _cuda_only()
    peaks, batch = {}, _wide(2048, gen)
    for micro in (256, 1024):
        model, plain = _mlp64(), _mlp64()
        acc = bigbatch.Accumulator(
            model, torch.optim.SGD(model.parameters(), lr=0.01), micro_batch_size=micro,
            memory_budget="64GiB",
        )  # fmt: skip
        acc.train_step(batch, mean_ce)  # warm: the allocator's pools
        peaks[micro] = acc.train_step(batch, mean_ce).peak_bytes
        with bigbatch.measure_peak(DEVICE) as by_hand:  # the window's part: no optimizer step
            for piece in bigbatch.split(batch, micro):
                (mean_ce(plain, piece) * (micro / 2048)).backward()
        assert peaks[micro] == pytest.approx(by_hand.peak_bytes, rel=0.1), (peaks, by_hand)
    hidden = 2 * 1024 * 8  # two hidden layers' outputs per sample, float64
    assert peaks[1024] > peaks[256] + 0.5 * (1024 - 256) * hidden, peaks


def test_checkpoint_offload_with_accumulation_equals_the_full_batch(gen):
    """``policy="offload"`` keeps the blocks' inputs in host memory and brings them back for the
    backward: the accumulated step still equals the plain full batch (float64)."""
    _cuda_only()
    ref = _mlp64(hidden=512)
    ours = bigbatch.enable_checkpointing(copy.deepcopy(ref), blocks=["0", "2"], policy="offload")
    ref_opt, our_opt = (OPTIMIZERS["adamw"](m.parameters()) for m in (ref, ours))
    acc = bigbatch.Accumulator(ours, our_opt, micro_batch_size=3)
    for _ in range(2):
        batch = _wide(10, gen)
        full_batch_step(ref, ref_opt, mean_ce, batch)
        acc.train_step(batch, mean_ce)
    assert max_relative_error(ref, ours) < 1e-10


# ----------------------------------------------------------------------------- compiled
def test_token_windows_under_inductor_equal_the_eager_full_batch(gen):
    """A compiled causal LM (Inductor), cut by tokens into buckets of one shape each
    (``pad_to_multiple_of``), against the eager model's full-batch step, float64."""
    ref = causal_lm(torch.float64).to(DEVICE)
    ours = copy.deepcopy(ref)
    ref_opt, our_opt = (OPTIMIZERS["adamw"](m.parameters()) for m in (ref, ours))
    backend = "inductor" if DEVICE.type == "cuda" else "eager"  # (the CPU check: no compiler)
    acc = bigbatch.Accumulator(
        torch.compile(ours, backend=backend), our_opt, micro_batch_tokens=36, pad_to_multiple_of=4
    )
    for _ in range(2):
        batch = _lm_text(gen)
        batch["attention_mask"] = (batch["labels"] != PAD).long()
        batch["attention_mask"][:, 0] = 1
        full_batch_step(ref, ref_opt, lm_token_loss, batch)
        result = acc.train_step(batch, lm_token_loss)
        assert result.micro_batches > 1 and result.padded_tokens > result.tokens
    assert max_relative_error(ref, ours) < 1e-9


# --------------------------------------------------------------------------- host syncs
def _syncs(acc: bigbatch.Accumulator, run) -> int:
    """Host synchronisations of ``run()`` counted by CUDA's sync debug mode ("warn"), the
    optimizer's own step left out (as in test_host_syncs.py)."""
    hooks = [
        acc.optimizer.register_step_pre_hook(lambda *_: torch.cuda.set_sync_debug_mode(0)),
        acc.optimizer.register_step_post_hook(lambda *_: torch.cuda.set_sync_debug_mode("warn")),
    ]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        for hook in hooks:
            hook.remove()
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("loss", ["samples", "tokens"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_window_waits_for_the_gpu_once(loss, precision, gen):
    """``train_step`` of 5 micro-batches: one host synchronisation, at the step."""
    _cuda_only()
    model = (mlp if loss == "samples" else per_token)(torch.float32).to(DEVICE)
    acc = bigbatch.Accumulator(
        model, torch.optim.AdamW(model.parameters()), micro_batch_size=2, max_grad_norm=1.0,
        precision=precision,
    )  # fmt: skip
    batch = _batch("mlp", 10, torch.float32, gen) if loss == "samples" else _lm_text(gen)
    loss_fn = mean_ce if loss == "samples" else _token_loss
    acc.train_step(batch, loss_fn)  # warm: the optimizer's state
    assert _syncs(acc, lambda: acc.train_step(batch, loss_fn)) == 1


def test_micro_batches_never_wait_for_the_gpu(gen):
    """The low-level path under ``set_sync_debug_mode("error")``: any synchronisation in a
    micro-batch's forward or backward raises; the step then reads the device once."""
    _cuda_only()
    model = per_token(torch.float32).to(DEVICE)
    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=1.0
    )
    pieces = [_to(padded_lm_batch(n, gen)) for n in (4, 4, 2)]
    for _ in range(2):
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i, piece in enumerate(pieces):
                with acc.micro_batch(last=i == len(pieces) - 1):
                    acc.backward(*_token_loss(model, piece))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert _syncs(acc, acc.step) == 1


def test_the_sync_count_sees_a_read_per_micro_batch(gen):
    """The count is not blind: ``.item()`` in the loss costs one synchronisation per micro-batch."""
    _cuda_only()
    model = mlp(torch.float32).to(DEVICE)
    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=2
    )
    batch = _batch("mlp", 10, torch.float32, gen)

    def reading(m, b):
        loss = mean_ce(m, b)
        assert loss.item() > 0
        return loss

    acc.train_step(batch, reading)
    assert _syncs(acc, lambda: acc.train_step(batch, reading)) == 1 + 5
