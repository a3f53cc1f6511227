"""bigbatch: train with the batch size you want on the memory you have.

Exact gradient accumulation for PyTorch: the optimizer steps equal those of full-batch training
however the logical batch is cut into micro-batches. ``import bigbatch`` needs only torch; the
trainer's names (``fit``, ``Task``, ``TrainConfig``) load the application on first use.
"""

from typing import Any

from bigbatch.core._stepping import NonFiniteError
from bigbatch.core._warnings import BigBatchWarning
from bigbatch.core.batchnorm import batchnorm
from bigbatch.core.engine import Accumulator, StepResult
from bigbatch.core.head import head_cross_entropy
from bigbatch.core.loss import LossFn, sample_cross_entropy, sample_mse, token_cross_entropy
from bigbatch.core.oom import MemoryBudgetExceeded, is_out_of_memory
from bigbatch.core.peak import PeakMemory, measure_peak
from bigbatch.core.split import split
from bigbatch.losses.cached import cached_loss
from bigbatch.memory.checkpointing import disable_checkpointing, enable_checkpointing
from bigbatch.memory.planner import Plan, plan
from bigbatch.verifier import CheckReport, NotExactError, check


def __getattr__(name: str) -> Any:
    """The trainer's names, imported on first use (the core never imports the application)."""
    module = {"fit": "loop", "Task": "task", "TrainConfig": "settings"}.get(name)
    if module is None:
        raise AttributeError(f"module 'bigbatch' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"bigbatch.app.{module}"), name)


__all__ = [
    "Accumulator",
    "BigBatchWarning",
    "CheckReport",
    "NotExactError",
    "LossFn",
    "MemoryBudgetExceeded",
    "NonFiniteError",
    "PeakMemory",
    "Plan",
    "StepResult",
    "Task",
    "TrainConfig",
    "batchnorm",
    "cached_loss",
    "check",
    "disable_checkpointing",
    "enable_checkpointing",
    "fit",
    "head_cross_entropy",
    "is_out_of_memory",
    "measure_peak",
    "plan",
    "sample_cross_entropy",
    "sample_mse",
    "split",
    "token_cross_entropy",
]
__version__ = "0.1.0"
