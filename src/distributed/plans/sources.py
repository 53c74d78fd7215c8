"""Model families plug into planning here; ``plans`` itself knows no family.

``plans`` plans any ``nn.Module`` on its own: the automatic plan, head
geometry, styles. What only a family of models knows comes from a
:class:`ModelFamily` registered here by the family's package: for
HuggingFace (``torchtp.hf``) the model's own ``tp_plan``, torchtp's built-in
plans per architecture, the model's dummy inputs for the probe forward, the
text config that holds head counts, the one-layer copy the plan verification
probes, the HF model inside a PEFT model, the per-module config copy of
an attention module whose heads are split, the layout of its experts modules,
and whether the installed release can run a state-space mixer split.

Registration does not depend on import order: before answering about a
model (or module), :func:`_load_for` imports the HuggingFace plug-in by name
(:data:`HF_PLUGIN`, the one link from ``plans`` to ``hf``) the first time the
object may need it: it has a ``config``, or a class from ``transformers`` or
``peft`` in its MRO. A plain ``nn.Module`` (an ``nn.Sequential`` MLP) never
loads or runs anything in ``hf``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

if TYPE_CHECKING:
    from .resolved import Rules

# The HuggingFace plug-in, imported by name relative to this package (it
# registers its family on import; it imports plans, never the reverse).
HF_PLUGIN = "..hf"
HUGGINGFACE = "huggingface"  # the family it registers
_LIBRARIES = ("transformers", "peft")  # a class from these in a model's MRO: load the plug-in


class ModelFamily(Protocol):
    """What a family of models adds to planning (see the module docstring).

    Every method but :meth:`claims` is asked only when it matters, and may
    answer ``None`` (nothing to add).
    """

    name: str

    def claims(self, model: nn.Module) -> bool:
        """Whether ``model`` belongs to this family (its sources then apply)."""

    def own_rules(self, model: nn.Module) -> Rules | None:
        """The plan the model ships with, if any (tried first)."""

    def builtin_rules(self, model: nn.Module) -> Rules | None:
        """torchtp's built-in plan for the model's architecture, if any."""

    def no_builtin(self, model: nn.Module) -> ValueError:
        """The error for ``plan="builtin"`` when there is no built-in plan."""

    def inner_model(self, model: nn.Module) -> tuple[str, nn.Module] | None:
        """``(name, model of this family)`` inside a model that hosts one (PEFT), else ``None``."""

    def probe_inputs(self, model: nn.Module) -> dict[str, Any] | None:
        """Keyword inputs for the automatic plan's probe forward."""

    def head_config(self, model: nn.Module) -> object:
        """Where head counts live when attention modules do not hold them."""

    def probe_copy(self, model: nn.Module) -> nn.Module | None:
        """A small CPU copy of ``model`` for the plan verification's probe."""

    def copy_key(self, model: nn.Module) -> Hashable | None:
        """What the probe copy is built from (its verdicts are cached under it)."""

    def attention_overrides(self, module: nn.Module, heads: int, kv_heads: int, head_dim: int,
                            local_heads: int, local_kv: int) -> dict[str, object]:
        """Attributes of a head-split attention module to set beyond the generic head counts."""

    def experts_layout(self, module: nn.Module) -> ExpertsLayout | None:
        """How an experts module of this family stores its experts (``None``: not one)."""

    def mixer_limit(self, module: nn.Module) -> str | None:
        """Why the installed library cannot run this Mamba-style mixer split, or ``None``."""


_FAMILIES: dict[str, ModelFamily] = {}
_HF_LOADED = False


def register_family(family: ModelFamily) -> None:
    """Add ``family`` (once per name; registering it again replaces it)."""
    _FAMILIES[family.name] = family


def family_of(model: nn.Module) -> ModelFamily | None:
    """The registered family that claims ``model``, if any."""
    _load_for(model)
    return next((f for f in _FAMILIES.values() if f.claims(model)), None)


def is_family(model: nn.Module, name: str) -> bool:
    """Whether the family called ``name`` claims ``model``."""
    family = family_of(model)
    return family is not None and family.name == name


def inner_model(model: nn.Module) -> tuple[str, nn.Module] | None:
    """``(name, model)`` of a family's model hosted inside ``model`` (a PEFT model), if any."""
    _load_for(model)
    return next((found for f in _FAMILIES.values() if (found := f.inner_model(model))), None)


def head_config(model: nn.Module) -> object:
    """The config holding ``model``'s head counts (``None``: attention modules hold them)."""
    _load_for(model)
    return next((c for f in _FAMILIES.values() if (c := f.head_config(model)) is not None), None)


def attention_overrides(module: nn.Module, heads: int, kv_heads: int, head_dim: int,
                        local_heads: int, local_kv: int) -> dict[str, object]:
    """What the families set on a head-split attention module besides its head counts."""
    _load_for(module)
    out: dict[str, object] = {}
    for family in _FAMILIES.values():
        out.update(family.attention_overrides(module, heads, kv_heads, head_dim, local_heads,
                                              local_kv))
    return out


@dataclass(frozen=True)
class ExpertsLayout:
    """How a family's experts module stores all experts of a layer in 3-D parameters.

    Attributes:
        concatenated: ``gate_up_proj`` holds ``[gate; up]`` (else interleaved pairs).
        transposed: Weights are ``(E, in, out)`` rather than ``(E, out, in)``.
        has_bias: Biases are added inside every expert.
        has_gate: A gate projection exists (``gate_up_proj``; else ``up_proj`` only).
        post_norm: A norm follows each expert.
        sentinel: Its forward skips routes numbered ``num_experts`` once
            :attr:`mark_parallel` ran (what expert parallelism masks routes with).
        mark_parallel: Turns that on (called on the module when it is cut).
        parallel_forward: ``parallel_forward(module, dtype)`` returns, at every call,
            the function ``f(module, x, index, weights)`` to run the cut module
            with, or ``None`` for its own forward.
        routed: Its forward takes ``(x, top_k_index, top_k_weights)``; else ``x``
            alone, every expert's rows already routed and scaled (Llama 4's
            ``(E * N, H)``).
    """

    concatenated: bool
    transposed: bool
    has_bias: bool
    has_gate: bool
    post_norm: bool
    sentinel: bool
    mark_parallel: Callable[[nn.Module], None]
    parallel_forward: Callable[[nn.Module, Any], Any]
    routed: bool = True


def experts_layout(module: nn.Module) -> ExpertsLayout | None:
    """The layout of ``module`` if a family knows it as an experts module."""
    _load_for(module)
    return next((lay for f in _FAMILIES.values() if (lay := f.experts_layout(module))), None)


def mixer_limit(module: nn.Module) -> str | None:
    """Why a family's library cannot run the Mamba-style mixer ``module`` split, if it cannot."""
    _load_for(module)
    return next((why for f in _FAMILIES.values() if (why := f.mixer_limit(module))), None)


def _load_for(obj: nn.Module) -> None:
    """Import the HuggingFace plug-in the first time ``obj`` may be one of its models."""
    global _HF_LOADED
    if _HF_LOADED or HUGGINGFACE in _FAMILIES:  # loaded, or registered by an import of hf
        return
    if getattr(obj, "config", None) is not None or any(
            c.__module__.partition(".")[0] in _LIBRARIES for c in type(obj).__mro__):
        importlib.import_module(HF_PLUGIN, __package__)
        _HF_LOADED = True
