"""Layer 9, beside the wrapper: pipeline parallelism on ``torch.distributed.pipelining``.

:func:`~torchtp.pipeline.stage.decoder_stage` turns a HuggingFace decoder LM
into this rank's stage (its share of the decoder layers; the embeddings on the
first stage, the final norm and LM head on the last),
:func:`~torchtp.pipeline.blocks.block_stage` an ``nn.Sequential`` or another
chain of blocks;
:class:`~torchtp.pipeline.schedule.PipelineSchedule` runs PyTorch's schedules
over the stages with a token-mean loss over the whole batch. See
docs/pipeline.md.

May import: every layer below, and ``wrap`` and ``cp`` beside it (not
``integrations``' entry points, ``cli``).
"""

from __future__ import annotations

from .blocks import BlockStage, block_stage
from .load import stage_from_pretrained
from .placement import SCHEDULES, stage_ids
from .schedule import PipelineSchedule
from .stage import DecoderStage, Stage, decoder_stage, decoder_stages, stage_layers

__all__ = ["SCHEDULES", "BlockStage", "DecoderStage", "PipelineSchedule", "Stage", "block_stage",
           "decoder_stage", "decoder_stages", "stage_from_pretrained", "stage_ids",
           "stage_layers"]
