"""What the wrapper sets up for the frameworks users train with (see docs/integrations.md)."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

from . import ddp_refusal
from .hf_model import guard_hf_model


def guard_frameworks(wrapper: Any) -> None:
    """HF model methods on the wrapped model; accelerate's and Lightning's DDP refused when tp > 1."""
    guard_hf_model(wrapper)
    if wrapper.world_size > 1 and importlib.util.find_spec("accelerate") is not None:
        ddp_refusal.install()
    if wrapper.world_size > 1 and "lightning" in sys.modules:
        ddp_refusal.install_lightning()  # a LightningModule wrapping its model in __init__
