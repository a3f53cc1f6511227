"""The step ledger: what one optimizer step counted and computed, from its samples' lengths.

Note [step ledger]
    Counted per step, once per data-parallel replica (a tensor- or context-parallel rank sees
    its replica's tokens: sum over the data-parallel group only), from what the cut knows:
    ``loss_tokens`` is the window's count (the normaliser, already global); ``input_tokens``
    Σ lᵢ, the samples' real tokens; ``computed_tokens`` Σ rows × length over the micro-batches,
    padding included; ``token_efficiency`` their ratio. FLOPs (a multiply-add is 2):

    * ``model_flops`` = 6 · N · Σ lᵢ + 12 · layers · width · Σ a(lᵢ): the linear layers
      (forward 2N per token, backward 4N) and attention's two products (QKᵀ and AV, each
      2 · l² · width forward, twice that backward) over each sample alone, packed or not, with
      a(l) = l(l + 1) / 2 for a causal model (the scores it needs), l² otherwise; ``width`` is
      heads × head_dim (the query side).
    * ``computed_flops``: the same over what ran, 6 · N · Σ rows · R + 12 · layers · width ·
      Σ rows · R²: padding is computed, and a dense attention kernel (SDPA or eager with a
      mask, on CPU) computes every score of a row, masked or not. A varlen kernel (flash
      attention with ``cu_seq_lens``) computes only the samples' own, about the model's.
      ``torch.utils.flop_counter.FlopCounterMode`` counts the same, except that torch 2.13
      counts nothing for CPU SDPA (``_scaled_dot_product_flash_attention_for_cpu`` is not in
      its registry): compare with eager attention.
    * ``recompute_flops``: activation checkpointing's second forward, the share ``recompute``
      of the forward (a third of ``computed_flops``), apart from both.

    ``mfu`` = ``model_flops`` / seconds / the peak, the peak either measured once
    (``measure_peak_flops``: one matrix product in the model's dtype) or given, and
    ``peak_source`` says which. ``bytes_per_token``: the peak memory over the largest
    micro-batch's computed tokens.

Note [matmul parameters]
    N counts the weights that enter a matrix product, each once: ``nn.Linear`` (not its bias:
    an addition), transformers' ``Conv1D`` (GPT-2) and ``nn.Conv1d`` (per position, like a
    linear layer). An embedding is a lookup, not a product, and is left out, unless its weight
    is also a linear layer's (a tied head), which then counts once. Experts kept as plain
    parameters (a mixture of experts' grouped products) are not found: give ``FlopModel`` the
    active parameters yourself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True)
class FlopModel:
    """What a model's FLOPs per token depend on (Note [step ledger]).

    Attributes:
        parameters: matmul parameters N (Note [matmul parameters]).
        layers: attention layers.
        width: attention heads × head dimension.
        causal: each token attends only to the tokens before it.
    """

    parameters: int
    layers: int
    width: int
    causal: bool = True


@dataclass(frozen=True)
class Ledger:
    """What one step counted and computed, on one data-parallel replica (Note [step ledger])."""

    loss_tokens: float
    input_tokens: int
    computed_tokens: int
    model_flops: float
    computed_flops: float
    recompute_flops: float = 0.0
    seconds: float | None = None
    peak_flops: float | None = None  # per second
    peak_source: str | None = None  # "given", or how it was measured
    peak_bytes: int | None = None
    largest_micro_batch: int | None = None  # its computed tokens

    @property
    def token_efficiency(self) -> float:
        """Real tokens over computed tokens (1 - the padding share)."""
        return self.input_tokens / self.computed_tokens

    @property
    def flops_per_s(self) -> float | None:
        """Model FLOPs per second of the step."""
        return None if not self.seconds else self.model_flops / self.seconds

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation: ``flops_per_s`` over the peak."""
        rate = self.flops_per_s
        return None if rate is None or not self.peak_flops else rate / self.peak_flops

    @property
    def bytes_per_token(self) -> float | None:
        """Peak memory per computed token of the largest micro-batch."""
        if self.peak_bytes is None or not self.largest_micro_batch:
            return None
        return self.peak_bytes / self.largest_micro_batch


def matmul_parameters(model: torch.nn.Module) -> int:
    """The weights ``model`` multiplies by, each counted once (Note [matmul parameters])."""
    found: dict[int, int] = {}
    for module in model.modules():
        if (
            isinstance(module, (torch.nn.Linear, torch.nn.Conv1d))
            or type(module).__name__ == "Conv1D"
        ):
            weight = module.get_parameter("weight")
            found[id(weight)] = weight.numel()
    return sum(found.values())


def flop_model(model: torch.nn.Module, causal: bool = True) -> FlopModel:
    """``FlopModel`` of a transformers model, its attention read from its ``config``
    (``layer_types``: full and sliding attention layers only).

    Raises:
        ValueError: no config with the layers, heads and width: build ``FlopModel`` yourself.
    """
    config = getattr(model, "config", None)
    names = (("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head"))
    found = [next((getattr(config, n) for n in pair if hasattr(config, n)), None) for pair in names]
    found.append(getattr(config, "hidden_size", getattr(config, "n_embd", None)))
    if None in found:
        raise ValueError(
            f"{type(model).__name__} has no transformers config with its layers, heads and "
            "width: pass FlopModel(matmul_parameters(model), layers=..., width=heads * head_dim)."
        )
    layers, heads, hidden = (int(v) for v in found)  # type: ignore[arg-type]  # not None
    head = getattr(config, "head_dim", None) or hidden // heads
    if kinds := getattr(config, "layer_types", None):  # linear attention is not counted
        layers = sum(k in ("full_attention", "sliding_attention") for k in kinds)
    return FlopModel(matmul_parameters(model), layers, heads * head, causal)


def step_ledger(
    flops: FlopModel,
    loss_tokens: float,
    lengths: Sequence[int],
    shapes: Sequence[tuple[int, int]],
    *,
    recompute: float = 0.0,
    seconds: float | None = None,
    peak: tuple[float, str] | None = None,
    peak_bytes: int | None = None,
) -> Ledger:
    """The ledger of one step (Note [step ledger]).

    Args:
        flops: the model's ``FlopModel``.
        loss_tokens: the window's count (its normaliser).
        lengths: each sample's real tokens, on this replica.
        shapes: ``(rows, length)`` of each micro-batch run, on this replica.
        recompute: the share of the forward that activation checkpointing runs again.
        seconds: the step's wall-clock time.
        peak: ``(FLOP/s, source)``: ``measure_peak_flops``'s, or ``(value, "given")``.
        peak_bytes: the step's peak memory.

    Example:
        >>> ledger = step_ledger(FlopModel(100, 1, 4), 5, [3, 2], [(1, 4), (1, 4)])
        >>> ledger.input_tokens, ledger.computed_tokens, ledger.model_flops
        (5, 8, 3432.0)
    """
    area = (lambda n: n * (n + 1) / 2) if flops.causal else (lambda n: float(n * n))
    attention = 12 * flops.layers * flops.width
    computed = sum(rows * length for rows, length in shapes)
    dense = sum(rows * length * length for rows, length in shapes)
    computed_flops = 6 * flops.parameters * computed + attention * dense
    peak_flops, peak_source = peak or (None, None)
    return Ledger(
        loss_tokens=float(loss_tokens),
        input_tokens=sum(lengths),
        computed_tokens=computed,
        model_flops=6.0 * flops.parameters * sum(lengths) + attention * sum(map(area, lengths)),
        computed_flops=float(computed_flops),
        recompute_flops=recompute * computed_flops / 3,
        seconds=seconds,
        peak_bytes=peak_bytes,
        largest_micro_batch=max((rows * length for rows, length in shapes), default=None),
        peak_flops=peak_flops,
        peak_source=peak_source,
    )


class Ledgers:
    """The ledger of each step of an ``Accumulator`` (Note [step ledger]): its model's
    ``FlopModel``, read once at the first step (attention counted where a transformers config
    says its layers and width, else left out: ``FlopModel(matmul_parameters(model), 0, 0)``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.flops: FlopModel | None = None

    def add(self, result: Any, pieces: Sequence[Any]) -> Any:
        """``result`` (a ``StepResult``) with the window's real and computed tokens and its
        ledger, where the cut knows each sample's tokens; else as it is."""
        if pieces[0].tokens is None:
            return result
        if self.flops is None:
            owner = next((m for m in self.model.modules() if hasattr(m, "config")), None)
            try:
                self.flops = flop_model(owner) if owner is not None else None
            except ValueError:
                pass
            self.flops = self.flops or FlopModel(matmul_parameters(self.model), 0, 0)
        lengths = [n for p in pieces for n in p.lengths or ()]
        shapes = [(p.padded_tokens // p.width, p.width) for p in pieces if p.width]
        ledger = step_ledger(
            self.flops, result.count, lengths, shapes, peak_bytes=result.peak_bytes
        )
        padded = sum(p.padded_tokens or 0 for p in pieces)
        return replace(result, tokens=ledger.input_tokens, padded_tokens=padded, ledger=ledger)


def measure_peak_flops(
    dtype: torch.dtype, device: torch.device | str, size: int | None = None, repeats: int = 3
) -> tuple[float, str]:
    """The FLOP/s of one ``size × size`` matrix product in ``dtype`` on ``device`` (the best of
    ``repeats`` after a warm-up; ``size``: 8192 on a GPU, 1024 elsewhere), and how it was found.
    """
    from torch.utils.benchmark import Timer

    device = torch.device(device)
    n = size or (8192 if device.type == "cuda" else 1024)
    seeded = torch.Generator(device).manual_seed(0)  # the global generators untouched (resume)
    a, b = (torch.randn(n, n, device=device, generator=seeded).to(dtype) for _ in range(2))
    a @ b  # warm-up
    seconds = min(
        Timer("a @ b", globals={"a": a, "b": b}).timeit(1).raw_times for _ in range(repeats)
    )
    name = str(dtype).removeprefix("torch.")
    return 2 * n**3 / seconds[0], f"measured: one {n}x{n} {name} matmul on {device}"
