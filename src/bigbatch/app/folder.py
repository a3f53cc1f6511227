"""The run folder: one run writes it at a time.

Note [one writer]
    Two ``bigbatch train`` processes on the same ``--out`` would interleave ``metrics.csv``, and a
    second one starting while the first writes a snapshot would delete the first one's temporary
    file. So a run holds an exclusive OS lock (``fcntl.flock``) on ``DIR/.lock`` for its whole
    life. The kernel releases it when the process ends, however it ends (a SIGKILLed run leaves
    no stale lock). A second process finds the lock held, reads the holder's PID from the file,
    and stops at once, before it has changed anything in the folder. Only the lock holder
    removes stale temporary files. Under torchrun, rank 0 holds the lock and tells the other
    ranks whether it got it.

Note [no links]
    A symbolic link planted in the run folder under a name bigbatch writes (``.lock``,
    ``metrics.csv``, a snapshot, ``model.pt``, a temporary file, ...) would make a write
    truncate or fill the file it points to, anywhere the user can write. So the lock holder
    refuses a folder that holds such a link before it writes anything, and every file bigbatch
    opens for writing there is opened with ``O_NOFOLLOW`` (``no_follow``; a new temporary file
    also with ``O_EXCL``), which refuses a link planted later; files are replaced by
    ``os.replace``, which replaces a link, never its target.
"""

from __future__ import annotations

import errno
import fnmatch
import os
from types import TracebackType

from bigbatch.distributed import launch as distributed

LOCK = ".lock"
# what bigbatch writes in a run folder (Note [no links]): files, snapshots, temporary files, logs
WRITTEN = (LOCK, "metrics.csv", "summary.json", "model.pt", "snapshot*.pt", "report.png",
           "tensorboard", ".*tmp*", "*.tmp", "*.log")  # fmt: skip


class RunFolderBusy(RuntimeError):
    """Another process is running in this run folder."""


class RunFolder:
    """The run folder ``out``, locked for the life of the ``with`` block (Note [one writer]).

    Args:
        out: the folder (created if missing).
        ranks: this process's place in the job; rank 0 locks, the others wait for its answer.

    Raises:
        RunFolderBusy: another process holds the folder (the message names its PID).
        OSError: the folder cannot be created or written (a file, read-only, no space).
    """

    def __init__(self, out: str, ranks: distributed.Ranks) -> None:
        self.out = out
        self.ranks = ranks
        self._fd: int | None = None

    def __enter__(self) -> RunFolder:
        problem = None
        if self.ranks.is_main:
            try:
                self._lock()
            except (RunFolderBusy, OSError) as exc:
                problem = exc
        answers = distributed.all_gather_object(_describe(problem))
        if problem is not None:
            raise problem
        if answers[0] is not None:  # rank 0 could not take the folder: every rank stops
            raise RunFolderBusy(answers[0])
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock; the file stays (removing it would race)
            self._fd = None

    def path(self, name: str) -> str:
        """``out/name``."""
        return os.path.join(self.out, name)

    def _lock(self) -> None:
        import fcntl

        _make_folder(self.out)
        links = planted_links(self.out)  # before anything is written (Note [no links])
        if links:
            raise OSError(
                errno.ELOOP,
                f"holds symbolic links where bigbatch writes ({', '.join(links)}), and bigbatch "
                "never writes through one: remove them, or choose another --out",
                self.out,
            )
        fd = no_follow(self.path(LOCK), os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunFolderBusy(
                f"run folder {self.out!r} is in use by another bigbatch run (process {holder}): "
                "wait for it to end, or choose another --out."
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd


def no_follow(path: str, flags: int, mode: int = 0o666) -> int:
    """``os.open`` that refuses a symbolic link at ``path`` (Note [no links]); usable as the
    ``opener`` of ``open``: ``open(path, "a", opener=no_follow)``.

    Raises:
        OSError: ``ELOOP`` naming ``path``, when it is a link.
    """
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.EEXIST and os.path.islink(path)):
            raise OSError(
                errno.ELOOP,
                "is a symbolic link, and bigbatch never writes through one in a run folder: "
                "remove the link, or choose another --out",
                path,
            ) from None
        raise


def planted_links(out: str) -> list[str]:
    """The names in ``out`` that bigbatch writes and that are symbolic links (Note [no links])."""
    with os.scandir(out) as entries:
        return sorted(
            e.name
            for e in entries
            if e.is_symlink() and any(fnmatch.fnmatch(e.name, w) for w in WRITTEN)
        )


def _make_folder(out: str) -> None:
    try:
        os.makedirs(out, exist_ok=True)
    except FileExistsError:
        raise NotADirectoryError(
            errno.ENOTDIR, "is a file, not a folder: choose another --out", out
        ) from None
    except OSError as exc:
        raise OSError(
            exc.errno, f"cannot be used as the run folder ({exc.strerror})", out
        ) from None
    if not os.access(out, os.W_OK):
        raise PermissionError(errno.EACCES, "is not writable: choose another --out", out)


def _describe(problem: BaseException | None) -> str | None:
    if problem is None:
        return None
    if isinstance(problem, OSError) and problem.filename is not None:
        return f"{problem.filename}: {problem.strerror}"
    return str(problem)
