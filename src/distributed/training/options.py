"""The wrapper's ``loss_parallel`` and ``sequence_parallel`` options: plan edits, then hooks.

Both are HuggingFace features (``torchtp.hf.loss_parallel``,
``torchtp.hf.sequence_parallel``), imported when an option is on, so a wrap
without them (any plain ``nn.Module``) loads nothing from ``torchtp.hf``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ..layers import grad_sync
from ..plans import ResolvedPlan, ShardContext
from ..plans.styles_sp import SequenceParallel

if TYPE_CHECKING:
    from ..hf.sequence_parallel import SequencePlan


class Options:
    """Edits the resolved plan before it is checked, installs hooks after the swap.

    Args:
        loss_parallel: Compute HF causal-LM losses from vocab-split logits.
        sequence_parallel: Run norms/dropout/residuals on sequence shards (also
            on when the plan assigns the ``"sequence_parallel"`` style).
    """

    def __init__(self, loss_parallel: bool, sequence_parallel: bool) -> None:
        self.loss_parallel = loss_parallel
        self.sequence_parallel = sequence_parallel
        self.sequence: SequencePlan | None = None

    def adjust(self, model: nn.Module, plan: ResolvedPlan, ctx: ShardContext) -> None:
        """Before the checks: vocab-split the LM head; mark the norms sequence-parallel."""
        if self.loss_parallel:
            from ..hf.loss_parallel import plan_loss_parallel

            plan_loss_parallel(model, plan, ctx)
        if self.sequence_parallel or any(isinstance(s, SequenceParallel)
                                         for s in plan.assignments.values()):
            from ..hf.sequence_parallel import plan_sequence_parallel

            self.sequence = plan_sequence_parallel(model, plan, ctx)

    def install(self, model: nn.Module, ctx: ShardContext) -> None:
        """After the swap: the loss switch and the sequence shard/gather hooks."""
        if self.loss_parallel:
            from ..hf.loss_parallel import install_loss_parallel

            install_loss_parallel(model)
        if self.sequence is not None:
            from ..hf.sequence_parallel import install_sequence_parallel

            install_sequence_parallel(model, self.sequence, ctx)
            grad_sync.install(model)
