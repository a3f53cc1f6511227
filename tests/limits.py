"""A process's data segment and a limit on it: how the out-of-memory children make the CPU
allocator really fail (``RLIMIT_DATA``), shared by ``oom_child.py``, the Keras child and the
CLI's real out-of-memory test."""

from __future__ import annotations

import ctypes
import gc
import resource

MiB = 2**20


def data_bytes(pid: int | str = "self") -> int:
    """The data segment of process ``pid`` (``VmData``), in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmData in /proc/{pid}/status")


def limit_data(margin_mib: float | None) -> None:
    """Allow this process ``margin_mib`` more data than it uses now (``None``: lift the limit),
    after giving back what the garbage collector and malloc hold free."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    soft = resource.RLIM_INFINITY if margin_mib is None else int(data_bytes() + margin_mib * MiB)
    resource.setrlimit(resource.RLIMIT_DATA, (soft, resource.RLIM_INFINITY))
