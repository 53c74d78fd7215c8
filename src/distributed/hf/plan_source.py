"""The plan a HuggingFace model ships: ``config.base_model_tp_plan`` + ``_tp_plan``."""

from __future__ import annotations

from torch import nn

from .compat import class_tp_plan, instance_tp_plan


def hf_plan(model: nn.Module) -> dict[str, str] | None:
    """The model's own TP plan with full module names, or ``None`` if it has none.

    transformers >= 4.50 assembles it on the instance (``model.tp_plan``:
    the base model's ``config.base_model_tp_plan`` prefixed with the base
    model's attribute name, the class's ``_tp_plan`` such as
    ``{"lm_head": "colwise_gather_output"}``, and ``embed_tokens`` as
    ``embedding_rowwise``). Older versions are assembled here the same way.
    """
    return instance_tp_plan(model) or _assemble(model)


def _assemble(model: nn.Module) -> dict[str, str] | None:
    base_plan = getattr(model.config, "base_model_tp_plan", None) or {}
    if not base_plan:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    has_base = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    plan = {(f"{prefix}.{k}" if has_base else k): v for k, v in base_plan.items()}
    plan.update(class_tp_plan(type(model)))
    return plan
