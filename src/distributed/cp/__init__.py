"""Context parallelism: every sequence split over ``cp`` ranks, attention exact across them.

The ``cp`` dimension of the one mesh (``init_parallel(cp=k)``,
``cfg.cp_group``). :class:`ContextParallel` wraps a HuggingFace causal LM
(or a :class:`~torchtp.DistributedModelWrapper` around one); the pieces it
is made of are usable alone:

* :mod:`~torchtp.cp.layout` - which tokens each rank holds (head/tail split);
* :mod:`~torchtp.cp.batch` - cutting a full batch, putting outputs back;
* :mod:`~torchtp.cp.masks` - the global mask for any queries and keys;
* :mod:`~torchtp.cp.attention` - all-gather and Ulysses attention, exact;
* :mod:`~torchtp.cp.hf_attention` - transformers' attention interface;
* :mod:`~torchtp.cp.loss`, :mod:`~torchtp.cp.grads` - the global token mean
  and gradients summed over cp.

See docs/context_parallel.md.

May import: every layer below (``core``, ``comm``, ``layers``, ``guards``), not
the wrapper or the integrations.
"""

from __future__ import annotations

from .attention import context_attention
from .batch import LocalBatch, shard_batch, shard_sequence, unshard_sequence
from .layout import SequenceLayout, causal_pairs
from .masks import MaskRule, SequenceMeta
from .model import ContextParallel

__all__ = ["ContextParallel", "LocalBatch", "MaskRule", "SequenceLayout", "SequenceMeta",
           "causal_pairs", "context_attention", "shard_batch", "shard_sequence",
           "unshard_sequence"]
