"""HuggingFace transformers support: the HF model family of ``torchtp.plans``.

``transformers`` is optional: nothing here imports it until a HF model is
wrapped, and :func:`require_transformers` says how to install it. Importing
this package registers the HuggingFace family with
:mod:`torchtp.plans.sources` (the model's own ``tp_plan``, the built-in
per-architecture plans, the config view, probe inputs and copies, model
detection); ``plans`` imports it by name the first time a model that may be
one is planned, and never imports anything else from here.

Layer 5, the HuggingFace plug-in of ``plans``. May import: ``core``, ``comm``,
``layers``, ``plans``.
"""

from __future__ import annotations

from ..plans.sources import register_family
from .builtin import BUILTIN_PLANS
from .detect import is_hf_model, require_transformers
from .family import HuggingFace

register_family(HuggingFace())

__all__ = ["BUILTIN_PLANS", "is_hf_model", "require_transformers"]
