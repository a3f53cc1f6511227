"""Resume snapshots: the whole training state in one file, written atomically, read back checked.

A ``Snapshot`` is taken at an optimizer-step boundary and holds the model, the optimizer, the LR
scheduler, what the engine owns (``Accumulator.state_dict``: the adopted micro-batch, the loss
scaler), every random generator of every rank (torch CPU and CUDA, numpy, Python), the step
(the data order is a pure function of ``seed`` and the epoch, so the step says where the data
are) and the run's identity. Under torchrun rank 0 writes it and every rank reads it: the run
folder must be one that every node sees. A run killed mid-window redoes that window from the
same data and the same random state, so the resumed run ends bitwise equal to an uninterrupted
one on the CPU. Under ``--local-steps`` λ > 1 snapshots are taken between rounds only, with
every rank's optimizer state (Note [local rounds] in ``app.rounds``).

``DIR/snapshot.pt`` is always the newest; the ones before it are ``DIR/snapshot-<step>.pt``, and
the newest ``keep`` snapshots are kept in all, so a bad late state (NaN weights are never
written, but a wrong setting may be) never replaces the only good one (Note [atomic snapshot]).
A file is refused field by field before anything is restored (Note [snapshot fields]).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import UnionType
from typing import Any, get_args, get_origin, get_type_hints

import torch

from bigbatch.app.folder import sync_folder, write_temp
from bigbatch.app.settings import described
from bigbatch.core import _rng
from bigbatch.core._warnings import BigBatchWarning
from bigbatch.distributed import launch as distributed

SNAPSHOT = "snapshot.pt"
FORMAT = "bigbatch-snapshot-4"  # 4: local rounds (``local``, and their settings in the identity)
_KEPT = "the previous snapshot is kept; free space and run again with --resume"


class RunMismatchError(ValueError):
    """The run folder holds a run with other settings or another task; the message says what."""


@dataclass
class Snapshot:
    """Everything a run needs to continue exactly where it was (see the module docstring).

    Attributes:
        identity: what makes the run the same run (task, settings, model shapes, optimizer).
        step: optimizer steps done.
        total_steps: optimizer steps the run takes in all.
        model, optimizer, scheduler: their ``state_dict``\\ s (``scheduler`` may be ``None``).
        engine: ``Accumulator.state_dict()``.
        rng: every rank's random generators (``bigbatch.core._rng.capture_all``), indexed by rank.
        elapsed_s: training time so far, summed over earlier resumes.
        local: under ``--local-steps`` λ > 1, taken between rounds: the outer state
            (``LocalAccumulation.state_dict``) and every rank's inner optimizer and engine
            state, indexed by rank (``optimizer`` and ``engine`` are then rank 0's); ``None``
            otherwise (Note [local rounds] in ``app.rounds``).
        torch_version, num_threads: where it was written (a difference is warned about on resume:
            other kernels or another thread count can change the last bits of a float).

    ``vars(snapshot)`` is the plain dict ``torch.save`` writes (no copies of the tensors).
    """

    identity: dict[str, Any]
    step: int
    total_steps: int
    model: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None
    engine: dict[str, Any]
    rng: list[dict[str, Any]]
    elapsed_s: float
    local: dict[str, Any] | None = None
    torch_version: str = field(default_factory=lambda: str(torch.__version__))
    num_threads: int = field(default_factory=torch.get_num_threads)
    format: str = FORMAT

    def environment_changes(self) -> list[str]:
        """How this process differs from the one that wrote the snapshot (for a warning)."""
        version, threads = str(torch.__version__), torch.get_num_threads()
        return [
            text
            for differs, text in [
                (self.torch_version != version, f"torch {self.torch_version} -> {version}"),
                (self.num_threads != threads, f"{self.num_threads} -> {threads} threads"),
            ]
            if differs
        ]


def write_snapshot(
    out: str, snapshot: Snapshot, keep: int = 2, previous_step: int | None = None
) -> None:
    """Write ``snapshot`` as ``out/snapshot.pt``, the newest ``keep`` kept.

    Note [atomic snapshot]
        ``write_snapshot`` writes the new snapshot to a temporary file in the run folder, synced
        (``folder.write_temp``, Note [whole files]: the free space is checked first, and a disk that
        fills up fails in one line, before anything is renamed or deleted: the previous snapshots
        stay), renames the current ``snapshot.pt`` to ``snapshot-<its step>.pt``, ``os.replace``\\ s
        the new one over ``snapshot.pt`` and ``fsync``\\ s the folder, and only then deletes
        snapshots beyond ``keep``. A kill at any moment leaves every committed snapshot whole:
        between the two renames the newest is ``snapshot-<step>.pt``, which ``latest_path`` finds. A
        killed writer leaves a stale temporary file, removed by ``folder.clean_stale_temps`` when
        the folder's next run starts (by the process that holds the folder's lock: Note [one
        writer]). Durability against power loss follows from the fsyncs (by construction, not by
        test).

    Args:
        out: the run folder.
        snapshot: what to write.
        keep: snapshots to keep in all (at least 1).
        previous_step: the step of the ``snapshot.pt`` being replaced (``None``: none, or unknown,
            in which case it is read from the file).
    """
    path = os.path.join(out, SNAPSHOT)
    temp = write_temp(path, vars(snapshot), _KEPT)
    if os.path.lexists(path):
        step = read_snapshot(path).step if previous_step is None else previous_step
        os.replace(path, os.path.join(out, f"snapshot-{step:08d}.pt"))
    os.replace(temp, path)
    sync_folder(out)
    older = older_snapshots(out)
    for _, old in older[: max(0, len(older) - (keep - 1))]:
        os.remove(old)


def older_snapshots(out: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the snapshots before the newest, oldest first."""
    found = (re.fullmatch(r"snapshot-(\d+)\.pt", name) for name in os.listdir(out))
    return sorted((int(m[1]), os.path.join(out, m[0])) for m in found if m)


def latest_path(out: str) -> str | None:
    """The newest snapshot's path in ``out``, or ``None`` when there is none."""
    path, older = os.path.join(out, SNAPSHOT), older_snapshots(out)
    # a writer killed between its two renames leaves only older ones (Note [atomic snapshot])
    return path if os.path.exists(path) else older[-1][1] if older else None


def _kinds(hint: Any) -> tuple[type, ...]:
    """The types a snapshot field annotated ``hint`` holds (an ``int`` too where a ``float`` is)."""
    members = get_args(hint) if isinstance(hint, UnionType) else (hint,)
    kinds = tuple(get_origin(m) or m for m in members)
    return (int, float) if kinds == (float,) else kinds


_TYPES = {name: _kinds(hint) for name, hint in get_type_hints(Snapshot).items()}


def read_snapshot(path: str) -> Snapshot:
    """Load one snapshot file (``weights_only``: a snapshot never runs code when loaded).

    Note [snapshot fields]
        A snapshot is loaded with ``weights_only`` (it never runs code), and every field is checked
        before anything is restored: its type, ``0 <= step <= total_steps``, a finite ``elapsed_s >=
        0``, every rank's random state a dict, and no key bigbatch does not write (named with the
        file, not left to ``Snapshot``'s constructor). What a field holds inside (a state dict) is
        checked by the object that loads it; either way a bad file is refused with one line naming
        the file and the field, never a traceback from torch.

    Raises:
        RunMismatchError: not a readable bigbatch snapshot, one of another bigbatch version, or
            one whose field does not fit (Note [snapshot fields]).
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        raise RunMismatchError(
            f"{path} is not a readable bigbatch snapshot ({type(exc).__name__}"
            "); move it away or choose another --out."
        ) from None
    found = state.get("format") if isinstance(state, dict) else None
    if isinstance(found, str) and found.startswith("bigbatch-snapshot-") and found != FORMAT:
        raise RunMismatchError(
            f"{path} was written by another version of bigbatch ({found}; this "
            f"one reads {FORMAT}): resume it with that version, or start again "
            "in another --out."
        )
    if found != FORMAT:
        raise RunMismatchError(f"{path} is not a bigbatch snapshot; choose another --out.")
    # every field there, of its type and range, and no other (Note [snapshot fields])
    if unknown := ", ".join(repr(key) for key in state if key not in _TYPES):
        raise RunMismatchError(
            f"{path}: the snapshot holds {unknown}, not a field of bigbatch's "
            f"snapshots: {_NOT_OURS}"
        )
    for name, kinds in _TYPES.items():
        if name not in state:
            raise crafted(path, name, "is missing")
        if isinstance(state[name], bool) or not isinstance(state[name], kinds):
            raise crafted(path, name, f"is {described(type(state[name]))}, not {described(*kinds)}")
    if not 1 <= state["total_steps"] or not 0 <= state["step"] <= state["total_steps"]:
        where = f"step={state['step']}, total_steps={state['total_steps']}"
        raise crafted(path, "step", f"is out of range ({where}; 0 <= step <= total_steps)")
    if not (math.isfinite(state["elapsed_s"]) and state["elapsed_s"] >= 0):
        raise crafted(path, "elapsed_s", f"is {state['elapsed_s']!r}, not a time in seconds")
    if not state["rng"] or not all(isinstance(r, dict) for r in state["rng"]):
        raise crafted(path, "rng", "is not a list of every rank's random state")
    return Snapshot(**state)


def crafted(path: str, name: str, problem: str) -> RunMismatchError:
    """The error for a snapshot field that cannot be used (Note [snapshot fields])."""
    return RunMismatchError(f"{path}: the snapshot's field {name!r} {problem}: {_NOT_OURS}")


_NOT_OURS = (
    "the file is damaged or was not written by bigbatch; move it away (an older "
    "snapshot-*.pt is used then), or choose another --out."
)


@contextlib.contextmanager
def restoring(path: str, name: str) -> Iterator[None]:
    """Load the field ``name`` of the snapshot ``path`` into its object; whatever that object
    refuses becomes one line naming the file and the field (Note [snapshot fields])."""
    try:
        yield
    except RunMismatchError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as exc:
        text = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise crafted(path, name, f"cannot be restored ({type(exc).__name__}: {text})") from None


def check_same_run(saved: dict[str, Any], current: dict[str, Any], out: str) -> None:
    """Refuse to resume a run folder whose identity (task, settings, model, optimizer) differs.

    Raises:
        RunMismatchError: naming each difference as ``key: saved -> now``.
    """
    keys = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    if keys:
        diffs = "; ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in keys)
        raise RunMismatchError(
            f"run folder {out!r} belongs to another run ({diffs}): resume with "
            "the same task and settings, or choose another --out."
        )


def restore_rng(saved: list[dict[str, Any]], ranks: distributed.Ranks) -> None:
    """Each rank takes back its own generators; on another number of ranks, rank 0's (warned)."""
    if len(saved) != ranks.world_size and ranks.is_main:
        warnings.warn(
            f"resuming on {ranks.world_size} rank(s) a run saved on {len(saved)}: each "
            "rank takes rank 0's random state, so random draws (dropout) differ; resume "
            f"on {len(saved)} for a bitwise-equal result.",
            BigBatchWarning,
            stacklevel=5,
        )
    _rng.restore_all(saved[ranks.rank if len(saved) == ranks.world_size else 0])
