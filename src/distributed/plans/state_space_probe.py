"""Confirm a state-space mixer's head split on the real module before any weight is cut.

The mixer's forward is the model's own code; whether it reads the cut parts
where the split put them (its ``[z | x | B | C | dt]`` packing, the sizes it
takes from its attributes, buffers such as Falcon-H1's ``mup_vector``) is
checked by running it. In one process, in float64, on fixed-seed inputs: the
whole mixer once, then every rank's cut of it (the styles' own layouts and
``apply``); the gated norm as
:class:`~torchtp.layers.gated_norm.GroupShardedGatedRMSNorm` computes it, with
each group's sum of squares summed over the simulated ranks that share it, and
``out_proj`` by its columns. The ranks' outputs must sum to the whole mixer's.
Every rank runs the same simulation, so all reach the same verdict.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..core.layouts import group_ranks
from ..layers.gated_norm import GroupShardedGatedRMSNorm, finish_gated_norm, gated_squares
from .linear_view import linear_view
from .resolved import ResolvedPlan
from .styles import LayerPlan, LinearStyle, ParallelStyle, Rowwise, ShardContext
from .styles_state_space import SsmHeads

TOKENS = (2, 7)  # batch, sequence: more than one chunk of the tiny probes' scans
# The gated norms compute in float32 whatever the input's dtype (as transformers' do):
# float32-level agreement; a part read in the wrong place differs at O(1).
RTOL = 1e-5


class _Capture(nn.Module):
    """A part's stand-in in the first pass: records its arguments and returns its own local
    output, or its input where the part itself needs the collective (the gated norm of a
    shared group); what follows is not used."""

    def __init__(self, part: nn.Module, local: bool) -> None:
        super().__init__()
        self.part = part
        self.local = local
        self.seen: tuple[torch.Tensor, ...] = ()

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        self.seen = args
        return self.part(*args) if self.local else args[0]


class _Fixed(nn.Module):
    """A part's stand-in in the second pass: what the whole group's collective gives."""

    def __init__(self, out: torch.Tensor) -> None:
        super().__init__()
        self.out = out

    def forward(self, *_a: object, **_k: object) -> torch.Tensor:
        return self.out


def probe_mixer(mixer: nn.Module, name: str, plan: ResolvedPlan, ctx: ShardContext
                ) -> str | None:
    """None when every rank's cut of ``mixer`` sums to its output, else why not.

    Args:
        mixer: The mixer (or the same module of a CPU copy of the model); weights
            are copied to float64, the module is not changed.
        name: Its name in the plan (its parts are ``name.in_proj`` ...).
        plan: The plan with the mixer's parts assigned.
        ctx: The tp size.
    """
    if any(t.is_meta for t in [*mixer.parameters(), *mixer.buffers()]):
        return "the model is on the meta device: the split cannot be probed before it is cut"
    whole = copy.deepcopy(mixer).to("cpu", torch.float64).eval()
    out = whole.get_submodule("out_proj")
    view = linear_view(out)
    assert view is not None  # the geometry checked it
    x = torch.randn(*TOKENS, view.out_features, dtype=torch.float64,  # (B, T, hidden)
                    generator=torch.Generator().manual_seed(0))
    styles = {"": plan.assignments[name],
              **{n.removeprefix(f"{name}."): s for n, s in plan.assignments.items()
                 if n.startswith(f"{name}.") and "." not in n.removeprefix(f"{name}.")}}
    mixer_style = styles[""]
    assert isinstance(mixer_style, SsmHeads) and mixer_style.geometry is not None
    bias = getattr(out, "bias", None)
    try:
        with torch.no_grad():
            want = whole(x)
            ranks = [_cut(whole, name, styles, ShardContext(ctx.world_size, r, None, "probe"))
                     for r in range(ctx.world_size)]
            got = _run(ranks, x, getattr(mixer_style.geometry, "groups", 1))
            if isinstance(bias, torch.Tensor):
                got = got + bias
    except Exception as err:  # the mixer's own code does not run on the cut parts
        return f"the probe forward of the cut mixer failed ({type(err).__name__}: {err})"
    error = float((got - want).abs().max())
    if error > RTOL * max(1.0, float(want.abs().max())):
        return (f"the ranks' outputs summed differ from the whole mixer's by {error:.3g} "
                "(it does not read its parts where the split puts them)")
    return None


def _cut(whole: nn.Module, name: str, styles: dict[str, ParallelStyle],
         ctx: ShardContext) -> nn.Module:
    """Rank ``ctx.rank``'s mixer: parts cut by their styles, no collective anywhere."""
    local = copy.deepcopy(whole)
    for leaf, style in styles.items():
        module = local.get_submodule(leaf) if leaf else local
        layer = style.plan(module, f"{name}.{leaf}" if leaf else name, ctx)
        new: nn.Module
        if isinstance(style, LinearStyle):  # a row split's bias is added once, after the sum
            new = _linear(layer, module, bias=not isinstance(style, Rowwise))
        else:
            new = style.apply(module, layer, ctx)
        if leaf:
            setattr(local, leaf, new)
        else:
            local = new
    return local


def _linear(layer: LayerPlan, module: nn.Module, bias: bool) -> nn.Linear:
    """A plain Linear holding this rank's slice (the cut the parallel layer would hold)."""
    full_weight, full_bias = module.weight, getattr(module, "bias", None)
    assert isinstance(full_weight, torch.Tensor)
    weight = layer.layouts["weight"].take(full_weight)
    keep_bias = bias and isinstance(full_bias, torch.Tensor)
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=keep_bias, dtype=weight.dtype)
    out.weight.data = weight
    if isinstance(full_bias, torch.Tensor) and keep_bias:
        out.bias.data = layer.layouts["bias"].take(full_bias)
    return out


def _run(ranks: list[nn.Module], x: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum of every rank's mixer output, each part that meets a collective (the gated norm of
    a shared group, a Mamba-1 mixer's ``x_proj``) fed what the collective would give."""
    leaf = ("norm" if isinstance(getattr(ranks[0], "norm", None), GroupShardedGatedRMSNorm)
            else "x_proj" if hasattr(ranks[0], "x_proj") else None)
    if leaf is None:
        return torch.stack([m(x) for m in ranks]).sum(0)
    captures = []
    for mixer in ranks:  # first pass: what reaches each rank's part
        capture = _Capture(mixer.get_submodule(leaf), local=leaf == "x_proj")
        setattr(mixer, leaf, capture)
        mixer(x)
        captures.append(capture)
    outs = _gated_norms(captures, groups) if leaf == "norm" else _summed(captures)
    outputs = []
    for mixer, out in zip(ranks, outs, strict=True):
        setattr(mixer, leaf, _Fixed(out))  # second pass: the rank's output
        outputs.append(mixer(x))
    return torch.stack(outputs).sum(0)


def _summed(captures: list[_Capture]) -> list[torch.Tensor]:
    """The all-reduce of the ranks' partial outputs (``x_proj``), on every rank."""
    total = torch.stack([c.part(*c.seen) for c in captures]).sum(0)
    return [total] * len(captures)


def _gated_norms(captures: list[_Capture], groups: int) -> list[torch.Tensor]:
    """Each rank's gated norm, its groups' sums of squares summed over the ranks sharing them."""
    norms = [n for c in captures if isinstance(n := c.part, GroupShardedGatedRMSNorm)]
    assert len(norms) == len(captures)
    parts = [gated_squares(c.seen[0], c.seen[1] if len(c.seen) > 1 else None, n.groups,
                           n.norm_before_gate) for c, n in zip(captures, norms, strict=True)]
    sharing = group_ranks(groups, len(captures))
    outs = []
    for r, (c, norm) in enumerate(zip(captures, norms, strict=True)):
        squares = parts[r][1]
        if norm.sharing > 1:  # the ranks holding the same group, as the sub-group sums
            holders = next(g for g in sharing if r in g)
            squares = torch.stack([parts[s][1] for s in holders]).sum(0)
        outs.append(finish_gated_norm(parts[r][0], squares, norm.weight, norm.variance_epsilon,
                                      norm.group_size, c.seen[1] if len(c.seen) > 1 else None,
                                      c.seen[0].dtype, norm.norm_before_gate, norm.weight_last))
    return outs
