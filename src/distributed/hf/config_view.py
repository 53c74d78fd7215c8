"""A per-module view of a shared HF config with local head counts."""

from __future__ import annotations

from typing import Any


class LocalConfig:
    """Reads like the wrapped config, except for the overridden (local) values.

    Attention modules that read ``self.config.num_attention_heads`` in their
    forward (Phi-3's fused-qkv split) need their rank's head count, while the
    model's shared config must keep the full one. Writes go to the shared
    config, so later changes (e.g. the attention implementation) still apply.
    """

    def __init__(self, base: Any, overrides: dict[str, Any]) -> None:
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_overrides", dict(overrides))

    def __getattr__(self, name: str) -> Any:
        overrides = object.__getattribute__(self, "_overrides")
        if name in overrides:
            return overrides[name]
        return getattr(object.__getattribute__(self, "_base"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_base"), name, value)

    def __repr__(self) -> str:
        return f"LocalConfig({object.__getattribute__(self, '_overrides')})"
