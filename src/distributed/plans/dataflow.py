"""Which Linear feeds which: the autograd graph of one probe forward.

One forward of the model on small inputs, with gradients enabled, is
recorded: forward hooks tag the autograd node that produced each Linear-like
module's output (in the node's metadata, which lives with the C++ node) and
keep the node its input came from, plus the tensors it saw. Walking the graph
back from a Linear's input until tagged nodes are reached says which Linears
feed it and through which operations; the consumers of every node say whether
anything else reads what lies between them.

Used by the automatic plan (:mod:`torchtp.plans.auto`), for hand-written and
HuggingFace models alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..core.torch_compat import node_inputs, node_metadata
from .linear_view import linear_view
from .module_io import first_input, first_output, other_outputs

_TAG = "torchtp_producer"  # key in an autograd node's metadata: the module that made it

Inputs = tuple[tuple[Any, ...], dict[str, Any]]  # (args, kwargs) of a forward call


@dataclass
class Call:
    """One call of a Linear-like module during the probe forward.

    Attributes:
        input: The input it received, detached, ``(..., in_features)``.
        output: The output it returned, detached, ``(..., out_features)``.
        input_node: The autograd node that produced the input (``None``: a constant).
        output_node: The autograd node of the output.
    """

    input: torch.Tensor
    output: torch.Tensor
    input_node: Any
    output_node: Any


@dataclass
class Region:
    """What lies between a Linear's input and the Linears that produce it.

    Attributes:
        producers: Linear-like modules whose outputs reach the input.
        nodes: Autograd nodes in between (ids -> nodes).
        leaves: Leaf tensors reached without passing a producer (parameters
            of other modules, inputs that need gradients), as node names.
        tensors: Those leaf tensors themselves (to tell whose parameters they are).
    """

    producers: set[str] = field(default_factory=set)
    nodes: dict[int, Any] = field(default_factory=dict)
    leaves: list[str] = field(default_factory=list)
    tensors: list[Any] = field(default_factory=list)


@dataclass
class Block:
    """A module with a residual shape: its first input and first output, one shape.

    Attributes:
        input: Its first input (positional, or ``hidden_states``), detached.
        input_node: The autograd node that produced it.
        output: Its output (or the first tensor of the tuple it returns), detached.
        output_node: The autograd node of that output.
        others: The other tensors it returns (attention weights...), detached.
    """

    input: torch.Tensor
    input_node: Any
    output: torch.Tensor
    output_node: Any
    others: list[torch.Tensor] = field(default_factory=list)


@dataclass
class Trace:
    """The recorded probe forward.

    Attributes:
        calls: Per Linear-like module, its calls in order.
        order: Modules in the order of their first call.
        roots: Autograd nodes of the model's outputs.
        inputs: The probe's inputs, as given.
        outputs: The model's output tensors, detached.
        returned: Per other module (``""``: the model) that returned one tensor
            once, that tensor detached and its autograd node, in the order the
            modules returned.
        blocks: Per other module called once whose first input and first
            output are computed tensors of one shape (a decoder layer), both.
    """

    calls: dict[str, list[Call]]
    order: list[str]
    roots: list[Any]
    inputs: Inputs = ((), {})
    outputs: list[torch.Tensor] = field(default_factory=list)
    returned: dict[str, tuple[torch.Tensor, Any]] = field(default_factory=dict)
    blocks: dict[str, Block] = field(default_factory=dict)
    _consumers: dict[int, set[int]] | None = None
    _keep: dict[int, Any] = field(default_factory=dict)  # holding nodes keeps their ids unique

    def region(self, name: str) -> Region:
        """Walk back from ``name``'s input to the tagged producer outputs."""
        return self.region_from(self.calls[name][0].input_node)

    def region_from(self, start: Any, stop: Any = None) -> Region:
        """Walk back from autograd node ``start`` to the tagged producer outputs (and
        to node ``stop``, which is not part of the region)."""
        found = Region()
        stack = [start]
        while stack:
            node = stack.pop()
            if node is None or node is stop or id(node) in found.nodes:
                continue
            tag = node_metadata(node).get(_TAG)
            if tag is not None:
                found.producers.add(tag)
                continue
            found.nodes[id(node)] = node
            nexts = list(node_inputs(node))
            if not nexts and hasattr(node, "variable"):  # AccumulateGrad: a leaf tensor
                found.leaves.append(type(node).__name__)
                found.tensors.append(node.variable)
            stack.extend(nexts)
        return found

    def sources(self, name: str) -> set[str]:
        """The Linear-like modules whose outputs reach ``name``'s input."""
        return self.region(name).producers

    def consumers(self) -> dict[int, set[int]]:
        """Node id -> ids of the nodes that read it, over the whole graph."""
        if self._consumers is None:
            users: dict[int, set[int]] = {}
            starts = [*self.roots, *(c.output_node for cs in self.calls.values() for c in cs)]
            seen = self._keep
            stack = [n for n in starts if n is not None]
            while stack:
                node = stack.pop()
                if id(node) in seen:
                    continue
                seen[id(node)] = node
                for nxt in node_inputs(node):
                    if nxt is not None:
                        users.setdefault(id(nxt), set()).add(id(node))
                        stack.append(nxt)
            self._consumers = users
        return self._consumers

    def internal_nodes(self, name: str) -> set[int]:
        """Ids of the nodes ``name``'s own forward created (from its output back to its input)."""
        call = self.calls[name][0]
        inside: set[int] = set()
        stack = [call.output_node]
        while stack:
            node = stack.pop()
            if node is None or node is call.input_node or id(node) in inside:
                continue
            inside.add(id(node))
            stack.extend(node_inputs(node))
        return inside


def record(model: nn.Module, inputs: Inputs) -> Trace:
    """Run ``model`` once on ``inputs`` and record every Linear-like module's calls.

    The model runs in eval mode with gradients enabled (trainable flags and
    mode are restored afterwards, and the CPU RNG state too), so dropout is
    the identity and the graph connects every Linear.

    Raises:
        Exception: whatever the model's forward raises on ``inputs``.
    """
    calls: dict[str, list[Call]] = {}
    returned: dict[str, list[tuple[torch.Tensor, Any]]] = {}
    blocks: dict[str, list[Block | None]] = {}
    hooks = [mod.register_forward_hook(_recorder(name, calls)) if linear_view(mod) is not None
             else mod.register_forward_hook(_returns(name, returned, blocks), with_kwargs=True)
             for name, mod in model.named_modules()]
    args, kwargs = inputs
    try:
        with probe_mode(model), torch.enable_grad():
            out = model(*_needing_grad(args), **dict(zip(kwargs, _needing_grad(tuple(
                kwargs.values())), strict=True)))
    finally:
        for h in hooks:
            h.remove()
    outs = output_tensors(out)
    roots = [t.grad_fn for t in outs if t.grad_fn is not None]
    once = {n: r[0] for n, r in returned.items() if len(r) == 1 and r[0][1] is not None}
    single = {n: b[0] for n, b in blocks.items() if len(b) == 1 and b[0] is not None}
    return Trace(calls, list(calls), roots, inputs, [t.detach() for t in outs], once, single)


def _returns(name: str, returned: dict[str, list[tuple[torch.Tensor, Any]]],
             blocks: dict[str, list[Block | None]]) -> Callable[..., None]:
    def hook(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: object) -> None:
        entry = (out.detach(), out.grad_fn) if isinstance(out, torch.Tensor) else (None, None)
        returned.setdefault(name, []).append(entry)  # type: ignore[arg-type]
        x, y = first_input(args, kwargs), first_output(out)
        same = x is not None and y is not None and x.shape == y.shape \
            and x.grad_fn is not None and y.grad_fn is not None
        others = [t.detach() for t in other_outputs(out)]
        blocks.setdefault(name, []).append(
            Block(x.detach(), x.grad_fn, y.detach(), y.grad_fn, others)  # type: ignore[union-attr]
            if same else None)
    return hook


def _recorder(name: str, calls: dict[str, list[Call]]) -> Callable[..., None]:
    def hook(_mod: nn.Module, args: tuple[Any, ...], out: object) -> None:
        if not (isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor)):
            return
        if out.grad_fn is not None:
            node_metadata(out.grad_fn).setdefault(_TAG, name)
        calls.setdefault(name, []).append(
            Call(args[0].detach(), out.detach(), args[0].grad_fn, out.grad_fn))
    return hook


@contextlib.contextmanager
def probe_mode(model: nn.Module, training: bool = False) -> Iterator[None]:
    """Eval mode (or training mode), every floating parameter trainable, CPU RNG untouched;
    all restored."""
    modes = [(m, m.training) for m in model.modules()]
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        model.train(training)
        for p, _ in flags:
            if p.is_floating_point():
                p.requires_grad_(True)
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        for m, training in modes:
            m.training = training
        for p, flag in flags:
            p.requires_grad_(flag)


def _needing_grad(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """Floating tensors as fresh leaves that need gradients, so the graph shows them as inputs."""
    return tuple(v.detach().requires_grad_(True) if isinstance(v, torch.Tensor)
                 and v.is_floating_point() else v for v in values)


def output_tensors(out: object) -> list[torch.Tensor]:
    """Every tensor in a (nested) forward output: tensors, tuples, lists, dicts, dataclasses."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in output_tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in output_tensors(v)]
    if hasattr(out, "__dataclass_fields__"):
        return [t for k in out.__dataclass_fields__ for t in output_tensors(getattr(out, k))]
    return []


def differs(got: torch.Tensor | None, want: torch.Tensor, rank: int) -> str | None:
    """Why ``got`` (one rank's probe value) is not ``want``, or ``None`` when it is."""
    if got is None:
        return f"rank {rank}: not called"
    if got.shape != want.shape:
        return f"rank {rank}: shape {tuple(got.shape)} instead of {tuple(want.shape)}"
    # Same ops on the same numbers, only fewer heads/features per call: any
    # difference beyond reordered float sums means the split is wrong. In bf16/fp16
    # (a model on the GPU) kernels picked per shape may round differently: a few
    # ulps of the largest value; a wrong split differs by the values themselves.
    # NaN (a fully masked row of the probe's dummy inputs) must sit in the same places;
    # the scale is the finite values' (max() with a NaN scale gave a NaN tolerance)
    finite = want[want.isfinite()] if want.is_floating_point() else want
    scale = finite.abs().max().item() if finite.numel() else 0.0
    ulps = 8 * torch.finfo(want.dtype).eps if want.is_floating_point() else 0.0
    if not torch.allclose(got, want, rtol=max(1e-4, ulps), atol=max(1e-5, ulps) * max(scale, 1.0),
                          equal_nan=True):
        diff = (got - want).abs().nan_to_num(nan=0.0).max().item()
        return f"rank {rank}: differs by up to {diff:.3g}" if diff else \
            f"rank {rank}: NaN where the full computation has none, or the reverse"
    return None


def kept_on_modules(model: nn.Module) -> list[torch.Tensor]:
    """Tensors with a gradient history a forward left on its modules (``self.l_aux = ...``)."""
    kept = []
    for module in model.modules():
        for value in vars(module).values():
            items = value if isinstance(value, (list, tuple)) else \
                list(value.values()) if isinstance(value, dict) else [value]
            kept += [t for t in items if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    return kept
