"""Whole experts per rank with all-to-all dispatch: each rank routes a slice of the tokens.

Every TP rank holds every token (the attention's output is replicated) and
``E/tp`` whole experts. The all-reduce path runs each rank's experts on every
token routed to them and sums the ranks' outputs with one all-reduce of
``(N, H)``. This path moves only the routed rows instead::

    x (N, H), weights (N, k)  replicated
      -- scatter (one node: x and weights side by side) --> (n, H), (n, k)   n ~ N / tp
    every (token, slot) pair's expert -> its rank; this rank's pairs sorted by rank
      -- all-gather of a 64-bit route hash: ranks that routed differently raise here
    rows (n*k, H) -- all-to-all --> (M, H): the rows for this rank's experts
    each row through its expert (weight 1) --> (M, H)
      -- all-to-all back --> (n*k, H) -- unsort, x weights, sum over k --> (n, H)
      -- all-gather --> (N, H) replicated

Bytes per rank: ``2 n k H (tp-1)/tp`` for the two all-to-alls plus
``N H (tp-1)/tp`` for the all-gather, against the all-reduce's ``2 N H
(tp-1)/tp``: fewer once ``tp > 2k``, at the price of four collectives'
latency instead of one. :func:`torchtp.costmodel.expert_dispatch_times`
estimates both; ``dispatch="auto"`` picks per call from the shapes alone, so
every rank picks the same path.

Every count is computed locally: all ranks hold every route, so each knows
what every rank sends where. The route hash is what makes that safe: with
routes that differ across ranks the counts would not match and the
all-to-all would fail or mix rows, so the hash is compared before it, always
(unlike the all-reduce path's check, ``TP_CHECK_INPUTS=0`` does not turn it off).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Literal

import torch

from ..comm import ops as _comm
from ..comm.regions import gather_from_tensor_parallel_region, scatter_to_tensor_parallel_region
from ..comm.runtime import ProcessGroup
from ..core import torch_compat as _torch_compat
from ..core.errors import RankMismatchError
from ..core.layouts import shard_range, shard_sizes
from .all_to_all import all_to_all_rows

Dispatch = Literal["auto", "all_reduce", "all_to_all"]
"""How tokens reach whole experts: the all-reduce, the all-to-all, or chosen per call."""
DISPATCH: tuple[Dispatch, ...] = ("auto", "all_reduce", "all_to_all")


# Eager even inside torch.compile: the counts are data (read on the host), and traced
# through dynamo with its all-to-alls this path gave wrong gradients upstream of the
# layer (aot_eager, torch 2.13) while its outputs were right; test_moe_compositions.
@_torch_compat.eager_when_compiled
def dispatch_combine(module: Any, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                     run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                     ) -> torch.Tensor:
    """The experts module's output ``(N, H)`` computed through all-to-all dispatch.

    Args:
        module: The :class:`~torchtp.ep.experts.ParallelExperts` (group, rank,
            ``expert_starts``, name).
        x: Token states ``(N, H)``, replicated; the experts run in their dtype.
        index: Every token's ``k`` global expert ids ``(N, k)``, replicated.
        weights: Their routing weights ``(N, k)``, replicated, in the dtype the
            weighted outputs are summed in (``x``'s promoted with the router's,
            as transformers' experts kernels do); the output is cast back to
            ``x``'s dtype, as theirs is.
        run: ``run(rows (M, H), local ids (M, 1), ones (M, 1))``: each row through
            one of this rank's experts.
    """
    group: ProcessGroup = module.tp_group
    size, rank = module.tp_world_size, module.tp_rank
    tokens, k = index.shape
    hidden = x.shape[1]
    _check_routes(module, index, group)
    # (N, H + k): one region node, so one all-gather of both gradients in backward (x's
    # values round-trip exactly through the wider dtype).
    both = scatter_to_tensor_parallel_region(torch.cat([x.to(weights.dtype), weights], 1),
                                             group, dim=0)
    mine, w = both[:, :hidden].to(x.dtype), both[:, hidden:]  # (n, H), (n, k)
    pairs, owner, send, recv = _counts(module, index, rank, size)
    order = torch.argsort(owner[pairs], stable=True)  # (n*k,): this rank's pairs by owner
    rows = mine.index_select(0, order // k)  # (n*k, H), grouped by destination rank
    got = all_to_all_rows(rows, send, recv, group)  # (M, H)
    first = module.expert_starts[rank]
    local = index.reshape(-1)[owner == rank] - first  # (M,): source ranks in order
    ones = w.new_ones((got.shape[0], 1))
    out = run(got, local.unsqueeze(1), ones) if got.shape[0] else got * 0  # (M, H)
    out = out + module._touched(got)  # every expert in the graph: zero grads when starved
    back = all_to_all_rows(out, recv, send, group)  # (n*k, H), in `order`
    unsorted = torch.empty_like(back).index_copy_(0, order, back)  # (n*k, H), pair order
    y = (unsorted.view(-1, k, hidden) * w.unsqueeze(-1)).sum(1).to(x.dtype)  # (n, H)
    return gather_from_tensor_parallel_region(y, group, dim=0, size=tokens)  # (N, H)


def _counts(module: Any, index: torch.Tensor, rank: int, size: int
            ) -> tuple[slice, torch.Tensor, list[int], list[int]]:
    """This rank's pairs, every pair's owner rank, and the rows sent to / received from
    each rank (computed locally from the replicated routes: every rank knows them all)."""
    tokens, k = index.shape
    bounds = torch.tensor(module.expert_starts[1:-1], dtype=index.dtype, device=index.device)
    owner = torch.bucketize(index.reshape(-1), bounds, right=True)  # (N*k,) rank per pair
    slices = torch.tensor(shard_sizes(tokens, size), device=index.device)  # as scattered
    source = torch.repeat_interleave(torch.arange(size, device=index.device), slices) \
        .repeat_interleave(k)  # (N*k,) the rank whose slice holds each pair
    table = torch.bincount(source * size + owner, minlength=size * size).view(size, size)
    start, n = shard_range(tokens, size, rank)
    return slice(start * k, (start + n) * k), owner, table[rank].tolist(), \
        table[:, rank].tolist()


def _check_routes(module: Any, index: torch.Tensor, group: ProcessGroup) -> None:
    """Raise on every rank if the ranks' routes differ (every rank reads every hash)."""
    data = index.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    digest = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)
    hashes = _comm.all_gather(torch.tensor([digest], device=index.device), 0, group)
    if bool((hashes == hashes[0]).all()):
        return
    raise RankMismatchError(
        f"'{module.tp_name}' ({type(module).__name__}): the tensor-parallel ranks routed "
        f"tokens to different experts (world_size={module.tp_world_size}), so their "
        "all-to-all dispatch cannot agree on what to send; every rank computes the routes "
        "from its own copy of the router and of the token states, so one of them differs "
        "across ranks (a replicated weight changed on one rank, non-deterministic kernels, "
        "different inputs); compare the router's weights across the ranks")
