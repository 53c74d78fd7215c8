"""Recorded gradient syncs are installed once, and again after a Parameter is replaced."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchtp import get_tensor_parallel_config
from torchtp.layers import grad_sync


def _sync(rank: int, world_size: int) -> list[float]:
    group = get_tensor_parallel_config().group
    layer = nn.Linear(2, 3, bias=False)
    grad_sync.mark(layer, "weight", (grad_sync.GradSync(group, rows=(1, 2)),))
    assert grad_sync.install(layer) == 1
    assert grad_sync.install(layer) == 0  # idempotent
    layer.weight = nn.Parameter(torch.zeros(3, 2))  # what a loader does
    assert grad_sync.install(layer) == 1
    layer(torch.full((1, 2), float(rank + 1))).sum().backward()
    # Row 0 keeps this rank's gradient; rows 1-2 hold the sum over ranks.
    rows = layer.weight.grad[:, 0].tolist()
    # One Parameter held by two modules that both record the same sum (tied weights):
    # summed once per backward, however many forwards re-hook it.
    a, b = nn.Linear(2, 3, bias=False), nn.Linear(2, 3, bias=False)
    b.weight = a.weight
    for module in (a, b):
        grad_sync.mark(module, "weight", (grad_sync.GradSync(group),))
    grad_sync.install(nn.Sequential(a, b))
    x = torch.full((1, 2), float(rank + 1))
    for _ in range(3):
        (a(x) + b(x)).sum().backward()
    # Tied but summed differently: neither sum alone is right, so it raises.
    c = nn.Linear(2, 3, bias=False)
    c.weight = a.weight
    grad_sync.mark(c, "weight", (grad_sync.GradSync(group, rows=(0, 1)),))
    with pytest.raises(ValueError, match="already sums its gradient"):
        grad_sync.install(c)
    return [*rows, a.weight.grad[0, 0].item()]


def test_installed_hooks_sum_the_recorded_rows(ranks):
    # tied: 3 backwards x 2 uses x (1 + 2) summed over the ranks
    assert ranks(_sync, 2) == [[1.0, 3.0, 3.0, 18.0], [2.0, 3.0, 3.0, 18.0]]


def _rows_then_whole(rank: int, world_size: int) -> list[float]:
    group = get_tensor_parallel_config().group
    layer = nn.Linear(2, 3, bias=False)
    grad_sync.mark(layer, "weight", (grad_sync.GradSync(group, rows=(1, 2)),
                                     grad_sync.GradSync(group)))
    grad_sync.install(layer)
    layer(torch.full((1, 2), float(rank + 1))).sum().backward()
    # rows 1-2: summed (1 + 2 = 3), then the whole tensor again (3 + 3 = 6); row 0: 1 + 2.
    return layer.weight.grad[:, 0].tolist()


def test_a_whole_tensor_sync_keeps_earlier_row_sums(ranks):
    assert ranks(_rows_then_whole, 2) == [[3.0, 6.0, 6.0]] * 2
