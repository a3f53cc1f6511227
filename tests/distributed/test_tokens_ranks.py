"""Token windows on 2 real gloo ranks (issue 22 item 2), float64, against one full-batch step on
the union: DDP with ranks running different numbers of micro-batches (each syncs once, on its
last), and the models whose forwards must pair up across ranks (DDP broadcasting a buffer, FSDP2),
where a rank with fewer micro-batches runs empty ones; DDP with the chunked head (issue 31)."""

from __future__ import annotations

import copy

import pytest
import torch
from cases import OPTIMIZERS
from models import TinyCausalLM
from ranks import run_ranks
from reference import full_batch_step, max_relative_error
from test_tokens import lm_loss, text_batch
from torch.nn.parallel import DistributedDataParallel as DDP

import bigbatch
from bigbatch.core.head import with_chunked_head

pytestmark = pytest.mark.slow  # real gloo ranks
STEPS = 3


class Buffered(TinyCausalLM):
    """A model with a buffer that DDP broadcasts in every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))


def _windows(seed: int) -> list[list[dict]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        long, short = text_batch(10, gen), text_batch(7, gen)
        short["attention_mask"][:, 4:] = 0  # rank 1 holds far fewer tokens
        short["labels"][:, 4:] = -100
        short["input_ids"][:, 4:] = 0
        out.append([long, short])
    return out


def _wrap(kind: str, model: torch.nn.Module) -> torch.nn.Module:
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        return fully_shard(model)
    return DDP(model)


KINDS = ["ddp", "ddp_buffers", "fsdp2", "ddp_chunked_head"]  # the last: Note [chunked head]


def _rank(rank: int, world: int, windows: list) -> dict:
    """Every row, one after the other, on the same two ranks (one spawn for the table)."""
    return {(k, o): _train(rank, k, o, windows) for k in KINDS for o in sorted(OPTIMIZERS)}


def _train(rank: int, kind: str, optimizer: str, windows: list) -> dict:
    torch.manual_seed(0)
    model = _wrap(kind, (Buffered if kind == "ddp_buffers" else TinyCausalLM)().double())
    paired = kind in ("ddp_buffers", "fsdp2")  # forwards pair up across ranks
    acc = bigbatch.Accumulator(
        model, OPTIMIZERS[optimizer](model.parameters()), micro_batch_tokens=24,
        pad_to_multiple_of=4 if paired else None,
    )  # fmt: skip
    loss = with_chunked_head(lm_loss, model) if kind == "ddp_chunked_head" else lm_loss
    counts = [acc.train_step(w[rank], loss).micro_batches for w in windows]
    if kind == "fsdp2":
        from torch.distributed.tensor import DTensor

        state = {
            k: v.full_tensor() if isinstance(v, DTensor) else v
            for k, v in model.state_dict().items()
        }
    else:
        state = model.module.state_dict()
    return {"micro_batches": counts, "state": state}


@pytest.fixture(scope="module")
def runs():
    windows = _windows(seed=7)
    return windows, run_ranks(_rank, windows, timeout_s=600)


@pytest.mark.xdist_group("tokens_ranks")  # one worker runs the ranks for every row
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("kind", KINDS)
def test_token_windows_on_two_ranks_equal_the_full_batch(kind, optimizer, runs):
    windows, by_rank = runs
    results = [by_rank[0][kind, optimizer], by_rank[1][kind, optimizer]]
    torch.manual_seed(0)
    ref = TinyCausalLM().double()
    ref_opt = OPTIMIZERS[optimizer](ref.parameters())
    for long, short in windows:
        union = {k: torch.cat([long[k], short[k]]) for k in long}
        full_batch_step(ref, ref_opt, lm_loss, union)
    ours = copy.deepcopy(ref)
    ours.load_state_dict({k: v for k, v in results[0]["state"].items() if k != "calls"})
    assert max_relative_error(ref, ours) < 1e-10
    per_rank = [r["micro_batches"] for r in results]
    if kind in ("ddp", "ddp_chunked_head"):
        assert per_rank[0] != per_rank[1]  # the ranks really ran different numbers
    else:
        assert per_rank[0] == per_rank[1]  # forwards paired up: the shorter rank ran empty ones
