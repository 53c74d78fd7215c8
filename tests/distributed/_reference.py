"""Helpers shared by the parity tests: seeded inputs and tolerances."""

from __future__ import annotations

import torch

# fp32: sharding changes only the order of additions (partial sums over
# in_features/tp, then an all-reduce). For the tiny fan-ins used here the
# reassociation error is a few ulps, well inside torch's default fp32
# tolerances (rtol 1.3e-6, atol 1e-5).
FP32 = {"rtol": 1.3e-6, "atol": 1e-5}
# bf16: each rank rounds its partial sum to bf16 (8-bit mantissa, eps 2^-8)
# before the all-reduce, and the reduction itself rounds again, so results
# differ from one fused bf16 matmul by up to ~tp * 2^-8 relative. Outputs here
# are O(1), so 2e-2 relative / 2e-2 absolute bounds that with margin.
BF16 = {"rtol": 2e-2, "atol": 2e-2}


def tol(dtype: torch.dtype) -> dict[str, float]:
    """Tolerances for comparing a sharded result with the unsharded one."""
    return BF16 if dtype == torch.bfloat16 else FP32


def seeded(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The same random tensor on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


def chunk(t: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s equal chunk of ``t`` along ``dim``."""
    return t.chunk(world_size, dim=dim)[rank]
