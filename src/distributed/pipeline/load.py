"""A pipeline stage built on meta and loaded with only its own tensors.

:func:`stage_from_pretrained` builds the model from the checkpoint's config on
the meta device (no parameter memory), cuts this stage out of it
(:func:`~torchtp.pipeline.stage.decoder_stage`), makes it tensor-parallel over
the stage's TP group if there is one, and reads only the tensors the stage
holds, and of each only this TP rank's part, through the same loader as
:meth:`torchtp.DistributedModelWrapper.from_pretrained` (its checks: every
rank the same checkpoint, every tensor present with the shape the config
says, a verdict on every rank).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.load import from_pretrained
from ..comm.runtime import ProcessGroup, get_tensor_parallel_config, group_size
from ..wrap.wrapper import DistributedModelWrapper
from .stage import DecoderStage, decoder_stage


class _Unsplit:
    """What the loader needs of a stage that is not tensor-parallel."""

    def __init__(self, model: nn.Module) -> None:
        self.base_model, self.rank = model, 0


def stage_from_pretrained(
    path: str | os.PathLike[str], stage: int, stages: int,
    split: Sequence[int] | str | None = None, plan: Any = None, group: ProcessGroup | None = None,
    dtype: torch.dtype | None = None, device: torch.device | str | None = None,
    model_class: type | None = None, progress: bool = True,
) -> DecoderStage:
    """Pipeline stage ``stage`` of ``stages``, reading only its own tensors from ``path``.

    Args:
        path: An HF model directory (``config.json`` and safetensors files) or a
            torchtp sharded checkpoint, as for
            :meth:`~torchtp.DistributedModelWrapper.from_pretrained`.
        stage: This rank's stage (``cfg.pp_rank`` of ``init_parallel(pp=...)``).
        stages: Pipeline stages.
        split: As for :func:`~torchtp.pipeline.decoder_stage` (``"params"``
            balances parameters, counted on the meta model).
        plan: The TP plan, as for ``DistributedModelWrapper`` (with a TP group).
        group: The stage's TP group; ``None``: ``init_parallel``'s ``tp`` group
            when it built a mesh, else none (without a mesh the world is the
            pipeline). A group of one rank: no tensor parallelism.
        dtype: Cast floating tensors to it; ``None`` keeps the checkpoint's.
        device: Where the tensors go (default: this rank's device).
        model_class: Class to build from the config (default: its
            ``architectures``).
        progress: Show a progress bar on the first rank (on a TTY).

    Returns:
        The stage; its ``model`` is tensor-parallel in place when there is a TP
        group (as after ``DistributedModelWrapper(stage.model)``).

    A tied LM head on the last stage is read from the input embedding's tensor
    (checkpoints store a tied weight once).

    Raises:
        ValueError: on every rank of the TP group, for what
            ``DistributedModelWrapper.from_pretrained`` refuses, and for a model
            :func:`~torchtp.pipeline.decoder_stage` cannot cut.
    """
    tp = _tp_group(group)
    built: list[DecoderStage] = []
    aliases: dict[str, str] = {}

    def wrap(model: nn.Module) -> Any:
        aliases.update(_tied_head_alias(model))
        built.append(decoder_stage(model, stage, stages, split))
        if tp is None or group_size(tp) == 1:
            return _Unsplit(built[0].model)
        return DistributedModelWrapper(built[0].model, plan=plan, group=tp)

    from_pretrained(wrap, path, plan, dtype, device, model_class, tp, progress,
                    aliases=aliases, partial=True)
    return built[0]


def _tp_group(group: ProcessGroup | None) -> ProcessGroup | None:
    if group is not None or not dist.is_initialized():
        return group
    cfg = get_tensor_parallel_config()
    return cfg.group if cfg.mesh is not None else None


def _tied_head_alias(model: Any) -> dict[str, str]:
    """``{LM head weight: input embedding weight}`` when the two are one tied weight."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embed is None or head.weight is not embed.weight:
        return {}
    names = {id(m): n for n, m in model.named_modules()}
    return {f"{names[id(head)]}.weight": f"{names[id(embed)]}.weight"}
