"""Build an HF model from a checkpoint's config with its parameters on the meta device.

``torchtp.hf`` is imported where a model is built (``from_pretrained``), so
importing torchtp loads nothing from it.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn


def load_config(path: str) -> Any:
    """The HF config in ``path`` (``config.json``).

    Raises:
        ValueError: ``config.json`` is missing or unreadable.
    """
    import transformers

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path} has no config.json: from_pretrained needs the model's HF config "
                         "next to its weights (save it with config.save_pretrained(path))")
    try:
        return transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{path}/config.json cannot be read by transformers: {err}") from err


def model_class_for(config: Any, model_class: type | None) -> Any:
    """The class to build: ``model_class``, the config's architecture, else an Auto class."""
    import transformers

    from ..hf.compat import is_causal_lm_config

    if model_class is not None:
        return model_class
    for arch in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, arch, None)
        if isinstance(cls, type):
            return cls
    if is_causal_lm_config(config):
        return transformers.AutoModelForCausalLM
    return transformers.AutoModel


def build_on_meta(config: Any, model_class: type | None) -> nn.Module:
    """The model with parameters on ``meta`` and buffers computed for real.

    Buffers are built on CPU exactly as the model's ``__init__`` computes them
    (rotary ``inv_freq`` and other non-persistent buffers are never in a
    checkpoint); they are small, unlike the parameters.
    """
    from accelerate import init_empty_weights

    from ..hf.compat import from_config

    cls = model_class_for(config, model_class)
    with init_empty_weights(include_buffers=False):
        model = from_config(cls, config)
    if hasattr(model, "tie_weights"):
        # accelerate's meta context re-creates a Parameter on every assignment,
        # which undoes the tie made in __init__; tie again outside it.
        model.tie_weights()
    return model.eval()
