"""Styles for partial sums reduced late: one all-reduce for several row-split Linears.

A hand-written MoE calls each expert's MLP on its own tokens and sums the
weighted outputs; a parallel-residual decoder layer (Falcon, GPT-J, GPT-NeoX,
Phi-2) adds its attention's and its MLP's outputs to the residual. With
every such ``down`` (or output projection) split by weight columns
(``rowwise``), each one all-reduces its output: one collective each.
Summing is linear, so the parts may instead leave their outputs as partial
sums (``rowwise_partial``) and one all-reduce of the combined output
(``reduce_output`` on the module that returns it, or ``reduce_input`` on the
Linear that reads it) sums them all. A replicated module whose output
multiplies those partial sums before the reduction (the router's weights)
gets a partial gradient on each rank; ``partial_grad_output`` sums it in
backward. A layer that adds the partial sums to its own input (the residual)
gets ``reduce_residual``: its output minus its input is what is summed.
The automatic plan (:mod:`torchtp.plans.late_reduce`) confirms all
of this on the real model before using it; a hand-written plan that uses
these styles is the user's responsibility.

=========================  ==============================================  ===========================
style                      forward                                         backward
=========================  ==============================================  ===========================
``rowwise_partial``        weight columns (in_features) split, no reduce   nothing extra
``reduce_output``          all-reduce the module's output                  identity
``reduce_input``           all-reduce the module's first input             identity
``reduce_residual``        input + all-reduce(output - input)              identity
``partial_grad_output``    identity (module replicated)                    all-reduce the output's grad
=========================  ==============================================  ===========================
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from ..comm import ops as _comm
from ..comm.regions import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region
from ..comm.runtime import ProcessGroup, group_size
from ..core import log as _log
from ..core.errors import RankMismatchError
from ..layers import ColumnParallelLinear
from .constraints import Constraint
from .linear_view import LinearView
from .module_io import first_input, first_output, with_first_output
from .styles import LayerPlan, ParallelStyle, Rowwise, ShardContext


class RowwisePartial(Rowwise):
    """``rowwise`` whose output stays this rank's partial sum (a later style reduces it).

    Args:
        producers: The Linears that feed it (an expert's up/gate projections),
            when the automatic plan found them: ``expert_parallel=True`` places
            such an expert whole on one rank instead
            (:mod:`torchtp.ep.whole_experts`).
        columns: The split whose input columns it keeps (an attention output
            projection's whole heads, :class:`torchtp.plans.styles_heads.HeadColumns`);
            ``None``: a balanced split of ``in_features``.
    """

    collectives = ()

    def __init__(self, producers: tuple[str, ...] = (), columns: Rowwise | None = None) -> None:
        super().__init__()
        self.name = "rowwise_partial"
        self.producers = producers
        self.columns = columns

    def constraints(self, view: LinearView, fqn: str) -> list[Constraint]:
        return self.columns.constraints(view, fqn) if self.columns is not None \
            else super().constraints(view, fqn)

    def column_segments(self, view: LinearView, ctx: ShardContext) -> tuple[tuple[int, int], ...]:
        return self.columns.column_segments(view, ctx) if self.columns is not None \
            else super().column_segments(view, ctx)

    def detail(self, view: LinearView) -> str:
        return self.columns.detail(view) if self.columns is not None else super().detail(view)

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        swapped = super().apply(module, layer, ctx)
        assert isinstance(swapped, ColumnParallelLinear)
        swapped.partial_output = True
        return swapped


def _tensor_output(fqn: str, style: str, out: object) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"module '{fqn}' (style {style!r}) returned {type(out).__name__}; the "
                        "style needs a single tensor output; plan it 'replicate' or reduce "
                        "where a tensor is returned")
    return out


class ReduceOutput(ParallelStyle):
    """The module's output is a partial sum over the group: all-reduce it after the forward.

    Args:
        routers: The ``partial_grad_output`` modules whose routes this reduction
            checks (the automatic plan fills it in; none in a hand-written plan).
    """

    name = "reduce_output"

    def __init__(self, routers: tuple[str, ...] = ()) -> None:
        self.routers = routers

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        if ctx.world_size > 1:
            module.register_forward_hook(_reduce_output(layer.fqn, ctx.group, self.routers))
        return module

    def plan(self, module: nn.Module, fqn: str, ctx: ShardContext) -> LayerPlan:
        return LayerPlan(fqn, self.name, collectives=("all_reduce",))


class ReduceInput(ReduceOutput):
    """The module's first input is a partial sum: all-reduce it before the forward.

    The module is marked ``tp_reduced_input``: a LoRA adapter around it would read
    the input before the hook, so torchtp's PEFT support refuses one.
    """

    name = "reduce_input"

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        if ctx.world_size > 1:
            module.tp_reduced_input = True  # type: ignore[assignment]
            module.register_forward_pre_hook(_reduce_input(layer.fqn, ctx.group, self.routers))
        return module

    def plan(self, module: nn.Module, fqn: str, ctx: ShardContext) -> LayerPlan:
        planned = ParallelStyle.plan(self, module, fqn, ctx)
        return LayerPlan(fqn, self.name, full=planned.full, local=planned.local,
                         collectives=("all_reduce",))


class ReduceResidual(ParallelStyle):
    """The module returns its first input ``x`` plus partial sums: ``x + all-reduce(out - x)``.

    A parallel-residual decoder layer computes ``x + attention(x) + mlp(x)``
    (dropout and all); with both branches' output projections left as partial
    sums, each rank's output is ``x`` plus its own part, so the parts are summed
    once, the residual kept once. Forward: one all-reduce of ``(..., hidden)``;
    backward: identity (the residual's gradient and the parts' flow as they
    would). ``x`` is the first positional argument or ``hidden_states`` (after
    any forward pre-hook changed it); the output a tensor or a tuple whose first
    element is one. The hook runs before the module's other forward hooks, so
    they see the summed output.
    """

    name = "reduce_residual"

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        if ctx.world_size > 1:
            module.register_forward_hook(_reduce_residual(layer.fqn, ctx.group),
                                         with_kwargs=True, prepend=True)
        return module

    def plan(self, module: nn.Module, fqn: str, ctx: ShardContext) -> LayerPlan:
        return LayerPlan(fqn, self.name, collectives=("all_reduce",))


class PartialGradOutput(ParallelStyle):
    """Replicated module whose output meets partial sums: sum its output's gradient in backward.

    The module is marked ``tp_partial_grad_output``: a LoRA adapter around it
    would add a branch whose gradient is not summed, so torchtp's PEFT support
    refuses one.
    """

    name = "partial_grad_output"

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        if ctx.world_size > 1:
            module.tp_partial_grad_output = True  # type: ignore[assignment]
            module.register_forward_hook(_grad_summed(layer.fqn, ctx.group))
        return module


def _reduce_output(fqn: str, group: ProcessGroup | None, routers: tuple[str, ...]) -> Any:
    def hook(_m: nn.Module, _args: object, out: object) -> torch.Tensor:
        x = _tensor_output(fqn, "reduce_output", out)
        ride = _ride_routes(group, routers, x.device)
        y = reduce_from_tensor_parallel_region(x, group)
        _check_routes(group, routers, ride)
        return y
    return hook


def _reduce_input(fqn: str, group: ProcessGroup | None, routers: tuple[str, ...]) -> Any:
    def hook(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if not args:
            raise TypeError(f"module '{fqn}' (style 'reduce_input') was called without a "
                            "positional input to reduce")
        x = _tensor_output(fqn, "reduce_input", args[0])
        ride = _ride_routes(group, routers, x.device)
        y = reduce_from_tensor_parallel_region(x, group)
        _check_routes(group, routers, ride)
        return (y, *args[1:])
    return hook


def _reduce_residual(fqn: str, group: ProcessGroup | None) -> Any:
    """The forward hook of ``reduce_residual``: ``x + all-reduce(out - x)`` as the output."""
    def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: object) -> object:
        x, y = first_input(args, kwargs), first_output(out)
        if x is None or y is None or y.shape != x.shape:
            raise TypeError(f"module '{fqn}' (style 'reduce_residual', world_size="
                            f"{group_size(group)}) needs a tensor input (first positional "
                            "argument or hidden_states) and an output of its shape (a tensor, "
                            f"or a tuple starting with one); got {type(out).__name__}. Plan its "
                            "output projections 'rowwise' instead of 'rowwise_partial' and "
                            "leave it out of the plan")
        # (..., hidden): each rank's out - x is its parts' partial sum.
        return with_first_output(out, x + reduce_from_tensor_parallel_region(y - x, group,
                                                                             inplace=True))
    return hook


def _grad_summed(fqn: str, group: ProcessGroup | None) -> Any:
    def hook(_m: nn.Module, _args: object, out: object) -> torch.Tensor:
        y = _tensor_output(fqn, "partial_grad_output", out)
        _note_routes(fqn, y, group)
        return copy_to_tensor_parallel_region(y, group)
    return hook


# Per group and router, the hash of the routes its latest call chose. The
# reduction that ends the MoE rides the hashes of its own routers on its own
# all-reduce: the same count on every rank, whatever else called a router.
_ROUTES: dict[object, dict[str, bytes]] = {}
_RANKED = 8  # experts ranked per token in the hash: top-k choices for k <= 8


def _checking(group: ProcessGroup | None) -> bool:
    return group is not None and group_size(group) > 1 and not torch.compiler.is_compiling() \
        and _log.CHECK_INPUTS


def _note_routes(fqn: str, logits: torch.Tensor, group: ProcessGroup | None) -> None:
    """Remember a hash of every token's ranking of the router's outputs (its top 8).

    The router is replicated: every rank computes its outputs from its own copy
    of the weights and of the token states. Ranks that disagree would send
    different tokens to the experts and sum inconsistent partial sums (the
    forward would not fail: every all-reduce keeps its shape). Ranking, not the
    values, is hashed, so a rounding difference that changes no choice passes.
    Off under ``torch.compile``, for one rank and with ``TP_CHECK_INPUTS=0``.
    """
    if not _checking(group):
        return
    ranked = logits.detach().topk(min(_RANKED, logits.shape[-1]), -1).indices  # (..., <=8)
    data = ranked.to("cpu", torch.int64).contiguous().numpy().tobytes()
    _ROUTES.setdefault(group, {})[fqn] = hashlib.blake2b(data, digest_size=16).digest()


def _ride_routes(group: ProcessGroup | None, routers: tuple[str, ...],
                 device: torch.device) -> _comm.Ride | None:
    """The routers' latest hashes, riding the all-reduce about to run (none: nothing rides)."""
    if not routers or not _checking(group):
        return None
    latest = _ROUTES.get(group, {})
    return _comm.ride_hash(group, b"".join(latest.pop(f, b"-") for f in routers), device)


def _check_routes(group: ProcessGroup | None, routers: tuple[str, ...],
                  ride: _comm.Ride | None) -> None:
    """After the reduction: raise on every rank if a router's ranking differed across ranks."""
    if ride is None or _comm.ride_agrees(group, ride, group_size(group)):
        return
    raise RankMismatchError(
        f"{', '.join(repr(r) for r in routers)} (style 'partial_grad_output'): the "
        "tensor-parallel ranks ranked the "
        f"experts differently (world_size={group_size(group)}); every rank computes the routes "
        "from its own copy of the router and of the token states, so one of them differs "
        "across ranks (a replicated weight changed on one rank, non-deterministic kernels, "
        "different inputs); compare its weights across the ranks (torchtp's optimizer-step "
        "check, TP_STEP_CHECK, does at every step)")
