"""The planner compares token budgets (issue 22 item 6): on variable-length text it measures
token windows beside fixed-count micro-batches, reports each one's padding, every token
candidate trains exactly like the full batch (float64), and bad budgets are one clear error."""

from __future__ import annotations

import re
import textwrap

import pytest
import torch
import torch.nn as nn
from cases import OPTIMIZERS
from models import PAD, VOCAB, TinyCausalLM
from reference import full_batch_step, max_relative_error

import bigbatch
from bigbatch.app.cli import main
from bigbatch.core._tokens import TokenCut
from bigbatch.core.loss import token_cross_entropy
from bigbatch.memory import _candidates as rules
from bigbatch.memory.planner import plan

CTX, N = 32, 16


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # the machine is shared: the plan's logic is pinned, not a speed


def lognormal_text(n: int = N, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded text whose lengths are log-normal (median 6 tokens), one of CTX tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randn(n, generator=gen).mul(0.7).add(1.8).exp().round().clamp(1, CTX).long()
    lengths[0] = CTX
    mask = torch.arange(CTX)[None, :] < lengths[:, None]
    ids = torch.randint(1, VOCAB, (n, CTX), generator=gen) * mask
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": ids.masked_fill(~mask, PAD)}


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]):
    return token_cross_entropy(model(batch["input_ids"]), batch["labels"], shift=True)


def model() -> nn.Module:
    torch.manual_seed(0)
    return TinyCausalLM(ctx=CTX).double()


def test_plan_offers_token_budgets_that_train_exactly_like_the_full_batch():
    batch = lognormal_text()
    p = plan(model(), batch, lm_loss, micro_batch_sizes=[4, N], micro_batch_tokens="auto",
             checkpointing=(0,), steps=2, memory_budget="8GiB")  # fmt: skip
    by_tokens = [c for c in p.candidates if c.micro_batch_tokens is not None]
    by_samples = [c for c in p.candidates if c.micro_batch_tokens is None]
    # 128 to 512 cut the batch as 64 does (the rows are bounded by the padding rule): measured
    # once, under the smallest of them
    cuts = {
        b: [(p.rows.tolist(), p.padded_tokens) for p in TokenCut()(batch, b)] for b in (64, 512)
    }
    assert cuts[64] == cuts[512] and len(cuts[64]) > 1
    assert [c.micro_batch_tokens for c in by_tokens] == [CTX, 2 * CTX]
    assert [c.micro_batch_size for c in by_samples] == [4, N]
    lengths = batch["attention_mask"].sum(-1)
    for c in by_samples:  # each micro-batch of the sample cut trimmed to its longest
        computed = sum(len(part) * int(part.max()) for part in lengths.split(c.micro_batch_size))
        assert c.padding == pytest.approx(1 - int(lengths.sum()) / computed)
    assert all(c.padding < by_samples[0].padding for c in by_tokens)  # sorted: less padding
    assert all(c.fits and c.measured and c.seconds_per_step for c in p.candidates)
    for c in by_tokens:  # each configuration offered trains exactly like the full batch
        assert c.cut == f"token budget {c.micro_batch_tokens} (up to {c.micro_batch_size} rows)"
        for name in ("sgd_momentum", "adamw"):
            ref, net = model(), model()
            ref_opt, opt = OPTIMIZERS[name](ref.parameters()), OPTIMIZERS[name](net.parameters())
            acc = bigbatch.Accumulator(net, opt, micro_batch_tokens=c.micro_batch_tokens)
            for seed in (0, 1):  # the planned batch, then another
                step = lognormal_text(seed=seed)
                full_batch_step(ref, ref_opt, lm_loss, step)
                steps = acc.train_step(step, lm_loss).micro_batches
                assert seed or steps == c.gradient_accumulation_steps
            assert max_relative_error(ref, net) < 1e-10, (c.micro_batch_tokens, name)
    # The choice is the rules' decision over all of them, and the reason says what it is.
    assert p.choice is rules.decide(p.candidates)[0]
    assert p.reason.startswith(p.choice.describe().capitalize())
    assert p.naive.micro_batch_tokens is None and p.naive.micro_batch_size == 4


def test_token_candidates_are_fitted_and_predicted_per_token():
    """Under a budget the larger token budgets do not fit: they are predicted from the line
    through the measured ones (per token of the budget), not run."""
    batch = lognormal_text()
    kwargs = {"micro_batch_sizes": [1], "checkpointing": (0,), "steps": 1}
    probe = plan(model(), batch, lm_loss, micro_batch_tokens=[CTX, 2 * CTX], **kwargs)
    fits = [f for f in probe.fits if f.tokens]
    assert len(fits) == 1 and fits[0].policy == "none"
    guess = rules.predicted(
        [rules.Candidate(micro_batch_size=3, gradient_accumulation_steps=5, checkpointing=0.0,
                         policy="none", peak_bytes=0, micro_batch_tokens=4 * CTX)],
        fits[0], probe.candidates[-1],
    )[0]  # fmt: skip
    assert guess.peak_bytes == max(fits[0].predict(4 * CTX), probe.candidates[-1].peak_bytes)
    assert (guess.measured, guess.fits, guess.micro_batch_tokens) == (False, False, 4 * CTX)


@pytest.mark.parametrize(
    ("tokens", "shown"),
    [([0], r"\[0\]"), ([CTX - 1], r"\[31\]"), ([N * CTX + 1], r"\[513\]"), ([True], r"\[True\]"),
     ("lots", "'lots'"), ([], r"\[\]")],
)  # fmt: skip
def test_bad_token_budgets_are_one_clear_error(tokens, shown):
    with pytest.raises(
        ValueError,
        match=rf"micro_batch_tokens={shown} is not allowed: use 'auto' or integers from the "
        rf"longest sample's {CTX} tokens to the whole batch's {N * CTX}, e\.g\.",
    ):
        plan(model(), lognormal_text(), lm_loss, micro_batch_tokens=tokens)


def test_token_budgets_need_lengths():
    with pytest.raises(TypeError, match=r"micro_batch_tokens needs each sample's length"):
        plan(model(), torch.randint(1, VOCAB, (4, 8)), lm_loss, micro_batch_tokens="auto")


TASK = """
import torch
from models import TinyCausalLM
from test_planner_tokens import lm_loss, lognormal_text
from bigbatch import Task

def task():
    batch = lognormal_text()
    rows = [{k: v[i] for k, v in batch.items()} for i in range(len(batch["input_ids"]))]
    torch.manual_seed(0)
    return Task(model=TinyCausalLM(ctx=32).double(), train_data=rows, loss_fn=lm_loss)
"""


@pytest.mark.needs("rich")
def test_cli_plan_compares_token_budgets(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    (tmp_path / "text_task.py").write_text(textwrap.dedent(TASK))
    args = ["plan", f"{tmp_path / 'text_task.py'}:task", "--batch-size", "16", "--steps", "1",
            "--micro-batch-sizes", "16", "--checkpointing", "none"]  # fmt: skip
    assert main(args + ["--micro-batch-tokens", "32,64,512"]) == 0  # 512 cuts as 64 does
    out, err = capsys.readouterr()
    out = " ".join(out.split())  # the paragraph is wrapped to the terminal
    # progress, a line per measurement (stderr is not a terminal here: lines, not a bar)
    assert re.search(r"^bigbatch plan: measuring the peak of token budget 64 .*\.\.\.$", err, re.M)
    assert re.search(r"^bigbatch plan: peak of token budget 64 \(up to \d+ rows\) x \d+ steps "
                     r"without checkpointing: [\d.]+ [KM]iB$", err, re.M)  # fmt: skip
    assert re.search(r"^bigbatch plan: timing round 1/1: micro-batch 16 x 1 steps", err, re.M)
    assert "tokens" in out and "padding" in out and "x token;" in out and "choice: " in out
    budgets = re.findall(r"│ +≤\d+ rows │ +(\d+) tokens │ +(\d+)% │", out)  # budget, padding
    assert [b for b, _ in budgets] == ["32", "64"] and all(int(p) < 50 for _, p in budgets)
    assert main(args + ["--micro-batch-tokens", "8"]) == 2
    assert "micro_batch_tokens=[8] is not allowed" in capsys.readouterr().err
