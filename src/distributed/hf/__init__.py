"""HuggingFace transformers support: plans, attention heads, fused projections.

``transformers`` is optional: nothing here imports it until a HF model is
wrapped, and :func:`require_transformers` says how to install it.
"""

from __future__ import annotations

from .attention import adjust_attention_modules, head_aware_assignments
from .builtin import BUILTIN_PLANS
from .detect import is_hf_model, require_transformers
from .plan_source import hf_plan
from .structural import structural_plan

__all__ = [
    "BUILTIN_PLANS",
    "adjust_attention_modules",
    "head_aware_assignments",
    "hf_plan",
    "is_hf_model",
    "require_transformers",
    "structural_plan",
]
