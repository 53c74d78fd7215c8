"""RowParallelLinear / ColumnParallelLinear against nn.Linear built from the same seed."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import torchtp
from torchtp import ColumnParallelLinear, RowParallelLinear

from ._reference import chunk, seeded, tol

IN, OUT = 24, 48  # divisible by 1, 2, 3, 4


def _reference(bias: bool, dtype: torch.dtype, x: torch.Tensor, gy: torch.Tensor):
    torch.manual_seed(0)
    ref = nn.Linear(IN, OUT, bias=bias, dtype=dtype)
    xr = x.clone().requires_grad_()
    y = ref(xr)
    (y * gy).sum().backward()
    return ref, xr, y


def _row_parity(rank: int, world_size: int, bias: bool, dtype: torch.dtype,
                gather: bool) -> None:
    x, gy = seeded(2, 3, IN, seed=1, dtype=dtype), seeded(2, 3, OUT, seed=2, dtype=dtype)
    ref, xr, yr = _reference(bias, dtype, x, gy)
    torch.manual_seed(0)  # same seed, built independently of the reference
    layer = RowParallelLinear(IN, OUT, bias=bias, dtype=dtype, gather_output=gather)
    assert layer.weight.shape == (OUT // world_size, IN)
    torch.testing.assert_close(layer.weight, chunk(ref.weight.detach(), 0, rank, world_size),
                               rtol=0, atol=0)
    xs = x.clone().requires_grad_()
    y = layer(xs)
    want = yr if gather else chunk(yr, -1, rank, world_size)
    assert y.shape == want.shape
    torch.testing.assert_close(y, want.detach(), **tol(dtype))
    (y * (gy if gather else chunk(gy, -1, rank, world_size))).sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad, **tol(dtype))
    torch.testing.assert_close(layer.weight.grad, chunk(ref.weight.grad, 0, rank, world_size),
                               **tol(dtype))
    if bias:
        torch.testing.assert_close(layer.bias.grad, chunk(ref.bias.grad, 0, rank, world_size),
                                   **tol(dtype))


def _column_parity(rank: int, world_size: int, bias: bool, dtype: torch.dtype,
                   input_is_parallel: bool) -> None:
    x, gy = seeded(2, 3, IN, seed=3, dtype=dtype), seeded(2, 3, OUT, seed=4, dtype=dtype)
    ref, xr, yr = _reference(bias, dtype, x, gy)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(IN, OUT, bias=bias, dtype=dtype,
                                 input_is_parallel=input_is_parallel)
    assert layer.weight.shape == (OUT, IN // world_size)
    torch.testing.assert_close(layer.weight, chunk(ref.weight.detach(), 1, rank, world_size),
                               rtol=0, atol=0)
    xin = chunk(x, -1, rank, world_size) if input_is_parallel else x
    xs = xin.clone().requires_grad_()
    y = layer(xs)
    torch.testing.assert_close(y, yr.detach(), **tol(dtype))
    (y * gy).sum().backward()
    want_xgrad = chunk(xr.grad, -1, rank, world_size) if input_is_parallel else xr.grad
    torch.testing.assert_close(xs.grad, want_xgrad, **tol(dtype))
    torch.testing.assert_close(layer.weight.grad, chunk(ref.weight.grad, 1, rank, world_size),
                               **tol(dtype))
    if bias:  # added once after the reduction: the full nn.Linear gradient on every rank
        torch.testing.assert_close(layer.bias.grad, ref.bias.grad, **tol(dtype))


def _all_parities(rank: int, world_size: int) -> int:
    checked = 0
    for bias, dtype, flag in itertools.product((True, False), (torch.float32, torch.bfloat16),
                                               (True, False)):
        _row_parity(rank, world_size, bias, dtype, gather=flag)
        _column_parity(rank, world_size, bias, dtype, input_is_parallel=flag)
        checked += 2
    return checked


@pytest.mark.parametrize("world_size", [2, 4])
def test_parity_with_nn_linear(ranks, world_size):
    # 16 cases per world size: {row, column} x bias x {fp32, bf16} x {gather / split input}.
    assert ranks(_all_parities, world_size) == [16] * world_size


def test_parity_world_size_one_in_process():
    assert _all_parities(0, 1) == 16


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("cls,dim", [(RowParallelLinear, 0), (ColumnParallelLinear, 1)])
def test_same_seed_gives_the_nn_linear_weights_at_any_world_size(world_size, cls, dim):
    torch.manual_seed(123)
    ref = nn.Linear(IN, OUT)
    shards = []
    for rank in range(world_size):
        torch.manual_seed(123)
        shards.append(cls(IN, OUT, world_size=world_size, rank=rank))
    torch.testing.assert_close(torch.cat([s.weight for s in shards], dim), ref.weight,
                               rtol=0, atol=0)
    bias = torch.cat([s.bias for s in shards]) if cls is RowParallelLinear else shards[0].bias
    torch.testing.assert_close(bias, ref.bias, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [RowParallelLinear, ColumnParallelLinear])
def test_world_size_one_is_exactly_nn_linear(cls):
    torch.manual_seed(5)
    ref = nn.Linear(IN, OUT)
    torch.manual_seed(5)
    layer = cls(IN, OUT)
    x = torch.randn(7, IN)
    assert torch.equal(layer(x), ref(x))
    with torchtp.count_collectives() as counter:
        layer(x).sum().backward()
    assert counter.total == 0


@pytest.mark.parametrize("cls,dim", [(RowParallelLinear, 0), (ColumnParallelLinear, 1)])
def test_from_linear_copies_only_the_local_slice(cls, dim):
    full = nn.Linear(IN, OUT)
    layer = cls.from_linear(full, world_size=4, rank=2)
    want = chunk(full.weight.detach(), dim, 2, 4)
    torch.testing.assert_close(layer.weight, want, rtol=0, atol=0)
    assert layer.weight.untyped_storage().nbytes() == want.numel() * 4  # no view of the full weight
    assert layer.weight.data_ptr() != full.weight.data_ptr()


def test_meta_device_skips_initialisation():
    layer = RowParallelLinear(IN, OUT, world_size=2, rank=1, device="meta")
    assert layer.weight.is_meta and layer.weight.shape == (OUT // 2, IN)
    col = ColumnParallelLinear.from_linear(nn.Linear(IN, OUT, device="meta"), world_size=2, rank=0)
    assert col.weight.is_meta and col.weight.shape == (OUT, IN // 2)


def test_guide_example_runs_without_a_process_group():
    layer = RowParallelLinear(in_features=64, out_features=256, world_size=4, rank=0)
    y = layer(torch.randn(2, 3, 64))
    assert y.shape == (2, 3, 64)
    assert (layer.in_features, layer.out_features, layer.out_features_local) == (64, 256, 64)
    assert layer.bias.shape == (64,)


def test_extra_repr_says_which_dimension_is_split():
    assert "split=weight rows (out_features 48 -> 12 per rank)" in repr(
        RowParallelLinear(IN, OUT, world_size=4, rank=0))
    assert "split=weight columns (in_features 24 -> 6 per rank)" in repr(
        ColumnParallelLinear(IN, OUT, world_size=4, rank=0))
