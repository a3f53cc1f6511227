"""Why accumulated and full-batch gradients differ: the diagnoses of ``check``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from bigbatch.core._tree import tensor_leaves
from bigbatch.core.batchnorm import label
from bigbatch.core.loss import WindowLoss
from bigbatch.core.split import Batch, batch_size, split
from bigbatch.memory.checkpointing import checkpointed_blocks
from bigbatch.verifier._probes import finite, probe_coupling
from bigbatch.verifier._runs import Case, FullRun, copy_float64, differences, full_run, seeded


@dataclass(frozen=True)
class Diagnosis:
    """One reason accumulation is not exact.

    Attributes:
        kind: ``"non-finite"``, ``"batch-statistics"``, ``"mean-as-sum"``, ``"token-mean"``,
            ``"batch-coupled-loss"``, ``"term-mean"`` (a named term normalised inside the
            micro-batch), ``"term-batch-statistic"`` (a named term that depends on the other
            samples of its micro-batch), ``"non-deterministic"``, ``"unprobed"`` (no cause found,
            and these modules could not be probed) or ``"checkpointing"``.
        modules: the modules (names in the model), parameters or named terms responsible.
        message: what happens and what to do.
    """

    kind: str
    modules: tuple[str, ...]
    message: str


Pair = tuple[float, float]
"""A ``(loss_sum, count)`` as floats."""

MESSAGES = {  # what happens and what to do, by kind; {} is where the modules are named
    "non-deterministic": "two full-batch runs from the same seed give different gradients: the "
    "model or loss uses randomness or non-deterministic kernels outside torch's seeded RNG.",
    "batch-statistics": "{} change one sample's output when other samples change (batch "
    "statistics in training mode): each micro-batch sees its own statistics. Use "
    'bigbatch.batchnorm(model, policy="groupnorm") or "freeze", or accept ghost-batch semantics.',
    "unprobed": "no cause found, and {} could not be probed: replayed on their recorded inputs "
    "they raised or gave another result (state each call changes): look for such state in them.",
    "checkpointing": "gradients with and without checkpointing differ (relative {}): these blocks' "
    "recomputed forward is not the first (state the forward changes, or randomness outside torch).",
    "mean-as-sum": "loss_fn returns a mean as the loss_sum of (loss_sum, count): micro-batch means "
    "are added up. Return (losses.sum(), count) (tokens: bigbatch.token_cross_entropy(logits, "
    "labels), or a transformers model's out.loss * count), or a mean over samples alone.",
    "token-mean": "loss_fn returns a mean over labelled tokens, read as a mean over samples: short "
    "sequences weigh as much as long ones. Instead return (loss_sum, token_count): bigbatch."
    "token_cross_entropy(logits, labels), or (out.loss * count, count) for a labels= loss.",
    "batch-coupled-loss": "each sample's loss depends on the other samples (in-batch negatives): a "
    "micro-batch sees fewer. If only through per-sample representations, bigbatch.cached_loss("
    "encode, batch_loss) (encode(model, micro_batch) gives them, batch_loss(reps, batch) the "
    "batch's loss) is exact (docs/contrastive.md); else accept the smaller pool.",
    "term-mean": "term {!r} is normalised inside each micro-batch ((x.mean(), 1), (x.sum() / len("
    "micro_batch), 1)): micro-batch means are added up. Return its sum and count, (x.sum(), n).",
    "term-batch-statistic": "term {!r} of a sample depends on the other samples of its micro-batch"
    ": a statistic computed per micro-batch (advantages normalised by its mean and std, a MoE "
    "balance over its routing). Compute it in stats_fn (train_step(batch, loss_fn, stats_fn="
    "stats_fn), docs/compound_losses.md); in-batch negatives: bigbatch.cached_loss.",
}


def diagnose(
    case: Case, tolerance: float, full: dict[str, torch.Tensor], terms: dict[str, float]
) -> list[Diagnosis]:
    """Why the accumulated gradient differs from ``full``: every cause found, most specific
    first (empty when none is found). Every probe works on a float64 copy of ``case.model``;
    ``tolerance`` is the relative difference counted as rounding (Note [float32 islands]);
    ``terms`` holds each named term's difference (``term_difference``; empty: a plain loss)."""
    found = [_naming("non-deterministic", case.model, [])] * (_rerun(case, full) > tolerance)
    work, rtol = copy_float64(case.model), max(1e-9, tolerance)
    coupled, unprobed = probe_coupling(
        work, lambda: case.loss_fn(work, case.batch), batch_size(case.batch),
        lambda: seeded(case.seed), rtol,
    )  # fmt: skip
    found += [_naming("batch-statistics", case.model, coupled)] * bool(coupled)
    differ = [k for k, d in terms.items() if not d <= tolerance] if terms else None
    found += _loss_diagnoses(case, rtol, bool(coupled or unprobed), differ)
    return found or [_naming("unprobed", case.model, unprobed)] * bool(unprobed)


def checkpointing(case: Case, full: dict[str, torch.Tensor], tolerance: float) -> list[Diagnosis]:
    """Does the gradient change when the model's checkpointed blocks are not checkpointed?"""
    worst = _rerun(case, full, checkpointing=False)
    blocks = tuple(checkpointed_blocks(case.model))
    message = MESSAGES["checkpointing"].format(f"{worst:.1e}")
    return [Diagnosis("checkpointing", blocks, message)] if worst > tolerance else []


def _rerun(case: Case, full: dict[str, torch.Tensor], checkpointing: bool = True) -> float:
    """The largest difference between ``full`` and the gradient of another full-batch run."""
    return max(differences(full_run(case, checkpointing).grads, full).values(), default=0.0)


def _naming(kind: str, model: nn.Module, names: list[str]) -> Diagnosis:
    labels = ", ".join(label(name, model.get_submodule(name)) for name in names)
    return Diagnosis(kind, tuple(names), MESSAGES[kind].format(labels))


def _loss_diagnoses(
    case: Case, rtol: float, suspect: bool, terms: list[str] | None
) -> list[Diagnosis]:
    """Is the loss, or each named term in ``terms`` (those that differ; ``None``: a plain loss),
    additive over samples (as (loss_sum, count) must be)? See ``loss_kind``.

    When modules of the model couple the samples or change state with every call (``suspect``;
    BatchNorm does not count, the eval() copy runs it on running statistics), halves do not add
    up whatever the loss does, so the loss is blamed only for a pattern it alone explains. A
    window loss (``cached_loss``) is coupled by design and exact through the window.
    """
    if isinstance(case.loss_fn, WindowLoss):
        return []
    work, n = copy_float64(case.model).eval(), batch_size(case.batch)  # the loss alone
    half = (n + 1) // 2
    per_sample = [torch.ones(n), *labelled_tokens(case.batch)]
    weights = [[float(k.sum()) for k in split(items, half)] for items in per_sample]
    whole, parts, found = case.sums(work, n)[0], case.sums(work, half), []
    for name in whole if terms is None else terms:
        kind = loss_kind(whole[name], [p[name] for p in parts], weights, rtol)
        if kind is None or (suspect and kind == "batch-coupled-loss"):
            continue
        if terms is not None:  # a named term: name it
            kind = "term-batch-statistic" if kind == "batch-coupled-loss" else "term-mean"
        found.append(Diagnosis(kind, () if terms is None else (name,), MESSAGES[kind].format(name)))
    return found


def loss_kind(
    whole: Pair, parts: list[Pair], weights: list[list[float]], rtol: float
) -> str | None:
    """What is wrong with a loss, from its ``(loss_sum, count)`` on a batch and on its parts.

    Args:
        whole: ``(loss_sum, count)`` on the whole batch.
        parts: ``(loss_sum, count)`` on each part (the parts cut the batch).
        weights: candidate item counts of each part that a mean might be over: samples first,
            then the labelled tokens of each labels tensor (``labelled_tokens``).
        rtol: relative difference counted as rounding.

    Returns:
        ``None`` when sums and counts add up (exact), ``"mean-as-sum"`` when ``loss_sum / count``
        is a mean over the parts' own counts or samples, ``"token-mean"`` when ``loss_sum /
        count`` is a mean over labelled tokens the count does not count, else
        ``"batch-coupled-loss"``.

    Example:
        >>> loss_kind((6.0, 3.0), [(2.0, 1.0), (4.0, 2.0)], [[1.0, 2.0]], 1e-9) is None
        True
    """

    def adds_up(total: float, pieces: list[float]) -> bool:
        return abs(total - sum(pieces)) <= rtol * max(1.0, abs(total), *(abs(p) for p in pieces))

    def weighted(values: list[float], w: list[float]) -> list[float]:
        return [v * k for v, k in zip(values, w, strict=True)]

    (s, c), sums, counts = whole, [p[0] for p in parts], [p[1] for p in parts]
    if adds_up(s, sums) and adds_up(c, counts):
        return None
    # the mean returned as loss_sum, over its count or samples
    if any(adds_up(s * sum(w), weighted(sums, w)) for w in (counts, weights[0])):
        return "mean-as-sum"
    means = [ps / pc for ps, pc in parts]
    if any(adds_up(s / c * sum(w), weighted(means, w)) for w in weights[1:]):
        return "token-mean"
    return "batch-coupled-loss"


def labelled_tokens(batch: Batch, ignore_index: int = -100) -> list[torch.Tensor]:
    """Per sample, the labelled positions of every integer tensor that marks some with -100.

    Each such tensor gives two candidates: all its labelled positions, and those after the
    first (a causal LM's shifted labels, as transformers and ``token_cross_entropy(shift=True)``
    count them).
    """
    found = []
    for _, t in tensor_leaves(batch):
        if t.dim() >= 2 and not t.is_floating_point() and bool((t == ignore_index).any()):
            real = (t != ignore_index).flatten(1)
            found += [real.sum(1).double(), real[:, 1:].sum(1).double()]
    return found


def nonfinite(
    case: Case, full: FullRun, acc: dict[str, torch.Tensor], acc_loss: float
) -> Diagnosis | None:
    """Where the NaN or inf comes from, when a loss or gradient is not finite (``None`` when
    everything is): the inputs, the model's weights, the first module whose output is not
    finite, the loss, the backward; and when only the accumulated gradient (``acc``, window loss
    ``acc_loss``) is not finite, the first micro-batch whose loss is not."""
    if full.finite and math.isfinite(acc_loss) and all(finite(g) for g in acc.values()):
        return None
    if (found := _nonfinite_data(case.model, case.batch)) is not None or full.finite:
        return found or _nonfinite_micro_batch(case)
    if (first := full.observed.nonfinite) is not None:
        return _nonfinite(
            f"non-finite outputs: {label(first, case.model.get_submodule(first))} is the first "
            "module whose output holds NaN or inf, from finite inputs and weights (an overflow, a "
            "log or division by zero...): fix that computation.", first,
        )  # fmt: skip
    if not math.isfinite(full.loss):
        return _nonfinite(
            f"non-finite loss: loss_fn returns a loss of {full.loss} from finite model outputs "
            "(a log of 0, a division by a zero count, ...): fix loss_fn."
        )
    return _nonfinite_backward([name for name, g in full.grads.items() if not finite(g)])


def _nonfinite(message: str, *modules: str) -> Diagnosis:
    return Diagnosis("non-finite", modules, message)


def _nonfinite_backward(bad: list[str]) -> Diagnosis:
    shown = f" ({', '.join(bad[:5])})" if bad else ""
    where = "a finite loss" if bad else "finite losses on every micro-batch"
    return _nonfinite(
        f"non-finite gradients{shown} from {where}: a backward that divides by zero (the square "
        "root or norm of 0...): add an epsilon there.", *bad,
    )  # fmt: skip


def _nonfinite_data(model: nn.Module, batch: Batch) -> Diagnosis | None:
    """Non-finite values in the batch's floating tensors, or in the model's weights."""
    inputs = [_count_nonfinite(path, t) for path, t in tensor_leaves(batch) if not finite(t)]
    if inputs:
        return _nonfinite(
            f"non-finite inputs: {'; '.join(inputs)}. Every gradient computed from them is NaN: "
            "clean the data (drop those samples, or torch.nan_to_num) before training."
        )
    weights = [k for k, t in [*model.named_parameters(), *model.named_buffers()] if not finite(t)]
    return None if not weights else _nonfinite(
        f"the model's weights hold NaN or inf ({', '.join(weights[:5])}): load good weights or "
        "initialise them again.", *weights,
    )  # fmt: skip


def _count_nonfinite(path: str, t: torch.Tensor) -> str:
    """``batch[0] holds 2 NaN and 1 inf in samples 3, 7``."""
    samples = torch.where(~t.isfinite().reshape(len(t), -1).all(1))[0].tolist() if t.dim() else []
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    kinds = " and ".join(f"{k} {w}" for k, w in ((nan, "NaN"), (inf, "inf")) if k)
    shown = ", ".join(map(str, samples[:8])) + (" ..." if len(samples) > 8 else "")
    noun = "sample" + "s" * (len(samples) > 1)
    return f"{path} holds {kinds}" + (f" in {noun} {shown}" if samples else "")


def _nonfinite_micro_batch(case: Case) -> Diagnosis:
    """The first micro-batch whose loss is not finite when the full batch's is."""
    pieces = case.sums(copy_float64(case.model), case.size)
    for i, name, (loss_sum, count) in ((i, *t) for i, p in enumerate(pieces) for t in p.items()):
        if not (math.isfinite(loss_sum) and math.isfinite(count)):
            start, end = i * case.size, min((i + 1) * case.size, batch_size(case.batch))
            term = "" if name == "loss" else f"term {name!r}: "
            return _nonfinite(
                f"non-finite loss on micro-batch {i + 1} (samples {start}-{end - 1}: {term}"
                f"loss_sum {loss_sum}, count {count}) while the whole batch's is finite: a mean "
                "over zero items (all padding?) is NaN. Return (loss_sum, count) with a sum (0 "
                "over no items), e.g. bigbatch.token_cross_entropy(logits, labels)."
            )
    return _nonfinite_backward([])
