"""``Accelerator.clip_grad_norm_`` by the whole model's norm for torchtp models.

accelerate clips with torch's norm functions (``torch.nn.utils.clip_grad_norm_``
by name up to 1.15, its own ``get_total_norm`` + ``clip_grads_with_norm_`` since
1.16), which on a tensor-parallel model see only this rank's shards. Installed by a
wrap at tp > 1 once accelerate is imported (``integrations/guards.py``), never at
import: parameters of a wrapped model are clipped by :func:`torchtp.clip_grad_norm_`
after accelerate unscales them; any others by accelerate's own code.
"""

from __future__ import annotations

import functools
from typing import Any

from ..training.clip import clip_grad_norm_ as whole_model_clip
from ..training.clip import holds_wrapped


def install() -> None:
    """Route ``Accelerator.clip_grad_norm_`` for wrapped models' parameters (idempotent)."""
    from accelerate import Accelerator

    original = Accelerator.clip_grad_norm_
    if getattr(original, "_torchtp", False):
        return

    @functools.wraps(original)
    def clip_grad_norm_(self: Any, parameters: Any, max_norm: float,
                        norm_type: float = 2) -> Any:
        params = list(parameters)
        if not holds_wrapped(params):
            return original(self, params, max_norm, norm_type=norm_type)
        self.unscale_gradients()
        return whole_model_clip(params, max_norm, norm_type)

    clip_grad_norm_._torchtp = True  # type: ignore[attr-defined]
    Accelerator.clip_grad_norm_ = clip_grad_norm_
