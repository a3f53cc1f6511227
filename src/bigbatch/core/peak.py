"""Peak memory of a block of code, measured rather than estimated.

What is counted, per device:

* **CUDA**: the caching allocator's own statistics for the current device
  (``torch.cuda.max_memory_allocated``), reset at entry; ``peak_bytes`` is the highest amount of
  memory held by tensors inside the block minus what tensors held at entry. Memory the allocator
  caches but no tensor uses, and memory outside PyTorch (cuBLAS workspaces, NCCL buffers) is not
  counted; ``reserved_bytes`` reports the allocator's peak reservation.
* **CPU**: the kernel's resident-set high-water mark of the whole process (``VmHWM``), which
  Linux lets a process reset by writing ``5`` to ``/proc/self/clear_refs``; ``peak_bytes`` is
  the high-water mark minus the resident set at entry. Freed heap memory is handed back to the
  system (``malloc_trim``) at entry so the baseline is honest. It counts everything the process
  touches (Python objects, other threads), page-granular; on systems without ``clear_refs`` the
  high-water mark cannot be reset and the reading is only an upper bound (``exact=False``).
  Only pages really touched count: ``torch.empty`` of 1 GiB that is never written adds nothing
  (on CUDA it counts in full).

Measurements may be nested or overlap (a ``measure_peak`` around a ``train_step`` whose
``memory_budget`` probes every window): both counters are process-wide and a new measurement
resets them, so the peak seen so far is first handed to every measurement still open on the same
device (see ``_open_probes``).

Note [honest CPU peaks]
    On the CPU the peak is the resident-set high-water mark. glibc raises its mmap threshold
    each time a large block is freed (up to 32 MiB), after which freed tensors stay in the heap
    and the high-water mark follows fragmentation rather than live tensors: measured here,
    checkpointing then seemed to save nothing. Code that compares CPU peaks (the planner, the
    demo, benchmarks) runs inside ``small_mmap_threshold()``, which fixes the threshold at 64 KiB
    as ``MALLOC_MMAP_THRESHOLD_=65536`` would: tensors of more than 64 KiB are mapped and
    unmapped on their own. On exit the threshold goes back to glibc's initial 128 KiB; glibc has
    no call to turn its dynamic adjustment back on, so it stays off for the process (freed large
    blocks then go back to the system at once, which keeps later readings honest too).
    A ``memory_budget`` on the CPU is enforced on these readings, so the engine's window meter
    turns the adjustment off the same way (``fix_mmap_threshold()``, at glibc's initial 128 KiB)
    when it is given one: otherwise the pages of a failed attempt stay in the heap and the next
    reading of a size that fit follows them (measured: a size that fit read 17 to 26 MiB from
    window to window against a 25 MiB budget; with the threshold fixed, within 1%).
    The reading is the high-water mark minus the resident set at the start, so memory freed
    during a window hides as much of the window's own: the meter also collects the process's
    garbage once, when it is built, so that cycles left from before the run (a long-lived
    process, a notebook, a test worker) are not freed by the collector inside a window.

Note [one counter per process]
    ``_open_probes`` is module state on purpose: the counters a probe reads (``VmHWM``, the CUDA
    allocator's peak) belong to the whole process, so a measurement that resets them must tell
    every other measurement still open, whoever owns it. A weak set: a probe nobody holds any
    more is finished.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from bigbatch.core._units import format_bytes
from bigbatch.core.split import check_choice


@dataclass
class PeakMemory:
    """Filled in when the ``measure_peak`` block exits.

    Attributes:
        device: ``"cpu"`` or ``"cuda:N"``.
        peak_bytes: highest memory in use inside the block, above what was in use at entry.
        baseline_bytes: memory in use at entry.
        reserved_bytes: CUDA only: peak bytes reserved by the caching allocator (else 0).
        exact: ``False`` where the high-water mark could not be reset (an upper bound).
    """

    device: str
    peak_bytes: int = 0
    baseline_bytes: int = 0
    reserved_bytes: int = 0
    exact: bool = True
    _carried_bytes: int = field(default=0, repr=False)  # raw peak before a nested reset

    def __str__(self) -> str:
        return f"{format_bytes(self.peak_bytes)} peak on {self.device}"


class PeakProbe:
    """A resettable reading of the process's (or CUDA device's) peak memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._record: PeakMemory | None = None

    def reset(self) -> PeakMemory:
        """Start a new measurement; return a record holding the baseline."""
        for probe in list(_open_probes):  # the peak so far (the statistics need no synchronisation)
            if probe is not self and probe.device == self.device and probe._record is not None:
                probe._record._carried_bytes = max(probe._record._carried_bytes, self._raw_peak())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            record = PeakMemory(
                str(self.device), baseline_bytes=torch.cuda.memory_allocated(self.device)
            )
        else:
            _libc_call("malloc_trim", 0)
            exact = False
            with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as clear_refs:
                exact = clear_refs.write("5") == 1
            record = PeakMemory("cpu", baseline_bytes=_proc_status_bytes("VmRSS"), exact=exact)
        self._record = record
        _open_probes.add(self)
        return record

    def peak_bytes(self, record: PeakMemory) -> int:
        """Peak above the baseline since ``reset`` (cheap: no synchronisation on CUDA)."""
        return max(0, max(self._raw_peak(), record._carried_bytes) - record.baseline_bytes)

    def finish(self, record: PeakMemory) -> PeakMemory:
        """Fill ``record`` with the final reading."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            record.reserved_bytes = torch.cuda.max_memory_reserved(self.device)
        record.peak_bytes = self.peak_bytes(record)
        _open_probes.discard(self)
        return record

    def _raw_peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return _proc_status_bytes("VmHWM")


# Measurements still open: Note [one counter per process].
_open_probes: weakref.WeakSet[PeakProbe] = weakref.WeakSet()


@contextlib.contextmanager
def measure_peak(device: torch.device | str | None = None) -> Iterator[PeakMemory]:
    """Measure the peak memory used by the code inside the block.

    Args:
        device: where to measure: ``"cpu"``, ``"cuda"``, ``"cuda:1"``. Default: the current CUDA
            device if CUDA is available, else the CPU.

    Yields:
        A ``PeakMemory`` whose fields are filled in when the block exits.

    Example:
        >>> with measure_peak("cpu") as peak:
        ...     x = torch.ones(64, 2**20 // 8, dtype=torch.float64)  # 64 MiB
        >>> peak.peak_bytes > 32 * 2**20
        True
    """
    probe = PeakProbe(resolve_device(device))
    record = probe.reset()
    try:
        yield record
    finally:
        probe.finish(record)


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``None`` -> the current CUDA device if there is one, else the CPU."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    check_choice("device", device.type, ("cpu", "cuda"))  # what measure_peak can read
    return device


def _proc_status_bytes(field: str) -> int:
    with contextlib.suppress(OSError, StopIteration), open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))
    import resource  # not Linux: ru_maxrss is the best available (never reset)

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@contextlib.contextmanager
def small_mmap_threshold() -> Iterator[None]:
    """Inside the block, glibc maps every allocation over 64 KiB on its own (Note [honest CPU
    peaks]); a no-op where the C library is not glibc."""
    _libc_call("mallopt", -3, 64 * 1024)  # -3: glibc's M_MMAP_THRESHOLD
    try:
        yield
    finally:
        fix_mmap_threshold()  # back to glibc's initial value


def fix_mmap_threshold() -> None:
    """Turn glibc's dynamic mmap threshold off for the process, at its initial 128 KiB
    (Note [honest CPU peaks]); a no-op where the C library is not glibc."""
    _libc_call("mallopt", -3, 128 * 1024)  # -3: glibc's M_MMAP_THRESHOLD


def _libc_call(name: str, *args: int) -> None:
    """Call the C library's ``name(*args)``; nothing where it is not glibc."""
    with contextlib.suppress(OSError, AttributeError, TypeError):  # no C library, or not glibc
        getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)(*args)
