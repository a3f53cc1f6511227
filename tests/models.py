"""Tiny models and data makers shared by the tests (float64-friendly, no downloads)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from bigbatch.core.loss import token_cross_entropy

VOCAB = 17
PAD = -100


def mlp(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 3)
    ).to(dtype)


def cnn(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 3),
    ).to(dtype)


class TinyCausalLM(nn.Module):
    """A two-block causal transformer on token ids."""

    def __init__(
        self, vocab: int = VOCAB, dim: int = 16, heads: int = 2, blocks: int = 2, ctx: int = 12
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(ctx, dim) * 0.1)

        def layer() -> nn.Module:
            # no bias: the key bias has a zero true gradient that Adam would turn into noise
            return nn.TransformerEncoderLayer(
                dim, heads, 2 * dim, dropout=0.0, batch_first=True, bias=False
            )

        self.blocks = nn.ModuleList(layer() for _ in range(blocks))
        self.head = nn.Linear(dim, vocab)

    def get_output_embeddings(self) -> nn.Module:
        """The output layer, as transformers names it (what ``--chunked-head`` defers)."""
        return self.head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        h = self.embed(ids) + self.pos[:t]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=h.device, dtype=h.dtype)
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.head(h)


def causal_lm(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TinyCausalLM().to(dtype)


def classification_batch(n: int, dtype: torch.dtype, gen: torch.Generator, image: bool = False):
    shape = (n, 2, 7, 7) if image else (n, 6)
    return torch.randn(shape, generator=gen, dtype=dtype), torch.randint(0, 3, (n,), generator=gen)


def padded_lm_batch(n: int, gen: torch.Generator, ctx: int = 12):
    """Token ids and labels with very uneven real lengths (padding labelled PAD)."""
    ids = torch.randint(0, VOCAB, (n, ctx), generator=gen)
    lengths = torch.randint(2, ctx + 1, (n,), generator=gen)
    lengths[0] = ctx  # one long sequence, others as short as 2 tokens
    labels = ids.clone()
    labels[torch.arange(ctx)[None, :] >= lengths[:, None]] = PAD
    return {"input_ids": ids, "labels": labels}


def mean_ce(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def lm_token_loss(model: nn.Module, batch):
    return token_cross_entropy(
        model(batch["input_ids"]), batch["labels"], ignore_index=PAD, shift=True
    )
