"""A tiny training script run by test_torchrun.py under ``torchrun`` and under plain ``python``.

The same code in both: ``setup`` joins the group torchrun describes (or none), the model is
wrapped in DDP when there are several ranks, each rank loads ``batch_size / W`` samples per
step from ``make_sampler``, and rank 0 alone writes the results, one per micro-batch size (several in one job: one launch).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import torch  # noqa: E402
from models import classification_batch, mean_ce, mlp  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import bigbatch  # noqa: E402
from bigbatch import distributed  # noqa: E402


def main(out_path: str, batch_size: int, micro_batch_sizes: str) -> None:
    torch.set_num_threads(1)
    ranks = distributed.setup("cpu")
    results = {size: train(ranks, batch_size, size) for size in micro_batch_sizes.split(",")}
    if distributed.is_main_process():
        torch.save(results, out_path)
    distributed.teardown()


def train(ranks: distributed.Ranks, batch_size: int, micro_batch_size: str) -> dict:
    dataset = TensorDataset(
        *classification_batch(20, torch.float64, torch.Generator().manual_seed(7))
    )
    sampler = distributed.make_sampler(dataset, ranks, shuffle=True, seed=3)
    per_rank = distributed.per_rank_batch_size(batch_size, ranks.world_size)
    loader = DataLoader(dataset, batch_size=per_rank, sampler=sampler)
    model = distributed.wrap(mlp(torch.float64), ranks)
    size = micro_batch_size if micro_batch_size == "auto" else int(micro_batch_size)
    acc = bigbatch.Accumulator(model, torch.optim.AdamW(model.parameters(), lr=1e-2), size)
    losses = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            losses.append(acc.train_step((x, y), mean_ce).loss)
    state = distributed.unwrap(model).state_dict()
    return {"losses": losses, "state": state, "world_size": ranks.world_size}


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    distributed.exit_process(0)  # Note [gloo exit]
