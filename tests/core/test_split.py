"""How a batch is cut: per-sample columns that are not tensors go with their rows.

A dataset of ``(x, y, "id")`` items collated by ``default_collate`` gives ``[x, y, [ids...]]``:
the ids are one per sample and each micro-batch must get its own, as it gets its own rows of
``x``; anything else that is not a tensor (a constant, a list of another length) is passed whole.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import mlp
from reference import full_batch_step, max_relative_error

import bigbatch
from bigbatch.core.split import split


class _Tagged(torch.utils.data.Dataset):
    """(x, y, id) items: the id is a string, as a dataset of files or records would give."""

    def __init__(self, n, gen):
        self.x = torch.randn(n, 6, generator=gen, dtype=torch.float64)
        self.y = torch.randint(0, 3, (n,), generator=gen)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i], f"sample-{i}"


@pytest.mark.parametrize("n, micro", [(8, 4), (10, 4), (9, 2)])
def test_default_collate_ids_are_cut_with_the_rows(n, micro, gen):
    batch = torch.utils.data.default_collate([_Tagged(n, gen)[i] for i in range(n)])
    assert isinstance(batch[2], (list, tuple)) and len(batch[2]) == n  # default_collate's ids
    start = 0
    for piece in split(batch, micro):
        rows = len(piece[0])
        assert list(piece[2]) == [f"sample-{i}" for i in range(start, start + rows)]
        assert type(piece[2]) is type(batch[2])
        assert torch.equal(piece[1], batch[1][start : start + rows])
        start += rows
    assert start == n


def test_the_loss_sees_each_micro_batchs_own_ids_and_the_step_stays_exact(gen):
    data = _Tagged(10, gen)
    batch = torch.utils.data.default_collate([data[i] for i in range(10)])
    weight = {f"sample-{i}": 1.0 + i for i in range(10)}  # a per-sample weight looked up by id
    seen = []

    def weighted(model, mb):
        x, y, ids = mb
        assert len(ids) == len(y)  # the whole list would not even line up with the rows
        seen.append(list(ids))
        w = torch.tensor([weight[i] for i in ids], dtype=torch.float64)
        return (w * F.cross_entropy(model(x), y, reduction="none")).sum(), w.sum()

    ref, model = mlp(), mlp()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = bigbatch.Accumulator(model, opt, micro_batch_size=4)
    for _ in range(2):
        full_batch_step(ref, opt_ref, weighted, batch)
        acc.train_step(batch, weighted)
    assert seen[1:4] == [[f"sample-{i}" for i in r] for r in (range(4), range(4, 8), range(8, 10))]
    assert max_relative_error(ref, model) < 1e-10


def test_values_that_are_not_per_sample_are_passed_whole():
    batch = {
        "x": torch.arange(6),
        "ids": ["a", "b", "c", "d", "e", "f"],  # one per sample: cut
        "vocab": ["<pad>", "<bos>"],  # another length: whole
        "scale": 0.5,  # a constant: whole
        "name": "batch-7",  # a string: whole (not a column of characters)
        "pairs": [("a", 1)] * 6,  # n containers: records, cut inside, not a column
    }
    first, second = split(batch, 4)
    assert first["ids"] == ["a", "b", "c", "d"] and second["ids"] == ["e", "f"]
    for piece in (first, second):
        assert piece["vocab"] == ["<pad>", "<bos>"]
        assert piece["scale"] == 0.5 and piece["name"] == "batch-7"
    assert torch.equal(second["x"], torch.tensor([4, 5]))


def test_a_tuple_column_stays_a_tuple():
    pieces = split((torch.zeros(5, 2), ("a", "b", "c", "d", "e")), 2)
    assert [p[1] for p in pieces] == [("a", "b"), ("c", "d"), ("e",)]
