"""Tensor parallelism inside a mixture of experts: every expert's intermediate features split.

An HF experts module keeps all of a layer's experts in 3-D parameters
(transformers >= 5): ``gate_up_proj`` ``(E, 2I, H)`` and ``down_proj``
``(E, H, I)`` (``(E, H, 2I)`` and ``(E, I, H)`` when ``is_transposed``).
Split exactly like a dense MLP, each rank keeps, for every expert, its share
of the ``I`` intermediate features: the matching rows of the gate and of the
up half of ``gate_up_proj`` (weight rows, like ``colwise``) and the matching
columns of ``down_proj`` (weight columns, like ``rowwise``). The module's own
forward (any of transformers' experts implementations) then computes this
rank's partial sum of every token's expert output, and **one** all-reduce per
MoE layer (not one per expert) completes it.

Expert parallelism over the same ranks (HF's ``"all_reduce"`` EP
implementation) is the other cut of the same module: each rank keeps whole
experts (dim 0), every rank sees every token (the attention output is
replicated), routes to other ranks' experts are masked, and the same one
all-reduce sums the outputs.

The parameters keep their names and stay 3-D (no conversion to
``nn.Linear``): the module keeps its class's forward, and its class becomes
a subclass of it that adds the region operators around that forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

from ..comm import ops as _comm
from ..comm.group_ref import WeakGroup
from ..comm.regions import (
    copy_pair_to_tensor_parallel_region,
    copy_to_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
)
from ..comm.runtime import ProcessGroup
from ..core import log as _log
from ..core.errors import RankMismatchError
from ..core.layouts import ParamLayout, shard_offsets
from ..costmodel import expert_dispatch_times, get_hardware
from ..layers.owned import ShardedModule, with_mixin
from .dispatch import Dispatch, dispatch_combine


class ParallelExperts(ShardedModule):
    """Mixin added to an HF experts module holding this rank's share of every expert.

    ``forward(hidden_states (N, H), top_k_index (N, k), top_k_weights (N, k))``:
    the token states and routing weights enter the tensor-parallel region
    (forward: identity; backward: all-reduce of their partial gradients, so
    the router's gradient is the unsharded one on every rank), the class's
    own forward computes this rank's partial output ``(N, H)``, and one
    all-reduce sums it (backward: identity).

    Every rank must route every token alike: a hash of the routes rides the
    output's all-reduce and a difference raises :class:`RankMismatchError` on
    every rank.

    Whole experts per rank with ``dispatch`` ``"all_to_all"`` (or ``"auto"``
    choosing it for the call) take :func:`~torchtp.ep.dispatch.dispatch_combine`
    instead: each rank routes a slice of the tokens to the experts' ranks.

    Attributes:
        tp_group: The tensor-parallel group (its all-reduce sums every rank's part).
        tp_world_size: Its size (the features are split over ``tp_world_size / ep``
            of them, and the experts over ``ep``).
        tp_rank: This rank.
    """

    tp_group: WeakGroup[ProcessGroup | None] = WeakGroup()  # held weakly (comm.group_ref)
    tp_world_size: int
    tp_rank: int
    tp_name: str = "experts"  # the module's name in the model, for errors
    expert_range: tuple[int, int] | None = None  # expert parallel: (first, count) held here
    expert_starts: tuple[int, ...] = ()  # whole experts: every rank's first expert, then E
    dispatch: Dispatch = "all_reduce"  # whole experts: "all_reduce", "all_to_all" or "auto"
    routed: bool = True  # forward(x, top_k_index, top_k_weights); else forward(x) (Llama 4)
    # Expert parallel: picks, per call, a function to run instead of the class's forward.
    expert_forward: Callable[[nn.Module, torch.dtype], Callable[..., torch.Tensor] | None] | None \
        = None
    # Experts with biases, features split: whether this rank adds down_proj_bias (None: no
    # bias to add once; whole experts add their own)
    bias_first: bool | None = None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None, *args: Any,
                **kwargs: Any) -> torch.Tensor:
        if not self.routed:  # Llama 4: (E * N, H), every expert's rows routed and scaled
            x = copy_to_tensor_parallel_region(hidden_states, self.tp_group)
            # (E * N, H), this rank's partial sum
            partial = super().forward(x, *args, **kwargs)  # type: ignore[misc]
            return reduce_from_tensor_parallel_region(partial, self.tp_group)
        assert top_k_index is not None and top_k_weights is not None
        # Routers return float32 weights; the expert outputs are multiplied by them in
        # the promoted dtype anyway, so promoting first is exact, and the weights'
        # gradient is then summed over the ranks in that dtype and rounded once, as the
        # unsharded model rounds it.
        dtype = torch.promote_types(hidden_states.dtype, top_k_weights.dtype)
        top_k_weights = top_k_weights.to(dtype)

        def run(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            pick = self.expert_forward
            fn = None if pick is None else pick(self, x.dtype)  # type: ignore[arg-type]
            with self._down_bias_once():
                if fn is not None:
                    return fn(self, x, index, weights, *args, **kwargs)
                return super(ParallelExperts, self).forward(  # type: ignore[misc]
                    x, index, weights, *args, **kwargs)

        if self._all_to_all(hidden_states, top_k_index):
            return dispatch_combine(self, hidden_states, top_k_index, top_k_weights, run)
        routes = top_k_index  # (N, k) global expert ids, as the router chose them
        x, weights = copy_pair_to_tensor_parallel_region(  # (N, H), (N, k)
            hidden_states, top_k_weights, self.tp_group)
        if self.expert_range is not None:
            top_k_index, weights = self._local_routes(top_k_index, weights)
        partial = run(x, top_k_index, weights)  # (N, H), this rank's partial sum
        if self.expert_range is not None:
            partial = partial + self._touched(x)
        ride = self._ride_routes(routes)
        out = reduce_from_tensor_parallel_region(partial, self.tp_group)  # (N, H), summed
        if ride is not None:
            self._check_routes(ride)
        return out

    @contextmanager
    def _down_bias_once(self) -> Iterator[None]:
        """While the class's forward runs, ``down_proj_bias`` reads as itself on the rank
        that adds it and as zeros on the other ranks of the features' split, so the
        all-reduce of the partial outputs adds it once (:class:`_OnOneRank`).

        The zeros shadow the Parameter as an instance attribute (the forward reads
        ``self.down_proj_bias``); the Parameter itself, its name and its checkpoint
        entry stay as they are.
        """
        if self.bias_first is None or self.bias_first:
            yield
            return
        # (E, H), (E/ep, H) in blocks: the Parameter, the same on every rank sharing it
        bias = nn.Module.__getattr__(self, "down_proj_bias")  # type: ignore[arg-type]
        self.__dict__["down_proj_bias"] = _OnOneRank.apply(bias)  # (E, H) zeros
        try:
            yield
        finally:
            del self.__dict__["down_proj_bias"]

    def _all_to_all(self, x: torch.Tensor, index: torch.Tensor) -> bool:
        """Whether this call dispatches by all-to-all (same answer on every rank: shapes only)."""
        if self.dispatch == "all_reduce" or self.tp_world_size == 1:
            return False
        if self.dispatch == "all_to_all":
            return True
        hw = get_hardware("cpu-gloo" if x.device.type == "cpu" else "h100-nvlink")
        times = expert_dispatch_times(x.shape[0], x.shape[-1], index.shape[-1],
                                      self.tp_world_size, x.element_size(), hw)
        return times["all_to_all"] < times["all_reduce"]

    def _ride_routes(self, routes: torch.Tensor) -> _comm.Ride | None:
        """Put a 64-bit hash of every token's routes on the output's all-reduce.

        Every rank computes the routes itself from its replicated copy of the
        router and of the token states; ranks that disagree would each compute
        slices of other experts and sum garbage. The hash's bits (64 values 0
        or 1, exact in any float dtype) ride the all-reduce this layer runs
        anyway: no extra collective. Off under ``torch.compile`` and
        ``TP_CHECK_INPUTS=0``. Costs a hash of ``(N, k)`` integers (a copy to
        the host on GPU) per MoE layer.
        """
        if self.tp_group is None or self.tp_world_size == 1 or torch.compiler.is_compiling() \
                or not _log.CHECK_INPUTS:
            return None  # (one rank: no all-reduce would carry it)
        data = routes.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
        return _comm.ride_hash(self.tp_group, data, routes.device)

    def _check_routes(self, ride: _comm.Ride) -> None:
        """Raise on every rank if the ranks' route hashes differ (they all read the same sums)."""
        if _comm.ride_agrees(self.tp_group, ride, self.tp_world_size):
            return
        raise RankMismatchError(
            f"'{self.tp_name}' ({type(self).__name__}): the tensor-parallel ranks routed tokens to "
            f"different experts (world_size={self.tp_world_size}); every rank computes the routes "
            "from its own copy of the router and of the token states, so one of them differs "
            "across ranks (a replicated weight changed on one rank, non-deterministic kernels, "
            "different inputs); compare the router's weights across the ranks (torchtp's "
            "optimizer-step check, TP_STEP_CHECK, does at every step)")

    def _touched(self, x: torch.Tensor) -> torch.Tensor:
        """An exact zero that uses ``x`` and every parameter of this module.

        A rank whose experts receive no token on a step would otherwise leave
        them out of the graph: their gradients would be ``None`` instead of
        zeros (the optimizer would skip them there and the ranks' optimizer
        states would drift apart), and its backward would skip the all-reduce
        of the region's entry that the other ranks run. An empty slice of each is
        enough for autograd to keep them in the graph.
        """
        params = nn.Module.parameters(self, recurse=False)  # type: ignore[arg-type]
        # [:0].sum(): an empty sum, exactly 0 whatever the values (an inf would make
        # inf * 0 = NaN for every token), still a node that reaches each tensor.
        return sum((p.reshape(-1)[:0].sum() for p in params), x.reshape(-1)[:0].sum())

    def _local_routes(self, index: torch.Tensor, weights: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert parallel: routes to this rank's experts, renumbered; the others masked.

        A route to another rank's expert gets transformers' sentinel index (the
        local expert count: skipped by every experts implementation) and weight
        0. Masked after entering the region, so the backward zeroes what this
        rank did not compute before the ranks' gradients are summed.
        """
        first, count = self.expert_range  # type: ignore[misc]
        local = index - first  # (N, k)
        outside = (local < 0) | (local >= count)
        return local.masked_fill(outside, count), weights.masked_fill(outside, 0)


class _OnOneRank(torch.autograd.Function):
    """A replicated bias as the ranks that do not add it see it.

    forward: zeros of the bias's shape (``bias * 0`` would turn an inf into NaN);
    backward: the gradient unchanged, so every rank's bias gets the whole
    gradient (every rank routes every token alike, so the gradients are equal and
    equal to one process's), as :class:`~torchtp.layers.ColumnParallelLinear`'s
    bias-once add gives it. No collective.
    """

    @staticmethod
    def forward(ctx: Any, bias: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def shard_experts(module: nn.Module, layouts: dict[str, ParamLayout],
                  group: ProcessGroup | None, world_size: int, rank: int,
                  expert_range: tuple[int, int] | None = None,
                  forward: Callable[[nn.Module, torch.dtype], Callable[..., torch.Tensor] | None]
                  | None = None, name: str = "experts",
                  dispatch: Dispatch = "all_reduce", routed: bool = True,
                  bias_first: bool | None = None) -> nn.Module:
    """Cut ``module``'s expert parameters to this rank's share, in place, and return it.

    Args:
        module: An HF experts module (3-D ``gate_up_proj`` and ``down_proj``).
        layouts: This rank's layout of each split parameter (full shapes checked).
        group: The tensor-parallel group.
        world_size: Its size.
        rank: This rank.
        expert_range: Expert parallelism: ``(first, count)`` of the whole experts
            this rank keeps (``layouts`` cut dim 0 to them); ``None``: every
            expert's features are split instead.
        forward: ``forward(module, dtype)`` returns, per call, a function
            ``f(module, x, index, weights)`` to run instead of the class's forward
            (one that skips routes to other ranks' experts), or ``None``.
        name: The module's name in the model, for errors.
        dispatch: Whole experts per rank (``expert_range`` over all ranks):
            ``"all_reduce"`` (every rank runs its experts on every token routed
            to them, one all-reduce), ``"all_to_all"`` (each rank routes a slice
            of the tokens, :mod:`torchtp.ep.dispatch`) or ``"auto"``
            (per call, the one the cost model estimates cheaper).
        routed: Whether the module's forward takes routes (see :class:`ParallelExperts`).
        bias_first: Experts with biases whose features are split: whether this rank
            adds the (whole, replicated) ``down_proj_bias``, which exactly one rank of
            the ranks sharing an expert's features does; ``None`` otherwise.

    Returns:
        ``module`` itself, now an instance of ``Parallel<its class>``.
    """
    for pname, layout in layouts.items():
        full = getattr(module, pname)
        shard = layout.take(full)  # (E, 2I/tp, H) or (E, H, I/tp), a fresh copy
        setattr(module, pname, nn.Parameter(shard, requires_grad=full.requires_grad))
    module.__class__ = with_mixin(ParallelExperts, type(module), "Parallel")
    cast(ParallelExperts, module).tp_group = group  # through its WeakGroup: held weakly
    module.__dict__.update(tp_layouts=dict(layouts), tp_world_size=world_size, tp_rank=rank,
                           expert_range=expert_range, expert_forward=forward, tp_name=name,
                           dispatch=dispatch, routed=routed, bias_first=bias_first)
    if dispatch != "all_reduce":  # every rank's first expert, then E (balanced, like the cut)
        total = int(module.__dict__["num_experts"])  # before it becomes this rank's count
        module.__dict__.update(expert_starts=tuple(shard_offsets(total, world_size)))
    if expert_range is not None:  # the forward numbers this rank's experts 0..count-1
        module.__dict__.update(num_experts=expert_range[1])
    return module
