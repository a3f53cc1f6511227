"""The window runner: the one place that runs a window and survives running out of memory.

A *window* is the logical batch of one optimizer step. ``Runner.run(batch, attempt)`` cuts it
(``SampleCut``, or by tokens: ``bigbatch.core._tokens.TokenCut``), sizes the cut (``Sizing``:
fixed, ``"auto"``, a memory budget), saves what the window's forwards change (``Backup``), and
calls ``attempt(pieces)``, which runs the micro-batches (the engine's loop, the Keras step, ...).
A real out-of-memory error discards the window, puts everything back, agrees with the other
ranks on a smaller size and redoes it; any other error puts everything back and propagates.
``Window`` is the running record of the micro-batches seen so far, per loss term. Passes over
the pieces before the window (counts, statistics, representations) are ``prepass`` and ``agree``.

Note [window buffers]
    Forwards in training mode mutate module buffers: BatchNorm's running statistics and
    ``num_batches_tracked``, and any buffer a model updates in place (an EMA, a counter). A window
    redone after an out-of-memory error would otherwise move them twice, and one that raised
    half-way would leave them moved. So before each window ``Backup`` copies the buffers that can
    change, and ``restore`` puts them back together with the random generators (so a redone
    window also draws the same dropout masks). Which buffers can change is learned from the
    tensors' version counters (``Tensor._version`` grows on every in-place write): the first
    window copies every buffer, later windows only the buffers seen changing before (BatchNorm
    statistics always). A buffer that changes for the first time in a later window that then
    fails is not restored; no model known to us does that.

Note [passes before the window]
    Some windows need a value of the whole window before the first backward: the counts of a
    loss of several terms (each term is divided by its own total: Note [named terms]), batch
    statistics (``stats_fn``), every sample's representation (``cached_loss``). ``prepass`` runs
    ``fn`` on every piece under ``torch.no_grad()`` (no activations kept), recording the random
    state before each piece and putting the buffers back afterwards, so the main pass starts
    from the same state, moves BatchNorm statistics once, and restoring ``states[i]`` before piece
    ``i`` gives it the dropout masks it drew in the pre-pass (a later pass, or the main pass, does
    that). On several ranks a pre-pass is followed by a
    collective (the totals, the gathered representations), so its outcome is agreed first
    (``agree``): if one rank failed, every rank raises, an out-of-memory error when it was one, and
    the runner redoes the window everywhere instead of leaving ranks waiting.
"""

from __future__ import annotations

import contextlib
import math
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from bigbatch.core import _rng
from bigbatch.core._sizing import Sizing, WindowMeter
from bigbatch.core._sync import GradSync
from bigbatch.core._tree import map_tensors, tensor_leaves
from bigbatch.core.batchnorm import momentum_window
from bigbatch.core.loss import Term
from bigbatch.core.oom import MemoryBudgetExceeded, is_out_of_memory, release_memory
from bigbatch.core.split import batch_size, split

T = TypeVar("T")
Attempt = Callable[[list["Piece"], int], None]  # runs a window's micro-batches at a size
Finish = Callable[[list["Piece"], int, int, int | None], T]  # the step: pieces, size, retries, peak
Discard = Callable[[], None]  # drops a failed attempt's partial gradients and window record


@dataclass
class Piece:
    """One micro-batch of a cut window.

    Attributes:
        batch: the micro-batch, as ``loss_fn`` sees it.
        samples: its samples (real rows; pad rows of a compile bucket are not counted).
        rows: its rows' positions in the window's batch (``None``: consecutive, in order).
        tokens: real tokens (text: Note [per-token tensors] in ``bigbatch.core._tokens``), else
            ``None``.
        padded_tokens: tokens computed, padding included (text), else ``None``.
        pad_rows: rows of padding added for a compile bucket (Note [compile buckets]).
        lengths: each sample's real tokens (text), else ``None`` (Note [step ledger]).
        width: the length its rows are computed at (text), else ``None``.
    """

    batch: Any
    samples: int
    rows: torch.Tensor | None = None
    tokens: int | None = None
    padded_tokens: int | None = None
    pad_rows: int = 0
    lengths: list[int] | None = None
    width: int | None = None


class SampleCut:
    """How a window is cut at a size: by samples, consecutive micro-batches of ``size`` samples
    (10 at 4: 4 + 4 + 2). ``bigbatch.core._tokens.TokenCut`` cuts by tokens, with these methods."""

    def units(self, batch: Any) -> int:
        """The size at which the whole window is one piece (what ``Sizing`` searches below)."""
        return batch_size(batch)

    def floor(self, batch: Any) -> int:
        """The size at which every piece holds one sample (nothing smaller cuts finer)."""
        return 1

    def measure(self, batch: Any) -> tuple[int, int, Callable[[int], list[Piece]]]:
        """``units``, ``floor`` and the cut of ``batch`` at a size, measuring the batch once (a
        token cut reads the lengths once per window: Note [one host sync] in ``core._stepping``)."""
        return self.units(batch), self.floor(batch), lambda size: self(batch, size)

    def __call__(self, batch: Any, size: int) -> list[Piece]:
        """The pieces of ``batch`` at ``size`` (samples, or a token budget)."""
        parts = split(batch, size)  # (only the last may be smaller)
        return [Piece(p, size) for p in parts[:-1]] + [Piece(parts[-1], batch_size(parts[-1]))]

    def bind(self, model: torch.nn.Module) -> None:
        """Check ``model`` for this cut once, when the ``Runner`` is made (for packing:
        Note [packing traps] in ``bigbatch.core._pack``); nothing for a plain cut."""

    def audit(self, model: torch.nn.Module, batch: Any, loss_fn: Any) -> None:
        """Check the first window's cut against the batch as given, once (for packing:
        Note [packing audit] in ``bigbatch.core._pack_audit``); nothing for a plain cut."""

    def during(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context for a window's micro-batches of ``model`` (packing checks each forward)."""
        return contextlib.nullcontext()

    def empty(self, batch: Any) -> Piece:
        """A micro-batch that counts nothing, for a rank that must run one more forward."""
        raise ValueError(
            "this model needs the same number of micro-batches on every rank (FSDP all-gathers, "
            "and DDP with broadcast_buffers broadcasts, in every forward), and the ranks' batches "
            "cut into different numbers: give every rank the same number of samples."
        )


@dataclass
class Window:
    """The running record of the window being accumulated (kept on the device: no host sync).

    Each micro-batch's sums and counts are kept as they come and reduced once, at step time
    (``totals``): nothing is converted or added per micro-batch.

    Attributes:
        micro_batches: backward calls so far.
        sums, counts, weights: per loss term (Note [named terms]), one entry per micro-batch;
            an entry's sum is its ``sums`` value times its ``factors`` one (a mean times its
            samples, multiplied at step time: one multiply fewer per micro-batch).
        scales: the constant each term's sum is multiplied by in every backward (Note [backward
            scale] in ``bigbatch.core._scale``); ``None`` until chosen.
        follow: fp16 without counts known before the window: the scale follows the count seen
            so far and the gradients are rescaled as counts arrive: ``"tensors"`` (counts that
            are tensors: token losses), ``"all"`` (the low-level path) or ``""`` (never).
        expected: each term's global count, known before the window (``count_fn``, a count pass).
        pending_forwards: forwards whose backward has not run yet (Note [several forwards]).
        deferred: the gradients are synchronised across ranks at step time, not in a backward.
        samples: samples in the window on this rank (``train_step``), else ``None``.
    """

    micro_batches: int = 0
    sums: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    counts: dict[str, list[Any]] = field(default_factory=dict)
    factors: dict[str, list[float]] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    scales: dict[str, Any] | None = None
    follow: str = ""
    expected: dict[str, Any] | None = None
    pending_forwards: int = 0
    deferred: bool = False
    samples: int | None = None

    def add(self, terms: Mapping[str, Term], factor: float = 1.0) -> None:
        """Record one micro-batch's terms (each ``loss_sum`` times ``factor`` is its sum)."""
        for name, (loss_sum, count, weight) in terms.items():
            if name not in self.weights:
                self.sums[name], self.counts[name], self.factors[name] = [], [], []
            s = loss_sum.detach()
            self.sums[name].append(s.reshape(()) if s.dim() else s)
            self.counts[name].append(count)
            self.factors[name].append(factor)
            self.weights[name] = weight
        self.micro_batches += 1

    def count(self, name: str) -> Any:
        """Term ``name``'s count so far: a float, or a 0-dim tensor on the device."""
        counts = self.counts.get(name, ())
        tensors = [c for c in counts if isinstance(c, torch.Tensor)]
        total = float(sum(c for c in counts if not isinstance(c, torch.Tensor)))
        return torch.stack(tensors).sum(dtype=torch.float64) + total if tensors else total

    def totals(self, extra: list[torch.Tensor]) -> tuple[list[float], list[float]]:
        """``[Σ sum, Σ count]`` per term, then the number of bad counts (negative or not finite;
        checked at step time, Note [window checks]), and the values of ``extra`` (the gradients'
        norms): all read from the device at once (Note [one host sync] in ``core._stepping``),
        with the ``expected`` counts (left in ``expected`` as numbers)."""
        parts = [s for v in self.sums.values() for s in v]
        n = len(parts)
        values = torch.stack(parts + [e.to(parts[0].device) for e in extra])
        tensors = [c for v in self.counts.values() for c in v if isinstance(c, torch.Tensor)]
        tensors += [c for c in (self.expected or {}).values() if isinstance(c, torch.Tensor)]
        if tensors:  # in float64, where an integer count is exact
            stacked = torch.stack(tensors).to(values.device, torch.float64)
            values = torch.cat([values.to(torch.float64), stacked])
        found = values.tolist()
        sums, read = iter(found[:n]), iter(found[n + len(extra) :])
        out: list[float] = []
        bad = 0
        for name, factors in self.factors.items():
            counts = [next(read) if isinstance(c, torch.Tensor) else c for c in self.counts[name]]
            bad += sum(not (math.isfinite(c) and c >= 0) for c in counts)
            out += [sum(next(sums) * f for f in factors), float(sum(counts))]
        if self.expected is not None:
            known = self.expected.items()
            self.expected = {k: next(read) if torch.is_tensor(c) else float(c) for k, c in known}
        return [*out, bad], found[n : n + len(extra)]


# ---------------------------------------------------------------------------- what a window changes
class Backup:
    """The random generators and the tensors a window may change, as they were before it
    (Note [window buffers]), and the model's BatchNorm layers, found in the same walk over the
    modules.

    Args:
        model: the module.
        tracked: more tensors that forwards change (``Accumulator.track``: Keras' variables).
        seen: ids of the tensors seen changing in earlier windows (``None``: no window yet).
        device: whose random generator the forwards draw from.
    """

    def __init__(
        self, model: nn.Module, tracked: list[Tensor], seen: set[int] | None, device: torch.device
    ) -> None:
        self.device, self.rng = device, _rng.capture(device)
        modules = list(model.modules())
        self.batchnorms = [m for m in modules if isinstance(m, _BatchNorm)]
        self.tensors = [b for m in modules for b in m._buffers.values() if b is not None] + tracked
        copied = set(map(id, self.tensors)) if seen is None else seen
        copied |= {id(b) for m in self.batchnorms for b in m.buffers()}  # BatchNorm: always
        self.saved = [(b, b.detach().clone()) for b in self.tensors if id(b) in copied]
        self.versions = [_version(b) for b in self.tensors]

    def restore(self, discard: Callable[[], None]) -> None:
        """``discard()`` the attempt (its partial gradients), put the generators and tensors back."""
        discard()
        _rng.restore(self.rng, self.device)
        with torch.no_grad():
            for buffer, value in self.saved:
                buffer.copy_(value)
        self.versions = [_version(b) for b in self.tensors]  # our copy_ is not the model's

    def changed(self) -> set[int]:
        """Ids of the tensors whose contents changed since the backup (or its last restore)."""
        return {id(b) for b, v in zip(self.tensors, self.versions, strict=True) if v != _version(b)}


def _version(tensor: torch.Tensor) -> int | None:
    # An inference tensor keeps no version counter (and cannot be written).
    return None if tensor.is_inference() else tensor._version


# ---------------------------------------------------------------------------- the runner
class Restart(Exception):
    """Raised inside an attempt to redo the window at the same size (nothing failed): e.g. the
    loss turned out to have several terms and the window needs a count pass first."""


@dataclass
class Runner:
    """Runs windows: cut, size, back up, attempt, retry smaller after out-of-memory, restore.

    Attributes:
        model: the module whose buffers a window may change.
        sizing: the micro-batch policy (``bigbatch.core._sizing.Sizing``).
        sync: the gradient-sync control (agrees on out-of-memory errors across ranks).
        meter: the window's memory meter (the budget; ``meter.check`` after each micro-batch).
        device: where the window runs.
        cut: how a window is cut (``SampleCut()`` by default).
        tracked: callables returning more tensors a window may change (``Accumulator.track``).
    """

    model: torch.nn.Module
    sizing: Sizing
    sync: GradSync
    meter: WindowMeter
    device: torch.device
    cut: SampleCut = field(default_factory=SampleCut)
    tracked: list[Callable[[], list[torch.Tensor]]] = field(default_factory=list)
    _seen: set[int] | None = field(default=None, init=False)  # Note [window buffers]: changed
    _used: int | None = field(default=None, init=False)  # the last budget overrun's bytes

    def __post_init__(self) -> None:
        self.cut.bind(self.model)

    def run(self, batch: Any, attempt: Attempt, finish: Finish[T], discard: Discard) -> T:
        """Run ``attempt(pieces, size)`` until a window completes, then ``finish(pieces, size,
        oom_retries, peak_bytes)`` (the peak of the attempt that completed, or ``None``).

        ``attempt`` runs the micro-batches; ``finish`` (the optimizer step) is never retried.
        ``discard()`` drops a failed attempt's partial gradients and window record; the runner
        then restores the buffers and the random state. Raises what ``attempt`` or ``finish``
        raised, after discarding and restoring, unless it is an out-of-memory error of
        ``attempt`` that the sizing policy retries.
        """
        units, floor, cut = self.cut.measure(batch)
        tracked = [t for tensors in self.tracked for t in tensors()]
        backup, retries = Backup(self.model, tracked, self._seen, self.device), 0
        while True:
            size = self.sizing.size_for(units, floor)
            self.meter.start()
            pieces = cut(size)
            if self.sync.equal_micro_batches:  # Note [micro-batches per rank] in core._sync
                most = int(self.sync.all_reduce(torch.tensor([float(len(pieces))]), "max").item())
                pieces += [self.cut.empty(batch) for _ in range(most - len(pieces))]  # pair up
            failure = self._try(pieces, size, attempt, discard, backup)
            if failure is None:  # a restart: the same size again
                continue
            # every rank learns of any rank's out-of-memory (Note [auto micro-batch across ranks])
            failed, measured = self.sync.agree_on_oom(*failure)
            if failed is None:
                break
            # Retried outside the except block: the live exception would keep its tensors alive.
            backup.restore(discard)
            release_memory(self.device)
            self.sizing.after_oom(failed, measured, floor, self._used if measured else None)
            retries += 1
        try:
            value = finish(pieces, size, retries, self.meter.peak_bytes())
        except BaseException:
            backup.restore(discard)
            raise
        self.sizing.after_success(size)
        self._seen = backup.changed() | (self._seen or set())
        return value

    def _try(
        self, pieces: list[Piece], size: int, attempt: Attempt, discard: Discard, backup: Backup
    ) -> tuple[int | None, bool] | None:
        """``(failed size or None, measured)``; ``None`` when the attempt asked for a restart."""
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(self.cut.during(self.model))
                if backup.batchnorms:
                    samples = sum(p.samples for p in pieces)
                    stack.enter_context(momentum_window(backup.batchnorms, samples))
                attempt(pieces, size)
            return None, False
        except Restart:
            backup.restore(discard)
            return None
        except BaseException as exc:
            backup.restore(discard)
            if not (self.sizing.retries and is_out_of_memory(exc)):
                raise
            traceback.clear_frames(exc.__traceback__)  # unpin the failed window's tensors
            self._used = getattr(exc, "used_bytes", None)
            return size, isinstance(exc, MemoryBudgetExceeded)


# ------------------------------------------------------------------------- passes before the window
def prepass(
    state: torch.nn.Module | Sequence[torch.Tensor],
    pieces: Sequence[Any],
    fn: Callable[[Any], T],
    device: torch.device,
    states: Sequence[_rng.RngState] | None = None,
) -> tuple[list[T], list[_rng.RngState]]:
    """``fn`` on every piece without gradients; the random state before each (with ``states``:
    the one an earlier pass recorded, replayed); the mutable ``state`` (a module's buffers, or
    the tensors an ``Accumulator`` tracks) put back.

    Note [passes before the window]. The random state afterwards is the one after the pass.
    """
    tensors = list(state.buffers()) if isinstance(state, torch.nn.Module) else list(state)
    saved = [b.detach().clone() for b in tensors]
    recorded, outputs = [], []
    try:
        with torch.no_grad():
            for i, piece in enumerate(pieces):
                if states is not None:
                    _rng.restore(states[i], device)
                recorded.append(_rng.capture(device))
                outputs.append(fn(piece))
    finally:  # also after a failure: a redone window starts from the same buffers
        with torch.no_grad():
            for b, value in zip(tensors, saved, strict=True):
                b.copy_(value)
    return outputs, recorded


def agree(fn: Callable[[], T], group: Any, world_size: int, device: Any) -> T:
    """``fn()``, whose outcome every rank of ``group`` learns before any goes on: if it failed on
    one rank it raises on all, an out-of-memory error when it was one.

    Note [passes before the window]. One small all-reduce on several ranks; nothing on one.
    """
    failure: Exception | None = None
    try:
        result = fn()
    except Exception as exc:  # the other ranks must not wait for us in the collective
        failure = exc
    failed, oom = failure is not None, failure is not None and is_out_of_memory(failure)
    if world_size > 1:
        flags = torch.tensor([float(failed), float(oom)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        failed, oom = map(bool, flags.tolist())
    if failure is not None:
        raise failure
    if failed:
        what = "another rank failed before the window's collective; this rank stops it too"
        raise torch.OutOfMemoryError(what) if oom else RuntimeError(what)
    return result


def with_stats(loss_fn: Any, outputs: Sequence[Any], sync: GradSync) -> Any:
    """``loss_fn(model, micro_batch)`` calling ``loss_fn(model, micro_batch, stats)`` with the
    window's statistics: the pieces' ``outputs`` totalled (``total_stats``)."""
    stats = total_stats(outputs, sync)
    return lambda model, micro_batch: loss_fn(model, micro_batch, stats)


def total_stats(outputs: Sequence[Any], sync: GradSync) -> Any:
    """The pieces' statistics summed by key (a mapping's keys may come in any order), then summed
    over ranks (one all-reduce): the structure of the first piece's (a tensor or a mapping /
    tuple of tensors), each leaf in its own dtype.

    Raises:
        TypeError: a piece's statistics hold no tensor, or not the keys of the first's (named).
    """
    leaves = [dict(tensor_leaves(out, "stats")) for out in outputs]
    if not leaves[0]:
        raise TypeError(
            "stats_fn must return additive statistics: a tensor, or a dict / tuple of tensors, the "
            f"same structure for every micro-batch (got {type(outputs[0]).__name__})."
        )
    for i, keys in enumerate(leaves):
        if keys.keys() != leaves[0].keys():
            raise TypeError(
                f"stats_fn returned {', '.join(keys)} for micro-batch {i + 1} and "
                f"{', '.join(leaves[0])} for the first: return the same keys for every micro-batch."
            )
        shapes = {k: (list(t.shape), list(leaves[0][k].shape)) for k, t in keys.items()}
        if k := next((k for k, (a, b) in shapes.items() if a != b), None):
            raise ValueError(
                f"stats_fn returned {k} of shape {shapes[k][0]} for micro-batch {i + 1} and "
                f"{shapes[k][1]} for the first: an additive statistic has one shape in every "
                "micro-batch (a value per sample is not additive: sum it over the micro-batch)."
            )
    order = sorted(leaves[0])  # every rank reduces in one order (its first piece's may differ)
    sums = [sum((f[k] for f in leaves[1:]), leaves[0][k].detach()) for k in order]
    if sync.world_size > 1:
        flat = sync.all_reduce(torch.cat([s.reshape(-1).to(torch.float64) for s in sums]))
        sizes = [s.numel() for s in sums]
        sums = [v.view_as(s).to(s.dtype) for v, s in zip(flat.split(sizes), sums, strict=True)]
    summed = iter([dict(zip(order, sums, strict=True))[k] for k in leaves[0]])
    return map_tensors(lambda _: next(summed), outputs[0])
