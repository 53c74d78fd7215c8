"""Style names -> style objects (PyTorch/HF vocabulary, with HF's meaning).

The core's styles are listed here; a parallel dimension's own styles (``ep``'s
experts, ``sp``'s sequence-sharded modules) are added by its folder with
:func:`register_style` when ``torchtp`` is imported, so ``plans`` never imports
a dimension folder.
"""

from __future__ import annotations

from .styles import (
    Colwise,
    ParallelStyle,
    Replicate,
    ReplicatedWithGradAllreduce,
    Rowwise,
    Unsupported,
)
from .styles_embedding import EmbeddingColwise, EmbeddingRowwise
from .styles_heads import HeadParams, HeadSplit, RopeKey
from .styles_partial import (
    PartialGradOutput,
    ReduceInput,
    ReduceOutput,
    ReduceResidual,
    RowwisePartial,
)
from .styles_state_space import SsmHeads

# The experts modules' styles (registered by ep): only a plan naming them splits experts
EXPERT_STYLES = ("moe_tp_experts", "ep_dispatch_experts")
_EP = ("a bare expert parameter is planned by its experts module's style "
       "('ep_dispatch_experts' or 'moe_tp_experts'), not on its own")

STYLES: dict[str, ParallelStyle] = {
    "colwise": Colwise(),
    "colwise_gather_output": Colwise(gather_output=True),
    "colwise_rep": Colwise(gather_output=True),
    "rowwise": Rowwise(),
    "rowwise_split_input": Rowwise(split_input=True),
    "rowwise_rep": Rowwise(split_input=True),
    "rowwise_partial": RowwisePartial(),
    # transformers 5.25 (MiniCPM5-MoE's k/v): whole heads, replicated where fewer heads
    # than ranks, which is what torchtp's head split makes of any colwise attention split
    "unit_colwise": Colwise(),
    "unit_rowwise": Rowwise(),
    "reduce_output": ReduceOutput(),
    "reduce_input": ReduceInput(),
    "reduce_residual": ReduceResidual(),
    "partial_grad_output": PartialGradOutput(),
    "replicate": Replicate(),
    "keep_full_weight": Replicate(),
    "packed_colwise": HeadSplit(),
    "replicated_with_grad_allreduce": ReplicatedWithGradAllreduce(),
    "embedding_rowwise": EmbeddingRowwise(),
    "embedding_colwise": EmbeddingColwise(),
    "moe_identity_expert": Unsupported("moe_identity_expert", "identity (zero-compute) experts "
                                       "are not split by torchtp yet"),
    "grouped_gemm": Unsupported("grouped_gemm", _EP),
    "packed_rowwise": Unsupported("packed_rowwise", "fused input-side projections are not "
                                  "split by torchtp yet"),
    "mla_kv_a_proj": RopeKey(),
    "ssm_heads": SsmHeads(),
    "all_reduce": Unsupported("all_reduce", "partial-output modules are not implemented yet"),
    "local_params": HeadParams(),
}

# Names users may pass that only exist for HF's internal bookkeeping are not listed:
# an unknown name raises with the list above.
SUPPORTED = sorted(n for n, s in STYLES.items() if not isinstance(s, Unsupported))


def register_style(name: str, style: ParallelStyle) -> None:
    """Add a parallel dimension's style under ``name`` (once, at import of its folder).

    Raises:
        ValueError: ``name`` is taken by another style.
    """
    if STYLES.get(name, style) is not style:
        raise ValueError(f"plan style {name!r} is already registered as {STYLES[name]!r}")
    STYLES[name] = style
    if not isinstance(style, Unsupported) and name not in SUPPORTED:
        SUPPORTED[:] = sorted([*SUPPORTED, name])  # in place: `from .registry import SUPPORTED`


def get_style(style: str | ParallelStyle, fqn: str = "?") -> ParallelStyle:
    """Look up a style by name (or pass a style object through).

    Raises:
        ValueError: unknown style name; the message lists the valid ones.
    """
    if isinstance(style, ParallelStyle):
        return style
    if isinstance(style, str) and style in STYLES:
        return STYLES[style]
    raise ValueError(f"unknown plan style {style!r} for '{fqn}'; valid styles: "
                     + ", ".join(SUPPORTED))
