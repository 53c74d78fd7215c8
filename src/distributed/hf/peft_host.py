"""The HuggingFace model inside a PEFT model, so it is planned by its own plan.

A ``PeftModel`` (or a bare ``LoraModel``) is no ``PreTrainedModel``; the plan
of the HF model it holds applies under the PEFT model's module names
(:func:`torchtp.plans.resolve.pick_rules`). PEFT is only looked at when it is
already imported: a model of a PEFT class cannot exist otherwise.
"""

from __future__ import annotations

import sys

from torch import nn

from .detect import is_hf_model


def hf_model_inside(model: nn.Module) -> tuple[str, nn.Module] | None:
    """``(name, HF model)`` inside a PEFT model (``PeftModel``/``LoraModel``), else ``None``."""
    if is_hf_model(model) or "peft" not in sys.modules:
        return None
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner

    if isinstance(model, PeftModel):
        inner = model.get_base_model()
    elif isinstance(model, BaseTuner):
        inner = model.model
    else:
        return None
    name = next((n for n, m in model.named_modules() if m is inner), None)
    return (name, inner) if name and is_hf_model(inner) else None
