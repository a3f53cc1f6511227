"""Process groups from torchrun's environment, rank-0 helpers and the data sharding rule.

Layer 2: the trainer uses this; the engine never does (it only needs ``bigbatch.core._sync``).

Note [global batch]
    ``batch_size`` is always the GLOBAL effective batch, the one the optimizer steps on, and the
    engine normalises by the count summed over all ranks (Note [global normalisation] in
    ``bigbatch.core._sync``), so the step equals the single-process step on the same samples. The
    trainer draws the single process's order (one permutation per epoch), cuts it into global
    batches and ``deal``s each out: rank r takes every W-th sample from position r. So any
    dataset size and any ``batch_size`` give the single-process steps exactly; the shares may
    differ by one sample, and a batch smaller than W is refused (``check_batch_sizes``).
    For your own loop, ``per_rank_batch_size`` (which refuses a remainder) and ``make_sampler``
    give torch's ``DistributedSampler``: it draws the same permutation everywhere
    (``seed + epoch``) and deals it out round-robin, so the union of the ranks' i-th batches
    is the single process's i-th batch when the dataset size is divisible by ``W``; otherwise
    the sampler repeats (or, with ``drop_last=True``, drops) up to ``W - 1`` samples per
    epoch, as torch's sampler does.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Ranks:
    """Where this process stands in the job.

    Attributes:
        rank: global rank, 0 to ``world_size - 1``.
        world_size: number of processes (1 without torchrun).
        local_rank: rank on this machine (picks the GPU).
        device: the device this process trains on.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """``True`` on rank 0, the process that logs and writes files."""
        return self.rank == 0


def setup(device: str | None = None) -> Ranks:
    """Join the process group that torchrun describes in the environment, if any.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (and torchrun's ``MASTER_ADDR`` /
    ``MASTER_PORT``). Without them (a plain ``python`` run) nothing is initialised and a
    one-process ``Ranks`` is returned. The backend is NCCL on CUDA and gloo on CPU; on CUDA the
    process's device is ``cuda:LOCAL_RANK``.

    Args:
        device: ``"cpu"``, ``"cuda"`` or ``None`` (CUDA when available).

    Returns:
        The ``Ranks`` of this process.

    Raises:
        ValueError: ``device`` is not ``"cpu"``, ``"cuda"`` or ``None``, or the environment
            variables are not integers.

    Example:
        >>> ranks = setup("cpu")  # no torchrun variables: one process
        >>> ranks.world_size, ranks.is_main
        (1, True)
    """
    if device not in (None, *DEVICES):
        raise ValueError(f'device={device!r} is not allowed: use "cpu", "cuda" or None.')
    if device == "cuda" and not torch.cuda.is_available():
        built = "without CUDA" if torch.version.cuda is None else f"with CUDA {torch.version.cuda}"
        raise ValueError(
            f"device='cuda' but no CUDA device is available (torch {torch.__version__} is built "
            f"{built}): use device='cpu' (--device cpu), or install a CUDA build of torch."
        )
    on_cuda = device == "cuda" or (device is None and torch.cuda.is_available())
    rank, world_size, local_rank = _environment(on_cuda)
    target = torch.device("cuda", local_rank) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(target)
    if world_size > 1 and not dist.is_initialized():
        try:
            dist.init_process_group("nccl" if on_cuda else "gloo", rank=rank, world_size=world_size)
        except (RuntimeError, ValueError) as exc:  # torch's rendezvous: said in one line
            raise RuntimeError(
                f"rank {rank} of {world_size} could not join the process group at "
                f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
                f"({' '.join(str(exc).split())[:200]}): launch with `torchrun --nproc_per_node "
                "N ...`, which sets the environment, or unset WORLD_SIZE for one process."
            ) from None
    return Ranks(rank, world_size, local_rank, target)


_LAUNCH = "launch with `torchrun --nproc_per_node N ...`, which sets it, or unset it."


def _environment(on_cuda: bool) -> tuple[int, int, int]:
    """``(RANK, WORLD_SIZE, LOCAL_RANK)`` from torchrun's environment, checked.

    Raises:
        ValueError: a variable that is not an integer or out of range, or the rendezvous
            address missing for several processes; the message names the variable.
    """
    rank, world_size, local_rank = map(_env_int, ("RANK", "WORLD_SIZE", "LOCAL_RANK"), (0, 1, 0))
    devices = torch.cuda.device_count() if on_cuda else world_size
    where = f"{devices} CUDA device(s) here" if on_cuda else f"WORLD_SIZE={world_size}"
    for wrong, what in (
        (
            world_size < 1,
            f"WORLD_SIZE={world_size} is not allowed: it is the number of processes, at least 1",
        ),
        (
            not 0 <= rank < world_size,
            f"RANK={rank} is out of range for WORLD_SIZE={world_size} (0 to {world_size - 1})",
        ),
        (
            not 0 <= local_rank < max(devices, 1),
            f"LOCAL_RANK={local_rank} is out of range ({where})",
        ),
        (
            world_size > 1 and not 0 < _env_int("MASTER_PORT", 1) < 65536,
            f"MASTER_PORT={os.environ.get('MASTER_PORT')} is not a port (1 to 65535)",
        ),
    ):
        if wrong:
            raise ValueError(f"environment variable {what}; {_LAUNCH}")
    missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(n)]
    if world_size > 1 and missing:
        raise ValueError(
            f"environment variable WORLD_SIZE={world_size} asks for {world_size} processes, and "
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: launch with "
            f"`torchrun --nproc_per_node {world_size} ...`, which sets them, or unset WORLD_SIZE."
        )
    return rank, world_size, local_rank


def teardown() -> None:
    """Leave the process group together (a no-op when none was initialised).

    The barrier first: a rank that destroys the group while another still talks to it (rank 0
    writing the last files) can abort the other's gloo threads.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """Exit with ``code``; under torchrun, skipping the interpreter's finalization.

    Note [gloo exit]
        Even after ``destroy_process_group`` a gloo worker thread can still hold finished
        work (tensors with Python references); if it drops them while the interpreter is being
        finalized, taking the GIL aborts the process (SIGABRT, "terminate called without an
        active exception"), so a run that wrote everything can still end with exit code -6 and
        torchrun reports a failure (seen here about once in 15 two-rank runs; upstream:
        pytorch/pytorch#179291). When the command returns, its work is done and its files are
        closed, so flushing stdout/stderr and leaving with ``os._exit`` loses nothing and skips
        the race. Whether this process is one of several ranks is read from torchrun's
        environment (``WORLD_SIZE``), not from a flag kept by ``teardown``; a plain run exits
        with ``sys.exit(code)``. So does a rank that ``torchrun --run-path`` started as a
        function in a multiprocessing child: torchrun waits for the function's return value,
        which ``os._exit`` would never give (the run hung once finished), and a multiprocessing
        child ends in ``os._exit`` after its function anyway, never finalizing the interpreter.
    """
    world_size = os.environ.get("WORLD_SIZE", "1").strip()
    if not world_size.isdigit() or int(world_size) <= 1 or torch.multiprocessing.parent_process():
        sys.exit(code)  # a plain run, a bad WORLD_SIZE (said so), or a multiprocessing child
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def in_group() -> bool:
    """``True`` when this process is in an initialised process group."""
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    """Wait for every rank (a no-op without a process group)."""
    if in_group():
        dist.barrier()


def all_gather_object(obj: Any) -> list[Any]:
    """``obj`` of every rank, indexed by rank (``[obj]`` without a process group)."""
    gathered: list[Any] = [obj] * (dist.get_world_size() if in_group() else 1)
    if len(gathered) > 1:
        dist.all_gather_object(gathered, obj)
    return gathered


def is_main_process() -> bool:
    """``True`` on rank 0 and in a job without a process group."""
    return not dist.is_initialized() or dist.get_rank() == 0


def wrap(model: torch.nn.Module, ranks: Ranks) -> torch.nn.Module:
    """Move ``model`` to the rank's device and wrap it in ``DistributedDataParallel`` when W > 1.

    The engine then skips the all-reduce on all but each window's last micro-batch
    (``bigbatch.core._sync``). One process: the model is returned unwrapped.
    """
    model = model.to(ranks.device)
    if ranks.world_size == 1:
        return model
    ids = [ranks.device.index] if ranks.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside ``torch.compile`` and ``DistributedDataParallel`` (for saving a
    plain state dict)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def per_rank_batch_size(batch_size: int, world_size: int) -> int:
    """Samples each rank loads per step for a GLOBAL ``batch_size`` (Note [global batch]).

    Raises:
        ValueError: ``batch_size`` is not a positive multiple of ``world_size``.

    Example:
        >>> per_rank_batch_size(64, 4)
        16
    """
    if batch_size < world_size or batch_size % world_size:
        fixed = max(world_size, batch_size // world_size * world_size)
        raise ValueError(
            f"batch_size={batch_size} is the global batch and must be a multiple of the "
            f"{world_size} ranks (each rank loads batch_size / {world_size}): use "
            f"--batch-size {fixed} or {fixed + world_size}."
        )
    return batch_size // world_size


def deal(indices: list[int], ranks: Ranks) -> list[int]:
    """This rank's share of one global batch: every ``W``-th index from its rank on.

    The shares differ by at most one sample (10 on 4 ranks: 3 + 3 + 2 + 2); the engine
    normalises by the count summed over the ranks, so the step is the step on all of
    ``indices`` (Note [global batch]).

    Example:
        >>> deal([7, 1, 4, 0, 9], Ranks(1, 2, 1, torch.device("cpu")))
        [1, 0]
    """
    return indices[ranks.rank :: ranks.world_size]


def check_batch_sizes(dataset_size: int, batch_size: int, world_size: int) -> None:
    """Refuse a global batch with fewer samples than ranks (one rank would get none).

    The trainer's batches are ``batch_size`` samples, and the last of each epoch holds the
    remainder ``dataset_size % batch_size``.

    Raises:
        ValueError: that last batch is non-empty but smaller than ``world_size``; the message
            names a batch size that works.
    """
    last = dataset_size % batch_size
    if 0 < last < world_size:
        sizes = range(batch_size, world_size - 1, -1)  # at least one sample per rank
        works = next(b for b in sizes if not 0 < dataset_size % b < world_size)
        raise ValueError(
            f"the last batch of each epoch holds {last} sample(s) ({dataset_size} samples at "
            f"batch_size={batch_size}), fewer than the {world_size} ranks: every rank needs at "
            f"least one. Use e.g. --batch-size {works}, or --steps below one epoch."
        )


def make_sampler(
    dataset: Dataset, ranks: Ranks, shuffle: bool = True, seed: int = 0, drop_last: bool = False
) -> DistributedSampler:
    """The sampler that deals the dataset out to the ranks (Note [global batch]).

    Call ``sampler.set_epoch(epoch)`` at the start of each epoch, as with any
    ``DistributedSampler``.
    """
    return DistributedSampler(dataset, ranks.world_size, ranks.rank, shuffle, seed, drop_last)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        message = f"environment variable {name}={value!r} is not an integer: {_LAUNCH}"
        raise ValueError(message) from None
