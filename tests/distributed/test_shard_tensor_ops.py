"""Sharded matmul / sum / mean: results against the full computation, and the
communication pattern of each strategy counted with torch's CommDebugMode."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from torchtp.shard import (
    Grid,
    MatmulStrategy,
    Sharding,
    choose_matmul_strategy,
    distribute,
    matmul,
    sharded_mean,
    sharded_sum,
)

ROWS, INNER, REPL = Sharding([[0]]), Sharding([[], [0]]), Sharding([[]])


def _comms(fn: Any) -> tuple[Any, dict[str, int]]:
    with CommDebugMode() as mode:
        out = fn()
    counts = {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
    return out, counts


def _case(grid: Grid, a_full: torch.Tensor, b_full: torch.Tensor, sa: Sharding,
          sb: Sharding) -> dict[str, Any]:
    a, b = distribute(a_full, sa, grid), distribute(b_full, sb, grid)
    strategy = choose_matmul_strategy(a, b)
    c, counts = _comms(lambda: matmul(a, b))
    full, gather_counts = _comms(c.full_tensor)
    return {"strategy": strategy.value, "counts": counts, "placements": str(c.placements),
            "local_shape": tuple(c.to_local().shape), "gather_counts": gather_counts,
            "ok": torch.allclose(full, a_full @ b_full, atol=1e-4)}


def _grad_errors(grid: Grid, sa: Sharding, sb: Sharding) -> dict[str, float]:
    """Largest relative error of A's and B's gradients of ``sum(W * (A @ B))`` against one
    process, in float64 (exact up to summation order). 6 columns over 4 ranks: uneven."""
    gen = torch.Generator().manual_seed(1)
    a_full, b_full, w = (torch.randn(*shape, generator=gen, dtype=torch.float64)
                         for shape in ((12, 8), (8, 6), (12, 6)))
    a_ref, b_ref = a_full.clone().requires_grad_(), b_full.clone().requires_grad_()
    ((a_ref @ b_ref) * w).sum().backward()
    a = distribute(a_full, sa, grid).detach().requires_grad_()
    b = distribute(b_full, sb, grid).detach().requires_grad_()
    (matmul(a, b).full_tensor() * w).sum().backward()
    assert a.grad is not None and b.grad is not None and a_ref.grad is not None
    assert b_ref.grad is not None
    return {name: ((got.full_tensor() - want).abs().max() / want.abs().max()).item()
            for name, got, want in (("A", a.grad, a_ref.grad), ("B", b.grad, b_ref.grad))}


def _ops(rank: int, world_size: int) -> dict[str, Any]:
    grid = Grid((4,))
    gen = torch.Generator().manual_seed(0)  # same full tensors on every rank
    a_full = torch.randn(128, 64, generator=gen)
    b_full = torch.randn(64, 32, generator=gen)
    out = {
        "row": _case(grid, a_full, b_full, ROWS, REPL),
        "inner": _case(grid, a_full, b_full, INNER, ROWS),
        "both_rows": _case(grid, a_full, b_full, ROWS, ROWS),
        "column": _case(grid, a_full, b_full, REPL, INNER),
        "replicated": _case(grid, a_full, b_full, REPL, REPL),
        "fallback": _case(grid, a_full, b_full, INNER, REPL),
        # Uneven: 10 rows over 4 ranks (3, 3, 3, 1), inner dim 6 (2, 2, 2, 0).
        "uneven_row": _case(grid, a_full[:10, :6], b_full[:6], ROWS, REPL),
        "uneven_inner": _case(grid, a_full[:10, :6], b_full[:6], INNER, ROWS),
    }
    a = distribute(a_full, ROWS, grid)
    total, out["sum_counts"] = _comms(lambda: sharded_sum(a))
    out["sum_ok"] = torch.allclose(total.to_local(), a_full.sum(), atol=1e-3)
    uneven = distribute(torch.arange(30.0).reshape(10, 3), ROWS, grid)
    mean, out["mean_counts"] = _comms(lambda: sharded_mean(uneven))
    out["uneven_local_rows"] = uneven.to_local().shape[0]
    out["mean"] = mean.to_local().item()
    col_sum, out["col_sum_counts"] = _comms(lambda: sharded_sum(uneven, dim=1))
    out["col_sum_placement"] = str(col_sum.placements)
    out["col_sum_ok"] = torch.equal(col_sum.full_tensor(), torch.arange(30.0).reshape(10, 3).sum(1))
    row_mean = sharded_mean(uneven, dim=0)
    out["row_mean_ok"] = torch.allclose(row_mean.to_local(),
                                        torch.arange(30.0).reshape(10, 3).mean(0))
    ints = distribute(torch.arange(10).reshape(5, 2), ROWS, grid)
    out["int_mean"] = sharded_mean(ints).to_local().item()
    partial = matmul(distribute(a_full, INNER, grid), distribute(b_full, ROWS, grid),
                     reduce=False)
    out["unreduced_is_partial"] = isinstance(partial.placements[0], Partial)
    # A replicated operand's gradient: each rank holds a partial sum of it
    out["grads"] = {name: _grad_errors(grid, sa, sb) for name, sa, sb in (
        ("row", ROWS, REPL), ("inner", INNER, ROWS), ("both_rows", ROWS, ROWS),
        ("column", REPL, INNER), ("replicated", REPL, REPL), ("fallback", INNER, REPL))}
    return out


def test_matmul_strategies_and_reductions(ranks):
    results = ranks(_ops, 4, timeout=120, gloo_timeout=60)
    for r in results:
        for name in ("row", "inner", "both_rows", "column", "replicated", "fallback",
                     "uneven_row", "uneven_inner"):
            assert r[name]["ok"], name
        # Strategy 1: row-sharded A, replicated B: no communication, rows stay sharded.
        assert r["row"]["strategy"] == MatmulStrategy.ROW_SHARDED.value
        assert r["row"]["counts"] == {}
        assert r["row"]["placements"] == str((Shard(0),))
        assert r["row"]["local_shape"] == (32, 32)
        # ... until the result is gathered: one all-gather.
        assert r["row"]["gather_counts"] == {"all_gather_into_tensor": 1}
        # Strategy 3: both sharded on the inner dim: local matmul + one all-reduce.
        assert r["inner"]["strategy"] == MatmulStrategy.INNER_SHARDED.value
        assert r["inner"]["counts"] == {"all_reduce": 1}
        assert r["inner"]["placements"] == str((Replicate(),))
        # Both sharded on axis 0: all-gather B, then a row-sharded matmul.
        assert r["both_rows"]["strategy"] == MatmulStrategy.GATHER_B.value
        assert r["both_rows"]["counts"] == {"all_gather_into_tensor": 1}
        assert r["both_rows"]["placements"] == str((Shard(0),))
        assert r["column"]["counts"] == {} and r["column"]["placements"] == str((Shard(1),))
        assert r["replicated"]["counts"] == {}
        assert r["fallback"]["strategy"] == MatmulStrategy.DTENSOR.value
        assert r["uneven_inner"]["counts"] == {"all_reduce": 1}
        # Strategy 2: distributed sum / mean: one all-reduce each.
        assert r["sum_ok"] and r["sum_counts"] == {"all_reduce": 1}
        assert r["mean_counts"] == {"all_reduce": 1}
        assert r["mean"] == torch.arange(30.0).mean().item()  # exact despite 3/3/3/1 rows
        assert r["col_sum_counts"] == {} and r["col_sum_placement"] == str((Shard(0),))
        assert r["col_sum_ok"] and r["row_mean_ok"]
        assert r["int_mean"] == 4.5
        assert r["unreduced_is_partial"]
        for name, errors in r["grads"].items():  # float64: only summation order differs
            assert max(errors.values()) < 1e-12, (name, errors)
    assert [r["uneven_local_rows"] for r in results] == [3, 3, 3, 1]
