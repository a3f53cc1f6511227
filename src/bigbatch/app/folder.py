"""The run folder: one run writes it at a time, never through a link, every file replaced whole.

A run holds the folder's lock for its life (``RunFolder``, Note [one writer]); every file bigbatch
opens for writing there refuses a planted symbolic link (``no_follow``, Note [no links]); and
every file it replaces is written beside it, synced and renamed over it after a check of the
free space (``replace_file``, Note [whole files]). The resume snapshots it holds are written
with the same care (``app.snapshot``).
"""

from __future__ import annotations

import errno
import fnmatch
import glob
import os
import shutil
from typing import Any

import torch

from bigbatch.core._tree import tensor_leaves
from bigbatch.core._units import format_bytes
from bigbatch.distributed import launch as distributed

LOCK = ".lock"
# what bigbatch writes in a run folder (Note [no links]): files, snapshots, temporary files, logs
WRITTEN = (
    LOCK,
    "metrics.csv",
    "summary.json",
    "model.pt",
    "snapshot*.pt",
    "report.png",
    "tensorboard",
    ".*tmp*",
    "*.tmp",
    "*.log",
)


class RunFolderBusy(RuntimeError):
    """Another process is running in this run folder."""


class RunFolder:
    """The run folder ``out``, locked for the life of the ``with`` block.

    Note [one writer]
        Two ``bigbatch train`` processes on the same ``--out`` would interleave ``metrics.csv``, and
        a second one starting while the first writes a snapshot would delete the first one's
        temporary file. So a run holds an exclusive OS lock (``fcntl.flock``) on ``DIR/.lock`` for
        its whole life. The kernel releases it when the process ends, however it ends (a SIGKILLed
        run leaves no stale lock). A second process finds the lock held, reads the holder's PID from
        the file, and stops at once, before it has changed anything in the folder. Only the lock
        holder removes stale temporary files. Under torchrun, rank 0 holds the lock and tells the
        other ranks whether it got it.

    Args:
        out: the folder (created if missing).
        ranks: this process's place in the job; rank 0 locks, the others wait for its answer.

    Raises:
        RunFolderBusy: another process holds the folder (the message names its PID).
        OSError: the folder cannot be created or written (a file, read-only, no space).
    """

    def __init__(self, out: str, ranks: distributed.Ranks) -> None:
        self.out, self.ranks, self._fd = out, ranks, -1

    def __enter__(self) -> RunFolder:
        problem = None
        if self.ranks.is_main:
            try:
                self._lock()
            except (RunFolderBusy, OSError) as exc:
                problem = exc
        first = distributed.all_gather_object(problem)[0]  # (an exception pickles whole)
        if first is not None:  # rank 0 could not: every rank stops, with rank 0's error
            raise problem or first
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the lock; the file stays (removing it would race)
            self._fd = -1

    def path(self, name: str) -> str:
        """``out/name``."""
        return os.path.join(self.out, name)

    def _lock(self) -> None:
        import fcntl

        try:
            os.makedirs(self.out, exist_ok=True)
        except FileExistsError:
            text = "is a file, not a folder: choose another --out"
            raise NotADirectoryError(errno.ENOTDIR, text, self.out) from None
        except OSError as exc:
            text = f"cannot be used as the run folder ({exc.strerror})"
            raise OSError(exc.errno, text, self.out) from None
        if not os.access(self.out, os.W_OK):
            raise PermissionError(errno.EACCES, "is not writable: choose another --out", self.out)
        links = planted_links(self.out)  # before anything is written (Note [no links])
        if links:
            raise OSError(
                errno.ELOOP,
                f"holds symbolic links where bigbatch writes ("
                f"{', '.join(links)}), and bigbatch never writes through one: remove "
                "them, or choose another --out",
                self.out,
            )
        fd = no_follow(self.path(LOCK), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunFolderBusy(
                f"run folder {self.out!r} is in use by another bigbatch run "
                f"(process {_holder(fd)}): wait for it to end, or choose another "
                "--out."
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd


def lock_holder(out: str) -> str | None:
    """The PID written in ``out/.lock`` while a run holds it (Note [one writer]), else None."""
    import fcntl

    try:
        fd = os.open(os.path.join(out, LOCK), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released when fd closes
        os.close(fd)
        return None
    except BlockingIOError:
        return _holder(fd)


def _holder(fd: int) -> str:
    """The PID in the lock file ``fd`` (closed here)."""
    holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
    os.close(fd)
    return holder


def no_follow(path: str, flags: int, mode: int = 0o666) -> int:
    """``os.open`` that refuses a symbolic link at ``path``; usable as the ``opener`` of
    ``open``: ``open(path, "a", opener=no_follow)``.

    Note [no links]
        A symbolic link planted in the run folder under a name bigbatch writes (``.lock``,
        ``metrics.csv``, a snapshot, ``model.pt``, a temporary file, ...) would make a write
        truncate or fill the file it points to, anywhere the user can write. So the lock holder
        refuses a folder that holds such a link before it writes anything, and every file bigbatch
        opens for writing there is opened with ``O_NOFOLLOW`` (``no_follow``; a new temporary file
        also with ``O_EXCL``), which refuses a link planted later; files are replaced by
        ``os.replace``, which replaces a link, never its target.

    Raises:
        OSError: ``ELOOP`` naming ``path``, when it is a link.
    """
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.EEXIST and os.path.islink(path)):
            raise OSError(
                errno.ELOOP,
                "is a symbolic link, and bigbatch never writes through "
                "one in a run folder: remove the link, or choose another --out",
                path,
            ) from None
        raise


def planted_links(out: str) -> list[str]:
    """The names in ``out`` that bigbatch writes and that are symbolic links (Note [no links])."""
    with os.scandir(out) as entries:
        links = [e.name for e in entries if e.is_symlink()]
    return sorted(name for name in links if any(fnmatch.fnmatch(name, w) for w in WRITTEN))


def write_temp(path: str, content: Any, kept: str = "nothing was changed") -> str:
    """Write ``content`` (bytes, or an object for ``torch.save``) to a new temporary file beside
    ``path``, synced to disk; return its path.

    Note [whole files]
        Every file bigbatch replaces (a snapshot, ``model.pt``, ``summary.json``, ``metrics.csv``
        cut back on resume, a plot) is written by ``write_temp`` to ``.NAME.tmp.PID`` beside it,
        flushed and ``fsync``\\ ed, then ``os.replace``\\ d over it and the folder ``fsync``\\ ed
        (``replace_file``): a kill leaves the old file or the new one, never half. Before writing,
        the bytes the file needs (its bytes, or its tensors' storages and a margin for
        ``torch.save``'s format) are compared with the free space; too little fails with
        ``OSError(ENOSPC)`` saying both and what the user still has, before anything is written, and
        a disk that fills up during the write fails the same way, the temporary file removed.

    Raises:
        OSError: ``ENOSPC`` naming ``path``, what it needs, what is free and ``kept`` (what the
            user still has); ``ELOOP`` for a link planted at the temporary file's name.
    """
    folder = os.path.dirname(path) or "."
    need = len(content) if isinstance(content, bytes) else bytes_needed(content)
    if need > shutil.disk_usage(folder).free:  # before anything is written (Note [whole files])
        raise _no_room(path, need, folder, kept)
    temp = os.path.join(folder, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    try:
        fd = no_follow(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except OSError as exc:  # named by the file asked for, unless a link was planted at temp
        raise exc if exc.errno == errno.ELOOP else OSError(exc.errno, exc.strerror, path) from None
    try:
        with open(fd, "wb") as file:
            file.write(content) if isinstance(content, bytes) else torch.save(content, file)
            file.flush()
            os.fsync(file.fileno())
    except BaseException as exc:
        os.remove(temp)
        full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
        # torch's writer reports a short write as "enforce fail ... unexpected pos": ask the disk
        if full or (isinstance(exc, RuntimeError) and shutil.disk_usage(folder).free < 1 << 20):
            raise _no_room(path, need, folder, kept) from None
        raise
    return temp


def replace_file(path: str, content: Any, kept: str = "nothing was changed") -> str:
    """Replace ``path`` by ``content`` (bytes, or an object for ``torch.save``) so that a kill
    leaves the old file or the new one, never half (Note [whole files]); ``write_temp``'s errors."""
    os.replace(write_temp(path, content, kept), path)
    sync_folder(os.path.dirname(path) or ".")
    return path


def bytes_needed(obj: Any) -> int:
    """What ``torch.save(obj)`` writes, at most: each tensor storage once, and a margin for the
    archive's records and the pickled structure."""
    storages = {
        (str(t.device), t.untyped_storage().data_ptr()): t.untyped_storage().nbytes()
        for _, t in tensor_leaves(obj)
    }
    return sum(storages.values()) + 1024 * len(storages) + (64 << 10)


def clean_stale_temps(out: str) -> None:
    """Remove the temporary files of writers killed mid-write. Call it only while holding the
    folder's lock (Note [one writer])."""
    for path in glob.glob(os.path.join(glob.escape(out), ".*.tmp.*")):
        os.remove(path)


def sync_folder(path: str) -> None:
    """``fsync`` a folder, so that a rename in it survives a power loss (where folders open)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _no_room(path: str, need: int, folder: str, kept: str) -> OSError:
    free = format_bytes(shutil.disk_usage(folder).free)
    text = f"needs {format_bytes(need)}, {free} free on its disk: {kept}"
    return OSError(errno.ENOSPC, text, path)
