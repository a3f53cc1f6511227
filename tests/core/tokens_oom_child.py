"""Child process for test_tokens_oom.py: ``micro_batch_tokens="auto"`` under a real allocator
failure (RLIMIT_DATA, as ``oom_child.py``), then one JSON line.

The model's activations grow with the TOKENS of a micro-batch (a broadcast ``tanh(h[..., None] *
v)`` per position: about 0.25 MiB per token in float64), so the whole window of variable-length text
does not fit and the token budget must shrink until it does. The rows' lengths (40 to 48 tokens)
differ by less than MAX_ROW_PADDING, so one micro-batch may hold every row: with lengths from 2 to
48 the row-padding rule alone cut the window into 7 micro-batches that all fit, and nothing failed.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
from limits import limit_data
from reference import full_batch_step, max_relative_error
from torch import nn

import bigbatch
from bigbatch.core.loss import token_cross_entropy

VOCAB, CTX, N = 11, 48, 16


class TokenNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.v = nn.Parameter(torch.linspace(-1, 1, 1024))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(torch.tanh(h[..., None] * self.v).mean(-1))


def loss(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return token_cross_entropy(model(batch["input_ids"]), batch["labels"], shift=True)


def main(config: dict) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(config["seed"])
    lengths = torch.randint(CTX - 8, CTX + 1, (N,), generator=gen)  # rows within MAX_ROW_PADDING
    mask = torch.arange(CTX)[None] < lengths[:, None]
    ids = torch.randint(1, VOCAB, (N, CTX), generator=gen) * mask
    batch = {
        "input_ids": ids,
        "attention_mask": mask.long(),
        "labels": ids.masked_fill(~mask, -100),
    }
    model = TokenNet().double()
    copies = [model, copy.deepcopy(model), copy.deepcopy(model)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in copies]
    warm = {k: v[:1, :2] for k, v in batch.items()}
    for m, opt in zip(copies, opts, strict=True):  # optimizer state, autograd, allocator
        bigbatch.Accumulator(m, opt, micro_batch_tokens=2).train_step(warm, loss)
    full_batch_step(copies[1], opts[1], loss, batch)  # before the limit: the whole window
    acc = bigbatch.Accumulator(model, opts[0], micro_batch_tokens="auto")
    limit_data(config["margin_mib"])
    result = acc.train_step(batch, loss)
    limit_data(None)
    fixed = bigbatch.Accumulator(copies[2], opts[2], micro_batch_tokens=result.micro_batch_tokens)
    fixed.train_step(batch, loss)
    return {
        "oom_retries": result.oom_retries,
        "budget": result.micro_batch_tokens,
        "whole": N * int(lengths.max()),
        "tokens": result.tokens,
        "real_tokens": int(mask.sum()),
        "micro_batches": result.micro_batches,
        "equal_to_same_budget": all(
            torch.equal(a, b)
            for a, b in zip(model.parameters(), copies[2].parameters(), strict=True)
        ),
        "error_to_full_batch": max_relative_error(copies[1], model),
    }


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
