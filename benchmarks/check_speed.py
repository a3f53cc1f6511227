"""How long `bigbatch.verifier._check` takes on models of a few million parameters (CPU).

For each model it prints the time of one `check` and, measured in the same run, the time of one
plain float64 forward + backward of the same batch (the median of three), and their ratio: what
a check costs in full-batch steps, a figure that noise on a shared machine moves less than the
seconds. A check that finds a difference also diagnoses it (probes every module), which costs
more than one that finds none. The transformers rows run when transformers is installed.

Run: PYTHONPATH=src python benchmarks/check_speed.py
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import bigbatch

Case = tuple[str, nn.Module, Any, Callable[[nn.Module, Any], Any]]


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def cnn_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def hf_token_loss(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return bigbatch.token_cross_entropy(model(input_ids=ids).logits, ids, shift=True)


def hf_mean_as_sum(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    loss_sum, count = hf_token_loss(model, ids)
    return loss_sum / count, count  # wrong on purpose: a token mean passed as loss_sum


def plain_step_seconds(model: nn.Module, batch: Any, loss_fn: Callable[..., Any]) -> float:
    """Median time of one float64 forward + backward of the whole batch (3 runs)."""
    work = copy.deepcopy(model).double()
    batch = float64(batch)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        out = loss_fn(work, batch)
        loss = out[0] / out[1] if isinstance(out, tuple) else out
        loss.backward()
        times.append(time.perf_counter() - start)
        work.zero_grad(set_to_none=True)
    return statistics.median(times)


def float64(batch: Any) -> Any:
    if isinstance(batch, tuple):
        return tuple(float64(t) for t in batch)
    return batch.double() if batch.is_floating_point() else batch


def cases() -> list[Case]:
    torch.manual_seed(0)
    blocks = [
        nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.1, batch_first=True) for _ in range(4)
    ]
    lm = nn.Sequential(nn.Embedding(1000, 256), *blocks, nn.Linear(256, 1000))
    ids = torch.randint(0, 1000, (16, 64))
    cnn = nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 128, 3, padding=1), nn.BatchNorm2d(128), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        nn.Flatten(), nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10),
    )  # fmt: skip
    images = (torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,)))
    found: list[Case] = [
        ("transformer LM", lm, ids, lm_loss),
        ("CNN + BatchNorm", cnn, images, cnn_loss),
    ]
    try:
        import transformers
    except ImportError:
        return found
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    llama = transformers.LlamaForCausalLM(config)
    found += [
        ("Llama (transformers), token loss", llama, ids, hf_token_loss),
        ("Llama (transformers), mean-as-sum", llama, ids, hf_mean_as_sum),
    ]
    return found


def main() -> None:
    torch.set_num_threads(2)
    print("| model | parameters | check | plain float64 step | ratio | verdict |")
    print("|---|---|---|---|---|---|")
    for name, model, batch, loss in cases():
        params = sum(p.numel() for p in model.parameters())
        step = plain_step_seconds(model, batch, loss)
        start = time.perf_counter()
        report = bigbatch.check(model, batch, loss)
        seconds = time.perf_counter() - start
        kinds = ", ".join(d.kind for d in report.diagnoses)
        verdict = "exact" if report.exact else f"not exact ({kinds})"
        if report.compute_dtype != torch.float64:
            verdict += f", tolerance {report.tolerance:.0e} ({report.compute_dtype} islands)"
        print(
            f"| {name} | {params / 1e6:.1f}M | {seconds:.2f} s | {step:.3f} s | "
            f"{seconds / step:.0f}x | {verdict} |"
        )


if __name__ == "__main__":
    main()
