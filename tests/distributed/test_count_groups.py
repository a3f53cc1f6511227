"""Context parallelism's count group (Note [count groups] in ``bigbatch.core._sync``).

Ranks along a ``"cp"`` mesh dimension hold shards of the SAME sequences (here each sequence cut
into two halves of its tokens; the label masks differ per shard), ranks along ``"dp"`` hold other
sequences, and DDP reduces the gradients over the flattened ``("dp", "cp")`` mesh. With
``count_group=mesh`` and each shard's ``(loss_sum, count)`` the window's step equals one float64
process on the whole sequences to 1e-10: the model is token-local (an embedding + MLP language
model), so a shard's tokens see the logits of the whole sequence and only the count is at stake.
"""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks
from token_lm import counts, model, reference, relative_error, sample_mean, token_loss, windows

import bigbatch

pytestmark = pytest.mark.slow  # gloo ranks

OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
}
SAMPLES = (5, 3, 4)  # per dp replica, window by window


def _shard(batch: dict, cp: int, index: int) -> dict:
    """The ``index``-th of ``cp`` slices of every sequence's positions (the last may be shorter)."""
    return {k: torch.tensor_split(v, cp, dim=1)[index] for k, v in batch.items()}


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "cp"))
    return mesh, mesh._flatten("dp_cp")  # DDP takes a 1-D mesh; its root keeps the names


def _rank(rank, world, optimizer_name):
    mesh, flat = _mesh(world)
    dp, cp = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")
    out = {}
    for name, count_fn in (("count_fn", counts), ("step_time", None)):
        ddp = torch.nn.parallel.DistributedDataParallel(
            model(dtype=torch.float64), device_mesh=flat
        )
        optimizer = OPTIMIZERS[optimizer_name](ddp.parameters())
        acc = bigbatch.Accumulator(ddp, optimizer, 2, trim_padding=False, count_group=mesh)
        for per_replica in windows(seed=7, world=world // 2, samples=SAMPLES):
            acc.train_step(_shard(per_replica[dp], 2, cp), token_loss, count_fn=count_fn)
        out[name] = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    ddp = torch.nn.parallel.DistributedDataParallel(model(dtype=torch.float64), device_mesh=flat)
    with pytest.raises(ValueError, match="^the model's device mesh has a 'cp' dimension of size 2"):
        bigbatch.Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"^count_group=.* is not allowed: pass the DeviceMesh of"):
        bigbatch.Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), count_group=mesh["dp"])
    acc = bigbatch.Accumulator(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), count_group=mesh)
    with pytest.raises(ValueError, match="^with count_group's 'cp' dimension ranks hold shards"):
        acc.train_step(windows(seed=0, world=1)[0][0], sample_mean)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "dp2xcp2"])
def ranks(request):
    world = request.param
    return world, {o: run_ranks(_rank, o, world_size=world, timeout_s=300) for o in OPTIMIZERS}


@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
@pytest.mark.parametrize("path", ["count_fn", "step_time"])
def test_shards_of_the_same_sequences_count_each_token_once(ranks, optimizer_name, path):
    world, results = ranks
    want = reference(windows(seed=7, world=world // 2, samples=SAMPLES), OPTIMIZERS[optimizer_name])
    for rank in results[optimizer_name]:
        assert relative_error(rank[path], want["params"]) < 1e-10
