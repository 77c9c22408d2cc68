"""Several processes, one model: process groups, tensor-parallel collectives, graph capture
across ranks, and the data-parallel agreement on each step's mode and size."""

from ostinato.distributed.agreement import StepAgreement, agree_on_step, idle_proposal
from ostinato.distributed.collectives import all_gather_last_dim, all_reduce_sum
from ostinato.distributed.groups import (
    ParallelConfig,
    ParallelGroups,
    TensorParallel,
    init_parallel,
    shutdown_parallel,
    single_process,
)

__all__ = [
    "ParallelConfig",
    "ParallelGroups",
    "StepAgreement",
    "TensorParallel",
    "agree_on_step",
    "all_gather_last_dim",
    "all_reduce_sum",
    "idle_proposal",
    "init_parallel",
    "shutdown_parallel",
    "single_process",
]
