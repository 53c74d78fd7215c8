"""HuggingFace transformers support: plans, attention heads, fused projections.

``transformers`` is optional: nothing here imports it until a HF model is
wrapped, and :func:`require_transformers` says how to install it. Submodules
are imported where they are used (``torchtp.plans`` imports this package's
styles, so importing the planners here would be circular).

Layer 4, the HuggingFace plug-in of ``plans``. May import: ``core``, ``comm``,
``layers``, ``plans``.
"""

from __future__ import annotations

from .builtin import BUILTIN_PLANS
from .detect import is_hf_model, require_transformers

__all__ = ["BUILTIN_PLANS", "is_hf_model", "require_transformers"]
