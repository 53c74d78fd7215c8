"""Sequence parallelism (``sp``, with ``tp``): token-wise parts of a layer on a sequence shard.

What is specific to sequence parallelism above the core, found together:

* :mod:`~torchtp.sp.style` - the plan style ``sequence_parallel`` (a module
  run on this rank's sequence shard, its weight gradient summed over the
  group), registered with the plans' style registry here;
* :mod:`~torchtp.sp.hf_plan` - which modules of a HuggingFace decoder run on
  sequence shards and where the sequence is gathered and scattered
  (``DistributedModelWrapper(..., sequence_parallel=True)``).

The region operators a parallel Linear enters in sequence-parallel mode (the
all-gather before the weight-rows-split projections, the reduce-scatter after
the weight-columns-split one) are core region functions, as in Megatron's
``mappings.py``: ``comm/sequence_parallel.py``, with the projections' shared
re-gather in ``layers/sequence_linear.py``. See docs/sequence_parallel.md.

Layer 6, a parallel dimension above the plans and the HF plug-in. May import:
``core``, ``costmodel``, ``comm``, ``layers``, ``plans``, ``hf``; never the
safety service, training, checkpoints or the wrapper.
"""

from __future__ import annotations

from ..plans.registry import register_style
from .style import SequenceParallel

register_style("sequence_parallel", SequenceParallel())
