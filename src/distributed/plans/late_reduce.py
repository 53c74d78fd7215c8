"""One all-reduce for several row-split Linears whose outputs are only summed.

A hand-written MoE (a router ``nn.Linear`` and an ``nn.ModuleList`` of expert
MLPs) weights each expert's output and adds it into one tensor. The automatic
plan pairs every expert's ``up``/``down`` (``colwise``/``rowwise``), so each
expert that gets tokens all-reduces its output. Here those ``down`` Linears
(the *parts*) become ``rowwise_partial`` instead, and one all-reduce sums the
combined tensor where it is complete (the *point*): the output of the
innermost module that returns it (``reduce_output``), or the input of the
replicated Linear that reads it (``reduce_input``). A replicated Linear whose
output only multiplies the partial sums on the way (the router) gets
``partial_grad_output``, because on each rank its gradient then covers only
that rank's part.

A parallel-residual decoder layer (Falcon, GPT-J, GPT-NeoX, Phi-2) returns
``x + attention(x) + mlp(x)``: the two output projections are the parts, and
the point is the layer's output minus its input ``x`` (``reduce_residual``:
``x + all-reduce(out - x)``), the walk back stopping at ``x``.

Checked on the recorded graph first, then by a probe:

* graph: between the parts and the point there is no parameter or model
  input (its gradient would be partial too), and nothing outside reads the
  parts' outputs, anything computed from them before the point, or the
  router's outputs (an auxiliary loss on the router logits would get its
  gradient summed ``tp`` times);
* residual layers only (:mod:`torchtp.plans.residual_path`): ``out - x`` must
  not depend on ``x`` (``x`` read once, by a plain addition, and only plain
  additions after it), in the recorded graph and in a training-mode one
  (dropout on the residual), and no tensor kept on a module may be computed
  from the parts; a layer whose output is bfloat16 or float16 keeps its
  per-branch all-reduces (each rank's ``x + part`` would round the residual);
* probe, for every rank: the model runs with each part returning that rank's
  partial sum (bias on rank 0 only) and the point replaced by the recorded
  full value; the values at the point, summed over the ranks, must equal the
  recorded value (a residual or shared term added before the point would be
  counted ``tp`` times; for a residual point the recorded value is the
  layer's output minus its input), and the model's outputs must equal the
  recorded ones on every rank (nothing else saw a partial sum).

A point that fails keeps its parts' own all-reduces; ``describe_plan()``
notes why, except for a layer the graph check already rules out (every
module with a residual shape is tried; a sequential residual layer, as in
Llama, is not worth a note).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .dataflow import (
    Block,
    Region,
    Trace,
    differs,
    kept_on_modules,
    output_tensors,
    probe_mode,
)
from .linear_view import linear_view
from .module_io import first_input, first_output, other_outputs, with_first_output
from .residual_path import path_problem, training_problems
from .resolved import Rules
from .styles import ParallelStyle, Rowwise, ShardContext
from .styles_partial import (
    PartialGradOutput,
    ReduceInput,
    ReduceOutput,
    ReduceResidual,
    RowwisePartial,
)


@dataclass
class Point:
    """Where a combined partial sum could be reduced.

    Attributes:
        name: The module.
        reads: ``True``: the Linear's input; ``False``: the module's output.
        node: The autograd node of that tensor.
        value: The tensor recorded by the probe forward (full, unsplit); for a
            residual point, the module's output minus its input.
        region: What lies between it and the Linears that produce it.
        block: For a residual point (``reduce_residual``), the module's recorded
            input and output; ``None`` otherwise.
    """

    name: str
    reads: bool
    node: Any
    value: torch.Tensor
    region: Region
    block: Block | None = None


def late_reduces(model: nn.Module, trace: Trace, consumers: list[str],
                 styles: dict[str, ParallelStyle | str], rules: Rules, ctx: ShardContext) -> None:
    """Reduce the outputs of the ``rowwise`` ``consumers`` once where they are summed.

    Updates ``styles`` and ``rules.why``/``rules.notes`` in place.
    """
    if ctx.world_size == 1:
        return
    # Row-split Linears that all-reduce their own output (by balanced columns or by
    # whole heads), not ones already partial or splitting their input themselves.
    plain = {c for c in consumers if _reduces_itself(styles.get(c))}
    # Sums of expert-like parts (a point that is not a residual layer) take balanced
    # column splits only; a residual layer's attention output projection keeps its heads.
    balanced = {c for c in plain if type(styles.get(c)) is Rowwise}
    uncalled = [n for n, m in model.named_modules() if linear_view(m) is not None
                and n not in trace.calls]
    if uncalled and len(plain) >= 2:
        # An expert the probe's tokens never reached stays replicated: at run time
        # its full output would join a sum of partial sums, counted once per rank.
        rules.notes.append(f"row-split Linears keep one all-reduce each: the probe forward did "
                           f"not call {uncalled[:4]}{' ...' if len(uncalled) > 4 else ''}, so "
                           "where their outputs go is unknown; pass example_inputs= that reach "
                           "every expert to sum them once")
        return
    used: set[str] = set()
    layers: list[tuple[Point, list[str]]] = []  # residual layers: probed together below
    for point in _points(trace, plain, balanced):
        mine = plain if point.block is not None else balanced
        parts = sorted(point.region.producers & mine, key=trace.order.index)
        if point.region.producers & used:
            continue
        routers = sorted(point.region.producers - mine, key=trace.order.index)
        problem = _graph_problem(trace, point, parts, routers, styles)
        if point.block is not None:
            if problem is not None or routers:
                continue  # every block is tried: a sequential residual layer is not noted
            problem = _residual_problem(trace, point, parts) or _precision_problem(point, ctx)
            if problem is None:
                layers.append((point, parts))
                used.update(parts)
            else:
                _note(rules, point, parts, problem)
            continue
        problem = problem or _probe_problems(model, trace, [(point, parts)], styles, ctx)[
            point.name] or _gradient_problem(model, trace, parts, routers)
        if problem is not None:
            _note(rules, point, parts, problem)
            continue
        _take(trace, point, parts, routers, styles, rules)
        used.update(parts)
    _take_layers(model, trace, layers, styles, rules, ctx)


def _take_layers(model: nn.Module, trace: Trace, layers: list[tuple[Point, list[str]]],
                 styles: dict[str, ParallelStyle | str], rules: Rules, ctx: ShardContext) -> None:
    """Probe every residual layer at once (one run per rank, one training-mode run), then
    take those that pass."""
    if not layers:
        return
    probed = _probe_problems(model, trace, layers, styles, ctx)
    trained = training_problems(model, trace.inputs, [(p.name, parts) for p, parts in layers])
    for point, parts in layers:
        problem = probed[point.name] or trained[point.name]
        if problem is not None:
            _note(rules, point, parts, problem)
        else:
            _take(trace, point, parts, [], styles, rules)


def _note(rules: Rules, point: Point, parts: list[str], problem: str) -> None:
    rules.notes.append(f"{parts} keep one all-reduce each: summing them once at "
                       f"'{point.name}' {problem}")


def _reduces_itself(style: ParallelStyle | str | None) -> bool:
    """A weight-columns split that all-reduces its own output (balanced or by whole heads)."""
    return isinstance(style, Rowwise) and not isinstance(style, RowwisePartial) \
        and not style.split_input


def _points(trace: Trace, plain: set[str], balanced: set[str]) -> list[Point]:
    """Tensors fed by at least two of the ``balanced`` consumers (residual layers: of the
    ``plain`` ones), the smallest region first."""
    found: list[Point] = []
    for name, (value, node) in trace.returned.items():
        # Not the model's own output (nothing after it to reduce in), and only
        # modules that hold two of the Linears (walking back is not free).
        if name and sum(c.startswith(f"{name}.") for c in balanced) >= 2:
            found.append(Point(name, False, node, value, trace.region_from(node)))
    for name in trace.blocks:
        if sum(c.startswith(f"{name}.") for c in plain) >= 2:
            found.append(_residual_point(trace, name))
    for name in trace.order:
        call = trace.calls[name]
        if len(call) == 1 and call[0].input_node is not None and name not in plain:
            found.append(Point(name, True, call[0].input_node, call[0].input,
                               trace.region(name)))
    found = [p for p in found
             if len(p.region.producers & (plain if p.block is not None else balanced)) >= 2]
    return sorted(found, key=lambda p: (len(p.region.producers), len(p.region.nodes)))


def _residual_point(trace: Trace, name: str) -> Point:
    """``name``'s output minus its input: the walk back stops at the input (the residual)."""
    block = trace.blocks[name]
    return Point(name, False, block.output_node, block.output - block.input,
                 trace.region_from(block.output_node, stop=block.input_node), block)


def _graph_problem(trace: Trace, point: Point, parts: list[str], routers: list[str],
                   styles: dict[str, ParallelStyle | str]) -> str | None:
    """Why the recorded graph does not allow one reduction at ``point``, if it does not."""
    region = point.region
    if region.leaves:
        return ("is not possible: a parameter or an input is read on the way, and its "
                "gradient would cover only this rank's part")
    # Lone Linears (a string style: gathered, input-split or replicated) may stay
    # whole instead; members of confirmed pairs (style objects) may not.
    if (point.reads and not isinstance(styles.get(point.name), str)) or (
            not point.reads and point.name in styles):
        return f"is not possible: '{point.name}' is split itself"
    split = [r for r in routers if not isinstance(styles.get(r), str)]
    if split:
        return f"is not possible: {split} on the way are split themselves"
    users = trace.consumers()
    inside = set(region.nodes)
    outs = {id(trace.calls[n][0].output_node): n for n in [*parts, *routers]}
    for node_id, name in outs.items():
        if not users.get(node_id, set()) <= inside:
            what = "an auxiliary loss on the router logits?" if name in routers else "a residual?"
            return f"is not possible: the output of '{name}' is also read elsewhere ({what})"
    for node_id in inside - {id(point.node)}:
        if not users.get(node_id, set()) <= inside:
            return "is not possible: a tensor on the way is also read elsewhere"
    return None


def _residual_problem(trace: Trace, point: Point, parts: list[str]) -> str | None:
    """For a residual point: whether ``out - x`` depends on ``x`` in the recorded graph."""
    if point.block is None:
        return None
    parts_nodes = {id(trace.calls[p][0].output_node) for p in parts}
    return path_problem(point.node, point.block.input_node, parts_nodes)


def _precision_problem(point: Point, ctx: ShardContext) -> str | None:
    """A residual layer in half precision: each rank's own ``x + part`` rounds the residual,
    so the sum would carry ``tp`` roundings of it instead of the unsplit layer's one."""
    if point.block is None or point.block.output.dtype not in (torch.float16, torch.bfloat16):
        return None
    return (f"is not done in {str(point.block.output.dtype).removeprefix('torch.')}: each "
            f"rank's residual add rounds the residual, and the sum would carry "
            f"{ctx.world_size} roundings of it instead of one (float32 models, and autocast "
            "with float32 weights, are summed once)")


def _probe_problems(model: nn.Module, trace: Trace, checks: list[tuple[Point, list[str]]],
                    styles: dict[str, ParallelStyle | str], ctx: ShardContext
                    ) -> dict[str, str | None]:
    """Per point, why its probe fails (see the module docstring); ``None``: it passes.

    The points run together (each is replaced by its recorded full value, so they
    do not see each other's partial sums); a failure of the whole run, which
    cannot be told apart, runs them again one by one.
    """
    shared, verdicts = _probe_run(model, trace, checks, styles, ctx)
    if shared is None:
        return verdicts
    if len(checks) == 1:
        return {checks[0][0].name: shared}
    return {point.name: _probe_problems(model, trace, [(point, parts)], styles, ctx)[point.name]
            for point, parts in checks}


def _probe_run(model: nn.Module, trace: Trace, checks: list[tuple[Point, list[str]]],
               styles: dict[str, ParallelStyle | str], ctx: ShardContext
               ) -> tuple[str | None, dict[str, str | None]]:
    """Every rank's partial sums up to the points: a failure of the run, or per point."""
    totals: dict[str, torch.Tensor] = {}
    for rank in range(ctx.world_size):
        local = ShardContext(ctx.world_size, rank, None, ctx.model_name)
        seen: dict[str, list[torch.Tensor]] = {point.name: [] for point, _ in checks}
        try:
            with _partial_run(model, checks, styles, local, seen), torch.no_grad():
                args, kwargs = trace.inputs
                outs = output_tensors(model(*args, **kwargs))
        except Exception as err:  # the local computation does not even run
            return f"failed in the probe (rank {rank}: {type(err).__name__}: {err})", {}
        for name, values in seen.items():
            if len(values) != 1:
                return f"failed in the probe (rank {rank}: reached {len(values)} times)", {}
            totals[name] = values[0] if name not in totals else totals[name] + values[0]
        for got, want in zip(outs, trace.outputs, strict=False):
            why = differs(got, want, rank)
            if why is not None:
                return (f"changes the model's outputs ({why}): a partial sum is read "
                        "elsewhere"), {}
    verdicts: dict[str, str | None] = {}
    for point, _ in checks:
        why = differs(totals[point.name], point.value, 0)
        verdicts[point.name] = None if why is None else (
            f"does not give the full value ({why.split(': ', 1)[1]}): something added before "
            "that point (a residual, a shared term) is not split")
    return None, verdicts


def _gradient_problem(model: nn.Module, trace: Trace, parts: list[str],
                      routers: list[str]) -> str | None:
    """In training mode, with the parts' outputs zeroed, no gradient may reach the routers.

    The routers' output gradients are summed over the ranks, which is right
    only if all of it comes through the partial sums. Anything else reading
    them (an auxiliary loss, returned or kept on a module; a custom function
    attaching it to the output; a branch that runs in training mode only)
    would have its full gradient counted once per rank. With every part
    returning zeros, the gradient through the weighted sum vanishes: whatever
    is left comes from elsewhere. The Linears called must also be the eval
    probe's.
    """
    if not routers:
        return None
    seen: dict[str, torch.Tensor] = {}
    called: set[str] = set()
    handles: list[RemovableHandle] = []
    try:
        for name, module in model.named_modules():
            if linear_view(module) is not None:
                handles.append(module.register_forward_hook(_note_call(name, called, seen,
                                                                       name in parts)))
        args, kwargs = trace.inputs
        with probe_mode(model, training=True), torch.enable_grad():
            outs = [*output_tensors(model(*args, **kwargs)), *kept_on_modules(model)]
    except Exception as err:
        return f"failed in the training-mode probe ({type(err).__name__}: {err})"
    finally:
        for handle in handles:
            handle.remove()
    if called != set(trace.calls):
        return (f"is not possible: in training mode the model calls other Linears "
                f"({sorted(called ^ set(trace.calls))[:4]})")
    gen = torch.Generator().manual_seed(0)
    loss = sum(((t * torch.randn(t.shape, generator=gen).to(t)).sum() for t in outs
                if t.requires_grad and t.is_floating_point()), torch.zeros(()))
    grads = torch.autograd.grad(loss, [seen[r] for r in routers], allow_unused=True) \
        if loss.requires_grad else [None] * len(routers)
    for name, grad in zip(routers, grads, strict=True):
        if grad is not None and bool(grad.abs().max() > 0):
            return (f"is not possible: the output of '{name}' also reaches the loss other than "
                    "through the weighted sum (an auxiliary loss?), and its gradient would be "
                    "summed once per rank")
    return None


def _note_call(name: str, called: set[str], seen: dict[str, torch.Tensor], zero: bool) -> Any:
    def hook(_m: nn.Module, _args: object, out: object) -> object:
        called.add(name)
        if isinstance(out, torch.Tensor):
            seen[name] = out
            return out * 0 if zero else out  # (finite probe values: an exact zero)
        return out
    return hook


@contextlib.contextmanager
def _partial_run(model: nn.Module, checks: list[tuple[Point, list[str]]],
                 styles: dict[str, ParallelStyle | str], ctx: ShardContext,
                 seen: dict[str, list[torch.Tensor]]) -> Iterator[None]:
    """Parts return this rank's partial sums; each point records its value, then goes on
    with its recorded full value."""
    handles: list[RemovableHandle] = []
    try:
        for point, parts in checks:
            for name in parts:
                module = model.get_submodule(name)
                style = styles[name]
                assert isinstance(style, Rowwise)
                handles.append(module.register_forward_hook(_partial_hook(module, style, ctx)))
            handles.append(_seen_hook(model.get_submodule(point.name), point,
                                      seen[point.name]))
        with probe_mode(model):
            yield
    finally:
        for handle in handles:
            handle.remove()


def _seen_hook(target: nn.Module, point: Point, seen: list[torch.Tensor]) -> RemovableHandle:
    if point.reads:
        return target.register_forward_pre_hook(_seen_input(point.value, seen))
    if point.block is not None:
        return target.register_forward_hook(_seen_residual(point.block, seen), with_kwargs=True)
    return target.register_forward_hook(_seen_output(point.value, seen))


def _partial_hook(module: nn.Module, style: Rowwise, ctx: ShardContext) -> Any:
    """This rank's partial sum: the module on its input columns only, bias on rank 0."""
    view = linear_view(module)
    assert view is not None
    (start, length), = style.column_segments(view, ctx)
    bias = getattr(module, "bias", None)

    def hook(_m: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        x = args[0]
        mask = torch.zeros(x.shape[-1], dtype=x.dtype, device=x.device)
        mask[start:start + length] = 1
        # The module's own forward on this rank's columns: (..., out) partial sum.
        partial = type(module).forward(module, x * mask)
        if isinstance(bias, torch.Tensor) and ctx.rank != 0:
            partial = partial - bias
        return partial
    return hook


def _seen_input(full: torch.Tensor, seen: list[torch.Tensor]) -> Any:
    def hook(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        seen.append(args[0].clone())
        return (full.clone(), *args[1:])
    return hook


def _seen_output(full: torch.Tensor, seen: list[torch.Tensor]) -> Any:
    def hook(_m: nn.Module, _args: object, out: torch.Tensor) -> torch.Tensor:
        seen.append(out.clone())
        return full.clone()
    return hook


def _seen_residual(block: Block, seen: list[torch.Tensor]) -> Any:
    """Record this rank's output less its input; go on with the recorded full output.

    Its other outputs (attention weights...) must be the recorded ones: a partial
    sum returned beside the output would reach the caller unsummed.
    """
    def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: object) -> object:
        x, y = first_input(args, kwargs), first_output(out)
        if x is None or y is None:
            raise ValueError("the layer's input or output is not a tensor in this call")
        seen.append((y - x).clone())
        others = other_outputs(out)
        whys = [differs(got, want, 0) for got, want in zip(others, block.others, strict=False)]
        if len(others) != len(block.others) or any(whys):
            raise ValueError("its other outputs change with the partial sums (a partial sum "
                             "returned beside the output?)")
        return with_first_output(out, block.output.clone())
    return hook


def _take(trace: Trace, point: Point, parts: list[str], routers: list[str],
          styles: dict[str, ParallelStyle | str], rules: Rules) -> None:
    """Record the styles and their reasons."""
    where = f"the input of '{point.name}'" if point.reads else \
        f"the output of '{point.name}' less its input (the residual)" if point.block is not None \
        else f"the output of '{point.name}'"
    for name in parts:
        # Producers mark a part as an expert (expert_parallel=True places it whole);
        # a residual layer's attention and MLP are not experts.
        producers = () if point.block is not None else tuple(
            sorted(trace.region(name).producers, key=trace.order.index))
        style = styles[name]
        assert isinstance(style, Rowwise)  # a part reduces its own output (_reduces_itself)
        styles[name] = RowwisePartial(producers, None if type(style) is Rowwise else style)
        rules.why[name] = (f"dataflow: one of {len(parts)} row-split Linears whose outputs are "
                           f"only summed; left as partial sums, reduced once at {where}")
    lone = [n for n in [point.name, *routers] if isinstance(styles.get(n), str)]
    rules.notes[:] = [n for n in rules.notes if not any(n.startswith(f"'{x}' ") for x in lone)]
    if point.block is not None:
        styles[point.name] = ReduceResidual()
    else:
        styles[point.name] = ReduceInput(tuple(routers)) if point.reads \
            else ReduceOutput(tuple(routers))
    rules.why[point.name] = (f"dataflow: {where} sums the partial outputs of {len(parts)} "
                             f"Linears ({parts[0]}, ...): one all-reduce instead of {len(parts)}")
    for name in routers:
        styles[name] = PartialGradOutput()
        rules.why[name] = (f"dataflow: its output multiplies the partial sums before {where}; "
                           "replicated, its output's gradient summed over the group")
