"""Resume snapshots: the whole training state in one file, written atomically.

A snapshot is taken at an optimizer-step boundary and holds the model, the optimizer, the LR
scheduler, the gradient scaler, every random generator of every rank (torch CPU and CUDA, numpy,
Python), the data position (epoch and batches done; the order is a pure function of ``seed`` and
the epoch), the adopted auto micro-batch size and the run's settings. Under torchrun rank 0
writes it and every rank reads it: the run folder must be one that every node sees. A run
killed mid-window redoes that window from the same data and the same random state, so the
resumed run ends bitwise equal to an uninterrupted one on the CPU.

Note [atomic snapshot]
    ``write_snapshot`` writes to a temporary file in the run folder, flushes and ``fsync``\\ s it,
    ``os.replace``\\ s it over ``snapshot.pt`` and ``fsync``\\ s the folder. A kill at any moment
    leaves either the previous snapshot or the new one, never a torn file: the previous one stays
    in place until the rename commits the new one. A killed writer leaves a stale temporary
    file, removed by ``clean_stale_temps`` when the next run starts. Durability against power
    loss follows from the fsyncs (by construction, not by test).
"""

from __future__ import annotations

import glob
import os
import random
from typing import Any

import torch

SNAPSHOT = "snapshot.pt"
_TEMP_PREFIX = ".snapshot.pt.tmp."


class RunMismatchError(ValueError):
    """The run folder holds a run with other settings or another task; the message says what."""


def snapshot_path(out: str) -> str:
    """Where the run folder ``out`` keeps its snapshot."""
    return os.path.join(out, SNAPSHOT)


def clean_stale_temps(out: str) -> list[str]:
    """Remove temporary files left by a writer killed mid-write; return their paths."""
    stale = glob.glob(os.path.join(glob.escape(out), _TEMP_PREFIX + "*"))
    for path in stale:
        os.remove(path)
    return stale


def write_snapshot(out: str, state: dict[str, Any]) -> str:
    """Write ``state`` to ``out/snapshot.pt`` atomically (Note [atomic snapshot])."""
    return atomic_save(state, snapshot_path(out))


def atomic_save(obj: Any, path: str) -> str:
    """``torch.save(obj, path)`` so that a kill leaves the old file or the new one, never half."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    temp = os.path.join(folder, f"{_TEMP_PREFIX}{os.getpid()}")
    with open(temp, "wb") as file:
        torch.save(obj, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temp, path)
    _fsync_dir(folder)
    return path


def read_snapshot(out: str) -> dict[str, Any] | None:
    """The snapshot in ``out``, or ``None`` when there is none.

    Raises:
        RunMismatchError: the file is not a bigbatch snapshot.
    """
    path = snapshot_path(out)
    if not os.path.exists(path):
        return None
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
    return state


FORMAT = "bigbatch-snapshot-2"  # 2: one random state per rank


def check_same_run(saved: dict[str, Any], current: dict[str, Any], out: str) -> None:
    """Refuse to resume a run folder whose identity (task, settings, model) differs.

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


def capture_rng() -> dict[str, Any]:
    """Every random generator's state: torch CPU and CUDA, numpy (if installed), Python."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _python_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy_state = _numpy_state()
    if numpy_state is not None:
        state["numpy"] = numpy_state
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what ``capture_rng`` saved."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _python_state() -> tuple[int, list[int], float | None]:
    version, internal, gauss = random.getstate()
    return version, list(internal), gauss


def _numpy_state() -> tuple[str, list[int], int, int, float] | None:
    try:
        import numpy as np
    except ImportError:
        return None
    kind, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    # Plain lists, not arrays: the snapshot then loads with torch.load(weights_only=True).
    return str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not every platform opens folders
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
