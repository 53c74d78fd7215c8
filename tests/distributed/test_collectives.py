"""Differentiable collectives and region operators on real Gloo processes."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchtp
from torchtp.comm import health, ops, regions

from ._reference import chunk, seeded


def _check_collectives(rank: int, world_size: int) -> None:
    base = seeded(4, 6 * world_size, seed=1)
    # Non-contiguous on purpose: a transposed view must not lose the result.
    mine = (base * (rank + 1)).t().contiguous().t().requires_grad_()
    before = mine.detach().clone()

    total = torchtp.all_reduce_sum(mine)
    expected = base * sum(range(1, world_size + 1))
    torch.testing.assert_close(total, expected)
    torch.testing.assert_close(mine.detach(), before, msg="all_reduce_sum changed its input")
    (total * 2).sum().backward()
    # backward is the identity: each rank already holds the full gradient.
    torch.testing.assert_close(mine.grad, torch.full_like(base, 2.0))

    for dim in (0, 1, -1):
        shard = chunk(base, dim, rank, world_size).t().contiguous().t().requires_grad_()
        full = torchtp.all_gather(shard, dim=dim)
        torch.testing.assert_close(full, base)
        weight = seeded(*base.shape, seed=7)
        (full * weight).sum().backward()
        torch.testing.assert_close(shard.grad, chunk(weight, dim, rank, world_size))

        partial = (base * (rank + 1)).requires_grad_()
        out = torchtp.reduce_scatter(partial, dim=dim)
        torch.testing.assert_close(out, chunk(expected, dim, rank, world_size))
        out_weight = chunk(weight, dim, rank, world_size)
        (out * out_weight).sum().backward()
        # every partial fed every chunk: its gradient is the gathered chunk grads.
        torch.testing.assert_close(partial.grad, weight)

    src = world_size - 1
    value = (base + rank).requires_grad_()
    got = torchtp.broadcast_tensor(value, src=src)
    torch.testing.assert_close(got, base + src)
    got.sum().backward()
    want = torch.ones_like(base) if rank == src else torch.zeros_like(base)
    torch.testing.assert_close(value.grad, want)
    # A broadcast's source (and a rank it already served) may finish it while another
    # rank still reads the broadcast's shape agreement; the agreement of the next new
    # shape must not delete what that rank has to read. Each shape here is new.
    for k in range(1, 21):
        got = torchtp.broadcast_tensor(seeded(k, 3, seed=k) * rank, src=src)
        torch.testing.assert_close(got, seeded(k, 3, seed=k) * src)
        ops.all_reduce(seeded(k, 5, seed=k), None)
    _check_rides(rank, world_size)
    torchtp.synchronize_across_ranks()


def _check_rides(rank: int, world_size: int) -> None:
    """Hash bits riding an all-reduce (the input check's and the experts' route check's):
    the model's sum is the same on every rank and every ride's sums are right, on both
    paths: Gloo's list of tensors, and the one buffer other backends and CUDA get."""
    st = health.state(None)
    assert st.cpu_gloo  # these processes run Gloo
    for cpu_gloo in (True, False):
        st.cpu_gloo = cpu_gloo  # which path the next riding all-reduce takes
        for dtype in (torch.float32, torch.bfloat16):
            # A sum whose float rounding depends on the values: bit-exact or not at all.
            x = (seeded(3, 5, seed=rank) * 1e3 ** rank).to(dtype)
            want = ops.all_reduce(x, None)
            same = ops.ride_hash(None, b"every rank hashes this", x.device)
            mine = ops.ride_hash(None, f"rank {rank}".encode(), x.device)
            got = ops.all_reduce_(x.clone(), None)  # the next float sum all-reduce: both ride
            # Replicated: bit-identical on every rank. Against the plain all-reduce: over
            # 2 ranks a sum of two numbers, bit-exact; over more, the backend may add in
            # another order once the values travel along (one rounding per addition).
            everyone = [torch.empty_like(got) for _ in range(world_size)]
            dist.all_gather(everyone, got)
            assert all(torch.equal(g, got) for g in everyone), (cpu_gloo, dtype)
            if world_size == 2:
                assert torch.equal(got, want), (cpu_gloo, dtype)
            torch.testing.assert_close(got, want)
            digest = hashlib.blake2b(b"every rank hashes this", digest_size=8).digest()
            bits = np.unpackbits(np.frombuffer(digest, dtype=np.uint8)).tolist()
            assert ops.ride_result(None, same) == [float(world_size * b) for b in bits]
            assert ops.ride_agrees(None, same, world_size)
            assert not ops.ride_agrees(None, mine, world_size)
    st.cpu_gloo = True
    _check_gather_rides(rank, world_size)


def _check_gather_rides(rank: int, world_size: int) -> None:
    """Hash bits riding an all-gather (a forward whose first collective gathers): the
    gathered tensor is the plain one, bit for bit, along any dim and for uneven shares;
    the sums are right; ranks whose rides differ raise instead of mixing them."""
    for dtype, dim, size in ((torch.float32, 0, None), (torch.bfloat16, -1, None),
                             (torch.float32, 1, 3 * world_size - 1)):
        width = 3 if size is None else (3 if rank < world_size - 1 else 2)
        x = seeded(2, width, 4, seed=rank).to(dtype).movedim(1, dim % 3)
        want = ops.all_gather(x, dim, None, size)
        same = ops.ride_hash(None, b"every rank hashes this", x.device)
        got = ops.all_gather(x, dim, None, size)  # the next all-gather carries it
        assert torch.equal(got, want), (dtype, dim)
        assert same.sums is not None and ops.ride_agrees(None, same, world_size)
    if rank == 0:  # a ride on this rank only: the ranks' collectives would not line up
        ops.ride_hash(None, b"rank 0 only", x.device)
    with pytest.raises(torchtp.RankMismatchError, match=r"\+64 check values"):
        ops.all_gather(x, 0, None)
    health.state(None).rides.clear()


def _check_regions(rank: int, world_size: int) -> None:
    group = torchtp.get_tensor_parallel_config().group
    x = seeded(3, 4 * world_size, seed=2).requires_grad_()
    y = regions.copy_to_tensor_parallel_region(x, group)
    torch.testing.assert_close(y, x)
    (y * (rank + 1)).sum().backward()  # partial grads differ per rank
    torch.testing.assert_close(x.grad, torch.full_like(x, sum(range(1, world_size + 1))))

    x = seeded(3, 4 * world_size, seed=3).requires_grad_()
    s = regions.scatter_to_tensor_parallel_region(x, group, -1)
    torch.testing.assert_close(s, chunk(x.detach(), -1, rank, world_size))
    s.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))

    x = seeded(3, 4, seed=4 + rank).requires_grad_()
    g = regions.gather_from_tensor_parallel_region(x, group, -1)
    assert g.shape == (3, 4 * world_size)
    w = seeded(3, 4 * world_size, seed=9)
    (g * w).sum().backward()
    torch.testing.assert_close(x.grad, chunk(w, -1, rank, world_size))

    x = seeded(3, 4, seed=5).requires_grad_()
    r = regions.reduce_from_tensor_parallel_region(x * 1.0, group, inplace=True)
    torch.testing.assert_close(r, x.detach() * world_size)
    r.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))

    # Double backward (a gradient penalty): the regions' backward collectives are not
    # differentiable, so a second-order gradient would miss the sums over ranks. It raises.
    torch.manual_seed(0)
    row = torchtp.RowParallelLinear.from_linear(nn.Linear(4, 4 * world_size), world_size, rank,
                                                group=group)
    col = torchtp.ColumnParallelLinear.from_linear(nn.Linear(4 * world_size, 4), world_size,
                                                   rank, group=group)
    x = seeded(3, 4, seed=6).requires_grad_()
    gx, = torch.autograd.grad(col(torch.tanh(row(x))).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gx.pow(2).sum().backward()


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_values_and_gradients(ranks, world_size):
    ranks(_check_collectives, world_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_region_operators(ranks, world_size):
    ranks(_check_regions, world_size)


def _count_and_log(rank: int, world_size: int) -> tuple[dict[str, int], list[str]]:
    import logging

    records: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    torchtp.logger.addHandler(Grab())
    with torchtp.count_collectives() as counter:
        torchtp.all_reduce_sum(torch.ones(2, 3))
        torchtp.all_gather(torch.ones(2, 3), dim=0)
    counts = dict(counter.counts)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    torchtp.DistributedModelWrapper(model)  # layer swaps are logged too
    return counts, records


def test_tp_debug_logs_every_collective_and_counter_counts(ranks):
    results = ranks(_count_and_log, 2, env={"TP_DEBUG": "1"})
    for counts, logs in results:
        assert counts == {"all_reduce": 1, "all_gather": 1}
        assert any("all_reduce shape=(2, 3) dtype=torch.float32 group_size=2" in m for m in logs)
        assert any(m.startswith("all_gather shape=(2, 3)") for m in logs)
        assert any(m.startswith("swapped 0: Linear -> RowParallelLinear(") for m in logs)
        assert any(m.startswith("swapped 2: Linear -> ColumnParallelLinear(") for m in logs)


def test_single_process_collectives_are_identity():
    x = torch.randn(2, 3)
    assert torchtp.all_reduce_sum(x) is x
    assert torchtp.all_gather(x) is x
    assert torchtp.reduce_scatter(x) is x
    assert torchtp.broadcast_tensor(x) is x
    torchtp.synchronize_across_ranks()


def test_missing_process_group_is_an_error_not_a_no_op(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(torchtp.MissingProcessGroupError,
                       match=r"WORLD_SIZE=2 but torch.distributed is not initialized.*torchrun"):
        torchtp.all_reduce_sum(torch.ones(2))


def _bad_src(rank: int, world_size: int) -> str:
    with pytest.raises(ValueError, match=r"src=5 is not a rank of the group \(group size 2\)"):
        torchtp.broadcast_tensor(torch.ones(2), src=5)
    with pytest.raises(ValueError, match=r"dim -1 has size 3, not divisible by the group size 2"):
        torchtp.reduce_scatter(torch.ones(2, 3))
    # Both checks ran before any collective: the ranks are still in step.
    # A barrier on one rank only meets the other's next collective: every rank raises at once
    start = time.monotonic()
    with pytest.raises(torchtp.RankMismatchError, match=r"all_reduce:barrier"):
        if rank == 0:
            torchtp.synchronize_across_ranks()
        else:
            torchtp.all_reduce_sum(torch.ones(3))
    assert time.monotonic() - start < 10.0  # not the collective timeout
    return str(torchtp.all_reduce_sum(torch.ones(1)).item())


def test_bad_arguments_raise_before_communicating(ranks):
    assert ranks(_bad_src, 2) == ["2.0", "2.0"]


def _mismatched_shapes(rank: int, world_size: int) -> str:
    # Same element count, different shapes: Gloo alone would accept this silently.
    shape = (2, 3) if rank == 0 else (3, 2)
    with pytest.raises(torchtp.RankMismatchError,
                       match=r"ranks passed different tensors to all_reduce: rank 0: "
                             r"\('all_reduce', \(2, 3\), 'torch.float32'\), rank 1: "
                             r"\('all_reduce', \(3, 2\), 'torch.float32'\)"):
        torchtp.all_reduce_sum(torch.ones(shape))
    return "raised"


def test_tp_check_shapes_catches_mismatched_collectives_on_every_rank(ranks):
    assert ranks(_mismatched_shapes, 2, env={"TP_CHECK_SHAPES": "1"}) == ["raised", "raised"]


def _alternating_forwards(rank: int, world_size: int) -> int:
    st = health.state(dist.group.WORLD)
    prefill, decode = (1, 16, 4), (1, 1, 4)

    def forward(shape: tuple[int, ...]) -> None:  # a 4-layer model: 8 all-reduces of one shape
        for _ in range(8):
            torchtp.all_reduce_sum(torch.ones(shape))

    for i in range(6):  # each context's signature is agreed once
        forward(prefill if i % 2 else decode)
    before = st.agreements
    for i in range(20):
        forward(prefill if i % 2 else decode)
    steady = st.agreements - before
    # Both shapes are remembered, yet a rank that runs a prefill where the others
    # decode is still caught: each context remembers one signature.
    with pytest.raises(torchtp.RankMismatchError,
                       match=r"rank 0: \('all_reduce', \(1, 16, 4\), 'torch.float32'\), "
                             r"rank 1: \('all_reduce', \(1, 1, 4\), 'torch.float32'\)"):
        torchtp.all_reduce_sum(torch.ones(prefill if rank == 0 else decode))
    return steady


def test_forwards_alternating_shapes_agree_once_and_still_catch_a_mismatch(ranks):
    # Keyed by the last 3 collectives alone, "3 prefill all-reduces before" meets the
    # prefill's 4th all-reduce and the decode's 1st: two store round trips per pair.
    assert ranks(_alternating_forwards, 2) == [0, 0]
