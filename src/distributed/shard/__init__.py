"""torchtp.shard: process grids, shardings and the MLIR ``shard`` dialect's collectives.

Names mirror the dialect (``shard.grid`` -> :class:`Grid`, ``shard.all_gather``
-> :func:`all_gather`, ...): the local tensor comes first, then the grid,
then the op's attributes; ``grid_axes=None`` means every grid axis. These
live beside, and do not replace, torchtp's top-level TP collectives.

Layer 3, a seed-document core beside ``plans``. May import: ``core``, ``comm``.
"""

from __future__ import annotations

from ._common import Reduction
from ._index import linear_index, multi_index
from .grid import Grid
from .ops_gather import all_gather, all_reduce, all_slice, all_to_all, reduce_scatter
from .ops_p2p import recv, send, shift, update_halo
from .ops_rooted import broadcast, gather, reduce, scatter
from .sharding import Sharding, assemble, shard, shard_bounds, shard_shape
from .tensor_ops import (
    MatmulStrategy,
    choose_matmul_strategy,
    distribute,
    matmul,
    placements,
    sharded_mean,
    sharded_sum,
)
from .unshard import unshard

__all__ = [
    "Grid",
    "MatmulStrategy",
    "Reduction",
    "Sharding",
    "all_gather",
    "all_reduce",
    "all_slice",
    "all_to_all",
    "assemble",
    "broadcast",
    "choose_matmul_strategy",
    "distribute",
    "gather",
    "linear_index",
    "matmul",
    "multi_index",
    "placements",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
    "shard",
    "shard_bounds",
    "shard_shape",
    "sharded_mean",
    "sharded_sum",
    "shift",
    "unshard",
    "update_halo",
]
