"""The integrations layer's steps in every wrap (see :mod:`torchtp.wrap.frameworks`).

Imported by ``torchtp`` itself; nothing here imports a framework.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from ..wrap.frameworks import FrameworkSteps, register
from .adapter_hosts import attach_adapters, detach_adapters, watch_for_peft
from .guards import guard_frameworks


def _set_aside(model: nn.Module) -> Any:
    """PEFT LoRA layers out of the model while it is planned; a later PEFT import watched."""
    if "peft" in sys.modules:
        return detach_adapters(model)
    watch_for_peft()  # PEFT imported after the wrap still learns torchtp's layers
    return []


register(FrameworkSteps(set_aside=_set_aside, put_back=attach_adapters,
                        after_wrap=guard_frameworks))
