"""Sharded checkpoints: load only this rank's shard, save sharded or consolidated, reshard.

* :func:`from_pretrained` - build on meta, wrap, read this rank's byte ranges
  (HF directories and torchtp sharded checkpoints at any saved tp).
* :func:`save_sharded` - one safetensors file per rank plus metadata.
* :func:`save_pretrained` - a consolidated HF directory, one tensor at a time
  (of a wrapped model, or of a pipeline job's stages: :mod:`.save_stages`).
* :func:`reshard` / :func:`consolidate` - the same conversions offline, with no
  process group (``python -m torchtp.checkpoint reshard SRC DST --tp M``).

See docs/checkpoints.md.

Layer 8. May import: ``core``, ``comm``, ``layers``, ``plans``, ``ep``, ``hf``, ``sp``,
``guards``
(agreement and fingerprints), ``training``.
"""

from __future__ import annotations

from .load import from_pretrained
from .offline import consolidate, reshard
from .save_pretrained import save_pretrained
from .save_sharded import save_sharded
from .sources import open_source

__all__ = ["consolidate", "from_pretrained", "open_source", "reshard", "save_pretrained",
           "save_sharded"]
