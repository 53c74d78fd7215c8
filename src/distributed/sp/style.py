"""The ``"sequence_parallel"`` plan style: a token-wise module on sequence shards."""

from __future__ import annotations

from ..plans.styles import ReplicatedWithGradAllreduce


class SequenceParallel(ReplicatedWithGradAllreduce):
    """A norm (or other token-wise module) that runs on this rank's sequence shard.

    Its parameters stay whole on every rank; each rank's gradient covers only
    its own tokens, so the gradients are summed over the TP group (a norm
    weight gradient that is not summed is Megatron's bug #1446). Assigning
    this style turns on sequence parallelism for the whole model (see
    ``DistributedModelWrapper(sequence_parallel=True)``), which places the
    gathers and reduce-scatters around attention and MLP blocks, and checks
    that only the decoder's norms carry this style.
    """

    name = "sequence_parallel"
