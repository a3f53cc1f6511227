"""transformers' Trainer on 2 real gloo ranks (accelerate's MULTI_CPU, DDP over gloo), float64.

Each rank reads the torchrun variables accelerate reads (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``); the process group is the one ``run_ranks``
already opened. 12 variable-length samples, 2 per micro-batch, 3 micro-batches per window on
each of 2 ranks: every optimizer step is the whole data set, split unevenly in tokens between the
ranks and their micro-batches, so the reference is two plain full-batch steps on the union.

The bug (FunASR PR #3472, build-nanogpt PR #30): no micro-batch of the window runs outside
``no_sync``, so the ranks never all-reduce, each steps with its own gradient and the replicas
drift apart. ``audit`` flags it as "ranks did not synchronise"; the stock Trainer raises no false
alarm, and flags a wrapper whose ``forward`` takes no loss kwargs (a mean of micro-batch means on
each rank); ``bigbatch.hf.Trainer`` (the model's own loss, and a wrapper whose ``forward`` takes no
loss kwargs) equals one process on the union.
"""

from __future__ import annotations

import copy

import pytest
from ranks import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hf_ranks import trainer_runs  # noqa: E402
from integrations.hf_models import (  # noqa: E402
    Wrapper,
    collate,
    distance,
    gpt2,
    loaded,
    sgd,
    texts,
    wrapper_loss,
)
from integrations.test_hf import counted, plain  # noqa: E402
from reference import full_batch_step  # noqa: E402

pytestmark = pytest.mark.slow  # real gloo ranks, transformers imported in each


def _never_syncs(base: type) -> type:
    class NeverSyncs(base):  # type: ignore[misc, valid-type]
        """Every micro-batch inside ``no_sync``, the last one too: the all-reduce never runs."""

        def training_step(self, model, inputs, num_items_in_batch=None):
            with self.accelerator.no_sync(model):
                return super().training_step(model, inputs, num_items_in_batch)

    return NeverSyncs


def _rank(rank: int, world: int, tmp: str) -> dict:
    import transformers

    import bigbatch.hf

    runs = {
        "stock": (transformers.Trainer, gpt2),
        "never syncs": (_never_syncs(transformers.Trainer), gpt2),
        "stock wrapper": (transformers.Trainer, lambda: Wrapper(gpt2())),
        "bigbatch": (bigbatch.hf.Trainer, gpt2),
        "bigbatch wrapper": (bigbatch.hf.Trainer, lambda: Wrapper(gpt2())),
        "stock dropout": (transformers.Trainer, lambda: gpt2(dropout=True)),
        "stock wrapper dropout": (transformers.Trainer, lambda: Wrapper(gpt2(dropout=True))),
        "bigbatch dropout": (bigbatch.hf.Trainer, lambda: gpt2(dropout=True)),
    }
    return trainer_runs(rank, world, tmp, runs, 29500)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_rank, str(tmp_path_factory.mktemp("hf")), timeout_s=400)


def test_no_sync_on_every_micro_batch_is_flagged_and_the_ranks_drift(ranks):
    states = [r["never syncs"][0] for r in ranks]
    a, b = (loaded(gpt2, s) for s in states)
    assert distance(a, b, gpt2()) > 1e-2  # each rank stepped alone
    for rank in ranks:
        for result in rank["never syncs"][1]:
            assert not result.exact and result.diagnosis == "ranks did not synchronise", result


def test_the_stock_trainer_on_ranks_is_no_false_alarm(ranks):
    for rank in ranks:
        assert [r.exact for r in rank["stock"][1]] == [True, True]


def test_dropout_on_ranks(ranks):
    """GPT-2's default dropout: each rank replays its window with dropout off (Note [audit
    dropout]), synchronised as the trainer synchronises it; no false alarm, and a mean of
    micro-batch means is still named."""
    for rank in ranks:
        assert [r.exact for r in rank["stock dropout"][1]] == [True, True]
        assert [r.exact for r in rank["bigbatch dropout"][1]] == [True, True]
        found = rank["stock wrapper dropout"][1]
        assert [r.diagnosis for r in found] == ["per-micro-batch mean on padded data"] * 2, found


def test_a_mean_of_micro_batch_means_on_ranks_is_flagged(ranks):
    """A wrapper whose forward takes no loss kwargs: each rank averages its micro-batch means."""
    for rank in ranks:
        for result in rank["stock wrapper"][1]:
            assert not result.exact, result
            assert result.diagnosis == "per-micro-batch mean on padded data", result


@pytest.mark.parametrize(
    "name, make", [("bigbatch", gpt2), ("bigbatch wrapper", lambda: Wrapper(gpt2()))]
)
def test_bigbatch_on_ranks_equals_one_process_on_the_union(ranks, name, make):
    base = make()
    reference = plain(copy.deepcopy(base), counted if name == "bigbatch" else wrapper_loss, sgd)
    for rank in ranks:
        state, results = rank[name]
        assert [r.exact for r in results] == [True, True], results
        assert distance(loaded(make, state), reference, base) < 1e-10


def empty_first() -> list[dict]:
    """12 samples, the first two one token long (transformers' ``test_loss_averaging`` data: two
    empty lines, a BOS each): in order, rank 0's first window starts with rows that count no
    shifted label."""
    return [{"input_ids": [5]}, {"input_ids": [7]}, *texts(12)[2:]]


def _empty_first_rank(rank: int, world: int, tmp: str) -> dict:
    import transformers

    import bigbatch.hf

    runs = {"stock": (transformers.Trainer, gpt2), "bigbatch": (bigbatch.hf.Trainer, gpt2)}
    out = {}
    for average in (True, False):  # average_tokens_across_devices
        found = trainer_runs(
            rank, world, f"{tmp}/{average}", runs, 29501, data=empty_first(),
            train_sampling_strategy="sequential", average_tokens_across_devices=average,
        )  # fmt: skip
        out.update({(name, average): result for name, result in found.items()})
    return out


def test_a_first_window_that_counts_nothing_on_one_rank(tmp_path):
    """Rank 0's first rows count no label: the loss's form (``loss_form``) read there decided
    nothing, rank 1's decided "sum", so the ranks disagreed on which counts to all-reduce and
    gloo aborted (an 8-byte count against a gradient bucket) at step 1, in both
    ``average_tokens_across_devices`` modes. The ranks now agree on the form (``agreed``): both
    modes equal one process on the union, as the stock Trainer does where it averages tokens
    across the ranks (it completes in the other mode too), and the audit finds every step
    exact."""
    ranks = run_ranks(_empty_first_rank, str(tmp_path), timeout_s=400)
    base, model = gpt2(), gpt2()
    optimizer = sgd(model)[0]
    for _ in range(2):
        full_batch_step(model, optimizer, counted, collate(empty_first()))
    for rank in ranks:
        for average in (True, False):
            state, results = rank["bigbatch", average]
            assert [r.exact for r in results] == [True, True], results
            assert distance(loaded(gpt2, state), model, base) < 1e-10
        assert distance(loaded(gpt2, rank["stock", True][0]), model, base) < 1e-10
