"""What the wrapper sets up for the frameworks users train with (see docs/integrations.md)."""

from __future__ import annotations

import importlib.util
from typing import Any

from . import accelerate_guard
from .hf_model import guard_hf_model


def guard_frameworks(wrapper: Any) -> None:
    """HF model methods on the wrapped model; accelerate's DDP wrapping refused when tp > 1."""
    guard_hf_model(wrapper)
    if wrapper.world_size > 1 and importlib.util.find_spec("accelerate") is not None:
        accelerate_guard.install()
