"""torchtp: tensor-parallel layers, collectives and model wrapping for PyTorch.

Layer names follow PyTorch's weight layout ``(out_features, in_features)``:
:class:`RowParallelLinear` splits weight rows (out_features; "colwise" in
PyTorch/HF plans), :class:`ColumnParallelLinear` splits weight columns
(in_features; "rowwise") and all-reduces its output.
"""

from __future__ import annotations

from ._version import __version__
from .comm.collectives import (
    all_gather,
    all_reduce_sum,
    broadcast_tensor,
    reduce_scatter,
    synchronize_across_ranks,
)
from .comm.ops import CollectiveCounter, count_collectives
from .comm.regions import copy_to_tensor_parallel_region, scatter_to_tensor_parallel_region
from .comm.runtime import (
    TensorParallelConfig,
    get_tensor_parallel_config,
    init_parallel,
    init_tensor_parallel,
    shutdown_tensor_parallel,
)
from .core.errors import (
    GroupDestroyedError,
    InconsistentGroupError,
    MissingProcessGroupError,
    RankMismatchError,
)
from .core.log import configure_from_env, logger
from .ep import styles as _ep_styles  # noqa: F401 - registers the experts' styles
from .integrations import wrap_steps as _wrap_steps  # noqa: F401 - registers its wrap steps
from .layers import (
    ColumnParallelLinear,
    FeatureParallelEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    layouts_of,
)
from .layers.loss import vocab_parallel_cross_entropy
from .layers.rng import manual_seed
from .sp import style as _sp_style  # noqa: F401 - registers the sequence-parallel style
from .training.clip import clip_grad_norm_, grad_norm
from .training.grad_scaler import GradScaler
from .wrap.wrapper import DistributedModelWrapper

configure_from_env()

# Loaded on first use: torchtp.signal reads TORCHTP_CONFIG when imported, and a
# bad file there must not break `import torchtp` for everyone else.
_LAZY_SUBPACKAGES = ("checkpoint", "hf", "plans", "shard", "signal", "slicing")


def __getattr__(name: str) -> object:
    if name in _LAZY_SUBPACKAGES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "CollectiveCounter",
    "ColumnParallelLinear",
    "DistributedModelWrapper",
    "FeatureParallelEmbedding",
    "GradScaler",
    "GroupDestroyedError",
    "InconsistentGroupError",
    "MissingProcessGroupError",
    "RankMismatchError",
    "RowParallelLinear",
    "TensorParallelConfig",
    "VocabParallelEmbedding",
    "__version__",
    "all_gather",
    "all_reduce_sum",
    "broadcast_tensor",
    "clip_grad_norm_",
    "copy_to_tensor_parallel_region",
    "count_collectives",
    "get_tensor_parallel_config",
    "grad_norm",
    "init_parallel",
    "init_tensor_parallel",
    "layouts_of",
    "logger",
    "manual_seed",
    "reduce_scatter",
    "scatter_to_tensor_parallel_region",
    "shutdown_tensor_parallel",
    "synchronize_across_ranks",
    "vocab_parallel_cross_entropy",
]
