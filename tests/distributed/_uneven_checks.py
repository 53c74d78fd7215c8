"""Rank-side checks of uneven shards: plain layers against nn.Linear / nn.Embedding.

The expected shard of a full tensor is cut with ``torch.tensor_split`` (which
gives the first ``n % tp`` parts one more element): independent of torchtp's
own cutter, and the balanced rule torchtp documents.
"""

from __future__ import annotations

import torch
from torch import nn

import torchtp

from ._reference import FP32, seeded

IN, OUT, VOCAB, DIM = 10, 11, 97, 10  # none divides by 3 or 4 (DIM by neither 3 nor 4)


def share(t: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s balanced share of ``t`` along ``dim`` (sizes differ by at most one)."""
    return torch.tensor_split(t, world_size, dim=dim)[rank]


def _linear(rank: int, world_size: int, cls: type, flag: bool) -> dict[str, int]:
    x, gy = seeded(2, 3, IN, seed=1), seeded(2, 3, OUT, seed=2)
    torch.manual_seed(0)
    ref = nn.Linear(IN, OUT)
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    (yr * gy).sum().backward()
    torch.manual_seed(0)
    kw = {"gather_output": flag} if cls is torchtp.RowParallelLinear else {"input_is_parallel": flag}
    layer = cls(IN, OUT, **kw)
    dim = 0 if cls is torchtp.RowParallelLinear else 1
    torch.testing.assert_close(layer.weight, share(ref.weight.detach(), dim, rank, world_size),
                               rtol=0, atol=0)
    if cls is torchtp.RowParallelLinear:
        xin, want, g = x, (yr if flag else share(yr, -1, rank, world_size)), \
            (gy if flag else share(gy, -1, rank, world_size))
    else:
        xin, want, g = (share(x, -1, rank, world_size) if flag else x), yr, gy
    xs = xin.clone().requires_grad_()
    with torchtp.count_collectives() as fwd:
        y = layer(xs)
    torch.testing.assert_close(y, want.detach(), **FP32)
    with torchtp.count_collectives() as bwd:
        (y * g).sum().backward()
    want_xgrad = share(xr.grad, -1, rank, world_size) if xs.shape != xr.shape else xr.grad
    torch.testing.assert_close(xs.grad, want_xgrad, **FP32)
    torch.testing.assert_close(layer.weight.grad, share(ref.weight.grad, dim, rank, world_size),
                               **FP32)
    want_bias = share(ref.bias.grad, 0, rank, world_size) if dim == 0 else ref.bias.grad
    torch.testing.assert_close(layer.bias.grad, want_bias, **FP32)
    return {**{f"fwd {k}": v for k, v in fwd.counts.items()},
            **{f"bwd {k}": v for k, v in bwd.counts.items()}}


def _embeddings(rank: int, world_size: int) -> None:
    ids = torch.tensor([[0, 5, 96, 40], [3, 3, 70, 24]])
    for cls, n, dim, split in ((torchtp.VocabParallelEmbedding, VOCAB, 6, 0),
                               (torchtp.FeatureParallelEmbedding, 12, DIM, 1)):
        torch.manual_seed(0)
        ref = nn.Embedding(n, dim, padding_idx=3)
        torch.manual_seed(0)
        emb = cls(n, dim, padding_idx=3)
        got_ids = ids % n
        torch.testing.assert_close(emb.weight, share(ref.weight.detach(), split, rank, world_size),
                                   rtol=0, atol=0)
        out = emb(got_ids)
        torch.testing.assert_close(out, ref(got_ids), **FP32)
        out.square().sum().backward()
        ref(got_ids).square().sum().backward()
        torch.testing.assert_close(emb.weight.grad,
                                   share(ref.weight.grad, split, rank, world_size), **FP32)


def _reduce_scatter(rank: int, world_size: int) -> None:
    # Each rank's partial (2, 10, 3) differs; the sum's balanced share along dim 1 comes back.
    parts = [seeded(2, IN, 3, seed=10 + r) for r in range(world_size)]
    x = parts[rank].clone().requires_grad_()
    group = torchtp.get_tensor_parallel_config().group
    y = torchtp.comm.regions.reduce_scatter_to_tensor_parallel_region(x, group, 1)
    torch.testing.assert_close(y, share(sum(parts), 1, rank, world_size), **FP32)
    g = seeded(2, IN, 3, seed=99)
    (y * share(g, 1, rank, world_size)).sum().backward()
    torch.testing.assert_close(x.grad, g, **FP32)  # every partial's gradient is the full one


def _mlp(rank: int, world_size: int) -> list[str]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(IN, OUT), nn.ReLU(), nn.Linear(OUT, 7), nn.Linear(7, 5))

    # auto-memory: split even where the cost guard would keep these tiny layers whole.
    ref, wrapped = build(), torchtp.DistributedModelWrapper(build(), plan="auto-memory")
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    x = seeded(4, IN, seed=5)
    for _ in range(3):
        for model, optim in ((ref, opt_ref), (wrapped, opt)):
            optim.zero_grad()
            model(x).square().mean().backward()
            optim.step()
        torch.testing.assert_close(wrapped(x), ref(x), **FP32)
    for name, p in wrapped.base_model.named_parameters():
        module = wrapped.base_model.get_submodule(name.rpartition(".")[0])
        layout = torchtp.layouts_of(module).get(name.rpartition(".")[2])
        want = ref.get_parameter(name).detach()
        if layout is not None and layout.dim is not None:
            want = share(want, layout.dim, rank, world_size)
        torch.testing.assert_close(p.detach(), want, **FP32)
    return list(wrapped.resolved_plan.rules.values())


def check_layers(rank: int, world_size: int) -> dict:
    """Linear (both splits, both flags), embeddings, reduce-scatter and a wrapped MLP."""
    counts = {f"{cls.__name__} {flag}": _linear(rank, world_size, cls, flag)
              for cls in (torchtp.RowParallelLinear, torchtp.ColumnParallelLinear)
              for flag in (True, False)}
    _embeddings(rank, world_size)
    _reduce_scatter(rank, world_size)
    return {"counts": counts, "plan": _mlp(rank, world_size)}
