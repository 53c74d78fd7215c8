"""Context parallelism inside pipeline stages (pp x cp).

:class:`~torchtp.pipeline.PipelineSchedule` calls this when its cp group has
more than one rank. Every stage's attention goes through torchtp's
context-parallel attention (:func:`~torchtp.cp.hf_attention.prepare`); each
step cuts the full batch once (:func:`~torchtp.cp.batch.shard_batch`) and the
schedule's microbatches are rows of this rank's tokens. A middle stage sees
only hidden states, never which microbatch it runs, so what its attention
and rotary embeddings need must be the same for every row: the global
positions and the mask of a plain batch (no padding, no packed documents),
which is all ``PipelineSchedule.step`` takes. The positions reach every
stage's decoder through a forward pre-hook.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..comm.runtime import ProcessGroup
from .batch import LocalBatch, shard_batch
from .hf_attention import CPState, prepare
from .masks import SequenceMeta

WHO = "PipelineSchedule (pp x cp)"


def prepare_stages(stages: Sequence[nn.Module], group: ProcessGroup | None) -> CPState:
    """Route every stage's attention through context-parallel attention over ``group``.

    Idempotent: stages a schedule prepared already keep their state (a second
    schedule over the same stages shares it, so each sees the batch of its step).

    Raises:
        ValueError: as :func:`~torchtp.cp.hf_attention.prepare` (a family whose
            mask torchtp does not reproduce, or no HF model in a stage).
    """
    held = [getattr(m, "torchtp_cp", None) for s in stages for m in s.modules()]
    state = next((h for h in held if isinstance(h, CPState)), None)
    if state is not None and state.pipeline and state.group is group:
        return state
    state = CPState(group=group, pipeline=True)
    for stage in stages:
        hf = prepare(stage, state, WHO)
        decoder: Any = hf.get_decoder()  # type: ignore[operator]
        decoder.register_forward_pre_hook(_PositionIds(state), with_kwargs=True)
    return state


class _PositionIds:
    """Forward pre-hook of a stage's decoder: the global position ids of this rank's tokens."""

    def __init__(self, state: CPState) -> None:
        self.state = state

    def __call__(self, _module: nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        batch = self.state.batch
        if batch is not None and kwargs.get("position_ids") is None:
            kwargs["position_ids"] = batch.position_ids[:1]  # (1, T/cp): every row alike
        return args, kwargs


def cut(input_ids: torch.Tensor, labels: torch.Tensor, group: ProcessGroup | None,
        state: CPState, ignore_index: int) -> LocalBatch:
    """This rank's share of a plain batch, recorded in ``state`` for the stages' attention.

    Its mask facts (documents, padding) have one row, shared by every
    microbatch's rows.
    """
    local = shard_batch(input_ids, group, labels=labels, ignore_index=ignore_index)
    meta = SequenceMeta(documents=local.meta.documents[:1], keys_valid=local.meta.keys_valid[:1])
    state.batch = LocalBatch(input_ids=local.input_ids, position_ids=local.position_ids,
                             labels=local.labels, tokens=local.tokens, layout=local.layout,
                             meta=meta, length=local.length)
    return state.batch


