"""A one-layer CPU copy of a HuggingFace model, for the plan verification's probe.

:mod:`torchtp.plans.verify` confirms whole-head attention splits by running
the model; an HF model (possibly on the meta device after ``from_pretrained``)
is probed on this copy, built from its config with random weights under a
fixed seed so every rank builds the same one. Its verdicts apply to every
layer of the same name pattern, and are cached under :func:`copy_key`.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, cast

import torch
from torch import nn

SMALL_VOCAB = 256  # the one-layer copy's vocabulary (above every special token id)
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")


def copy_key(model: nn.Module) -> str | None:
    """The config the copy is built from, as JSON (``None``: it does not serialize)."""
    try:
        return cast(str, cast(Any, model).config.to_json_string())
    except Exception:  # a config that does not serialize: no caching
        return None


# Layer types of softmax attention: a hybrid whose first layer is another kind (Qwen3-Next's
# linear attention) keeps its layers up to the first of these, so the copy holds one of each.
ATTENTION_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


def _layers_kept(types: object) -> int:
    """Layers the copy keeps: one, or up to the first softmax attention of a hybrid."""
    if not isinstance(types, list) or not types or types[0] in ATTENTION_TYPES:
        return 1
    return next((i + 1 for i, t in enumerate(types) if t in ATTENTION_TYPES), 1)


def small_copy(model: nn.Module) -> nn.Module | None:
    """A one-layer CPU copy of an HF model from its config (a hybrid's layers up to its first
    softmax attention), random weights under seed 0."""
    config: Any = copy.deepcopy(cast(Any, model).config)
    for cfg in {id(c): c for c in (config, getattr(config, "text_config", None))
                if c is not None}.values():
        layers = _layers_kept(getattr(cfg, "layer_types", None))
        if isinstance(getattr(cfg, "num_hidden_layers", None), int):
            cfg.num_hidden_layers = layers
        if isinstance(getattr(cfg, "layer_types", None), list):
            with contextlib.suppress(AttributeError):  # Mamba-2's: derived, read-only
                cfg.layer_types = cfg.layer_types[:layers]
        vocab = getattr(cfg, "vocab_size", None)
        if isinstance(vocab, int):  # the embedding and LM head dominate the copy's build time
            ids = [getattr(cfg, k, None) for k in _TOKEN_IDS]
            cfg.vocab_size = min(vocab, max([SMALL_VOCAB] + [i + 1 for i in ids
                                                             if isinstance(i, int)]))
    try:
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(0)  # every rank builds the same copy
            small = type(model)(config)
    except Exception:  # a config that cannot be shrunk or rebuilt: unverifiable
        return None
    return small.float().eval()
