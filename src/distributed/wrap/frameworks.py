"""The steps the integrations layer adds to every wrap (it imports ``wrap``, never the reverse).

PEFT's LoRA layers are set aside while the model is planned and put back
around the parallel base layers (and a PEFT imported later is watched for);
the frameworks users train with are guarded once the model is wrapped (HF
model methods, accelerate's and Lightning's DDP).
:mod:`torchtp.integrations.wrap_steps` registers them when ``torchtp`` is
imported; until then a wrap runs none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass
class FrameworkSteps:
    """What the frameworks layer does at each step of a wrap (defaults: nothing).

    Attributes:
        set_aside: Before planning: take adapters out of the model; returns a
            token for ``put_back``.
        put_back: After the layers are swapped (or on an error): restore them.
        after_wrap: Once the wrapper is complete: guard the frameworks.
    """

    set_aside: Callable[[nn.Module], Any] = lambda _model: None
    put_back: Callable[[Any], None] = lambda _token: None
    after_wrap: Callable[[nn.Module], None] = lambda _wrapper: None


STEPS = FrameworkSteps()


def register(steps: FrameworkSteps) -> None:
    """Install the integrations layer's steps (once, when ``torchtp`` is imported)."""
    global STEPS
    STEPS = steps
