"""Recognise HuggingFace models without importing transformers eagerly."""

from __future__ import annotations

import sys
from types import ModuleType

from torch import nn

from .compat import require_supported_transformers


def require_transformers() -> ModuleType:
    """Import transformers or raise an ImportError that says how to install it."""
    try:
        import transformers
    except ImportError as err:
        raise ImportError("this needs HuggingFace transformers: pip install 'torchtp[hf]' "
                          "(transformers, safetensors, accelerate)") from err
    return transformers


def is_hf_model(model: nn.Module) -> bool:
    """True for a ``transformers.PreTrainedModel`` (only checked if transformers is loaded).

    Raises:
        RuntimeError: it is one, but transformers is older than torchtp supports.
    """
    # A model of that class can only exist if transformers was imported already.
    loaded = sys.modules.get("transformers")
    base = getattr(loaded, "PreTrainedModel", None) if loaded is not None else None
    found = base is not None and isinstance(model, base)
    if found:
        require_supported_transformers(loaded)
    return found


def text_config(model: nn.Module) -> object:
    """The config that holds the language model's sizes (multimodal models nest it)."""
    config = model.config
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config
