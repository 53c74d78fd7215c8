"""Every example of the shard dialect's documentation, on real Gloo processes.

One launch per world size runs many ops; each rank returns its results and
the test compares them with the dialect's pictures, written out here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torchtp
from torchtp import shard
from torchtp.shard import Grid, Sharding

# The dialect's 2x2 picture: device (i, j) holds one 2x2 block of FULL.
FULL = torch.tensor([[1, 2, 5, 6], [3, 4, 7, 8], [9, 10, 13, 14], [11, 12, 15, 16]],
                    dtype=torch.int8)


def _block(i: int, j: int) -> torch.Tensor:
    return FULL[2 * i:2 * i + 2, 2 * j:2 * j + 2].clone()


def _examples_2x2(rank: int, world_size: int) -> dict[str, Any]:
    grid = Grid((2, 2))
    line = Grid((3,), ranks=[0, 1, 2], name="grid1")
    ring = Grid((4,), name="ring")
    i, j = grid.process_multi_index()
    x = _block(i, j)
    out: dict[str, Any] = {"index": (i, j), "linear": grid.process_linear_index()}
    out["all_gather"] = shard.all_gather(x, grid, 1, grid_axes=[1])
    out["all_slice"] = shard.all_slice(out["all_gather"], grid, 1, grid_axes=[1])
    out["all_gather_all_axes"] = shard.all_gather(x, grid, 0)
    # broadcast: tensor<2xi8>; (0, 0) holds [1, 2], (0, 1) [3, 4], row 1 garbage.
    b_in = torch.tensor([1 + 2 * j, 2 + 2 * j], dtype=torch.int8) if i == 0 else torch.full(
        (2,), -99, dtype=torch.int8)
    out["broadcast"] = shard.broadcast(b_in, grid, [0], grid_axes=[0])
    out["gather"] = shard.gather(x, grid, 1, [1], grid_axes=[1])
    out["reduce_scatter"] = shard.reduce_scatter(x.float(), grid, 0, grid_axes=[1],
                                                 reduction="max", dtype=torch.float64)
    # scatter: root [1] along axis 0; (1, 0) holds [[1,2],[3,4]], (1, 1) [[5,6],[7,8]].
    s_in = _block(0, j) if i == 1 else torch.full((2, 2), -99, dtype=torch.int8)
    out["scatter"] = shard.scatter(s_in, grid, 0, [1], grid_axes=[0])
    f = x.float()
    out["all_reduce_max_f64"] = shard.all_reduce(f, grid, grid_axes=[1, 0], reduction="max",
                                                 dtype=torch.float64)
    out["all_reduce_sum_axis0"] = shard.all_reduce(f, grid, grid_axes=[0])
    out["all_reduce_min"] = shard.all_reduce(f, grid, reduction="min")
    out["all_reduce_product_axis1"] = shard.all_reduce(f, grid, grid_axes=[1],
                                                       reduction=shard.Reduction.PRODUCT)
    out["all_reduce_average"] = shard.all_reduce(f, grid, reduction="average")
    # reduce: root is an in-group multi-index in grid_axes order: [1, 0] on
    # grid_axes [1, 0] is axis-1 index 1, axis-0 index 0, i.e. device (0, 1).
    out["reduce_max"] = shard.reduce(f, grid, [1, 0], grid_axes=[1, 0], reduction="max",
                                     dtype=torch.float64)
    out["reduce_average"] = shard.reduce(f, grid, [1], grid_axes=[0], reduction="average")
    out["all_to_all_2x2"] = shard.all_to_all(x, grid, 0, 1, grid_axes=[1])
    out["shift_rotate"] = shard.shift(x, grid, 1, 1, grid_axes=[1], rotate=True)
    out["shift_no_rotate"] = shard.shift(x, grid, 0, 1, grid_axes=[0])
    out["send_recv"] = _send_recv(x, grid, j)
    if rank < 3:
        # all_to_all on a 3-grid over ranks [0, 1, 2]: device d holds
        # [[d1 d2], [d3 d4], [d5 d6]] with d = 10 * (d + 1).
        d = 10 * (rank + 1)
        a_in = torch.tensor([[d + 1, d + 2], [d + 3, d + 4], [d + 5, d + 6]], dtype=torch.int8)
        out["all_to_all_3"] = shard.all_to_all(a_in, line, 0, 0, grid_axes=[0])
    out.update(_sharding_on_processes(ring, grid))
    with torchtp.count_collectives() as counter:
        shard.all_gather(x, grid, 1, grid_axes=[1])
        shard.all_slice(x, grid, 0, grid_axes=[0])
    out["counts"] = dict(counter.counts)
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def _send_recv(x: torch.Tensor, grid: Grid, j: int) -> torch.Tensor:
    if j == 0:
        shard.send(x, grid, [1], grid_axes=[1])
        return x
    return shard.recv(torch.zeros_like(x), grid, [0], grid_axes=[1])


def _sharding_on_processes(ring: Grid, grid: Grid) -> dict[str, Any]:
    out: dict[str, Any] = {}
    full = torch.arange(4 * 14, dtype=torch.float32).reshape(4, 14)
    offsets = Sharding([[], [0]], sharded_dims_offsets=[0, 2, 5, 9, 14])
    piece = shard.shard(full, offsets, ring)
    out["offsets_shape"] = tuple(piece.shape)
    out["offsets_unshard_ok"] = torch.equal(shard.unshard(piece, offsets, ring), full)
    two_d = Sharding([[0], [1]])
    out["2d_unshard_ok"] = torch.equal(
        shard.unshard(shard.shard(full[:, :12], two_d, grid), two_d, grid), full[:, :12])
    # update_halo: 8 rows over the ring (2 per rank) with halos [1, 2]. The
    # local block and the expected result are cut from the full tensor by hand
    # (global row of local row a is 2r - 1 + a); halos start stale (-1) and
    # edge halos, which have no neighbour, must stay stale.
    rows = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    r = ring.process_linear_index()
    stale = torch.full((5, 3), -1.0)
    stale[1:3] = rows[2 * r:2 * r + 2]
    want_1d = torch.stack([rows[g] if 0 <= g < 8 else torch.full((3,), -1.0)
                           for g in range(2 * r - 1, 2 * r + 4)])
    fresh = shard.update_halo(stale, ring, [[0]], [1, 2])
    out["halo_1d_ok"] = fresh.shape == (5, 3) and torch.equal(fresh, want_1d)
    halo = Sharding([[0]], halo_sizes=[1, 2])
    cut = shard.shard(rows, halo, ring)  # shard() fills the same halo rows where they exist
    inside = [a for a in range(5) if 0 <= 2 * r - 1 + a < 8]
    out["halo_shard_ok"] = cut.shape == (5, 3) and torch.equal(cut[inside], want_1d[inside])
    # 2-D halos on the 2x2 grid (3x3 cores of a 6x6 tensor), corners included.
    square = torch.arange(36, dtype=torch.float32).reshape(6, 6)
    i, j = grid.process_multi_index()
    local = torch.full((5, 5), -1.0)
    local[1:4, 1:4] = square[3 * i:3 * i + 3, 3 * j:3 * j + 3]
    want_2d = torch.full((5, 5), -1.0)
    for a in range(5):
        for b in range(5):
            gr, gc = 3 * i - 1 + a, 3 * j - 1 + b
            if 0 <= gr < 6 and 0 <= gc < 6:
                want_2d[a, b] = square[gr, gc]
    got = shard.update_halo(local, grid, [[0], [1]], [1, 1, 1, 1])
    out["halo_2d_ok"] = got.shape == (5, 5) and torch.equal(got, want_2d)
    return out


@pytest.fixture(scope="module")
def results_2x2(tmp_path_factory) -> list[dict[str, Any]]:
    from .harness import run_ranks

    return run_ranks(_examples_2x2, 4, tmp_path=tmp_path_factory.mktemp("shard2x2"),
                     timeout=120, gloo_timeout=60)


def _rows(t: torch.Tensor) -> list:
    return t.tolist()


def test_grid_indices_on_processes(results_2x2):
    assert [r["index"] for r in results_2x2] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["linear"] for r in results_2x2] == [0, 1, 2, 3]


def test_all_gather_and_all_slice_example(results_2x2):
    for r in results_2x2:
        i, j = r["index"]
        assert r["all_gather"] == _rows(FULL[2 * i:2 * i + 2])
        assert r["all_slice"] == _rows(_block(i, j))
        # Over both axes the group is (0,0), (0,1), (1,0), (1,1) in row-major order.
        assert r["all_gather_all_axes"] == _rows(torch.cat(
            [_block(0, 0), _block(0, 1), _block(1, 0), _block(1, 1)]))


def test_broadcast_example(results_2x2):
    assert [r["broadcast"] for r in results_2x2] == [[1, 2], [3, 4], [1, 2], [3, 4]]


def test_gather_example(results_2x2):
    for r in results_2x2:
        i, j = r["index"]
        want = FULL[2 * i:2 * i + 2] if j == 1 else torch.zeros(2, 4, dtype=torch.int8)
        assert r["gather"] == _rows(want)


def test_reduce_scatter_example(results_2x2):
    assert [r["reduce_scatter"] for r in results_2x2] == [
        [[5.0, 6.0]], [[7.0, 8.0]], [[13.0, 14.0]], [[15.0, 16.0]]]


def test_scatter_example(results_2x2):
    assert [r["scatter"] for r in results_2x2] == [
        [[1, 2]], [[5, 6]], [[3, 4]], [[7, 8]]]


def test_all_reduce_and_reduce(results_2x2):
    blocks = {(i, j): _block(i, j).double() for i in range(2) for j in range(2)}
    biggest = torch.stack(list(blocks.values())).amax(0)
    for r in results_2x2:
        i, j = r["index"]
        assert r["all_reduce_max_f64"] == _rows(biggest)
        assert r["all_reduce_sum_axis0"] == _rows(blocks[0, j] + blocks[1, j])
        assert r["all_reduce_min"] == _rows(torch.stack(list(blocks.values())).amin(0))
        assert r["all_reduce_product_axis1"] == _rows(blocks[i, 0] * blocks[i, 1])
        assert r["all_reduce_average"] == _rows(sum(blocks.values()) / 4)
        want = biggest if (i, j) == (0, 1) else torch.zeros(2, 2)
        assert r["reduce_max"] == _rows(want)
        avg = (blocks[0, j] + blocks[1, j]) / 2 if i == 1 else torch.zeros(2, 2)
        assert r["reduce_average"] == _rows(avg)


def test_all_to_all_examples(results_2x2):
    assert [r["all_to_all_3"] for r in results_2x2[:3]] == [
        [[11, 12], [21, 22], [31, 32]],
        [[13, 14], [23, 24], [33, 34]],
        [[15, 16], [25, 26], [35, 36]],
    ]
    assert "all_to_all_3" not in results_2x2[3]
    for r in results_2x2:
        i, j = r["index"]
        mine = [_block(i, k)[j:j + 1] for k in range(2)]
        assert r["all_to_all_2x2"] == _rows(torch.cat(mine, dim=1))


def test_shift_and_send_recv(results_2x2):
    for r in results_2x2:
        i, j = r["index"]
        assert r["shift_rotate"] == _rows(_block(i, 1 - j))
        want = _block(0, j) if i == 1 else torch.zeros(2, 2, dtype=torch.int8)
        assert r["shift_no_rotate"] == _rows(want)
        assert r["send_recv"] == _rows(_block(i, 0))


def test_shard_unshard_and_update_halo_on_processes(results_2x2):
    assert [r["offsets_shape"] for r in results_2x2] == [(4, 2), (4, 3), (4, 4), (4, 5)]
    for r in results_2x2:
        assert r["offsets_unshard_ok"] and r["2d_unshard_ok"]
        assert r["halo_1d_ok"] and r["halo_shard_ok"] and r["halo_2d_ok"]


def test_ops_are_counted_and_all_slice_does_not_communicate(results_2x2):
    assert all(r["counts"] == {"all_gather": 1} for r in results_2x2)
