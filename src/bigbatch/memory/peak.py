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
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from bigbatch.memory.auto import format_bytes


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
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._hand_peak_to_open_probes()
            torch.cuda.reset_peak_memory_stats(self.device)
            record = PeakMemory(
                str(self.device), baseline_bytes=torch.cuda.memory_allocated(self.device)
            )
        else:
            self._hand_peak_to_open_probes()
            _malloc_trim()
            exact = _reset_rss_high_water_mark()
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

    def _hand_peak_to_open_probes(self) -> None:
        for probe in list(_open_probes):
            if probe is not self and probe.device == self.device and probe._record is not None:
                record = probe._record
                record._carried_bytes = max(record._carried_bytes, self._raw_peak())


# Measurements still open. Module state on purpose: the counters they read are process-wide, so a
# measurement that resets them must tell the others (weak: a probe nobody holds is finished).
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
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else "cpu"
        )
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"device={str(device)!r} is not supported by measure_peak: use 'cpu' or 'cuda'."
        )
    return device


def _proc_status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # not Linux: ru_maxrss is the best available (never reset)

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _reset_rss_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
