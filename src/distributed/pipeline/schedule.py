"""Run a decoder LM's pipeline stages with PyTorch's schedules, loss as one process has it.

``torch.distributed.pipelining`` does the sends, receives and the order of
microbatch forwards and backwards. torchtp adds what makes the result the
unsplit model's:

* the loss is the token mean over the **whole batch**: each microbatch's
  summed cross-entropy (labels shifted as HuggingFace's causal-LM loss does,
  ``ignore_index`` skipped) is divided by the number of counted tokens in the
  whole batch, and the schedule does not rescale gradients, so padding spread
  unevenly over the microbatches changes nothing;
* the batch and the microbatch count are checked on every rank before the
  first send (every stage is given the same batch), so a bad shape raises
  everywhere instead of leaving a stage waiting in a receive.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from ..comm import ops as _comm
from ..comm.objects import all_gather_object
from ..comm.runtime import ProcessGroup
from ..training.clip import grad_norm
from .stage import DecoderStage

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
"""Schedule names (case-insensitive) and PyTorch's classes."""


class PipelineSchedule:
    """One training step's forward and backward over every stage.

    Args:
        stage: This rank's :class:`~torchtp.pipeline.stage.DecoderStage`.
        microbatches: Microbatches per step (the batch must divide into them;
            ``"1f1b"`` needs at least as many as stages).
        schedule: A name of :data:`SCHEDULES`.
        group: The pipeline's process group (stage ``i`` is its rank ``i``);
            ``None``: the default group.
        ignore_index: Labels not counted in the loss.

    Raises:
        ValueError: an unknown schedule or a microbatch count the schedule
            cannot run (the same verdict on every rank: it depends on the
            arguments only).
    """

    def __init__(self, stage: DecoderStage, microbatches: int, schedule: str = "1f1b",
                 group: ProcessGroup | None = None, ignore_index: int = -100) -> None:
        cls = SCHEDULES.get(schedule.lower())
        if cls is None:
            raise ValueError(f"schedule={schedule!r} is not a pipeline schedule; valid: "
                             f"{sorted(SCHEDULES)}")
        if microbatches < 1 or (cls is Schedule1F1B and microbatches < stage.stages):
            need = stage.stages if cls is Schedule1F1B else 1
            raise ValueError(f"microbatches={microbatches}: schedule {schedule!r} over "
                             f"{stage.stages} stages needs at least {need}")
        self.stage, self.microbatches, self.ignore_index = stage, microbatches, ignore_index
        device = next(stage.parameters()).device
        self._pipe = PipelineStage(stage, stage.stage, stage.stages, device, group=group)
        self._schedule = cls(self._pipe, n_microbatches=microbatches, loss_fn=self._loss,
                             scale_grads=False)
        self._counted = torch.ones(())
        self._tied = _tied_group(self._pipe.group) if stage.tied else None

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor,
             counted: int | None = None) -> torch.Tensor | None:
        """Forward and backward of the batch; gradients accumulate in this stage's parameters.

        Args:
            input_ids: ``(B, T)`` token ids, the same on every stage (the first reads them).
            labels: ``(B, T)``, the same on every stage (the last reads them);
                shifted by one inside, as HuggingFace's causal-LM loss does.
            counted: The tokens the loss is a mean over; ``None``: this batch's
                counted tokens. For gradient accumulation over several
                ``step`` calls before one optimizer step, pass the count of the
                whole accumulation window (every batch's labels, shifted, not
                ``ignore_index``): the summed gradients then equal one step
                over all those batches.

        Returns:
            On the last stage the batch's loss (token mean, as one process computes
            it), ``None`` on the others.

        Raises:
            ValueError: shapes that differ or a batch that does not split into the
                microbatches, on every rank before the first send.
        """
        if input_ids.shape != labels.shape or input_ids.dim() != 2 \
                or input_ids.shape[0] % self.microbatches:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and labels "
                             f"{tuple(labels.shape)}: give both as (batch, tokens) with a batch "
                             f"that divides into microbatches={self.microbatches}")
        # Tokens the loss is a mean over: the whole batch's (labels shifted by one),
        # or the accumulation window's.
        own = (labels[:, 1:] != self.ignore_index).sum()
        self._counted = own if counted is None else torch.tensor(counted)
        losses: list[torch.Tensor] = []
        if self.stage.is_first:
            self._schedule.step(input_ids)
        elif not self.stage.is_last:
            self._schedule.step()
        else:
            self._schedule.step(target=labels, losses=losses)
        self._sum_tied()
        return torch.stack(losses).sum() if self.stage.is_last else None

    def _sum_tied(self) -> None:
        """Tied embeddings: the first and last stage hold copies; both get the summed gradient."""
        weight = self.stage.tied_weight()
        if weight is None or self._tied is None or weight.grad is None:
            return
        _comm.all_reduce_(weight.grad, self._tied)  # (V, H), or this TP rank's rows of it

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        tp_group: ProcessGroup | None = None) -> torch.Tensor:
        """Clip this stage's gradients by the whole model's norm, over every stage.

        Each stage's norm is torchtp's (:func:`torchtp.grad_norm`: split
        parameters counted once over the stage's TP group ``tp_group``, ``None``
        when the stage is not tensor-parallel); the stages' norms are combined
        over the pipeline group, so every rank of every stage applies the factor
        ``torch.nn.utils.clip_grad_norm_`` would apply to the unsplit model.

        Returns:
            The total norm before clipping (0-dim, equal on every rank).
        """
        params = [w for w in self.stage.parameters() if w.grad is not None]
        # A tied embedding is one weight: counted on the first stage, not again on the last.
        copy = self.stage.tied_weight() if self.stage.is_last else None
        normed = [w for w in params if w is not copy]
        order = float(norm_type)
        device = next(self.stage.parameters()).device
        own = grad_norm(normed, norm_type, group=tp_group) if normed \
            else torch.zeros((), device=device)
        mine = own if math.isinf(order) else own ** order  # this stage's share of the total
        if self._group_size() > 1:
            mine = _comm.all_reduce(mine, self._pipe.group, "max" if math.isinf(order) else "sum")
        total = mine if math.isinf(order) else mine ** (1.0 / order)
        if params:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def _group_size(self) -> int:
        return dist.get_world_size(self._pipe.group)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One microbatch's share of the batch's token-mean loss: ``(b, T, V)``, ``(b, T)``."""
        shifted = logits[:, :-1].reshape(-1, logits.shape[-1])  # (b*(T-1), V)
        # At least float32, as HuggingFace's loss upcasts half-precision logits.
        shifted = shifted.to(torch.promote_types(shifted.dtype, torch.float32))
        summed = F.cross_entropy(shifted, labels[:, 1:].reshape(-1),
                                 ignore_index=self.ignore_index, reduction="sum")
        return summed / self._counted


def _tied_group(pipe: ProcessGroup | None) -> ProcessGroup | None:
    """The group of the first and last stage of ``pipe`` (collective over the world).

    Every pipeline (one per TP rank, per data-parallel replica) has such a pair,
    and ``new_group`` must be called by every rank for every pair in one order:
    the pairs are gathered first.
    """
    ranks = dist.get_process_group_ranks(pipe) if pipe is not None \
        else list(range(dist.get_world_size()))
    pairs = all_gather_object((ranks[0], ranks[-1]), None, "the tied embeddings' stage pairs")
    mine = None
    for pair in sorted({tuple(p) for p in pairs}):
        group = dist.new_group(list(pair))
        if pair == (ranks[0], ranks[-1]):
            mine = group
    return mine
