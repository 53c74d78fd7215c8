"""Recognise HuggingFace models without importing transformers eagerly."""

from __future__ import annotations

import sys
from types import ModuleType

from torch import nn


def require_transformers() -> ModuleType:
    """Import transformers or raise an ImportError that says how to install it."""
    try:
        import transformers
    except ImportError as err:
        raise ImportError("this needs HuggingFace transformers: pip install 'torchtp[hf]' "
                          "(transformers, safetensors, accelerate)") from err
    return transformers


def is_hf_model(model: nn.Module) -> bool:
    """True for a ``transformers.PreTrainedModel`` (only checked if transformers is loaded)."""
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def text_config(model: nn.Module) -> object:
    """The config that holds the language model's sizes (multimodal models nest it)."""
    config = model.config
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config
