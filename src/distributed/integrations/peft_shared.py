"""PEFT LoRA beside a replicated projection whose output features every head reads.

Multi-head latent attention's ``kv_a_proj_with_mqa`` (DeepSeek-V2/V3, Kimi-K2,
...) stays whole on every rank while the heads are split; the last ``rope``
features of its output ``(B, T, kv_lora_rank + rope)`` are one key every head
reads, so each rank's gradient of them covers its own heads only. torchtp
enters them into the head region with a forward hook (``plans/styles_heads.py``:
forward identity, backward all-reduce of those features' gradient) and marks
the module ``tp_shared_output``. A LoRA adapter adds ``s * B(A x)`` to that
same output after the hook, so its gradient would be this rank's part: each
adapter's ``B`` gets the same hook on its output, and the adapters' gradients
are the unsharded ones. Merged adapters go through the base's own hook; after
``merge_and_unload`` the base keeps it.
"""

from __future__ import annotations

from typing import Any

from peft.tuners.lora import Linear as LoraLinear


class SharedEntryLoraLinear(LoraLinear):
    """PEFT's ``lora.Linear`` around a ``tp_shared_output`` projection: each adapter's
    ``B`` output enters the head region like the base's output (module docstring)."""

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
    """Turn PEFT's ``lora.Linear`` around a ``tp_shared_output`` base into a
    :class:`SharedEntryLoraLinear` (same state), every adapter's ``B`` hooked.

    Raises:
        TypeError: another LoRA layer class (quantized...).
        ValueError: an adapter uses a LoRA variant.
    """
    if type(layer) is not LoraLinear:
        raise TypeError(f"LoRA layer {type(layer).__name__} around "
                        f"{type(layer.get_base_layer()).__name__} (whole on every rank, its "
                        "last output features read by every split head) is not supported; "
                        "only PEFT's lora.Linear (plain LoRA) is")
    if layer.lora_variant:
        raise ValueError(_variant_refusal(layer))
    layer.__class__ = SharedEntryLoraLinear
    for adapter in layer.lora_B:
        _enter(layer, adapter)
    return layer  # type: ignore[return-value]


def _enter(layer: Any, adapter: str) -> None:
    b = layer.lora_B[adapter]  # (..., out) output: its shared features enter the region
    if not b.__dict__.get("_torchtp_entered"):
        b.register_forward_hook(layer.get_base_layer().tp_shared_output)
        b.__dict__["_torchtp_entered"] = True


def _variant_refusal(layer: Any) -> str:
    return (f"LoRA on {type(layer.get_base_layer()).__name__} (whole on every rank, its last "
            "output features read by every split head): LoRA variants (DoRA, aLoRA, ...) are "
            "not supported under tensor parallelism there; use plain LoRA")
