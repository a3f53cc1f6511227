"""How long `bigbatch.check` takes on models of a few million parameters (CPU).

Run: PYTHONPATH=src python benchmarks/check_speed.py
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import bigbatch


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def cnn_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    blocks = [nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.1, batch_first=True) for _ in range(4)]
    lm = nn.Sequential(nn.Embedding(1000, 256), *blocks, nn.Linear(256, 1000))
    ids = torch.randint(0, 1000, (16, 64))
    cnn = nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        nn.Flatten(), nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10),
    )
    images = (torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,)))
    for name, model, batch, loss in [("transformer LM", lm, ids, lm_loss), ("CNN + BatchNorm", cnn, images, cnn_loss)]:
        params = sum(p.numel() for p in model.parameters())
        start = time.perf_counter()
        report = bigbatch.check(model, batch, loss)
        seconds = time.perf_counter() - start
        verdict = "exact" if report.exact else f"not exact ({', '.join(d.kind for d in report.diagnoses)})"
        print(f"{name}: {params / 1e6:.1f}M parameters, batch 16: {seconds:.2f} s, {verdict}")


if __name__ == "__main__":
    main()
