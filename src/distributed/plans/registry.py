"""Style names -> style objects (PyTorch/HF vocabulary, with HF's meaning)."""

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
from .styles_experts import ExpertsEP, ExpertsTP
from .styles_heads import HeadSplit, RopeKey
from .styles_partial import (
    PartialGradOutput,
    ReduceInput,
    ReduceOutput,
    ReduceResidual,
    RowwisePartial,
)
from .styles_sp import SequenceParallel
from .styles_state_space import SsmHeads

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
    "moe_tp_experts": ExpertsTP(),
    "moe_identity_expert": Unsupported("moe_identity_expert", "identity (zero-compute) experts "
                                       "are not split by torchtp yet"),
    "ep_dispatch_experts": ExpertsEP(),
    "grouped_gemm": Unsupported("grouped_gemm", _EP),
    "packed_rowwise": Unsupported("packed_rowwise", "fused input-side projections are not "
                                  "split by torchtp yet"),
    "sequence_parallel": SequenceParallel(),
    "mla_kv_a_proj": RopeKey(),
    "ssm_heads": SsmHeads(),
    "all_reduce": Unsupported("all_reduce", "partial-output modules are not implemented yet"),
    "local_params": Unsupported("local_params", "bare sharded parameters are not implemented yet"),
}

# Names users may pass that only exist for HF's internal bookkeeping are not listed:
# an unknown name raises with the list above.
SUPPORTED = sorted(n for n, s in STYLES.items() if not isinstance(s, Unsupported))


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
