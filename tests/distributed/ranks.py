"""Run a function on real gloo ranks (separate processes) and collect what each returns.

``run_ranks(fn, *args)`` starts ``world_size`` processes (forked from a parent that has imported
torch and bigbatch: ``forks.py``), joins them into one gloo process group over a file rendezvous,
calls ``fn(rank, world_size, *args)`` in each and returns the per-rank results. A failing rank's
traceback is re-raised in the test; a hang is killed.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import tempfile
import traceback

import torch
from forks import context


def _entry(fn, rank, world_size, init_file, results, args):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        try:
            # Bytes, not tensors: shared-memory tensors die with the rank process.
            buffer = io.BytesIO()
            torch.save(fn(rank, world_size, *args), buffer)
            results.put((rank, "ok", buffer.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


@contextlib.contextmanager
def _started(fn, args: tuple, world_size: int):
    """``world_size`` rank processes running ``fn`` over a fresh rendezvous, and the queue they
    answer on; a process still alive when the block ends is killed."""
    ctx = context()  # forked from a parent that has imported torch (forks.py)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, init_file, results, args))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            yield procs, results
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()


def run_ranks(fn, *args, world_size: int = 2, timeout_s: float = 120.0) -> list:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results by rank."""
    out: dict = {}
    with _started(fn, args, world_size) as (_, results):
        try:
            while len(out) < world_size:
                rank, status, value = results.get(timeout=timeout_s)
                if status == "error":
                    raise RuntimeError(f"rank {rank} failed:\n{value}")
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
        except queue.Empty:
            raise TimeoutError(
                f"ranks did not finish in {timeout_s}s (a collective hung?)"
            ) from None
    return [out[r] for r in range(world_size)]


def killed_ranks(fn, *args, world_size: int = 2, code: int = 17, timeout_s: float = 300.0) -> None:
    """Call ``fn(rank, world_size, *args)`` on gloo ranks that must die with ``os._exit(code)``
    (a real kill: no cleanup, nothing returned); re-raise a rank's traceback otherwise."""
    with _started(fn, args, world_size) as (procs, results):
        for p in procs:
            p.join(timeout=timeout_s)
        codes = [p.exitcode for p in procs]
        if codes != [code] * world_size:
            errors = []
            while not results.empty():
                rank, status, value = results.get()
                if status == "error":
                    errors.append(f"rank {rank}:\n{value}")
            raise RuntimeError(f"ranks exited {codes}, not {code}:\n" + "\n".join(errors))
