"""bigbatch.distributed.launch without a process group: the batch rule, the sampler union, errors."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from bigbatch.distributed import launch as distributed
from bigbatch.distributed.launch import Ranks


def test_per_rank_batch_size_divides_the_global_batch():
    assert distributed.per_rank_batch_size(64, 4) == 16
    assert distributed.per_rank_batch_size(7, 1) == 7


@pytest.mark.parametrize(
    "batch_size,fix", [(10, "--batch-size 9 or 12"), (2, "--batch-size 3 or 6")]
)
def test_per_rank_batch_size_refuses_a_remainder(batch_size, fix):
    with pytest.raises(
        ValueError, match=rf"batch_size={batch_size} is the global batch .* use {fix}\."
    ):
        distributed.per_rank_batch_size(batch_size, 3)


@pytest.mark.parametrize("world_size,n", [(2, 20), (4, 24), (3, 21)])
def test_union_of_rank_batches_is_the_single_process_batch(world_size, n):
    dataset = TensorDataset(torch.arange(n))
    global_batch = 2 * world_size + world_size  # 3 per rank, a short last batch
    one = Ranks(0, 1, 0, torch.device("cpu"))
    single = list(
        DataLoader(dataset, global_batch, sampler=distributed.make_sampler(dataset, one, seed=5))
    )
    per_rank = distributed.per_rank_batch_size(global_batch, world_size)
    shards = [
        list(
            DataLoader(
                dataset,
                per_rank,
                sampler=distributed.make_sampler(
                    dataset, Ranks(r, world_size, r, one.device), seed=5
                ),
            )
        )
        for r in range(world_size)
    ]
    assert all(len(s) == len(single) for s in shards)
    for i, (batch,) in enumerate(single):
        union = torch.cat([s[i][0] for s in shards])
        assert sorted(union.tolist()) == sorted(batch.tolist())


def test_setup_without_torchrun_is_one_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    ranks = distributed.setup("cpu")
    assert (ranks.rank, ranks.world_size, ranks.is_main) == (0, 1, True)
    assert distributed.is_main_process()
    model = torch.nn.Linear(2, 1)
    assert distributed.unwrap(distributed.wrap(model, ranks)) is model
    distributed.teardown()


def test_setup_errors(monkeypatch):
    with pytest.raises(
        ValueError, match=r'device=\'tpu\' is not allowed: use "cpu", "cuda" or None\.'
    ):
        distributed.setup("tpu")
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(
        ValueError, match=r"WORLD_SIZE='two' is not an integer: launch with `torchrun"
    ):
        distributed.setup("cpu")
