"""What a plan costs: bytes moved per forward + backward, their time, parameter bytes per rank.

The plan chooser (:mod:`torchtp.plans.choose`) compares candidate plans with
these numbers. Per planned module (``T`` rows: the tokens it sees in one
forward, ``b`` bytes per value, ``in``/``out`` its features):

=============================  ============================  ===============================
style                          forward                       backward
=============================  ============================  ===============================
``colwise`` (and head splits)  nothing                       all-reduce ``(T, in)``, once
                                                             per input tensor its siblings
                                                             share (q/k/v: one)
``colwise_gather_output``      all-gather ``(T, out)``       all-reduce ``(T, in)``
``rowwise`` (head columns)     all-reduce ``(T, out)``       nothing
``rowwise_split_input``        all-reduce ``(T, out)``       all-gather ``(T, in)``
``embedding_rowwise``          all-reduce ``(T, dim)``       nothing
``embedding_colwise``          all-gather ``(T, dim)``       nothing
gradient-summed replicas       nothing                       all-reduce of its parameters
``partial_grad_output``        nothing                       all-reduce ``(T, out)``
``rowwise_partial``            nothing                       nothing
``reduce_input``               all-reduce ``(T, in)``        nothing
``reduce_output``,             all-reduce of the module's    nothing
``reduce_residual``            output as the probe saw it
any other style                its collectives, ``(T, out)``  nothing
=============================  ============================  ===============================

A module whose input is the model's own input (a patch projection on pixels)
wants no input gradient, so its backward collective is not counted. Rows
come from the automatic plan's probe forward when it ran (a classifier head
that reads only the class token sees ``B`` rows, not ``B x N``), else every
module sees the probe inputs' tokens. Times are the alpha-beta model of
:mod:`torchtp.costmodel` on the hardware profile in use: ``cpu-gloo`` for a
model on the CPU (Gloo), ``h100-nvlink`` for one on a GPU (NCCL).

Parameter bytes per rank count every parameter once (tied ones too), each
split one as this rank's shard. Nothing here touches a weight or communicates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..comm.runtime import ProcessGroup
from ..costmodel import Hardware, allgather_time, allreduce_time, get_hardware
from .dataflow import Trace
from .linear_view import linear_view
from .resolved import ResolvedPlan
from .styles import (
    Colwise,
    LayerPlan,
    ParallelStyle,
    ReplicatedWithGradAllreduce,
    Rowwise,
    ShardContext,
)
from .styles_embedding import EmbeddingColwise, EmbeddingRowwise
from .styles_partial import PartialGradOutput, ReduceInput, ReduceOutput, ReduceResidual

CPU_PROFILE = "cpu-gloo"
GPU_PROFILE = "h100-nvlink"
# Lone styles: a module split on its own, its collective serving only it.
LONE = (EmbeddingRowwise, EmbeddingColwise)


@dataclass(frozen=True)
class Shapes:
    """How many rows each module sees in one forward, and which inputs are shared.

    Attributes:
        tokens: Rows of a module the probe did not record (and of embeddings).
        rows: Module -> rows over all its calls in one forward.
        entry: Modules whose input is the model's input (no input gradient).
        shared: Module -> the first module that reads the same input tensor.
        outputs: Other module (a decoder layer, an MoE block) -> the elements of
            the tensor it returned in the probe forward.
    """

    tokens: int
    rows: Mapping[str, int] = field(default_factory=dict)
    entry: frozenset[str] = frozenset()
    shared: Mapping[str, str] = field(default_factory=dict)
    outputs: Mapping[str, int] = field(default_factory=dict)

    def of(self, name: str) -> int:
        """Rows ``name`` sees per forward."""
        return self.rows.get(name, self.tokens)


def shapes_from_trace(trace: Trace | None, tokens: int) -> Shapes:
    """Rows per module as the probe forward recorded them (``tokens`` where it did not)."""
    if trace is None:
        return Shapes(tokens)
    rows: dict[str, int] = {}
    entry: set[str] = set()
    first: dict[int, str] = {}
    shared: dict[str, str] = {}
    for name in trace.order:
        calls = trace.calls[name]
        width = calls[0].input.shape[-1] if calls[0].input.dim() else 1
        rows[name] = sum(c.input.numel() // max(width, 1) for c in calls)
        node = calls[0].input_node
        if node is None:  # a leaf: the model's own input (or a constant)
            entry.add(name)
        else:
            shared[name] = first.setdefault(id(node), name)
    outputs = {n: v.numel() for n, (v, _node) in trace.returned.items()}
    outputs.update({n: b.output.numel() for n, b in trace.blocks.items()})
    return Shapes(_token_count(trace) or tokens, rows, frozenset(entry), shared, outputs)


def _token_count(trace: Trace) -> int | None:
    """Tokens of the probe's first integer input (token ids), if it has one."""
    args, kwargs = trace.inputs
    for value in [*args, *kwargs.values()]:
        if isinstance(value, torch.Tensor) and not value.is_floating_point() and value.dim():
            return int(value.numel())
    return None


def hardware_for(model: nn.Module, group: ProcessGroup | None = None) -> Hardware:
    """The hardware profile of the model's device: NVLink GPUs for CUDA/NCCL, else Gloo on CPU.

    Decided from the parameters' device type (or, on the meta device, the
    group's backend), which every rank of a TP group shares.
    """
    first = next(model.parameters(), None)
    if first is not None and first.device.type == "cuda":
        return get_hardware(GPU_PROFILE)
    meta = first is not None and first.is_meta
    if meta and dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return get_hardware(GPU_PROFILE)
    return get_hardware(CPU_PROFILE)


@dataclass(frozen=True)
class Transfer:
    """One collective a module issues per forward + backward.

    Attributes:
        op: ``"all_reduce"``, ``"all_gather"``...
        nbytes: The whole tensor's bytes (the reduced or the gathered one).
        backward: Issued in the backward.
        key: Transfers with the same key are issued once (siblings' input gradient).
    """

    op: str
    nbytes: int
    backward: bool = False
    key: str | None = None

    def moved(self, tp: int) -> float:
        """Bytes each rank sends: ``2(N-1)/N`` of the tensor for an all-reduce, else ``(N-1)/N``."""
        share = (tp - 1) / tp
        return (2 * share if self.op == "all_reduce" else share) * self.nbytes

    def seconds(self, tp: int, hw: Hardware) -> float:
        """Alpha-beta time on ``hw``."""
        if self.op == "all_reduce":
            return allreduce_time(self.nbytes, tp, hw)
        return allgather_time(self.nbytes, tp, hw)


@dataclass(frozen=True)
class PlanCost:
    """A plan's estimated cost at one tp size.

    Attributes:
        seconds: Time of its collectives per forward + backward on the hardware profile.
        moved: Bytes each rank sends per forward + backward.
        memory: Parameter bytes each rank holds.
        forward: Collectives per forward.
    """

    seconds: float
    moved: int
    memory: int
    forward: dict[str, int]


def traffic(name: str, style: ParallelStyle, module: nn.Module, layer: LayerPlan,
            shapes: Shapes, tp: int) -> list[Transfer]:
    """The collectives ``module`` issues per forward + backward under ``style`` (table above)."""
    b = _value_bytes(module)
    rows = shapes.of(name)
    view = linear_view(module)
    if isinstance(style, ReduceInput) and view is not None:
        return [Transfer("all_reduce", rows * view.in_features * b)]
    if isinstance(style, (ReduceOutput, ReduceResidual)) and name in shapes.outputs:
        return [Transfer("all_reduce", shapes.outputs[name] * b)]
    if not layer.layouts and not isinstance(style, (ReplicatedWithGradAllreduce,
                                                     PartialGradOutput)):
        return []  # kept whole (or unfit at this tp: never chosen)
    grads_in = name not in shapes.entry
    shared = shapes.shared.get(name, name.rpartition(".")[0] or name)
    if isinstance(style, Colwise) and view is not None:
        out = [Transfer("all_gather", rows * view.out_features * b)] if style.gather_output else []
        if grads_in:
            out.append(Transfer("all_reduce", rows * view.in_features * b, True, f"in:{shared}"))
        return out
    if isinstance(style, Rowwise) and view is not None:
        out = [Transfer("all_reduce", rows * view.out_features * b)] if style.collectives else []
        if style.split_input and grads_in:
            out.append(Transfer("all_gather", rows * view.in_features * b, True))
        return out
    if isinstance(style, LONE):
        dim = int(getattr(module, "embedding_dim", 0) or layer.full[-1])
        op = "all_reduce" if isinstance(style, EmbeddingRowwise) else "all_gather"
        return [Transfer(op, shapes.tokens * dim * b)]
    if isinstance(style, ReplicatedWithGradAllreduce):
        size = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        return [Transfer("all_reduce", size, True)]
    if isinstance(style, PartialGradOutput) and view is not None:
        return [Transfer("all_reduce", rows * view.out_features * b, True)]
    width = view.out_features if view is not None else (layer.full[0] if layer.full else 1)
    return [Transfer(op, rows * width * b) for op in layer.collectives]


def _value_bytes(module: nn.Module) -> int:
    """Bytes per activation value: the module's first floating parameter's (4 without one)."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.element_size()
    return 4


def plan_cost(model: nn.Module, plan: ResolvedPlan, tp: int, shapes: Shapes,
              hw: Hardware) -> PlanCost:
    """The collectives, bytes and parameter bytes per rank of ``plan``."""
    modules = dict(model.named_modules())
    seen: set[str] = set()
    seconds = moved = 0.0
    forward: dict[str, int] = {}
    for name, style in plan.assignments.items():
        layer = plan.layers.get(name)
        if layer is None:
            continue
        for t in traffic(name, style, modules[name], layer, shapes, tp):
            if t.key is not None:
                if t.key in seen:
                    continue
                seen.add(t.key)
            seconds += t.seconds(tp, hw)
            moved += t.moved(tp)
            if not t.backward:
                forward[t.op] = forward.get(t.op, 0) + 1
    return PlanCost(seconds, round(moved), memory_per_rank(model, plan, tp), forward)


def memory_per_rank(model: nn.Module, plan: ResolvedPlan, tp: int = 1) -> int:
    """Parameter bytes the plan leaves on its largest rank (tied parameters once).

    Shares may differ by a head or a row (balanced uneven splits), so every rank
    computes the same number from the plan alone: each split layer is planned at
    every rank of ``tp`` (no weight touched) and the largest total wins. A choice
    made on it is the same on every rank.
    """
    modules = dict(model.named_modules())
    split = {n: s for n, s in plan.assignments.items()
             if (layer := plan.layers.get(n)) is not None and layer.layouts}
    totals = []
    for rank in range(tp if tp > 1 and split else 1):
        ctx = ShardContext(tp, rank, None)
        layers = {n: s.plan(modules[n], n, ctx) for n, s in split.items()} if tp > 1 \
            else plan.layers
        total = 0
        for full_name, p in model.named_parameters():
            owner, _, pname = full_name.rpartition(".")
            layer = layers.get(owner)
            layout = layer.layouts.get(pname) if layer is not None else None
            numel = math.prod(layout.local_shape) if layout is not None else p.numel()
            total += numel * p.element_size()
        totals.append(total)
    return max(totals)


def is_lone(style: ParallelStyle) -> bool:
    """A split whose collective serves only its own module (no partner to share it)."""
    return (isinstance(style, Colwise) and style.gather_output) or (
        isinstance(style, Rowwise) and style.split_input) or isinstance(style, LONE)


def size_text(nbytes: float) -> str:
    """``nbytes`` in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


def time_text(seconds: float) -> str:
    """``seconds`` in ms (or us below 0.1 ms)."""
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.1f} us"
