"""torch.compile(fullgraph=True) traces wrapped models without graph breaks (CPU, Gloo)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

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
    # Compiled code does not switch torchtp's RNG streams: active dropout in
    # training mode is refused (dynamo reports the error it traced), eval compiles.
    drop = torchtp.DistributedModelWrapper(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 16)))
    with pytest.raises(Exception, match=r"torch\.compile of a tensor-parallel model \(tp=2\) "
                       r"in training mode with dropout at 2 \(p=0\.1\).*train it eagerly"):
        torch.compile(drop, fullgraph=True, backend="aot_eager")(x)
    drop.eval()
    torch.compile(drop, fullgraph=True, backend="aot_eager")(x)
    return "ok"


def test_fullgraph_compile_matches_eager(ranks):
    assert ranks(_compiled, 2, timeout=300) == ["ok", "ok"]
