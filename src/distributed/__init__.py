"""torchtp: tensor-parallel layers, collectives and model wrapping for PyTorch.

Layer names follow PyTorch's weight layout ``(out_features, in_features)``:
:class:`RowParallelLinear` splits weight rows (out_features; "colwise" in
PyTorch/HF plans), :class:`ColumnParallelLinear` splits weight columns
(in_features; "rowwise") and all-reduces its output.
"""

from __future__ import annotations

from ._comm import CollectiveCounter, count_collectives
from ._logging import configure_from_env, logger
from .collectives import (
    all_gather,
    all_reduce_sum,
    broadcast_tensor,
    reduce_scatter,
    synchronize_across_ranks,
)
from .errors import MissingProcessGroupError, RankMismatchError
from .layers import ColumnParallelLinear, RowParallelLinear
from .regions import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_tensor_parallel_region,
    scatter_to_tensor_parallel_region,
)
from .runtime import (
    TensorParallelConfig,
    get_tensor_parallel_config,
    init_tensor_parallel,
)
from .wrapper import DistributedModelWrapper

__version__ = "0.1.0"

configure_from_env()

__all__ = [
    "CollectiveCounter",
    "ColumnParallelLinear",
    "DistributedModelWrapper",
    "MissingProcessGroupError",
    "RankMismatchError",
    "RowParallelLinear",
    "TensorParallelConfig",
    "__version__",
    "all_gather",
    "all_reduce_sum",
    "broadcast_tensor",
    "copy_to_tensor_parallel_region",
    "count_collectives",
    "gather_from_tensor_parallel_region",
    "get_tensor_parallel_config",
    "init_tensor_parallel",
    "logger",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter",
    "reduce_scatter_to_tensor_parallel_region",
    "scatter_to_tensor_parallel_region",
    "synchronize_across_ranks",
]
