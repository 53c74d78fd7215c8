"""Parameter counts of a wrapped model: this rank's and the full model's."""

from __future__ import annotations

import math

from torch import nn

from .placements import placements


def parameter_summary(model: nn.Module) -> str:
    """One line: parameters and bytes on this rank and in the full (unsharded) model.

    HF's ``num_parameters()`` / ``get_memory_footprint()`` count what this
    rank holds; the full numbers come from the recorded layouts (no
    communication). Tied parameters count once.
    """
    local = full = local_bytes = full_bytes = 0
    for p in placements(model):
        if not p.is_param:
            continue
        size = p.tensor.element_size()
        n_local, n_full = p.tensor.numel(), math.prod(p.layout.full_shape)
        local, full = local + n_local, full + n_full
        local_bytes, full_bytes = local_bytes + n_local * size, full_bytes + n_full * size
    return (f"parameters: {local:,} on this rank ({local_bytes / 2**20:.2f} MiB), "
            f"{full:,} in the full model ({full_bytes / 2**20:.2f} MiB); HF's num_parameters() "
            "and get_memory_footprint() count this rank's share")
