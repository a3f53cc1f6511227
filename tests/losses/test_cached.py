"""``cached_loss``: batch-coupled losses (in-batch negatives) accumulated exactly, in float64.

Every case trains the same two-tower model twice -- one plain full-batch step per batch, written
below, and ``Accumulator.train_step`` with a ``cached_loss`` in micro-batches -- and asserts the
parameters agree to 1e-10 relative (tests/contrastive.py has the model and the losses).

Dropout and the reference: torch draws dropout masks from the global generator in call order.
``cached_loss`` encodes micro-batch after micro-batch (pass 1, recording the random state before
each) and replays each one's state in pass 2, so its masks are those of encoding the batch in the
same consecutive chunks, one after the other. With dropout the reference therefore encodes the
batch in those chunks, inside ONE graph, concatenates them and takes one full-batch step: the
gradient of the full-batch loss for that draw of masks (a mask is i.i.d. per element, so cutting
the forward changes only which sample gets which draw, not the distribution). Without dropout the
reference encodes the whole batch in one call.
"""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path

import forks
import pytest
import reference
import torch
import torch.nn as nn
import torch.nn.functional as F
from contrastive import Block, concat_reps, losses, pairs, two_tower
from reference import max_relative_error
from refusals import assert_refused

import bigbatch
from bigbatch.core.loss import WindowLoss, as_sum_and_count

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.2, momentum=0.9, nesterov=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
}
N = 10
STEPS = 3
TOL = 1e-10


def full_batch_step(model, opt, encode, batch_loss, batch, chunk=None, sched=None, max_norm=None):
    """``reference.full_batch_step`` of the plain batch loss; ``chunk``: encode the batch in
    chunks, in one graph (dropout)."""

    def loss_fn(model, batch):
        n = len(batch["x"])
        size = chunk or n
        parts = [
            encode(model, {k: v[i : i + size] for k, v in batch.items()}) for i in range(0, n, size)
        ]
        return batch_loss(concat_reps(parts), batch)

    return reference.full_batch_step(model, opt, loss_fn, batch, sched, max_norm)


def _twins(dropout=0.0, opt="sgd_momentum", kind="clip", temperature="encode"):
    ref = two_tower(dropout)
    eng = copy.deepcopy(ref)
    opts = OPTIMIZERS[opt](ref.parameters()), OPTIMIZERS[opt](eng.parameters())
    return ref, eng, opts, losses(ref, kind, temperature), losses(eng, kind, temperature)


CASES = [  # (kind, temperature, optimizer, micro_batch_size, dropout)
    ("clip", "encode", "sgd_momentum", 4, 0.0),  # 10 = 4 + 4 + 2
    ("clip", "encode", "adamw", 4, 0.0),
    ("clip", "direct", "sgd_momentum", 3, 0.0),  # 3 + 3 + 3 + 1
    ("clip", "direct", "adamw", 4, 0.2),
    ("clip", "encode", "sgd_momentum", 4, 0.2),
    ("masked_sum", "encode", "adamw", 4, 0.0),
    ("masked_sum", "direct", "sgd_momentum", 1, 0.1),  # ten micro-batches of one sample
    ("masked_sum", "encode", "adamw", 7, 0.2),  # 7 + 3
    ("clip", "encode", "adamw", 10, 0.2),  # one piece: the plain loss, one forward
]


@pytest.mark.parametrize("kind,temperature,opt,micro,dropout", CASES)
def test_cached_loss_equals_full_batch(kind, temperature, opt, micro, dropout, gen):
    ref, eng, (opt_ref, opt_eng), (enc, bl), (enc2, bl2) = _twins(dropout, opt, kind, temperature)
    acc = bigbatch.Accumulator(eng, opt_eng, micro_batch_size=micro)
    loss_fn = bigbatch.cached_loss(enc2, bl2)
    torch.manual_seed(1)
    for _ in range(STEPS):
        batch = pairs(N, gen)
        state = torch.get_rng_state()
        want = full_batch_step(ref, opt_ref, enc, bl, batch, chunk=micro if dropout else None)
        torch.set_rng_state(state)
        result = acc.train_step(batch, loss_fn)
        assert result.loss == pytest.approx(want, rel=1e-12)  # the true batch loss, not a surrogate
        assert result.micro_batches == -(-N // micro)
        assert result.count == (N if kind == "clip" else 2 * N)
    assert max_relative_error(ref, eng) < TOL
    assert ref.logit_scale.item() != pytest.approx(two_tower().logit_scale.item())  # it learned


def test_plain_accumulation_of_the_same_loss_is_not_exact(gen):
    """The problem cached_loss solves: each micro-batch sees only its own negatives."""
    ref, eng, (opt_ref, opt_eng), (enc, bl), _ = _twins()
    acc = bigbatch.Accumulator(eng, opt_eng, micro_batch_size=4)
    batch = pairs(N, gen)
    full_batch_step(ref, opt_ref, enc, bl, batch)
    acc.train_step(batch, lambda m, mb: bl(enc(m, mb), mb))
    assert max_relative_error(ref, eng) > 1e-4


def test_checkpointing_clipping_and_scheduler(gen):
    ref, eng, (opt_ref, opt_eng), (enc, bl), (enc2, bl2) = _twins(dropout=0.2, opt="adamw")
    bigbatch.enable_checkpointing(eng, blocks=[Block])
    scheds = [
        torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in (opt_ref, opt_eng)
    ]
    acc = bigbatch.Accumulator(
        eng, opt_eng, micro_batch_size=4, scheduler=scheds[1], max_grad_norm=0.05
    )
    for _ in range(STEPS):
        batch = pairs(N, gen)
        state = torch.get_rng_state()
        full_batch_step(ref, opt_ref, enc, bl, batch, chunk=4, sched=scheds[0], max_norm=0.05)
        torch.set_rng_state(state)
        result = acc.train_step(batch, bigbatch.cached_loss(enc2, bl2))
        assert result.grad_norm > 0.05  # the clipping was active
    assert len(bigbatch.memory.checkpointing.checkpointed_blocks(eng)) == 4
    assert max_relative_error(ref, eng) < TOL
    assert scheds[1].get_last_lr() == scheds[0].get_last_lr()


def test_own_loop_with_prepare(gen):
    """The low-level path: prepare() once, then micro_batch / backward / step."""
    ref, eng, (opt_ref, opt_eng), (enc, bl), (enc2, bl2) = _twins(opt="adamw", kind="masked_sum")
    acc = bigbatch.Accumulator(eng, opt_eng)
    batch = pairs(N, gen)
    full_batch_step(ref, opt_ref, enc, bl, batch)
    loss = bigbatch.cached_loss(enc2, bl2)
    assert isinstance(loss, WindowLoss)
    pieces = bigbatch.split(batch, 4)
    with acc.micro_batch(last=False):
        piece_loss = loss.prepare(eng, batch, pieces)
    for i, piece in enumerate(pieces):
        with acc.micro_batch(last=i == len(pieces) - 1):
            acc.backward(*piece_loss(eng, piece))
    acc.step()
    assert max_relative_error(ref, eng) < TOL


def test_called_plainly_it_is_the_full_loss(gen):
    model = two_tower()
    enc, bl = losses(model, "masked_sum")
    batch = pairs(N, gen)
    loss_sum, count = bigbatch.cached_loss(enc, bl)(model, batch)
    want_sum, want_count = bl(enc(model, batch), batch)
    assert count == want_count == 2 * N and torch.equal(loss_sum, want_sum)
    one_arg = bigbatch.cached_loss(lambda m, b: m(b["x"], b["y"]), lambda reps: bl(reps, batch))
    assert torch.equal(one_arg(model, batch)[0], want_sum)  # batch_loss(reps): given no batch
    mean = bigbatch.cached_loss(enc, losses(model, "clip")[1])(model, batch)
    assert mean[1] == N  # a mean becomes (mean * N, N)


@pytest.mark.parametrize(
    "limits,failures",
    [
        ((4, 3), [("graph", 10), ("no graph", 5)]),  # pass 1 of 5 + 5 runs out
        ((6, 3), [("graph", 10), ("graph", 5)]),  # pass 1 fits, pass 2 of 5 runs out
    ],
    ids=["pass 1", "pass 2"],
)
def test_auto_redoes_the_window_after_oom_in_either_pass(limits, failures, gen):
    """Wiring (a real allocator failure: tests/losses/test_cached_oom.py). encode raises
    ``MemoryError`` above ``limits`` samples (without a graph, with one), as a forward too large
    would. The whole batch runs first as the plain loss (one piece), with a graph."""
    ref, eng, (opt_ref, opt_eng), (enc, bl), (enc2, bl2) = _twins(dropout=0.2)
    seen = []

    def encode(m, mb):
        n, graph = len(mb["x"]), torch.is_grad_enabled()
        if n > limits[graph]:
            seen.append(("graph" if graph else "no graph", n))
            raise MemoryError(f"{n} samples")
        return enc2(m, mb)

    acc = bigbatch.Accumulator(eng, opt_eng, micro_batch_size="auto")
    torch.manual_seed(2)
    for step in range(STEPS):
        batch = pairs(N, gen)
        before = torch.get_rng_state()
        result = acc.train_step(batch, bigbatch.cached_loss(encode, bl2))
        after = torch.get_rng_state()
        torch.set_rng_state(before)  # the redone window replays the first try's random state
        full_batch_step(ref, opt_ref, enc, bl, batch, chunk=result.micro_batch_size)
        assert torch.equal(torch.get_rng_state(), after)  # and leaves the full batch's behind
        assert (result.micro_batch_size, result.oom_retries) == (2, 2 if step == 0 else 0)
    assert seen == failures
    assert max_relative_error(ref, eng) < TOL


@pytest.mark.slow  # autocast on the CPU: seconds per case
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_close_to_fp32_reference(precision, gen):
    ref = two_tower(dtype=torch.float32)
    eng = copy.deepcopy(ref)
    opt_ref, opt_eng = (OPTIMIZERS["adamw"](m.parameters()) for m in (ref, eng))
    (enc, bl), (enc2, bl2) = losses(ref), losses(eng)
    acc = bigbatch.Accumulator(eng, opt_eng, micro_batch_size=4, precision=precision)
    taken = 0
    for _ in range(2 * STEPS):
        batch = pairs(N, gen, torch.float32)
        result = acc.train_step(batch, bigbatch.cached_loss(enc2, bl2))
        if result.skipped:  # fp16: inf gradients at the first scales, as any fp16 run
            continue
        taken += 1
        want = full_batch_step(ref, opt_ref, enc, bl, batch)
        assert result.loss == pytest.approx(want, rel=5e-2)
    assert taken >= STEPS
    assert max_relative_error(ref, eng) < 5e-2


def test_batchnorm_running_statistics_move_once_per_micro_batch(gen):
    """Pass 1 puts the buffers back: the statistics are those of ONE forward per micro-batch."""
    model = two_tower()
    model.a.insert(1, nn.BatchNorm1d(8, dtype=torch.float64))
    plain = copy.deepcopy(model)
    batch = pairs(N, gen)
    acc = bigbatch.Accumulator(
        model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=4
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", bigbatch.BigBatchWarning)  # per-micro-batch statistics
        acc.train_step(batch, bigbatch.cached_loss(*losses(model)))
    with torch.no_grad():
        for piece in bigbatch.split(batch, 4):
            plain.a(piece["x"])
    bn, want = model.a[1], plain.a[1]
    assert torch.allclose(bn.running_mean, want.running_mean, rtol=1e-12, atol=0)
    assert torch.allclose(bn.running_var, want.running_var, rtol=1e-12, atol=0)
    assert bn.num_batches_tracked == want.num_batches_tracked == 3


def test_check_says_a_coupled_loss_can_be_written_as_cached_loss(gen):
    model = two_tower()
    enc, bl = losses(model)
    batch = pairs(N, gen)
    report = bigbatch.check(model, batch, lambda m, mb: bl(enc(m, mb), mb), micro_batch_size=4)
    [diagnosis] = [d for d in report.diagnoses if d.kind == "batch-coupled-loss"]
    assert "bigbatch.cached_loss(encode, batch_loss)" in diagnosis.message
    assert bigbatch.check(model, batch, bigbatch.cached_loss(enc, bl), micro_batch_size=4).exact


def test_check_on_a_cached_loss_with_dropout_names_the_dropout(gen):
    model = two_tower(dropout=0.3)
    report = bigbatch.check(model, pairs(N, gen), bigbatch.cached_loss(*losses(model)), 4)
    assert report.exact and report.diagnoses == []  # compared with dropout off (issue 21 item 6)
    assert report.dropout_off == tuple(f"'{t}.{i}.drop' (Dropout)" for t in "ab" for i in (1, 2))
    model.eval()
    assert bigbatch.check(model, pairs(N, gen), bigbatch.cached_loss(*losses(model)), 4).exact


# ---------------------------------------------------------------------------- errors
def _failing_step(gen, encode=None, batch_loss=None, micro=4):
    """Run a step that must fail; check nothing changed; return the error."""
    model = two_tower()
    enc, bl = losses(model)
    opt = OPTIMIZERS["sgd_momentum"](model.parameters())
    acc = bigbatch.Accumulator(model, opt, micro_batch_size=micro)
    acc.train_step(pairs(N, gen), bigbatch.cached_loss(enc, bl))  # momentum state exists
    before = copy.deepcopy((model.state_dict(), opt.state_dict()))
    with assert_refused(model, (ValueError, TypeError)) as info:
        acc.train_step(pairs(N, gen), bigbatch.cached_loss(encode or enc, batch_loss or bl))
    assert all(torch.equal(v, before[0][k]) for k, v in model.state_dict().items())
    assert str(opt.state_dict()) == str(before[1])
    return str(info.value)


def test_encode_outputs_that_disagree_on_the_sample_dimension(gen):
    def encode(m, mb):
        q, d, _ = m(mb["x"], mb["y"])
        return q, d[:-1]

    message = _failing_step(gen, encode, lambda reps, b: (reps[0] @ reps[1].T).mean())
    assert message.startswith(
        "encode_fn's outputs disagree on the sample dimension for micro-batch 0 of 4 samples "
        "(reps[0] has 4 rows, reps[1] has 3 rows): every representation needs one row per sample."
    )


def test_batch_loss_that_is_not_a_scalar(gen):
    def per_sample(reps, batch):
        q, d, scale = reps
        return F.cross_entropy(scale * q @ d.T, torch.arange(len(q)), reduction="none")

    with pytest.raises(
        ValueError,
        match=r"batch_loss_fn's return value has shape \(10,\); it must be a scalar\. Reduce",
    ):
        raise ValueError(_failing_step(gen, batch_loss=per_sample))


def test_representation_that_does_not_require_grad(gen):
    def detached(m, mb):
        q, d, scale = m(mb["x"], mb["y"])
        return q, d.detach(), scale

    message = _failing_step(gen, detached)
    assert message.startswith(
        "encode_fn's reps[1] (shape (4, 5)) does not require grad, so no gradient reaches the "
        "model through it"
    )
    labels = _failing_step(gen, lambda m, mb: (m(mb["x"], mb["y"])[0], mb["label"]))
    assert labels.startswith("encode_fn's reps[1] (shape (4,)) does not require grad")


@pytest.mark.parametrize(
    "encode,batch_loss,match",
    [
        (
            lambda m, mb: None,
            None,
            r"encode_fn returned NoneType with no per-sample tensor for micro-batch 0: return a tensor",
        ),
        (
            lambda m, mb: m(mb["x"], mb["y"])[: 2 if len(mb["x"]) == 4 else 3],
            None,
            r"encode_fn returned \['reps\[0\]', 'reps\[1\]', 'reps\[2\]'\] for micro-batch 2 but \['reps\[0\]', 'reps\[1\]'\] for micro-batch 0: return the same structure",
        ),  # fmt: skip
        (
            None,
            lambda reps, b: "low",
            r"batch_loss_fn returned str; return a scalar tensor \(the mean",
        ),
        (
            None,
            lambda reps, b: torch.tensor(1.0, dtype=torch.float64),
            r"batch_loss_fn's loss does not depend on the representations",
        ),  # fmt: skip
    ],
    ids=["no tensor", "structure changes", "not a tensor", "no gradient"],
)
def test_other_bad_encodes_and_losses(encode, batch_loss, match, gen):
    with pytest.raises(ValueError, match=match):
        raise ValueError(_failing_step(gen, encode, batch_loss))


def test_bad_arguments():
    with pytest.raises(TypeError, match=r"encode_fn=3 is not callable: pass a function"):
        bigbatch.cached_loss(3, lambda reps, b: reps)
    with pytest.raises(TypeError, match=r"batch_loss_fn=None is not callable"):
        bigbatch.cached_loss(lambda m, b: m(b), None)
    with pytest.raises(TypeError, match=r"gather='yes' is not allowed: use True or False\."):
        bigbatch.cached_loss(lambda m, b: m(b), lambda reps, b: reps, gather="yes")


def test_a_window_loss_fn_refuses_other_micro_batches(gen):
    model = two_tower()
    batch = pairs(N, gen)
    pieces = bigbatch.split(batch, 4)
    piece_loss = bigbatch.cached_loss(*losses(model)).prepare(model, batch, pieces)
    with pytest.raises(
        ValueError, match=r"this loss_fn belongs to the micro-batches given to CachedLoss\.prepare"
    ):
        piece_loss(model, pairs(4, gen))
    assert as_sum_and_count(piece_loss(model, pieces[0]), 4)[1] == pytest.approx(4.0)


# ---------------------------------------------------------------------------- the scripts
ROOT = Path(__file__).resolve().parents[2]


def _script(*argv: str) -> str:
    """``python ARGV`` at the root, forked (``forks``: torch imported once); its output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = forks.run([str(ROOT / argv[0]), *argv[1:]], env=env, timeout=600, cwd=str(ROOT))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_example_checks_both_losses_and_learns():
    out = _script("examples/contrastive.py")  # (tests/test_examples.py runs it too, unchecked)
    assert "plain loss_fn:  NOT exact" in out and "- batch-coupled-loss: " in out
    assert "cached_loss:    exact: max relative difference" in out
    assert "step 29: loss" in out and "held-out recall@1 among 512 documents" in out


@pytest.mark.slow
@pytest.mark.needs("transformers")  # the benchmark's BERT
def test_benchmark_quick_mode():
    out = _script("benchmarks/contrastive.py", "--quick")  # (d) measured only where installed
    assert "| (d) sentence-transformers Cached MNRL |" in out
    assert "(c) exact to 1e-10 in float64: yes" in out
