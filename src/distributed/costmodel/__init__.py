"""An alpha-beta cost model for tensor-parallel transformer inference.

Answers "will TP make my model faster on this hardware" before any code runs::

    from torchtp.costmodel import ModelDims, estimate, get_hardware
    dims = ModelDims.make(hidden=4096, layers=32, heads=32, ffn=11008)
    estimate(dims, get_hardware("a100-nvlink"), tp=2, phase="decode").speedup

Layer 0: pure arithmetic. May import: nothing from torchtp.
"""

from __future__ import annotations

from .dims import ModelDims, dims_from_config, read_config
from .experts import expert_dispatch_times
from .hardware import PRESETS, Hardware, get_hardware
from .model import (
    PHASES,
    Estimate,
    allgather_time,
    allreduce_time,
    estimate,
    gemm_time,
    ring_steps,
    slowdown,
    sweep,
)

__all__ = [
    "PHASES",
    "PRESETS",
    "Estimate",
    "Hardware",
    "ModelDims",
    "allgather_time",
    "allreduce_time",
    "dims_from_config",
    "estimate",
    "expert_dispatch_times",
    "gemm_time",
    "get_hardware",
    "read_config",
    "ring_steps",
    "slowdown",
    "sweep",
]
