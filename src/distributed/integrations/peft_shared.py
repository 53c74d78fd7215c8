"""PEFT LoRA beside a whole projection whose output or gradient torchtp treats per rank.

Two kinds of whole (replicated) projection feed split heads, and a LoRA branch
``s * B(A x)`` added to their output must be treated as the base is:

* **A shared output entry** (``tp_shared_output``): multi-head latent
  attention's ``kv_a_proj_with_mqa`` (DeepSeek-V2/V3, Kimi-K2, ...); the last
  ``rope`` features of its output ``(B, T, kv_lora_rank + rope)`` are one key
  every head reads, so each rank's gradient of them covers its own heads only.
  torchtp enters them into the head region with a forward hook
  (``plans/styles_heads.py``: forward identity, backward all-reduce of those
  features' gradient). The hook runs before PEFT adds the branch, so each
  adapter's ``B`` gets the same hook on its output.
* **A weight gradient summed over ranks** (``tp_summed_gradient``:
  ``replicated_with_grad_allreduce``, a module applied to this rank's heads
  only): each adapter's ``A`` and ``B`` gradients are partial the same way, so
  they get the base weight's sums (``tp_grad_sync``).

Merged adapters go through the base's own hook; after ``merge_and_unload`` the
base keeps it.
"""

from __future__ import annotations

from typing import Any

from peft.tuners.lora import Linear as LoraLinear
from torch import nn

from ..layers import grad_sync


def treated_per_rank(base: nn.Module) -> bool:
    """Whether ``base`` is a whole projection whose output entry or weight gradient
    torchtp treats per rank (module docstring), so LoRA beside it must follow."""
    return getattr(base, "tp_shared_output", None) is not None \
        or getattr(base, "tp_summed_gradient", False)


class SharedEntryLoraLinear(LoraLinear):
    """PEFT's ``lora.Linear`` around a whole projection :func:`treated_per_rank`: each
    adapter's ``B`` output enters the head region like the base's output, and its
    ``A`` and ``B`` gradients get the base weight's sums (module docstring)."""

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config: Any,
                     **kwargs: Any) -> None:
        """PEFT's ``update_layer``, then the new adapter's ``B`` takes the entry hook.

        Raises:
            ValueError: a LoRA variant (DoRA...), which computes with ``B``'s weight
                rather than through its forward.
        """
        if self.resolve_lora_variant(config=config) is not None:
            raise ValueError(_variant_refusal(self))
        super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        _enter(self, adapter_name)

    def __repr__(self) -> str:
        return "torchtp." + super().__repr__()


def convert_shared(layer: Any) -> SharedEntryLoraLinear:
    """Turn PEFT's ``lora.Linear`` around a base :func:`treated_per_rank` into a
    :class:`SharedEntryLoraLinear` (same state), every adapter treated as the base.

    Raises:
        TypeError: another LoRA layer class (quantized...).
        ValueError: an adapter uses a LoRA variant.
    """
    if type(layer) is not LoraLinear:
        raise TypeError(f"LoRA layer {type(layer).__name__} around "
                        f"{type(layer.get_base_layer()).__name__} (whole on every rank, its "
                        "output read by every split head or its gradient summed over the "
                        "ranks) is not supported; only PEFT's lora.Linear (plain LoRA) is")
    if layer.lora_variant:
        raise ValueError(_variant_refusal(layer))
    layer.__class__ = SharedEntryLoraLinear
    for adapter in layer.lora_B:
        _enter(layer, adapter)
    return layer  # type: ignore[return-value]


def _enter(layer: Any, adapter: str) -> None:
    base = layer.get_base_layer()
    b = layer.lora_B[adapter]  # (..., out) output: its shared features enter the region
    entry = getattr(base, "tp_shared_output", None)
    if entry is not None and not b.__dict__.get("_torchtp_entered"):
        b.register_forward_hook(entry)
        b.__dict__["_torchtp_entered"] = True
    syncs = getattr(base, "tp_grad_sync", {}).get("weight")
    if syncs:  # the branch's gradients are partial as the base weight's is
        for factor in (layer.lora_A[adapter], b):
            grad_sync.mark(factor, "weight", syncs)
        grad_sync.install(layer)


def _variant_refusal(layer: Any) -> str:
    return (f"LoRA on {type(layer.get_base_layer()).__name__} (whole on every rank, its output "
            "read by every split head or its gradient summed over the ranks): LoRA variants "
            "(DoRA, aLoRA, ...) are not supported under tensor parallelism there; use plain "
            "LoRA")
