"""torch.compile(fullgraph=True) traces wrapped models without graph breaks (CPU, Gloo)."""

from __future__ import annotations

import torch

import torchtp

from ._models import mlp
from ._reference import seeded, tol


def _compiled(rank: int, world_size: int) -> str:
    ref = mlp()
    wrapped = torchtp.DistributedModelWrapper(mlp())
    # fullgraph=True raises on any graph break, so passing proves there is none.
    # aot_eager traces forward and backward like inductor does, without C++ builds.
    compiled = torch.compile(wrapped, fullgraph=True, backend="aot_eager")
    x = seeded(4, 16, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), ref(x), **tol(torch.float32))
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    compiled(xs).square().sum().backward()
    ref(xr).square().sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad, **tol(torch.float32))
    return "ok"


def test_fullgraph_compile_matches_eager(ranks):
    assert ranks(_compiled, 2, timeout=300) == ["ok", "ok"]
