"""Resume snapshots: the whole training state in one file, written atomically, the newest kept.

A ``Snapshot`` is taken at an optimizer-step boundary and holds the model, the optimizer, the LR
scheduler, what the engine owns (``Accumulator.state_dict``: the adopted micro-batch, the loss
scaler), every random generator of every rank (torch CPU and CUDA, numpy, Python), the step
(the data order is a pure function of ``seed`` and the epoch, so the step says where the data
are) and the run's identity. Under torchrun rank 0 writes it and every rank reads it: the run
folder must be one that every node sees. A run killed mid-window redoes that window from the
same data and the same random state, so the resumed run ends bitwise equal to an uninterrupted
one on the CPU. Under ``--local-steps`` λ > 1 snapshots are taken between rounds only, with
every rank's optimizer state (Note [local rounds] in ``train.rounds``).

``DIR/snapshot.pt`` is always the newest; the ones before it are ``DIR/snapshot-<step>.pt``, and
the newest ``keep`` snapshots are kept in all, so a bad late state (NaN weights are never
written, but a wrong setting may be) never replaces the only good one.

Note [atomic snapshot]
    ``write_snapshot`` writes to a temporary file in the run folder, flushes and ``fsync``\\ s it,
    renames the current ``snapshot.pt`` to ``snapshot-<its step>.pt``, ``os.replace``\\ s the new
    one over ``snapshot.pt`` and ``fsync``\\ s the folder, and only then deletes snapshots beyond
    ``keep``. A kill at any moment leaves every committed snapshot whole: between the two
    renames the newest is ``snapshot-<step>.pt``, which ``read_latest`` finds. A killed writer
    leaves a stale temporary file, removed by ``clean_stale_temps`` when the folder's next run
    starts (by the process that holds the folder's lock: Note [one writer]). Before writing,
    the bytes the file needs (its tensors' storages and a margin for the format) are compared
    with the free space; too little fails with ``OSError(ENOSPC)`` saying both, before
    anything is written or deleted, and a disk that fills up during the write fails the same
    way, the temporary file removed: the previous snapshots stay. The temporary file is created
    with ``O_EXCL | O_NOFOLLOW`` (Note [no links] in ``train.folder``). Durability against
    power loss follows from the fsyncs (by construction, not by test).

Note [snapshot fields]
    A snapshot is loaded with ``weights_only`` (it never runs code), and every field is checked
    before anything is restored: its type, ``0 <= step <= total_steps``, a finite
    ``elapsed_s >= 0``, every rank's random state a dict. What a field holds inside (a state
    dict) is checked by the object that loads it; either way a bad file is refused with one
    line naming the file and the field, never a traceback from torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import glob
import math
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from bigbatch.app.folder import no_follow
from bigbatch.core import _rng
from bigbatch.core._tree import tensor_leaves
from bigbatch.core._units import format_bytes
from bigbatch.core._warnings import BigBatchWarning
from bigbatch.distributed import launch as distributed

SNAPSHOT = "snapshot.pt"
FORMAT = "bigbatch-snapshot-4"  # 4: local rounds (``local``, and their settings in the identity)
_TEMP_PREFIX = ".snapshot.pt.tmp."
_OLDER = re.compile(r"snapshot-(\d+)\.pt$")
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
            otherwise (Note [local rounds] in ``train.rounds``).
        torch_version, num_threads: where it was written (a difference is warned about on resume:
            other kernels or another thread count can change the last bits of a float).
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

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (no copies of the tensors), what ``torch.save`` writes."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def environment_changes(self) -> list[str]:
        """How this process differs from the one that wrote the snapshot (for a warning)."""
        changes = []
        if self.torch_version != str(torch.__version__):
            changes.append(f"torch {self.torch_version} -> {torch.__version__}")
        if self.num_threads != torch.get_num_threads():
            changes.append(f"{self.num_threads} -> {torch.get_num_threads()} threads")
        return changes


def clean_stale_temps(out: str) -> list[str]:
    """Remove temporary files left by a writer killed mid-write; return their paths.

    Call it only while holding the folder's lock (Note [one writer]).
    """
    stale = glob.glob(os.path.join(glob.escape(out), _TEMP_PREFIX + "*"))
    for path in stale:
        os.remove(path)
    return stale


def write_snapshot(
    out: str, snapshot: Snapshot, keep: int = 2, previous_step: int | None = None
) -> str:
    """Write ``snapshot`` as ``out/snapshot.pt``, keeping the newest ``keep`` (Note [atomic snapshot]).

    Args:
        out: the run folder.
        snapshot: what to write.
        keep: snapshots to keep in all (at least 1).
        previous_step: the step of the ``snapshot.pt`` being replaced (``None``: none, or unknown,
            in which case it is read from the file).
    """
    path = os.path.join(out, SNAPSHOT)
    temp = _write_temp(snapshot.to_dict(), path, _KEPT)
    if os.path.lexists(path):
        if previous_step is None:
            previous_step = read_snapshot(path).step
        os.replace(path, os.path.join(out, f"snapshot-{previous_step:08d}.pt"))
    os.replace(temp, path)
    _fsync_dir(out)
    older = older_snapshots(out)
    for _, old in older[: max(0, len(older) - (keep - 1))]:
        os.remove(old)
    return path


def older_snapshots(out: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the snapshots before the newest, oldest first."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(out), "snapshot-*.pt")):
        match = _OLDER.search(os.path.basename(path))
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_path(out: str) -> str | None:
    """The newest snapshot's path in ``out``, or ``None`` when there is none."""
    path = os.path.join(out, SNAPSHOT)
    if os.path.exists(path):
        return path
    older = older_snapshots(out)  # a writer killed between its two renames (Note [atomic snapshot])
    return older[-1][1] if older else None


def read_latest(out: str) -> Snapshot | None:
    """The newest snapshot in ``out``, or ``None`` when there is none.

    Raises:
        RunMismatchError: the file is not a bigbatch snapshot of this version.
    """
    path = latest_path(out)
    return None if path is None else read_snapshot(path)


def read_snapshot(path: str) -> Snapshot:
    """Load one snapshot file (``weights_only``: a snapshot never runs code when loaded).

    Raises:
        RunMismatchError: not a readable bigbatch snapshot, or one of another bigbatch version.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        raise RunMismatchError(
            f"{path} is not a readable bigbatch snapshot ({type(exc).__name__}); move it away or "
            "choose another --out."
        ) from None
    found = state.get("format") if isinstance(state, dict) else None
    if isinstance(found, str) and found.startswith("bigbatch-snapshot-") and found != FORMAT:
        raise RunMismatchError(
            f"{path} was written by another version of bigbatch ({found}; this one reads "
            f"{FORMAT}): resume it with that version, or start again in another --out."
        )
    if found != FORMAT:
        raise RunMismatchError(f"{path} is not a bigbatch snapshot; choose another --out.")
    _check_fields(path, state)
    return Snapshot(**state)


_TYPES: dict[str, tuple[type, ...]] = {
    "identity": (dict,), "step": (int,), "total_steps": (int,), "model": (dict,),
    "optimizer": (dict,), "scheduler": (dict, type(None)), "engine": (dict,), "rng": (list,),
    "elapsed_s": (int, float), "local": (dict, type(None)), "torch_version": (str,),
    "num_threads": (int,), "format": (str,),
}  # fmt: skip


def _check_fields(path: str, state: dict[str, Any]) -> None:
    """Every field there, of its type and range (Note [snapshot fields])."""
    missing = [name for name in _TYPES if name not in state]
    if missing:
        raise crafted(path, missing[0], "is missing")
    for name, kinds in _TYPES.items():
        value = state[name]
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise crafted(path, name, f"is {_kinds((type(value),))}, not {_kinds(kinds)}")
    if not 1 <= state["total_steps"] or not 0 <= state["step"] <= state["total_steps"]:
        where = f"step={state['step']}, total_steps={state['total_steps']}"
        raise crafted(path, "step", f"is out of range ({where}; 0 <= step <= total_steps)")
    if not (math.isfinite(state["elapsed_s"]) and state["elapsed_s"] >= 0):
        raise crafted(path, "elapsed_s", f"is {state['elapsed_s']!r}, not a time in seconds")
    if not state["rng"] or not all(isinstance(r, dict) for r in state["rng"]):
        raise crafted(path, "rng", "is not a list of every rank's random state")


def _kinds(kinds: tuple[type, ...]) -> str:
    names = ["None" if k is type(None) else k.__name__ for k in kinds]
    return " or ".join(
        n if n == "None" else f"{'an' if n[0] in 'aeiou' else 'a'} {n}" for n in names
    )


def crafted(path: str, name: str, problem: str) -> RunMismatchError:
    """The error for a snapshot field that cannot be used (Note [snapshot fields])."""
    return RunMismatchError(
        f"{path}: the snapshot's field {name!r} {problem}: the file is damaged or was not "
        "written by bigbatch; move it away (an older snapshot-*.pt is used then), or choose "
        "another --out."
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
    keys = sorted(set(saved) | set(current))
    diffs = [
        f"{k}: {saved.get(k)!r} -> {current.get(k)!r}"
        for k in keys
        if saved.get(k) != current.get(k)
    ]
    if diffs:
        raise RunMismatchError(
            f"run folder {out!r} belongs to another run ({'; '.join(diffs)}): resume with the same "
            "task and settings, or choose another --out."
        )


def restore_rng(saved: list[dict[str, Any]], ranks: distributed.Ranks) -> None:
    """Each rank takes back its own generators; on another number of ranks, rank 0's (warned)."""
    if len(saved) == ranks.world_size:
        _rng.restore_all(saved[ranks.rank])
        return
    if ranks.is_main:
        warnings.warn(
            f"resuming on {ranks.world_size} rank(s) a run saved on {len(saved)}: every rank "
            "takes rank 0's random state, so random draws (dropout) differ from the "
            "uninterrupted run; resume on the same number of ranks for a bitwise-equal result.",
            BigBatchWarning,
            stacklevel=5,
        )
    _rng.restore_all(saved[0])


def atomic_save(obj: Any, path: str, kept: str = "nothing was changed") -> str:
    """``torch.save(obj, path)`` so that a kill leaves the old file or the new one, never half.

    Raises:
        OSError: ``ENOSPC`` when the disk has too little room, naming what the file needs, what
            is free and ``kept`` (what the user still has); a symbolic link in the way (ELOOP).
    """
    temp = _write_temp(obj, path, kept)
    os.replace(temp, path)
    _fsync_dir(os.path.dirname(path) or ".")
    return path


def _write_temp(obj: Any, path: str, kept: str) -> str:
    folder = os.path.dirname(path) or "."
    need, free = bytes_needed(obj), shutil.disk_usage(folder).free
    if need > free:  # before anything is written or deleted (Note [atomic snapshot])
        raise _no_room(path, need, free, kept)
    temp = os.path.join(folder, f"{_TEMP_PREFIX}{os.getpid()}")
    fd = no_follow(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with open(fd, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
    except BaseException as exc:
        os.remove(temp)
        if _disk_full(exc, folder):
            raise _no_room(path, need, shutil.disk_usage(folder).free, kept) from None
        raise
    return temp


def bytes_needed(obj: Any) -> int:
    """What ``torch.save(obj)`` writes, at most: each tensor storage once, and a margin for the
    archive's records and the pickled structure."""
    storages = {
        (str(t.device), t.untyped_storage().data_ptr()): t.untyped_storage().nbytes()
        for _, t in tensor_leaves(obj)
    }
    return sum(storages.values()) + 1024 * len(storages) + (64 << 10)


def _no_room(path: str, need: int, free: int, kept: str) -> OSError:
    return OSError(
        errno.ENOSPC,
        f"needs {format_bytes(need)}, {format_bytes(free)} free on its disk: {kept}",
        path,
    )


def _disk_full(exc: BaseException, folder: str) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # torch's writer reports a short write as "enforce fail ... unexpected pos": ask the disk.
    return isinstance(exc, RuntimeError) and shutil.disk_usage(folder).free < 1 << 20


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not every platform opens folders
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
