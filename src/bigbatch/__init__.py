"""bigbatch: train with the batch size you want on the memory you have.

Exact gradient accumulation for PyTorch: the optimizer steps equal those of full-batch training
however the logical batch is cut into micro-batches.
"""

from bigbatch._warnings import BigBatchWarning
from bigbatch.batchnorm import batchnorm
from bigbatch.cached import cached_loss
from bigbatch.check import CheckReport, NotExactError, check
from bigbatch.engine import Accumulator, StepResult
from bigbatch.loss import LossFn, sample_cross_entropy, sample_mse, token_cross_entropy
from bigbatch.memory.checkpointing import disable_checkpointing, enable_checkpointing
from bigbatch.memory.oom import MemoryBudgetExceeded, is_out_of_memory
from bigbatch.memory.peak import PeakMemory, measure_peak
from bigbatch.memory.planner import Plan, plan
from bigbatch.split import split
from bigbatch.stepping import NonFiniteError
from bigbatch.train.config import TrainConfig
from bigbatch.train.loop import fit
from bigbatch.train.task import Task

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
    "is_out_of_memory",
    "measure_peak",
    "plan",
    "sample_cross_entropy",
    "sample_mse",
    "split",
    "token_cross_entropy",
]
__version__ = "0.1.0"
