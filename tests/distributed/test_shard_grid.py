"""Grid index helpers and Sharding shapes from shapes alone (no processes)."""

from __future__ import annotations

import pytest
import torch

from torchtp import shard
from torchtp.shard import Grid, Sharding, assemble, shard_shape


def test_process_linear_index_10x20x30():
    # Dialect: multi-index (1, 2, 3) on (10, 20, 30) has index 3 + 30*2 + 20*30*1.
    grid = Grid((10, 20, 30))
    assert grid.process_linear_index((1, 2, 3)) == 3 + 30 * 2 + 20 * 30 * 1 == 663
    assert grid.process_multi_index(device=663) == (1, 2, 3)
    assert grid.process_multi_index(axes=[2, 0], device=(1, 2, 3)) == (3, 1)
    assert grid.grid_shape() == (10, 20, 30)
    assert grid.grid_shape(axes=[2, 0]) == (30, 10)
    assert grid.size == 6000 and grid.ndim == 3


def test_neighbors_linear_indices_10x20x30():
    # Dialect: device (1, 2, 3), split_axes [1] -> 633 (1, 1, 3) and 693 (1, 3, 3).
    grid = Grid((10, 20, 30))
    assert grid.neighbors_linear_indices((1, 2, 3), [1]) == (633, 693)
    assert grid.process_linear_index((1, 1, 3)) == 633
    assert grid.process_linear_index((1, 3, 3)) == 693
    # -1 where there is no neighbour.
    first = grid.process_linear_index((1, 1, 3))
    assert grid.neighbors_linear_indices((1, 0, 3), [1]) == (-1, first)
    assert grid.neighbors_linear_indices((9, 2, 3), [0])[1] == -1
    # Several split axes act as one axis linearised row-major: (0, 19) -> (1, 0).
    assert grid.neighbors_linear_indices((0, 19, 5), [0, 1]) == (
        grid.process_linear_index((0, 18, 5)), grid.process_linear_index((1, 0, 5)))


def test_index_round_trip_small_grid():
    for lin in range(24):
        assert shard.linear_index(shard.multi_index(lin, (2, 3, 4)), (2, 3, 4)) == lin


def test_grid_errors():
    with pytest.raises(ValueError, match=r"grid shape \(2, 0\) is invalid"):
        Grid((2, 0))
    with pytest.raises(ValueError, match=r"has 4 devices but ranks=\[0, 1, 2\] lists 3"):
        Grid((2, 2), ranks=[0, 1, 2])
    with pytest.raises(ValueError, match=r"repeats a rank"):
        Grid((2,), ranks=[1, 1])
    grid = Grid((10, 20, 30))
    with pytest.raises(ValueError, match=r"axes=\[3\]: axis 3 is out of range for a grid with 3"):
        grid.grid_shape([3])
    with pytest.raises(ValueError, match=r"entry 1 = 20 is outside grid axis 1 of size 20"):
        grid.process_linear_index((1, 20, 3))
    with pytest.raises(RuntimeError, match=r"has no processes .* pass device="):
        grid.process_linear_index()


def test_sharding_examples_from_the_dialect():
    grid0 = (2, 2, 4)
    # split_axes = [[]]: fully replicated.
    assert shard_shape((4, 8), Sharding([[]]), (1, 1, 3), grid0) == (4, 8)
    # split_axes = [[0]]: first dim over grid axis 0.
    assert shard_shape((4, 8), Sharding([[0]]), (1, 0, 0), grid0) == (2, 8)
    # halo_sizes = [1, 2] on the sharded dim: 2 + 1 + 2 rows.
    assert shard_shape((4, 8), Sharding([[0]], halo_sizes=[1, 2]), (0, 0, 0), grid0) == (5, 8)
    # grid1d_4, split_axes [[], [0]], offsets [0, 2, 5, 9, 14]: 4x2, 4x3, 4x4, 4x5.
    offs = Sharding([[], [0]], sharded_dims_offsets=[0, 2, 5, 9, 14])
    assert [shard_shape((4, 14), offs, i, (4,)) for i in range(4)] == [
        (4, 2), (4, 3), (4, 4), (4, 5)]
    # 32x32x32, first two dims sharded, offsets [0, 24, 32, 0, 20, 32] on a 2x2 grid.
    two = Sharding([[0], [1]], sharded_dims_offsets=[0, 24, 32, 0, 20, 32])
    assert shard_shape((32, 32, 32), two, (0, 0), (2, 2)) == (24, 20, 32)
    assert shard_shape((32, 32, 32), two, (1, 1), (2, 2)) == (8, 12, 32)
    assert shard_shape((32, 32, 32), two, (0, 1), (2, 2)) == (24, 12, 32)


def test_shard_and_assemble_are_inverse_without_processes():
    full = torch.arange(4 * 14).reshape(4, 14)
    cases = [
        (Sharding([[], [0]], sharded_dims_offsets=[0, 2, 5, 9, 14]), (4,)),
        (Sharding([[0], [1]]), (2, 2)),
        (Sharding([[1, 0]]), (2, 2)),
        (Sharding([[0]], halo_sizes=[1, 2]), (2, 2)),
        (Sharding([[]]), (3,)),
    ]
    for sharding, grid in cases:
        pieces = [shard.shard(full, sharding, grid, i) for i in range(_n(grid))]
        assert torch.equal(assemble(pieces, sharding, grid), full), sharding
    halo = shard.shard(full, Sharding([[0]], halo_sizes=[1, 2]), (2, 2), (1, 0))
    # Rows 1..3 of the full tensor, then zeros where the halo leaves the tensor.
    assert torch.equal(halo[:3], full[1:4]) and not halo[3:].any()
    # [[1, 0]]: dim 0 split over axes 1 then 0, so device (1, 0) holds shard 1.
    assert torch.equal(shard.shard(full, Sharding([[1, 0]]), (2, 2), (1, 0)), full[1:2])


def test_unshard_on_one_device_crops_the_halos():
    full = torch.arange(18.0).reshape(6, 3)
    halo = Sharding([[0]], halo_sizes=[1, 2])
    piece = shard.shard(full, halo, Grid((1,)), 0)  # (1 + 6 + 2, 3): zero halo rows
    assert piece.shape == (9, 3)
    assert torch.equal(shard.unshard(piece, halo, Grid((1,))), full)


def _n(grid: tuple[int, ...]) -> int:
    out = 1
    for s in grid:
        out *= s
    return out


def test_sharding_errors():
    with pytest.raises(ValueError, match=r"mutually exclusive"):
        Sharding([[0]], halo_sizes=[1, 1], sharded_dims_offsets=[0, 2, 4])
    with pytest.raises(ValueError, match=r"halo_sizes=\[1\] needs 2 non-negative values per "
                                         r"sharded dim.*give 2 values"):
        Sharding([[0]], halo_sizes=[1])
    with pytest.raises(ValueError, match=r"each grid axis may split at most one tensor dim"):
        Sharding([[0], [0]])
    with pytest.raises(ValueError, match=r"tensor dim 0 of size 5 does not split evenly over "
                                         r"grid axes \[0\] \(2 shards.*sharded_dims_offsets"):
        shard_shape((5, 2), Sharding([[0]]), 0, (2,))
    with pytest.raises(ValueError, match=r"split_axes=\[2\]: axis 2 is out of range"):
        shard_shape((4, 2), Sharding([[2]]), 0, (2, 2))
    with pytest.raises(ValueError, match=r"offsets for tensor dim 1 are \[0, 2, 5, 9, 13\].*"
                                         r"end at the dim size 14"):
        shard_shape((4, 14), Sharding([[], [0]], sharded_dims_offsets=[0, 2, 5, 9, 13]), 0, (4,))
    with pytest.raises(ValueError, match=r"must hold shards\+1 values per sharded dim: 5"):
        shard_shape((4, 14), Sharding([[], [0]], sharded_dims_offsets=[0, 14]), 0, (4,))
    with pytest.raises(ValueError, match=r"no grid"):
        shard_shape((4,), Sharding([[0]]), 0)
