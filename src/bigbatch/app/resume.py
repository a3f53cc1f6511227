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
    starts (by the process that holds the folder's lock: Note [one writer]). A full disk fails
    the write with ``OSError(ENOSPC)``, the temporary file is removed, and the previous
    snapshots stay. Durability against power loss follows from the fsyncs (by construction, not
    by test).
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Any

import torch

SNAPSHOT = "snapshot.pt"
FORMAT = "bigbatch-snapshot-4"  # 4: local rounds (``local``, and their settings in the identity)
_TEMP_PREFIX = ".snapshot.pt.tmp."
_OLDER = re.compile(r"snapshot-(\d+)\.pt$")


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
    temp = _write_temp(snapshot.to_dict(), path)
    if os.path.exists(path):
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
    names = {f.name for f in dataclasses.fields(Snapshot)}
    if found != FORMAT or set(state) != names:
        raise RunMismatchError(f"{path} is not a bigbatch snapshot; choose another --out.")
    return Snapshot(**state)


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


def atomic_save(obj: Any, path: str) -> str:
    """``torch.save(obj, path)`` so that a kill leaves the old file or the new one, never half."""
    temp = _write_temp(obj, path)
    os.replace(temp, path)
    _fsync_dir(os.path.dirname(path) or ".")
    return path


def _write_temp(obj: Any, path: str) -> str:
    folder = os.path.dirname(path) or "."
    temp = os.path.join(folder, f"{_TEMP_PREFIX}{os.getpid()}")
    try:
        with open(temp, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
    except BaseException as exc:
        if os.path.exists(temp):
            os.remove(temp)
        if _disk_full(exc, folder):
            raise OSError(
                errno.ENOSPC, "no space left on the device; the previous snapshot is kept", path
            ) from None
        raise
    return temp


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
