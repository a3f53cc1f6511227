"""``check(model, batch, loss_fn)``: is accumulation exact for *this* model and loss? If not, why?

On float64 deep copies (the user's model, its running statistics and the global RNG are left
as they were), with the same seed for both runs and dropout off (Note [dropout in check]), it
computes the full-batch gradient of the mean loss and the gradient that
``Accumulator.train_step`` really accumulates (Σ loss_sum / Σ count), and compares them per
parameter, within the rounding of the precision the copy really computes in (Note [float32
islands] in ``_runs``). When they differ it diagnoses why: non-finite inputs, weights, outputs
or losses; modules whose output for one sample depends on the other samples (found by replaying
every module, not by class name: Note [replay without caches]); a loss that returns a mean as if
it were a ``(loss_sum, count)`` pair (a mean over samples or over tokens); a batch-coupled loss
(in-batch negatives); a named term normalised inside the micro-batch, or one that depends on
a statistic of its micro-batch where a statistics pass (``stats_fn``) is needed (each named term
is compared alone: ``CheckReport.term_differences``); or non-determinism. When blocks of the
model are checkpointed (``enable_checkpointing``) it also checks that the gradient is the same
without.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from bigbatch.core._tree import map_tensors, tensor_leaves
from bigbatch.core.batchnorm import label
from bigbatch.core.loss import LossFn, WindowLoss
from bigbatch.core.split import Batch, batch_size, split
from bigbatch.memory.checkpointing import checkpointed_blocks
from bigbatch.verifier import _runs
from bigbatch.verifier._runs import Case, FullRun, copy_float64, differences, finite, full_run


@dataclass(frozen=True)
class Diagnosis:
    """One reason accumulation is not exact.

    Attributes:
        kind: ``"non-finite"``, ``"batch-statistics"``, ``"mean-as-sum"``, ``"token-mean"``,
            ``"batch-coupled-loss"``, ``"term-mean"`` (a named term normalised inside the
            micro-batch), ``"term-batch-statistic"`` (a named term that depends on the other
            samples of its micro-batch), ``"non-deterministic"``, ``"randomness"`` (random draws
            besides dropout, seeded: another seed, another gradient), ``"unprobed"`` (no cause found,
            and these modules could not be probed) or ``"checkpointing"``.
        modules: the modules (names in the model), parameters or named terms responsible.
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
        differences: per parameter, ``‖g_acc − g_full‖ / ‖g_full‖`` (see ``differences``);
            NaN when a gradient is not finite.
        batch_size, micro_batch_size: the batch compared and how it was cut.
        tolerance: the relative difference counted as rounding: the ``tolerance`` asked for,
            raised to the rounding of ``compute_dtype`` when that is below float64.
        diagnoses: why it is not exact (empty when exact).
        compute_dtype: the lowest precision the float64 copy really computed in: float64, or
            float32 (or a half type) where the model or loss casts down (Note [float32 islands]).
        low_precision_in: where it computed in ``compute_dtype`` (modules, or ``loss_fn``);
            empty when that is float64.
        dropout_off: the modules whose dropout ``check`` turned off (Note [dropout in check]);
            with dropout on, the accumulated gradient is equal to the full batch's in
            distribution, not in value.
        term_differences: when not exact and ``loss_fn`` returns named terms, per term the
            largest relative difference of the gradient accumulated from that term alone.
    """

    exact: bool
    differences: dict[str, float]
    batch_size: int
    micro_batch_size: int
    tolerance: float
    diagnoses: list[Diagnosis] = field(default_factory=list)
    compute_dtype: torch.dtype = torch.float64
    low_precision_in: tuple[str, ...] = ()
    dropout_off: tuple[str, ...] = ()
    term_differences: dict[str, float] = field(default_factory=dict)

    @property
    def max_difference(self) -> float:
        """The largest per-parameter relative difference (NaN if any is NaN)."""
        return next((d for _, d in self.worst(1)), 0.0)

    def worst(self, k: int = 10) -> list[tuple[str, float]]:
        """The ``k`` parameters with the largest relative difference, largest (or NaN) first."""
        return sorted(self.differences.items(), key=lambda kv: (not math.isnan(kv[1]), -kv[1]))[:k]

    def summary(self) -> str:
        """One paragraph: the verdict, the precision it holds to, dropout, each diagnosis."""
        verdict = "exact" if self.exact else "NOT exact"
        if self.dropout_off:
            verdict += " (dropout off)" + ("; with dropout on, equal in distribution" * self.exact)
        dtype = str(self.compute_dtype).removeprefix("torch.")
        notes = [  # (shown, line)
            (
                self.dropout_off,
                f"dropout off in {_by_class(self.dropout_off)} (dropout_off names "
                "them): micro-batches draw other masks, from the same distribution",
            ),
            (
                dtype != "float64",
                f"tolerance {self.tolerance:.0e}: the float64 copy computes "
                f"partly in {dtype} (in {_by_class(self.low_precision_in)}: low_precision_in names "
                f"them), so differences up to {dtype} rounding are not counted",
            ),
            *((True, f"{d.kind}: {d.message}") for d in self.diagnoses),
        ]
        head = f"{verdict}: max relative difference {self.max_difference:.2e} (batch "
        head += f"{self.batch_size}, micro-batches of {self.micro_batch_size})"
        return "\n".join([head, *(f"- {line}" for shown, line in notes if shown)])


def _by_class(labels: tuple[str, ...]) -> str:
    """``'a.norm' (RMSNorm)``, ``'b.norm' (RMSNorm)``, ``loss_fn`` -> ``RMSNorm ×2, loss_fn``."""
    counts = Counter(label.rpartition(" (")[2].rstrip(")") for label in labels)
    return ", ".join(name if k == 1 else f"{name} ×{k}" for name, k in counts.items())


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

    Works on any ``nn.Module``, transformers models included (their key/value caches are never
    replayed; their float32 islands set the tolerance, and the report says so). Dropout is
    turned off in every run, and the report names where (Note [dropout in check]): with it on,
    micro-batches draw other masks than the full batch, which is expected, not a bug.

    Args:
        model: the model, in the mode (train / eval) it trains in; it is not changed.
        batch: one logical batch (at least 2 samples).
        loss_fn: ``loss_fn(model, micro_batch)`` as given to the ``Accumulator`` (a mean, a
            ``(loss_sum, count)`` pair or named terms).
        micro_batch_size: samples per micro-batch; default about a third of the batch
            (uneven: 10 samples give 4 + 4 + 2).
        tolerance: relative difference counted as rounding in float64, a number >= 0; raised to
            ``ROUNDING`` of a lower precision the copy computes in (``CheckReport.compute_dtype``).
        seed: the seed both runs start from (randomness other than dropout).
        raise_on_failure: raise ``NotExactError`` instead of returning a report that is not exact.

    Returns:
        The ``CheckReport``.

    Raises:
        ValueError: the batch has fewer than 2 samples, ``micro_batch_size`` is not positive or
            covers it all, ``tolerance`` is negative or not finite, the model has no trainable
            parameter, or no gradient reaches one from the loss.
        TypeError: ``tolerance`` is not a number.
        NotExactError: not exact and ``raise_on_failure`` is set.

    Example:
        >>> m = torch.nn.Linear(3, 1)
        >>> mse = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
        >>> check(m, (torch.randn(10, 3), torch.randn(10, 1)), mse).exact
        True
    """
    n, size = _check_arguments(model, batch, micro_batch_size, tolerance)
    batch = map_tensors(lambda t: t.double() if t.is_floating_point() else t, batch)
    case = Case(model, batch, loss_fn, size, seed)
    full = full_run(case)
    tolerance = max(tolerance, _runs.ROUNDING.get(full.observed.dtype, 0.0))
    acc, acc_loss = _runs.accumulated_grads(case) if full.finite else ({}, math.nan)
    diffs = differences(acc, full.grads) if full.finite else dict.fromkeys(full.grads, math.nan)
    found = nonfinite(case, full, acc, acc_loss)
    within = all(d <= tolerance for d in diffs.values())
    terms = {} if within or found else {k: _runs.term_difference(case, k) for k in full.terms}
    diagnoses = [found] if found else [] if within else diagnose(case, tolerance, full.grads, terms)
    if checkpointed_blocks(model) and found is None:
        diagnoses += checkpointing(case, full.grads, tolerance)
    report = CheckReport(  # the fields in order
        within and not diagnoses,
        diffs,
        n,
        size,
        tolerance,
        diagnoses,
        full.observed.dtype,
        _labels(model, full.observed.where),
        _labels(model, full.observed.dropout),
        terms,
    )
    if raise_on_failure and not report.exact:
        raise NotExactError(report)
    return report


def _check_arguments(
    model: nn.Module, batch: Batch, micro_batch_size: int | None, tolerance: object
) -> tuple[int, int]:
    """``(samples, micro-batch size)``, or one clear error about the argument at fault."""
    n = batch_size(batch)
    if n < 2:
        raise ValueError(f"check needs a batch of at least 2 samples to cut; got {n}.")
    m = max(1, (n + 2) // 3) if micro_batch_size is None else micro_batch_size
    if isinstance(m, bool) or not isinstance(m, int) or not 0 < m < n:
        raise ValueError(
            f"micro_batch_size={m!r} is not allowed: use a positive integer smaller than the batch "
            f"({n} samples: one micro-batch leaves nothing to compare), or None for about a third."
        )
    allowed = "use a relative difference >= 0, e.g. tolerance=1e-10 (float64 rounding)."
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        raise TypeError(f"tolerance={tolerance!r} is not allowed: {allowed}")
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance={tolerance!r} is not allowed: {allowed}")
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        held = f"all {len(params)} of its parameters have requires_grad=False"
        raise ValueError(
            f"check needs a model with trainable parameters, and {type(model).__name__} has none "
            f"({held if params else 'it has no parameters'}): pass the module holding the weights "
            "you train, or requires_grad_(True) them."
        )
    return n, m


def _labels(model: nn.Module, names: list[str]) -> tuple[str, ...]:
    return tuple(n if n == _runs.LOSS_FN else label(n, model.get_submodule(n)) for n in names)


# ---------------------------------------------------------------------------- diagnoses
Pair = tuple[float, float]
"""A ``(loss_sum, count)`` as floats."""

MESSAGES = {  # what happens and what to do, by kind; {}: the modules, term or values named
    "non-deterministic": "two full-batch runs from the same seed give different gradients: the "
    "model or loss uses randomness or non-deterministic kernels outside torch's seeded RNG.",
    "randomness": "another seed gives another full-batch gradient: the model or loss draws random "
    "numbers besides dropout (torch.randn_like, ...), and a micro-batch draws other numbers than "
    "the full batch did: equal in distribution, not in value, so the gradients cannot be compared."
    " Draw the noise per sample in the data (a batch tensor), or turn it off to check the rest.",
    "batch-statistics": "{} change one sample's output when other samples change (batch "
    "statistics in training mode): each micro-batch sees its own statistics. Use "
    'bigbatch.batchnorm(model, policy="groupnorm") or "freeze", or accept ghost-batch semantics.',
    "unprobed": "no cause found, and {} could not be probed: replayed on their recorded inputs "
    "they raised or gave another result (state each call changes): look for such state in them.",
    "checkpointing": "gradients with and without checkpointing differ (relative {}): these blocks' "
    "recomputed forward is not the first (state the forward changes, or randomness outside torch).",
    "mean-as-sum": "loss_fn returns a mean as the loss_sum of (loss_sum, count): micro-batch means "
    "are added up. Return (losses.sum(), count) (tokens: bigbatch.token_cross_entropy(logits, "
    "labels), with shift=True for a causal LM, or a transformers model's out.loss * count), or a "
    "mean over samples alone.",
    "token-mean": "loss_fn returns a mean over labelled tokens, read as a mean over samples: short "
    "sequences weigh as much as long ones. Instead return (loss_sum, token_count): bigbatch."
    "token_cross_entropy(logits, labels{}), or (out.loss * count, count) for a labels= loss.",
    "batch-coupled-loss": "each sample's loss depends on the others (in-batch negatives): a "
    "micro-batch sees fewer. If only through reps = encode(model, micro_batch), bigbatch."
    "cached_loss(encode, batch_loss) is exact (docs/contrastive.md); else accept a smaller pool.",
    "term-mean": "term {!r} is normalised inside each micro-batch ((x.mean(), 1), (x.sum() / len("
    "micro_batch), 1)): micro-batch means are added up. Return its sum and count, (x.sum(), n).",
    "term-batch-statistic": "term {!r} of a sample depends on the other samples of its micro-batch"
    ": a statistic computed per micro-batch (advantages normalised by its mean and std, a MoE "
    "balance over its routing). Compute it in stats_fn (train_step(batch, loss_fn, stats_fn="
    "stats_fn), docs/compound_losses.md); in-batch negatives: bigbatch.cached_loss.",
    # kind "non-finite", by where the NaN or inf first appears (``nonfinite``)
    "non-finite inputs": "non-finite inputs: {}. Every gradient computed from them is NaN: clean "
    "the data (drop those samples, or torch.nan_to_num) before training.",
    "non-finite weights": "model weights hold NaN or inf ({}): load good ones or re-initialise.",
    "non-finite outputs": "non-finite outputs: {} is the first module to output NaN or inf from "
    "finite inputs and weights (an overflow, a log or division by zero...): fix that computation.",
    "non-finite loss": "non-finite loss: loss_fn returns a loss of {} from finite model outputs (a "
    "log of 0, a division by a zero count, ...): fix loss_fn.",
    "non-finite micro-batch": "non-finite loss on micro-batch {} while the whole batch's is finite"
    ": a mean over zero items (all padding?) is NaN. Return (loss_sum, count) with a sum (0 over "
    "no items), e.g. bigbatch.token_cross_entropy(logits, labels) (shift=True for a causal LM).",
    "non-finite gradients": "non-finite gradients{} from {}: a backward that divides by zero (the "
    "square root or norm of 0...): add an epsilon there.",
}


def diagnose(
    case: Case, tolerance: float, full: dict[str, torch.Tensor], terms: dict[str, float]
) -> list[Diagnosis]:
    """Why the accumulated gradient differs from ``full``: every cause found, most specific
    first (empty when none is found). Every probe works on a float64 copy of ``case.model``;
    ``tolerance`` is the relative difference counted as rounding (Note [float32 islands]);
    ``terms`` holds each named term's difference (``term_difference``; empty: a plain loss)."""
    found = [_naming("non-deterministic", case.model, [])] * (_rerun(case, full) > tolerance)
    if not found and _rerun(replace(case, seed=case.seed + 1), full) > tolerance:
        return [_naming("randomness", case.model, [])]  # no probe can compare other draws
    work, rtol = copy_float64(case.model), max(1e-9, tolerance)
    coupled, unprobed = _runs.probe_coupling(
        work,
        lambda: case.loss_fn(work, case.batch),
        batch_size(case.batch),
        lambda: _runs.seeded(case.seed),
        rtol,
    )
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
    return Diagnosis(kind, tuple(names), MESSAGES[kind].format(", ".join(_labels(model, names))))


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
    per_sample = [torch.ones(n), *labelled_tokens(case.batch)]
    whole, found = case.sums(work, n)[0], []
    for name in whole if terms is None else terms:
        # halves, then the cut checked: halves of equal tokens hide a token mean
        for size in dict.fromkeys([(n + 1) // 2, case.size]):
            weights = [[float(k.sum()) for k in split(items, size)] for items in per_sample]
            parts = case.sums(work, size)
            kind = loss_kind(whole[name], [p[name] for p in parts], weights, rtol)
            if kind is not None:
                break
        if kind is None or (suspect and kind == "batch-coupled-loss"):
            continue
        if terms is not None:  # a named term: name it
            kind = "term-batch-statistic" if kind == "batch-coupled-loss" else "term-mean"
        shown = name
        if kind == "token-mean":  # over the labels after the first: a causal LM's, shift=True
            shifted = [weights[0], *weights[2::2]]  # (its fix must train the next token)
            shift = loss_kind(whole[name], [p[name] for p in parts], shifted, rtol) == kind
            shown = ", shift=True" * shift
        found.append(
            Diagnosis(kind, () if terms is None else (name,), MESSAGES[kind].format(shown))
        )
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
        return _nonfinite("outputs", [first], _labels(case.model, [first])[0])
    if not math.isfinite(full.loss):
        return _nonfinite("loss", [], full.loss)
    return _nonfinite_backward([name for name, g in full.grads.items() if not finite(g)])


def _nonfinite(where: str, modules: list[str], *values: object) -> Diagnosis:
    return Diagnosis("non-finite", tuple(modules), MESSAGES[f"non-finite {where}"].format(*values))


def _nonfinite_backward(bad: list[str]) -> Diagnosis:
    where = "a finite loss" if bad else "finite losses on every micro-batch"
    return _nonfinite("gradients", bad, f" ({', '.join(bad[:5])})" if bad else "", where)


def _nonfinite_data(model: nn.Module, batch: Batch) -> Diagnosis | None:
    """Non-finite values in the batch's floating tensors, or in the model's weights."""
    if inputs := [_count_nonfinite(path, t) for path, t in tensor_leaves(batch) if not finite(t)]:
        return _nonfinite("inputs", [], "; ".join(inputs))
    weights = [k for k, t in [*model.named_parameters(), *model.named_buffers()] if not finite(t)]
    return _nonfinite("weights", weights, ", ".join(weights[:5])) if weights else None


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
            where = f"{i + 1} (samples {start}-{end - 1}: {term}loss_sum {loss_sum}, count {count})"
            return _nonfinite("micro-batch", [], where)
    return _nonfinite_backward([])
