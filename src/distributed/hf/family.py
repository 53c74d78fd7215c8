"""HuggingFace as a model family of :mod:`torchtp.plans.sources` (registered by ``torchtp.hf``).

For a ``transformers.PreTrainedModel`` the candidate plans are the model's own
``tp_plan`` (:mod:`~torchtp.hf.plan_source`), torchtp's built-in plan for its
``model_type`` (:mod:`~torchtp.hf.builtin`) and the automatic plan on the
model's dummy inputs (:mod:`~torchtp.hf.probe_inputs`) with head counts from
its text config; :mod:`torchtp.plans.choose` picks one by cost. Attention
modules that read ``self.config`` get a per-module copy with their local head
counts (:mod:`~torchtp.hf.config_view`).
"""

from __future__ import annotations

import fnmatch
from typing import Any, cast

from torch import nn

from ..plans.attention_local import local_values
from ..plans.heads import mixer_rules
from ..plans.resolved import Rules
from ..plans.sources import HUGGINGFACE, ExpertsLayout
from .builtin import (
    BUILTIN_PLANS,
    HEAD_NORM_TYPES,
    builtin_plan,
    heads_kept_local,
    latent_attention_plan,
)
from .compat import (
    expert_parallel_forward,
    experts_flags,
    mark_expert_parallel,
    preallocated_state_cache,
)
from .config_view import is_local_config, local_config
from .detect import is_hf_model, text_config
from .peft_host import hf_model_inside
from .plan_source import hf_plan
from .probe_copy import copy_key, small_copy
from .probe_inputs import probe_inputs


class HuggingFace:
    """The HuggingFace transformers family (see the module docstring)."""

    name = HUGGINGFACE

    def claims(self, model: nn.Module) -> bool:
        """A ``transformers.PreTrainedModel`` (raises for a transformers too old)."""
        return is_hf_model(model)

    def own_rules(self, model: nn.Module) -> Rules | None:
        """The model's own plan: ``config.base_model_tp_plan`` + the class's ``_tp_plan``."""
        own = hf_plan(model)
        return Rules("HF plan (config.base_model_tp_plan + _tp_plan)", own) if own else None

    def builtin_rules(self, model: nn.Module) -> Rules | None:
        """torchtp's plan for the model's ``config.model_type``, if it has one."""
        hf: Any = model
        prefix = cast(str, hf.base_model_prefix) if hf.base_model is not model else ""
        model_type = getattr(hf.config, "model_type", "")
        names = [name for name, _ in model.named_modules()]
        rules = builtin_plan(model_type, prefix)
        own = hf_plan(model) if model_type in HEAD_NORM_TYPES else None
        if own:
            rules = heads_kept_local(own)
        if rules is None:
            rules = latent_attention_plan(names, hf_plan(model))
        mixers = mixer_rules(model)
        if mixers:  # state-space mixers split by heads, beside the plan's other rules
            rules = {**(rules if rules is not None else hf_plan(model) or {}), **mixers}
        if rules is None:
            return None
        # A built-in plan covers an architecture's variants (T5's plain or gated
        # feed-forward): the rules for modules this model lacks are dropped, not warned of.
        # HF's rules for expert parameters (planned by their experts module) stay.
        names += [name for name, _ in model.named_parameters()]
        rules = {p: s for p, s in rules.items() if any(fnmatch.fnmatchcase(n, p) for n in names)}
        return Rules(f"torchtp built-in plan for {model_type!r}", rules)

    def no_builtin(self, model: nn.Module) -> ValueError:
        """Why ``plan="builtin"`` cannot be honoured, listing the architectures that have one."""
        model_type = getattr(cast(Any, model).config, "model_type", "")
        return ValueError(f"plan='builtin': torchtp has no built-in plan for "
                          f"model_type={model_type!r}; built-in plans exist for "
                          f"{sorted(BUILTIN_PLANS.keys() | HEAD_NORM_TYPES)}")

    def inner_model(self, model: nn.Module) -> tuple[str, nn.Module] | None:
        """The HF model inside a PEFT model."""
        return hf_model_inside(model)

    def probe_inputs(self, model: nn.Module) -> dict[str, Any] | None:
        """``model.dummy_inputs`` with token ids below the vocabulary size."""
        return probe_inputs(model)

    def head_config(self, model: nn.Module) -> object:
        """The text config of any model with a ``config`` (multimodal models nest it)."""
        return text_config(model) if hasattr(model, "config") else None

    def probe_copy(self, model: nn.Module) -> nn.Module | None:
        """A one-layer CPU copy built from the config."""
        return small_copy(model)

    def copy_key(self, model: nn.Module) -> str | None:
        """The config as JSON."""
        return copy_key(model)

    def attention_overrides(self, module: nn.Module, heads: int, kv_heads: int, head_dim: int,
                            local_heads: int, local_kv: int) -> dict[str, object]:
        """A per-module copy of the module's ``config`` with its local head counts and widths.

        For forwards that read ``self.config.num_attention_heads`` (Phi-3); the
        shared config keeps the full values.
        """
        config = getattr(module, "config", None)
        if config is None or is_local_config(config):
            return {}
        return {"config": local_config(config, local_values(config, heads, kv_heads, head_dim,
                                                            local_heads, local_kv))}

    def experts_layout(self, module: nn.Module) -> ExpertsLayout | None:
        """transformers' experts modules (3-D expert weights and their layout flags)."""
        flags = experts_flags(module)
        if flags is None or not type(module).__module__.startswith("transformers."):
            return None
        return ExpertsLayout(**flags, mark_parallel=mark_expert_parallel,
                             parallel_forward=expert_parallel_forward)

    def mixer_limit(self, module: nn.Module) -> str | None:
        """Why transformers' cache cannot hold a split Mamba-style mixer's states, if so."""
        return preallocated_state_cache(module)
