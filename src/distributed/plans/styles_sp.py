"""The ``"sequence_parallel"`` plan style: a token-wise module on sequence shards."""

from __future__ import annotations

from torch import nn

from .linear_view import linear_view
from ..hf.styles import ReplicatedWithGradAllreduce


class SequenceParallel(ReplicatedWithGradAllreduce):
    """A norm (or other token-wise module) that runs on this rank's sequence shard.

    Its parameters stay whole on every rank; each rank's gradient covers only
    its own tokens, so the gradients are summed over the TP group (a norm
    weight gradient that is not summed is Megatron's bug #1446). Assigning
    this style turns on sequence parallelism for the whole model (see
    ``DistributedModelWrapper(sequence_parallel=True)``), which places the
    gathers and reduce-scatters around attention and MLP blocks.
    """

    name = "sequence_parallel"

    def check_type(self, module: nn.Module, fqn: str) -> None:
        for name, sub in module.named_modules():
            if linear_view(sub) is not None:
                raise TypeError(
                    f"plan style 'sequence_parallel' for module '{fqn}' "
                    f"({type(module).__name__}): it contains the projection "
                    f"'{name or fqn}', but only token-wise modules (norms, dropout) run on "
                    "sequence shards; give its projections 'colwise'/'rowwise'")
