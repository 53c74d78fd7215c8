"""The causal-LM loss of a context-parallel batch: the token mean over the whole batch.

Each rank holds ``T/cp`` tokens and their globally shifted labels
(:func:`~torchtp.cp.batch.shard_batch`), so no label is lost at a shard
boundary and none is counted twice. The loss is

    sum over every rank's labelled tokens of -log p(label) / (labelled tokens in the batch)

which is exactly transformers' ``ForCausalLMLoss`` of the full batch, however
unevenly padding falls over the ranks (a per-rank mean would weigh a rank's
few tokens as much as another's many). The divisor is known on every rank
(it comes from the full batch); the numerator is one all-reduce (backward:
identity, each rank's tokens' gradient stays with it; :mod:`torchtp.cp.grads`
then sums the parameter gradients).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm.regions import reduce_from_tensor_parallel_region
from ..comm.runtime import ProcessGroup
from .batch import IGNORE_INDEX, LocalBatch


def token_mean_loss(logits: torch.Tensor, batch: LocalBatch, group: ProcessGroup | None,
                    divisor: int | torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy over every labelled token of the full batch, on every rank.

    Args:
        logits: ``(B, T/cp, V)`` this rank's logits.
        batch: The :class:`LocalBatch` (its shifted labels and the global token count).
        group: The context-parallel group.
        divisor: The token count to divide by; ``None``: the batch's labelled
            tokens (HF Trainer passes a whole accumulation window's as
            ``num_items_in_batch``).

    Returns:
        A 0-dim tensor, the same on every cp rank (NaN when no token is
        labelled, as transformers' loss).
    """
    if batch.labels is None:
        raise ValueError("token_mean_loss: the batch was sharded without labels")
    # At least float32, as transformers' loss; float64 stays float64.
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    local = F.cross_entropy(wide.flatten(0, 1), batch.labels.flatten(),
                            ignore_index=IGNORE_INDEX, reduction="sum")
    total = reduce_from_tensor_parallel_region(local, group)
    count = batch.tokens if divisor is None else divisor
    if isinstance(count, torch.Tensor):  # a float64 count keeps the loss in its own dtype
        count = count.to(total.dtype)
    return total / count
