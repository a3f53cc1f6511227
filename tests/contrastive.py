"""A tiny two-tower model and contrastive losses for the cached_loss tests (float64, no downloads).

``TwoTower`` maps "images" (6 features) and "texts" (7 features) into one 5-dimensional space of
unit vectors, with CLIP's learnable logit scale; each tower is a stem, two residual ``Block``s
(with dropout, checkpointable by class) and a projection. ``losses(model, kind, temperature)``
gives the ``(encode, batch_loss)`` pair for one model copy:

* kind ``"clip"``: the symmetric InfoNCE of CLIP, a mean over the samples;
* kind ``"masked_sum"``: the same with false negatives masked (pairs whose ``batch["label"]``
  agree are not negatives), returned as ``(loss_sum, count)`` with count = 2 N;
* temperature ``"encode"``: ``encode`` returns ``logit_scale.exp()`` as a 0-dim output;
  ``"direct"``: ``batch_loss`` uses ``model.logit_scale`` itself (a closure over the parameter).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(torch.tanh(self.lin(h)))


class TwoTower(nn.Module):
    def __init__(self, dropout: float = 0.0, dim: int = 8, out: int = 5) -> None:
        super().__init__()
        self.a = nn.Sequential(
            nn.Linear(6, dim), Block(dim, dropout), Block(dim, dropout), nn.Linear(dim, out)
        )
        self.b = nn.Sequential(
            nn.Linear(7, dim), Block(dim, dropout), Block(dim, dropout), nn.Linear(dim, out)
        )
        # shape [1], not []: FSDP2 does not shard 0-dim parameters
        self.logit_scale = nn.Parameter(torch.full((1,), math.log(1 / 0.3)))

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        return (
            F.normalize(self.a(x), dim=-1),
            F.normalize(self.b(y), dim=-1),
            self.logit_scale.exp()[0],
        )


def two_tower(dropout: float = 0.0, dtype: torch.dtype = torch.float64, seed: int = 0) -> TwoTower:
    torch.manual_seed(seed)
    return TwoTower(dropout).to(dtype)


def pairs(n: int, gen: torch.Generator, dtype: torch.dtype = torch.float64) -> dict:
    """``n`` matching pairs: y is a noisy linear view of x; labels in 0..2 (repeats: false negatives)."""
    x = torch.randn(n, 6, generator=gen, dtype=dtype)
    mix = torch.randn(6, 7, generator=gen, dtype=dtype)
    y = x @ mix + 0.5 * torch.randn(n, 7, generator=gen, dtype=dtype)
    return {"x": x, "y": y, "label": torch.randint(0, 3, (n,), generator=gen)}


def _clip(q: torch.Tensor, d: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    logits = scale * q @ d.T
    targets = torch.arange(len(q), device=q.device)
    return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)) / 2


def _masked_sum(q, d, scale, label):
    logits = scale * q @ d.T
    same = (label[:, None] == label[None, :]) & ~torch.eye(len(q), dtype=torch.bool)
    logits = logits.masked_fill(same, float("-inf"))
    targets = torch.arange(len(q))
    rows = F.cross_entropy(logits, targets, reduction="sum")
    cols = F.cross_entropy(logits.T, targets, reduction="sum")
    return rows + cols, 2 * len(q)


def losses(model: nn.Module, kind: str = "clip", temperature: str = "encode"):
    """``(encode, batch_loss)`` for ``model`` (see the module docstring)."""

    def encode(m, mb):
        q, d, scale = m(mb["x"], mb["y"])
        return (q, d, scale) if temperature == "encode" else (q, d)

    def batch_loss(reps, batch):
        if temperature == "encode":
            q, d, scale = reps
        else:
            (q, d), scale = reps, model.logit_scale.exp()[0]
        if kind == "clip":
            return _clip(q, d, scale)
        return _masked_sum(q, d, scale, batch["label"])

    return encode, batch_loss


def concat_reps(parts: list) -> tuple:
    """The per-chunk outputs of ``encode`` as one batch's: rows concatenated, 0-dim from the first."""
    return tuple(torch.cat(ts) if ts[0].dim() else ts[0] for ts in zip(*parts, strict=True))
