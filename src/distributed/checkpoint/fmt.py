"""torchtp's sharded checkpoint format: file names and the metadata file.

A directory holding ``config.json`` (the model's HF config, when it has one),
``rank-0000r-of-0000n.safetensors`` (rank r's tensors in the checkpoint's
orientation, its segments concatenated along the split dim; replicated
tensors only in rank 0's file) and ``torchtp_checkpoint.json``::

    {"format": "torchtp-sharded", "format_version": 1, "torchtp_version": "0.1.0",
     "tp_size": 4, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
     "plan": {"source": "...", "rules": {"pattern": "style"}},
     "files": ["rank-00000-of-00004.safetensors", ...],
     "aliases": {"lm_head.weight": "model.embed_tokens.weight"},
     "tensors": {"name": {"shape": [...], "dtype": "F32", "dim": 0 | null,
                          "transposed": false,
                          "shards": [{"rank": 0, "segments": [[start, length], ...]}]}}}

A shard cut along a second dimension as well (a block of experts with their
share of features: expert parallel x TP inside the experts) also holds
``"second": [dim, start, length]``; metadata with any such shard has
``format_version`` 2, so an older torchtp refuses it by version rather than
misreading it.
"""

from __future__ import annotations

import json
import os
from typing import Any

METADATA_FILE = "torchtp_checkpoint.json"
FORMAT = "torchtp-sharded"
FORMAT_VERSION = 2
FORMAT_VERSION_ONE_CUT = 1  # written when no shard has a second cut: older releases read it
_REQUIRED = ("format", "format_version", "tp_size", "files", "tensors")


def rank_file(rank: int, tp: int) -> str:
    """Name of rank ``rank``'s safetensors file in a checkpoint saved at ``tp``."""
    return f"rank-{rank:05d}-of-{tp:05d}.safetensors"


def read_metadata(path: str) -> dict[str, Any]:
    """Read and check ``torchtp_checkpoint.json`` in ``path``.

    Raises:
        ValueError: unreadable, not torchtp's format, a newer format version,
            or missing fields.
    """
    meta_path = os.path.join(path, METADATA_FILE)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"{meta_path} cannot be read as JSON: {err}; the checkpoint is "
                         "corrupt or was interrupted while saving") from err
    missing = [k for k in _REQUIRED if not isinstance(meta, dict) or k not in meta]
    if missing or meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path} is not a torchtp sharded checkpoint's metadata "
                         f"(format {meta.get('format') if isinstance(meta, dict) else None!r}, "
                         f"missing fields {missing})")
    if int(meta["format_version"]) > FORMAT_VERSION:
        raise ValueError(f"{meta_path} has format_version {meta['format_version']}; this torchtp "
                         f"reads up to {FORMAT_VERSION}: upgrade torchtp")
    if len(meta["files"]) != int(meta["tp_size"]):
        raise ValueError(f"{meta_path}: tp_size={meta['tp_size']} but {len(meta['files'])} rank "
                         "files are listed")
    return meta
