"""``check(model, batch, loss_fn)``: is accumulation exact for *this* model and loss?

On float64 deep copies (the user's model, its running statistics and the global RNG are left
as they were), with the same seed for both runs, it computes the full-batch gradient of the mean
loss and the gradient that ``Accumulator.train_step`` really accumulates (Σ loss_sum / Σ count),
and compares them per parameter. When they differ it diagnoses why: modules whose output for one
sample depends on the other samples (found by probing every module, not by class name), a loss
that returns a mean as if it were a ``(loss_sum, count)`` pair, a batch-coupled loss (in-batch
negatives), dropout drawn per micro-batch, or non-determinism. When blocks of the model are
checkpointed (``enable_checkpointing``) it also checks that the gradient is the same without.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from bigbatch._tree import map_tensors, tensor_leaves
from bigbatch._warnings import BigBatchWarning
from bigbatch.batchnorm import label
from bigbatch.engine import Accumulator
from bigbatch.loss import LossFn, WindowLoss, as_sum_and_count
from bigbatch.memory.checkpointing import checkpointed_blocks, disable_checkpointing
from bigbatch.split import Batch, batch_size

Grads = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Diagnosis:
    """One reason accumulation is not exact.

    Attributes:
        kind: ``"batch-statistics"``, ``"mean-as-sum"``, ``"batch-coupled-loss"``,
            ``"dropout"``, ``"non-deterministic"`` or ``"checkpointing"``.
        modules: the modules responsible (names in the model), if any.
        message: what happens and what to do.
    """

    kind: str
    modules: tuple[str, ...]
    message: str


@dataclass
class CheckReport:
    """The result of ``check``.

    Attributes:
        exact: every parameter's relative difference is within ``tolerance``.
        differences: per parameter, ``‖g_acc − g_full‖ / ‖g_full‖`` (see ``_differences``).
        diagnoses: why it is not exact (empty when exact).
        batch_size, micro_batch_size: the batch compared and how it was cut.
        tolerance: the relative difference counted as rounding.
    """

    exact: bool
    differences: dict[str, float]
    batch_size: int
    micro_batch_size: int
    tolerance: float
    diagnoses: list[Diagnosis] = field(default_factory=list)

    @property
    def max_difference(self) -> float:
        """The largest per-parameter relative difference."""
        return max(self.differences.values(), default=0.0)

    def worst(self, k: int = 10) -> list[tuple[str, float]]:
        """The ``k`` parameters with the largest relative difference, largest first."""
        return sorted(self.differences.items(), key=lambda kv: -kv[1])[:k]

    def summary(self) -> str:
        """One paragraph: the verdict and each diagnosis."""
        head = (
            f"{'exact' if self.exact else 'NOT exact'}: max relative difference "
            f"{self.max_difference:.2e} (batch {self.batch_size}, micro-batches of {self.micro_batch_size})"
        )
        return "\n".join([head, *(f"- {d.kind}: {d.message}" for d in self.diagnoses)])


class NotExactError(AssertionError):
    """Accumulated and full-batch gradients differ; ``.report`` holds the ``CheckReport``."""

    def __init__(self, report: CheckReport) -> None:
        super().__init__(report.summary())
        self.report = report


def check(
    model: nn.Module,
    batch: Batch,
    loss_fn: LossFn,
    micro_batch_size: int | None = None,
    *,
    tolerance: float = 1e-10,
    seed: int = 0,
    raise_on_failure: bool = False,
) -> CheckReport:
    """Compare the accumulated gradient with the full-batch gradient on one batch, in float64.

    Args:
        model: the model, in the mode (train / eval) it trains in; it is not changed.
        batch: one logical batch (at least 2 samples).
        loss_fn: ``loss_fn(model, micro_batch)`` as given to the ``Accumulator``.
        micro_batch_size: samples per micro-batch; default about a third of the batch
            (uneven: 10 samples give 4 + 4 + 2).
        tolerance: relative difference counted as rounding.
        seed: the seed both runs start from (dropout masks, other randomness).
        raise_on_failure: raise ``NotExactError`` instead of returning a report that is not exact.

    Returns:
        The ``CheckReport``.

    Raises:
        ValueError: the batch has fewer than 2 samples, or ``micro_batch_size`` covers it all.
        NotExactError: not exact and ``raise_on_failure`` is set.

    Example:
        >>> m = torch.nn.Linear(3, 1)
        >>> mse = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
        >>> check(m, (torch.randn(10, 3), torch.randn(10, 1)), mse).exact
        True
    """
    n = batch_size(batch)
    if n < 2:
        raise ValueError(f"check needs a batch of at least 2 samples to cut; got {n}.")
    size = micro_batch_size or max(1, (n + 2) // 3)
    if size >= n:
        raise ValueError(
            f"micro_batch_size={size} covers the whole batch of {n} samples, so there is nothing to "
            "compare: use a smaller micro_batch_size or a larger batch."
        )
    batch = map_tensors(lambda t: t.double() if t.is_floating_point() else t, batch)
    full = _full_grads(model, batch, loss_fn, seed)
    acc = _accumulated_grads(model, batch, loss_fn, size, seed)
    differences = _differences(acc, full)
    report = CheckReport(
        exact=all(d <= tolerance for d in differences.values()),
        differences=differences,
        batch_size=n,
        micro_batch_size=size,
        tolerance=tolerance,
    )
    if not report.exact:
        report.diagnoses = diagnose(model, batch, loss_fn, size, seed, tolerance, full)
    if checkpointed_blocks(model):
        plain = _full_grads(model, batch, loss_fn, seed, checkpointing=False)
        worst = max(_differences(full, plain).values(), default=0.0)
        if worst > tolerance:
            report.exact = False
            report.diagnoses.append(Diagnosis(
                "checkpointing", tuple(checkpointed_blocks(model)),
                f"gradients with and without checkpointing differ (relative {worst:.1e}): the "
                "recomputed forward of these blocks is not the first one (state changed by the "
                "forward, or randomness outside torch's RNG).",
            ))
    if raise_on_failure and not report.exact:
        raise NotExactError(report)
        if raise_on_failure:
            raise NotExactError(report)
    return report


def diagnose(
    model: nn.Module, batch: Batch, loss_fn: LossFn, size: int, seed: int, tolerance: float, full: Grads
) -> list[Diagnosis]:
    """Why the accumulated gradient differs: every cause found (see the module docstring)."""
    found = []
    again = _full_grads(model, batch, loss_fn, seed)
    if max(_differences(again, full).values(), default=0.0) > tolerance:
        found.append(Diagnosis(
            "non-deterministic", (),
            "two full-batch runs from the same seed give different gradients: the model or loss "
            "uses randomness or non-deterministic kernels outside torch's seeded RNG.",
        ))
    coupled = coupled_modules(model, batch, loss_fn, seed)
    if coupled:
        found.append(Diagnosis(
            "batch-statistics", tuple(coupled),
            f"{_labels(model, coupled)} change one sample's output when other samples change (batch "
            "statistics in training mode): each micro-batch sees its own statistics. Use "
            'bigbatch.batchnorm(model, policy="groupnorm") or "freeze", or accept ghost-batch semantics.',
        ))
    found.extend(_loss_diagnoses(model, batch, loss_fn, seed))
    dropout = [name for name, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0]
    if dropout and not coupled and not any(d.kind != "dropout" for d in found):
        found.append(Diagnosis(
            "dropout", tuple(dropout),
            f"{_labels(model, dropout)} draw their masks per micro-batch, so the masks differ from the "
            "full batch's (fused kernels draw in another order): each step is an equally valid "
            "sample, not the same numbers. Put those modules in eval() to check the rest.",
        ))
    return found


def coupled_modules(model: nn.Module, batch: Batch, loss_fn: LossFn, seed: int) -> list[str]:
    """Modules whose output for sample 0 changes when the other samples of its input change.

    A forward pass records every module's inputs; each module is then run again with samples
    1.. of its first input perturbed, from the same seed. Only the innermost coupled modules are
    named (a container of a BatchNorm is coupled through it).
    """
    n = batch_size(batch)
    work = _copy(model)
    names = {m: name for name, m in work.named_modules()}
    inputs: dict[nn.Module, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        inputs.setdefault(module, (args, kwargs))

    hooks = [m.register_forward_pre_hook(record, with_kwargs=True) for m in work.modules()]
    with _seeded(seed), torch.no_grad():
        loss_fn(work, batch)
    for h in hooks:
        h.remove()
    coupled = [names[m] for m, (a, kw) in inputs.items() if _is_coupled(m, a, kw, n, seed)]
    inner = [c for c in coupled if not any(o != c and (c == "" or o.startswith(c + ".")) for o in coupled)]
    return inner


def _labels(model: nn.Module, names: list[str]) -> str:
    return ", ".join(label(name, model.get_submodule(name)) for name in names)


def _is_coupled(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], n: int, seed: int) -> bool:
    if not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
        return False
    x = args[0]
    if x.dim() == 0 or x.shape[0] != n:
        return False
    other = x.clone()
    other[1:] = x[1:] * 1.7 + 0.3
    outs = []
    for first in (x, other):
        with _seeded(seed), torch.no_grad():
            outs.append(_first_rows(module(first, *args[1:], **kwargs), n))
    a, b = outs
    return a is not None and b is not None and not torch.allclose(a, b, rtol=1e-9, atol=1e-12)


def _first_rows(out: Any, n: int) -> torch.Tensor | None:
    for _, t in tensor_leaves(out):
        if t.dim() and t.shape[0] == n and t.is_floating_point():
            return t[0]
    return None


def _loss_diagnoses(model: nn.Module, batch: Batch, loss_fn: LossFn, seed: int) -> list[Diagnosis]:
    """Is the loss additive over samples (as (loss_sum, count) must be)?"""
    if isinstance(loss_fn, WindowLoss):  # coupled by design, exact through the window (cached_loss)
        return []
    n = batch_size(batch)
    work = _copy(model).eval()  # probes the loss alone: no dropout, running statistics
    half = n // 2
    parts = [_rows(batch, a, b) for a, b in ((0, half), (half, n))]
    with torch.no_grad():
        whole, count = _sum_and_count(work, batch, loss_fn, seed)
        sums = [_sum_and_count(work, p, loss_fn, seed) for p in parts]
    tol = 1e-9 * max(1.0, abs(whole))
    if abs(whole - sum(s for s, _ in sums)) <= tol and abs(count - sum(c for _, c in sums)) <= 1e-9:
        return []
    if abs(whole * n - sum(s * batch_size(p) for (s, _), p in zip(sums, parts, strict=True))) <= tol * n:
        return [Diagnosis(
            "mean-as-sum", (),
            "loss_fn returns a mean as the loss_sum of its (loss_sum, count) pair: return "
            "(per_item_losses.sum(), count), or the mean alone.",
        )]
    return [Diagnosis(
        "batch-coupled-loss", (),
        "each sample's loss depends on the other samples in the batch (e.g. in-batch negatives "
        "of a contrastive loss): a micro-batch sees fewer of them. If it depends on them only "
        "through per-sample representations (embeddings), write it as "
        "bigbatch.cached_loss(encode, batch_loss) -- encode(model, micro_batch) returns the "
        "representations, batch_loss(reps, batch) the whole batch's loss from them -- and "
        "accumulation is exact (docs/contrastive.md); otherwise accept the smaller pool.",
    )]


def _rows(batch: Batch, start: int, stop: int) -> Batch:
    return map_tensors(lambda t: t[start:stop], batch)


def _sum_and_count(model: nn.Module, batch: Batch, loss_fn: LossFn, seed: int) -> tuple[float, float]:
    with _seeded(seed):
        loss_sum, count = as_sum_and_count(loss_fn(model, batch), batch_size(batch))
    return float(loss_sum), float(count)


def _full_grads(
    model: nn.Module, batch: Batch, loss_fn: LossFn, seed: int, checkpointing: bool = True
) -> Grads:
    work = _copy(model)
    if not checkpointing:
        disable_checkpointing(work)
    with _seeded(seed):
        loss_sum, count = as_sum_and_count(loss_fn(work, batch), batch_size(batch))
        (loss_sum / count).backward()
    return _grads(work)


def _accumulated_grads(model: nn.Module, batch: Batch, loss_fn: LossFn, size: int, seed: int) -> Grads:
    """The gradient ``Accumulator.train_step`` steps with, captured by a recording optimizer."""
    work = _copy(model)
    params = [p for p in work.parameters() if p.requires_grad]
    recorder = _Recorder(params)
    with _seeded(seed), warnings.catch_warnings():
        warnings.simplefilter("ignore", BigBatchWarning)  # check reports the cause itself
        Accumulator(work, recorder, micro_batch_size=size).train_step(batch, loss_fn)
    by_id = {id(p): name for name, p in work.named_parameters()}
    return {by_id[k]: g for k, g in recorder.grads.items()}


class _Recorder(torch.optim.Optimizer):
    """An optimizer whose step records the normalised gradients and changes nothing."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params, {})
        self.grads: dict[int, torch.Tensor] = {}

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.grads[id(p)] = p.grad.detach().clone()


def _copy(model: nn.Module) -> nn.Module:
    work = copy.deepcopy(model).double()
    work.zero_grad(set_to_none=True)
    return work


def _grads(model: nn.Module) -> Grads:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _differences(got: Grads, want: Grads) -> dict[str, float]:
    """Per parameter ``‖got − want‖ / max(‖want‖, 1e-6 ‖all of want‖)``.

    The floor keeps a gradient that is zero in exact arithmetic (a bias before a normalisation)
    from turning rounding noise into a relative difference of 1.
    """
    total = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in want.values()])))
    floor = max(1e-6 * total, torch.finfo(torch.float64).tiny)
    out = {}
    for name, g in want.items():
        a = got.get(name, torch.zeros_like(g))
        out[name] = float(torch.linalg.vector_norm(a - g)) / max(float(torch.linalg.vector_norm(g)), floor)
    return out


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Fork the global RNG (CPU and initialised CUDA devices), seed it, restore it afterwards."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def run_check_command(task_path: str, batch_size_: int, micro_batch_size: int | None) -> int:
    """``bigbatch check``: check one batch of a task, print a table; 0 when exact, else 1."""
    from rich.console import Console
    from rich.table import Table

    from bigbatch.train.task import load_task

    if batch_size_ < 2:
        raise ValueError(f"--batch-size {batch_size_} is too small: use at least 2.")
    task = load_task(task_path)
    loader = torch.utils.data.DataLoader(
        task.train_data, batch_size=batch_size_, shuffle=False, collate_fn=task.collate_fn
    )
    report = check(task.model, next(iter(loader)), task.loss_fn, micro_batch_size)
    table = Table(title=f"bigbatch check {task_path}: worst parameters")
    table.add_column("parameter")
    table.add_column("relative difference", justify="right")
    for name, diff in report.worst(10):
        table.add_row(name, f"{diff:.2e}")
    console = Console()
    console.print(table)
    console.print(report.summary(), markup=False)
    return 0 if report.exact else 1
