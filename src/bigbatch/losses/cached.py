"""``cached_loss``: exact big batches for losses that couple the samples of a batch.

A contrastive loss (CLIP, SimCLR, InfoNCE, in-batch negatives) scores every sample against every
other sample of the batch, so cut into micro-batches it sees only a micro-batch's negatives:
plain accumulation of micro-batches of 32 trains with a batch of 32. Such a loss depends on the
batch only through small per-sample representations ``r_i = f(x_i)``; ``cached_loss`` splits it
into ``encode_fn(model, micro_batch) -> r`` and ``batch_loss_fn(reps, batch) -> loss`` and gets
the big batch's gradient exactly at the memory of one micro-batch plus the representations
(representation-gradient caching: Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size
under Memory Limited Setup").

Note [representation caching]
    ``Accumulator.train_step`` calls ``CachedLoss.prepare`` once per attempt at a window
    (``bigbatch.core.loss.WindowLoss``), then the per-piece loss it returns for each micro-batch:

    1. pass 1, in ``prepare``: each micro-batch is encoded under ``torch.no_grad()`` (no
       activations kept) after recording the random state, so dropout can be replayed;
    2. the whole batch's representations (every rank's, ``gather=True``) become leaves that
       require grad; ``batch_loss_fn`` runs once and ``torch.autograd.grad`` gives ``∂S/∂r``
       for every sample (``S`` = the loss sum), and ``∂S/∂p`` for a parameter ``p`` that the
       loss uses directly (a learnable temperature: found in the loss's autograd graph) or a
       0-dim ``encode_fn`` output (one value for the whole batch, e.g. ``logit_scale.exp()``);
    3. pass 2, one micro-batch per call: re-encode with a graph under the recorded random state
       and return a loss whose gradient is ``⟨∂S/∂r_j, r_j⟩`` (Note [surrogate loss]).

    The model's buffers are put back after pass 1, so pass 2 starts from the same state and a
    BatchNorm's running statistics move once per micro-batch, not twice. The random state after
    the window is the one after pass 1 and the batch loss, whatever pass 2 draws.

Note [surrogate loss]
    Micro-batch ``j`` of ``n_j`` samples returns ``(loss_sum_j, count_j)`` with
    ``count_j = C · n_j / N`` (``C`` the batch loss's count, ``N`` the samples it covered) and
    ``loss_sum_j = s_j - s_j.detach() + L · count_j`` where ``s_j = Σ ⟨∂S/∂r_j, r_j⟩`` and
    ``L = S / C``. Its gradient is that of ``s_j``; its value adds up to ``L · C``. The engine's
    arithmetic is unchanged: ``Σ_j ∇loss_sum_j / Σ_j count_j = ∇S / C = ∇L``, the reported loss is
    ``L``, and clipping, ``no_sync``, the scaler and the global count all-reduce work as for any
    loss. The direct-parameter and 0-dim terms join the window's last micro-batch (the one DDP
    syncs), each weighted ``1/W`` when ``W`` ranks computed the same gathered loss (DDP
    averages, the engine multiplies by ``W``).

Note [cached loss across ranks]
    With ``gather=True`` and a process group of ``W > 1`` ranks (the DDP model's, else the
    default one), every rank's representations (and, when ``batch_loss_fn`` takes it, every
    tensor of its batch) are all-gathered along the sample dimension, in rank order, padded to the
    largest share so that shares may differ. Every rank computes the same batch loss and
    back-propagates only its own rows. Before gathering, the ranks agree on pass 1's outcome
    (Note [passes before the window] in ``bigbatch.core._window``): when one failed (out of
    memory, say) the others raise too, so ``micro_batch_size="auto"`` redoes the window on every
    rank instead of leaving them waiting in the gather. Called as a plain ``loss_fn(model,
    batch)`` (evaluation, ``bigbatch.verifier._check``) it never gathers: it computes the loss
    over the batch it is given.
"""

from __future__ import annotations

import functools
import inspect
from collections import namedtuple
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bigbatch.core import _rng
from bigbatch.core._tree import is_column, map_tensors, tensor_leaves
from bigbatch.core._window import agree, prepass
from bigbatch.core.loss import LossFn, Term, as_sum_and_count, as_terms, mean_of
from bigbatch.core.split import Batch, batch_size

EncodeFn = Callable[[nn.Module, Batch], Any]
"""``encode_fn(model, micro_batch) -> reps``: a tensor or a tuple / list / dict of tensors."""

BatchLossFn = Callable[..., Any]
"""``batch_loss_fn(reps, batch)`` (or ``batch_loss_fn(reps)``) -> a mean, ``(loss_sum, count)``
or named terms (a ``LossOutput``)."""

Leaves = list[tuple[str, torch.Tensor]]
Grads = list[torch.Tensor | None]
_Ranks = namedtuple("_Ranks", "group size rank")  # who computes the loss together; size 1: alone


def cached_loss(encode_fn: EncodeFn, batch_loss_fn: BatchLossFn, gather: bool = True) -> CachedLoss:
    """A loss over the whole batch's representations, accumulated exactly in micro-batches.

    Use it for losses in which each sample's loss depends on the other samples of the batch
    through per-sample representations: contrastive losses with in-batch negatives (CLIP,
    SimCLR, InfoNCE, sentence embeddings). Pass the result to ``Accumulator.train_step`` (or as a
    ``Task``'s ``loss_fn``) like any ``loss_fn``: the step equals the full-batch step (float64: to
    rounding), dropout included, for about one extra forward per micro-batch
    (Note [representation caching]). Called as ``loss_fn(model, batch)`` it computes the plain loss
    over ``batch`` in one piece.

    Args:
        encode_fn: ``encode_fn(model, micro_batch)`` returning the micro-batch's representations:
            a tensor or a tuple / list / dict of tensors whose first dimension is the sample
            dimension; a 0-dim tensor is one value for the whole batch (e.g. a learnable
            temperature ``model.logit_scale.exp()``).
        batch_loss_fn: ``batch_loss_fn(reps, batch)`` returning the loss of the WHOLE logical
            batch from its representations (the same structure, all samples concatenated) as a
            mean over the samples or a ``(loss_sum, count)`` pair; ``batch`` holds per-sample
            inputs it may need (labels). It may use parameters directly (a temperature). A
            ``batch_loss_fn(reps)`` with one argument gets no batch (nothing is gathered for it).
        gather: under ``torch.distributed``, compute the loss over every rank's representations
            (negatives span the global batch; shares may differ per rank). ``False``: each rank's
            loss covers its own share.

    Returns:
        A ``CachedLoss`` (a ``loss_fn`` and a ``bigbatch.core.loss.WindowLoss``).

    Raises:
        TypeError: ``encode_fn`` or ``batch_loss_fn`` is not callable, or ``gather`` not a bool.

    Example:
        >>> import torch.nn.functional as F
        >>> from bigbatch import Accumulator
        >>> model = torch.nn.Linear(4, 3)
        >>> def info_nce(reps, batch):  # each query against every document of the batch
        ...     q, d = reps
        ...     return F.cross_entropy(q @ d.T / 0.05, torch.arange(len(q)))
        >>> loss_fn = cached_loss(lambda m, mb: (m(mb[0]), m(mb[1])), info_nce)
        >>> acc = Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), micro_batch_size=4)
        >>> acc.train_step((torch.randn(10, 4), torch.randn(10, 4)), loss_fn).micro_batches
        3
    """
    for name, fn in (("encode_fn", encode_fn), ("batch_loss_fn", batch_loss_fn)):
        if not callable(fn):
            raise TypeError(
                f"{name}={fn!r} is not callable: pass a function, e.g. "
                "cached_loss(lambda model, mb: model(mb), my_batch_loss)."
            )
    if not isinstance(gather, bool):
        raise TypeError(f"gather={gather!r} is not allowed: use True or False.")
    return CachedLoss(encode_fn, batch_loss_fn, gather)


class CachedLoss:
    """The object ``cached_loss`` returns: a ``loss_fn`` that sees the whole window first.

    ``prepare(model, batch, pieces)`` (called by ``Accumulator.train_step``, or by your own loop
    with the micro-batches you cut) runs pass 1 and the batch loss and returns the ``loss_fn``
    for the pieces' pass 2; see Note [representation caching].
    """

    def __init__(self, encode_fn: EncodeFn, batch_loss_fn: BatchLossFn, gather: bool) -> None:
        self.encode_fn, self.batch_loss_fn, self.gather = encode_fn, batch_loss_fn, gather
        self.takes_batch = _takes_batch(batch_loss_fn)

    def __call__(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | float]:
        """The plain loss over ``batch`` in one piece (no gathering), as ``(loss_sum, count)``."""
        n, reps = batch_size(batch), self.encode_fn(model, batch)
        _split_leaves(reps, n, "the batch")
        return self._loss(reps, batch, n)

    def prepare(
        self,
        model: nn.Module,
        batch: Batch,
        pieces: list[Batch],
        rows: list[torch.Tensor] | None = None,
    ) -> LossFn:
        """Pass 1 and the batch loss for one window; returns the ``loss_fn`` of its pieces.

        Args:
            model: the model as the engine calls it (plain, DDP or FSDP).
            batch: this rank's share of the logical batch.
            pieces: ``batch`` cut into micro-batches (``bigbatch.core.split``), in order.
            rows: each piece's rows in ``batch`` when the cut reorders them (token windows:
                sorted by length); ``None`` for consecutive pieces.

        Returns:
            ``loss_fn(model, piece)`` for each of ``pieces``, in order (Note [surrogate loss]).

        Raises:
            ValueError, TypeError: bad representations or batch loss (the messages say which).
        """
        ranks = _ranks(model, self.gather)
        if len(pieces) == 1 and ranks.size == 1:
            return self  # one piece is the whole batch: the plain loss is exact, one forward
        # Pass 1, agreed on by every rank before the gather (Note [passes before the window]).
        device = _device_of(model)
        encode = functools.partial(_encode, self.encode_fn, model, pieces, device)
        template, encoded, per_batch, states = agree(encode, ranks.group, ranks.size, device)
        order = None if rows is None else torch.cat([torch.as_tensor(r) for r in rows])
        if order is not None:  # the batch loss sees the batch's order (token windows sort it)
            encoded = [(path, t[torch.argsort(order)]) for path, t in encoded]
        everyone, whole, offset = [t for _, t in encoded], batch, 0
        if ranks.size > 1:
            everyone, whole, offset = _gather(ranks, encoded, batch if self.takes_batch else None)
        reps = [t.detach().requires_grad_() for t in everyone]
        scalars = [t.detach().requires_grad_(t.is_floating_point()) for _, t in per_batch]
        row_it, scalar_it = iter(reps), iter(scalars)
        tree = map_tensors(lambda t: next(scalar_it if t.dim() == 0 else row_it), template)
        with torch.enable_grad():
            loss_sum, count = self._loss(tree, whole, len(reps[0]))
        sizes, states = [batch_size(p) for p in pieces], [*states, _rng.capture(device)]
        grads = _gradients(loss_sum, reps, scalars, offset, sum(sizes), order)
        counts = [count * (n / len(reps[0])) for n in sizes]
        paths = [path for path, _ in encoded + per_batch]
        return _PieceLoss(
            self.encode_fn,
            pieces,
            paths,
            sizes,
            states,
            *grads,
            loss_sum.detach() / count,
            counts,
            1.0 / ranks.size,
        )

    def _loss(self, reps: Any, batch: Batch, n: int) -> tuple[torch.Tensor, torch.Tensor | float]:
        """``batch_loss_fn``'s output as ``(loss_sum, count)``; a mean covers the ``n`` samples.

        Named terms are all computed over the whole batch here, so their value ``Σ w_k S_k / C_k``
        is already the window's (Note [named terms]): it is carried as a mean over the samples."""
        out = self.batch_loss_fn(reps, batch) if self.takes_batch else self.batch_loss_fn(reps)
        if isinstance(out, (Mapping, Term)):
            out = mean_of(as_terms(out, n))
        loss_sum, count = as_sum_and_count(out, n, "batch_loss_fn")
        return loss_sum.reshape(()), count


@dataclass
class _PieceLoss:
    """Pass 2: the ``loss_fn`` of one window's micro-batches (Note [surrogate loss])."""

    encode_fn: EncodeFn
    pieces: list[Batch]
    paths: list[str]  # the representations, as pass 1 saw them
    sizes: list[int]  # samples per micro-batch
    states: list[_rng.RngState]  # random state before each micro-batch's encode, then after
    grads: Grads  # ∂S/∂r of this rank's samples; None: the loss ignores r
    per_batch: Grads  # ∂S/∂(0-dim output)
    params: list[tuple[torch.Tensor, torch.Tensor]]  # (parameter used directly, ∂S/∂p)
    loss: torch.Tensor  # L = S / C
    counts: list[Any]  # C · n_j / N per micro-batch
    weight: float  # of the whole-batch terms: 1 / ranks computing the same loss

    def __call__(self, model: nn.Module, piece: Batch) -> tuple[torch.Tensor, Any]:
        j = next((j for j, p in enumerate(self.pieces) if p is piece), None)
        if j is None:
            raise ValueError(
                "this loss_fn belongs to the micro-batches given to CachedLoss.prepare: call it "
                "with those, or call the cached_loss itself for the plain loss of a batch."
            )
        device, start, n = _device_of(model), sum(self.sizes[:j]), self.sizes[j]
        _rng.restore(self.states[j], device)  # the dropout masks of pass 1
        reps = self.encode_fn(model, piece)
        _rng.restore(self.states[-1], device)  # as after pass 1 and the batch loss
        needs = attrgetter("requires_grad")
        rows, per_batch = _split_leaves(reps, n, f"micro-batch {j}", self.paths, needs)
        mine = zip([r for _, r in rows], self.grads, strict=True)
        terms = [_dot(r, g[start : start + n]) for r, g in mine if g is not None]
        if j == len(self.pieces) - 1:  # the piece DDP syncs: the whole-batch terms join it
            whole = [*zip([t for _, t in per_batch], self.per_batch, strict=True), *self.params]
            terms += [
                _dot(t, g) * self.weight for t, g in whole if g is not None and t.requires_grad
            ]
        # No term: the loss ignores this micro-batch; a zero keeps the graph.
        surrogate = sum(terms[1:], terms[0]) if terms else rows[0][1].sum() * 0
        return surrogate - surrogate.detach() + self.loss * self.counts[j], self.counts[j]


def _encode(
    encode_fn: EncodeFn, model: nn.Module, pieces: list[Batch], device: torch.device
) -> tuple[Any, Leaves, Leaves, list[_rng.RngState]]:
    """Pass 1 on the runner's ``prepass`` (no graph; the random state before each micro-batch
    recorded; the buffers put back): the first micro-batch's reps (the structure), the
    per-sample tensors of every micro-batch concatenated, the 0-dim ones, the random states."""
    reps, states = prepass(model, pieces, lambda piece: encode_fn(model, piece), device)
    parts: list[tuple[Leaves, Leaves]] = []
    for j, (r, piece) in enumerate(zip(reps, pieces, strict=True)):
        paths = [p for p, _ in parts[0][0] + parts[0][1]] if parts else None
        floats = torch.is_floating_point  # a graph in pass 2 needs them
        parts.append(_split_leaves(r, batch_size(piece), f"micro-batch {j}", paths, floats))
    first, per_batch = parts[0]
    rows = [(path, torch.cat([p[0][k][1] for p in parts])) for k, (path, _) in enumerate(first)]
    return reps[0], rows, per_batch, states


def _split_leaves(
    reps: Any,
    n: int,
    where: str,
    paths: list[str] | None = None,
    needs: Callable[[torch.Tensor], bool] | None = None,
) -> tuple[Leaves, Leaves]:
    """``(per-sample, per-batch)`` tensors of ``reps``, checked: one row per sample each, the
    ``paths`` of micro-batch 0, and what the pass ``needs`` of each per-sample tensor."""
    leaves = list(tensor_leaves(reps, "reps"))
    rows, per_batch = [x for x in leaves if x[1].dim()], [x for x in leaves if not x[1].dim()]
    _check_rows(reps, rows, n, where)
    _check_pass(rows, [p for p, _ in rows + per_batch], where, paths, needs)
    return rows, per_batch


def _check_rows(reps: Any, rows: Leaves, n: int, where: str) -> None:
    """Every per-sample value of ``reps`` is a tensor, and has one row per sample of ``n``."""
    column = _column_in(reps, n)
    if column is not None:
        raise TypeError(
            f"encode_fn returned per-sample values that are not tensors ({column}) for {where}: "
            "the batch loss would see one micro-batch's only. Return tensors; take ids or "
            "strings from batch_loss_fn's batch (it sees the whole batch)."
        )
    if not rows:
        raise TypeError(
            f"encode_fn returned {type(reps).__name__} with no per-sample tensor for {where}: "
            "return a tensor, or a tuple / dict of tensors, one row per sample."
        )
    if any(t.shape[0] != n for _, t in rows):
        listing = ", ".join(f"{p} has {t.shape[0]} row{'s' * (t.shape[0] != 1)}" for p, t in rows)
        raise ValueError(
            f"encode_fn's outputs disagree on the sample dimension for {where} of {n} samples "
            f"({listing}): every representation needs one row per sample. Return one value for "
            "the batch (e.g. a temperature) as 0-dim."
        )


def _check_pass(
    rows: Leaves,
    names: list[str],
    where: str,
    paths: list[str] | None,
    needs: Callable[[torch.Tensor], bool] | None,
) -> None:
    """The representations are named as micro-batch 0's ``paths``, and each per-sample tensor
    is what the pass ``needs`` (pass 1: floating; pass 2: requiring grad)."""
    if paths is not None and names != paths:
        raise ValueError(
            f"encode_fn returned {names} for {where} but {paths} for micro-batch 0: return the "
            "same structure for every micro-batch."
        )
    bad = next(((p, tuple(t.shape)) for p, t in rows if needs and not needs(t)), None)
    if bad is not None:
        raise ValueError(
            f"encode_fn's {bad[0]} (shape {bad[1]}) does not require grad, so no gradient reaches "
            "the model through it: compute every per-sample representation from trainable "
            "parameters with gradients on (not under torch.no_grad(), not .detach()ed, not an "
            "input passed through); take labels and such from batch_loss_fn's batch."
        )


def _column_in(tree: Any, n: int, path: str = "reps") -> str | None:
    """The path of a per-sample column of non-tensors in ``tree`` (``None``: there is none)."""
    listed = isinstance(tree, (tuple, list))
    if listed and is_column(tree, n):
        return path
    items = enumerate(tree) if listed else tree.items() if isinstance(tree, Mapping) else ()
    found = (_column_in(v, n, f"{path}[{k!r}]") for k, v in items)
    return next((f for f in found if f is not None), None)


def _gradients(
    loss_sum: torch.Tensor,
    reps: list[torch.Tensor],
    scalars: list[torch.Tensor],
    offset: int,
    rows: int,
    order: torch.Tensor | None,
) -> tuple[Grads, Grads, list[tuple[torch.Tensor, torch.Tensor]]]:
    """``∂S/∂r`` of our ``rows`` samples from ``offset`` on (this rank's; in the pieces' ``order``
    when the cut reordered them), ``∂S/∂(0-dim outputs)`` and ``∂S/∂p`` for parameters the loss
    uses directly."""
    if not loss_sum.requires_grad:
        raise ValueError(
            "batch_loss_fn's loss does not depend on the representations (it does not require "
            "grad): compute it from the reps it is given, with gradients on."
        )
    leaves = [*reps, *(t for t in scalars if t.requires_grad)]
    params = _direct_params(loss_sum, leaves)
    grads = torch.autograd.grad(loss_sum, [*leaves, *params], allow_unused=True)
    by_leaf = {id(t): g for t, g in zip(leaves, grads, strict=False)}
    mine = [None if g is None else g[offset : offset + rows] for g in grads[: len(reps)]]
    return (
        [g if g is None else (g if order is None else g[order]).clone() for g in mine],
        [by_leaf.get(id(t)) for t in scalars],
        [(p, g) for p, g in zip(params, grads[len(leaves) :], strict=True) if g is not None],
    )


def _direct_params(loss: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors requiring grad that ``loss`` uses directly, other than ``leaves`` (its graph's
    ``AccumulateGrad`` nodes), in a fixed order: e.g. a learnable temperature."""
    known, found, seen, stack = {id(t) for t in leaves}, [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf tensor
        if variable is None:
            stack.extend(fn for fn, _ in node.next_functions)
        elif id(variable) not in known:
            found.append(variable)
    return found


def _dot(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``Σ t · g`` in at least float32 (a half-precision sum over a batch loses too much)."""
    dtype = torch.promote_types(t.dtype, torch.float32)
    return (t.to(dtype) * g.to(dtype)).sum()


# ---------------------------------------------------------------------------- across ranks
def _ranks(model: nn.Module, gather: bool) -> _Ranks:
    """The ranks to gather over: the DDP model's group, else the default one; size 1: none."""
    if not gather or not dist.is_available() or not dist.is_initialized():
        return _Ranks(None, 1, 0)
    group = getattr(model, "process_group", None)
    return _Ranks(group, dist.get_world_size(group), dist.get_rank(group))


def _gather(
    ranks: _Ranks, rows: Leaves, batch: Batch | None
) -> tuple[list[torch.Tensor], Batch, int]:
    """Every rank's representations (and batch), concatenated in rank order, and our offset
    (Note [cached loss across ranks])."""
    leaves = rows + list(tensor_leaves(batch))  # the batch's tensors too, when gathered
    shapes = [(path, str(t.dtype), list(t.shape[1:])) for path, t in leaves]
    everyone: list[Any] = [None] * ranks.size  # every rank's rows and shapes, before the gather
    dist.all_gather_object(everyone, (len(rows[0][1]), shapes), group=ranks.group)
    for r, (_, theirs) in enumerate(everyone):
        if theirs != shapes:
            differ = [a for a, b in zip(shapes, theirs, strict=False) if a != b] or shapes[-1:]
            path, dtype, shape = differ[0]  # the first that differs (else: one rank has more)
            raise ValueError(
                f"gather=True: {path} is {dtype} of shape [n, {str(shape)[1:-1]}] on rank "
                f"{ranks.rank}, not on rank {r}: every rank's tensors must agree past the sample "
                "dimension (pad to one length), or write batch_loss_fn(reps) to not gather the batch."
            )
    sizes = [n for n, _ in everyone]
    batch = map_tensors(lambda t: _gather_rows(t, sizes, ranks), batch)
    return [_gather_rows(t, sizes, ranks) for _, t in rows], batch, sum(sizes[: ranks.rank])


def _gather_rows(t: torch.Tensor, sizes: list[int], ranks: _Ranks) -> torch.Tensor:
    """All-gather ``t`` along dim 0 when ranks hold different numbers of rows (padded, trimmed)."""
    padded = t.new_zeros((max(sizes), *t.shape[1:]))
    padded[: len(t)] = t
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded, group=ranks.group)
    return torch.cat([o[:n] for o, n in zip(out, sizes, strict=True)])


# ---------------------------------------------------------------------------- small helpers
def _takes_batch(fn: Callable[..., Any]) -> bool:
    """Does ``fn`` take a second positional argument (the batch)?"""
    try:
        kinds = [p.kind for p in inspect.signature(fn).parameters.values()]
    except (TypeError, ValueError):  # a builtin without a signature: pass the batch
        return True
    P = inspect.Parameter  # kinds are ordered: POSITIONAL_ONLY < POSITIONAL_OR_KEYWORD < ...
    return P.VAR_POSITIONAL in kinds or sum(k <= P.POSITIONAL_OR_KEYWORD for k in kinds) >= 2


def _device_of(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))
