"""Several processes: process groups from torchrun, the data-sharding rule, local accumulation.

``bigbatch.distributed.setup()`` / ``wrap`` / ``make_sampler`` for your own loop under torchrun,
and ``LocalAccumulation`` for slow links (see ``README.md`` in this folder).
"""

from bigbatch.distributed.launch import (
    Ranks,
    all_gather_object,
    barrier,
    check_batch_sizes,
    deal,
    exit_process,
    in_group,
    is_main_process,
    make_sampler,
    per_rank_batch_size,
    setup,
    teardown,
    unwrap,
    wrap,
)
from bigbatch.distributed.local import LocalAccumulation, LocalStepResult, OuterStepResult

__all__ = [
    "LocalAccumulation",
    "LocalStepResult",
    "OuterStepResult",
    "Ranks",
    "all_gather_object",
    "barrier",
    "check_batch_sizes",
    "deal",
    "exit_process",
    "in_group",
    "is_main_process",
    "make_sampler",
    "per_rank_batch_size",
    "setup",
    "teardown",
    "unwrap",
    "wrap",
]
