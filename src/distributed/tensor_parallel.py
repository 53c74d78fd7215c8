"""The reference guide's import path: ``from torchtp.tensor_parallel import ...``.

Also importable from a checkout as ``src.distributed.tensor_parallel``.
"""

from __future__ import annotations

from .comm.collectives import (
    all_gather,
    all_reduce_sum,
    broadcast_tensor,
    reduce_scatter,
    synchronize_across_ranks,
)
from .comm.runtime import (
    TensorParallelConfig,
    get_tensor_parallel_config,
    init_tensor_parallel,
    shutdown_tensor_parallel,
)
from .layers import ColumnParallelLinear, RowParallelLinear
from .wrap.wrapper import DistributedModelWrapper

__all__ = [
    "ColumnParallelLinear",
    "DistributedModelWrapper",
    "RowParallelLinear",
    "TensorParallelConfig",
    "all_gather",
    "all_reduce_sum",
    "broadcast_tensor",
    "get_tensor_parallel_config",
    "init_tensor_parallel",
    "reduce_scatter",
    "shutdown_tensor_parallel",
    "synchronize_across_ranks",
]
