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
from .styles import LayerPlan, ParallelStyle, ShardContext
from .styles_state_space import SsmHeads

TOKENS = (2, 7)  # batch, sequence: more than one chunk of the tiny probes' scans
# The gated norms compute in float32 whatever the input's dtype (as transformers' do):
# float32-level agreement; a part read in the wrong place differs at O(1).
RTOL = 1e-5


class _Capture(nn.Module):
    """The norm's stand-in in the first pass: records ``(x, gate)``, returns ``x``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        self.seen = (x, gate)
        return x


class _Fixed(nn.Module):
    """The norm's stand-in in the second pass: the rank's normalised channels."""

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
    into, out = linear_view(whole.get_submodule("in_proj")), whole.get_submodule("out_proj")
    assert into is not None  # mixer_geometry checked it
    x = torch.randn(*TOKENS, into.in_features, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(0))
    styles = {leaf: plan.assignments[f"{name}.{leaf}" if leaf else name]
              for leaf in ("", "in_proj", "conv1d", "norm", "out_proj")
              if (f"{name}.{leaf}" if leaf else name) in plan.assignments}
    mixer_style = styles[""]
    assert isinstance(mixer_style, SsmHeads) and mixer_style.geometry is not None
    bias = getattr(out, "bias", None)
    try:
        with torch.no_grad():
            want = whole(x)
            ranks = [_cut(whole, name, styles, ShardContext(ctx.world_size, r, None, "probe"))
                     for r in range(ctx.world_size)]
            got = _run(ranks, x, mixer_style.geometry.groups)
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
        if leaf in ("in_proj", "out_proj"):
            new = _linear(layer, module, bias=leaf == "in_proj")  # out_proj's bias added once
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
    """Sum of every rank's mixer output; the norm (if split) fed each group's full statistic."""
    norms = [m.get_submodule("norm") for m in ranks if hasattr(m, "norm")]
    if not all(isinstance(n, GroupShardedGatedRMSNorm) for n in norms) or not norms:
        return torch.stack([m(x) for m in ranks]).sum(0)
    captured = []
    for mixer in ranks:  # first pass: what reaches each rank's norm
        capture = _Capture()
        norm = mixer.get_submodule("norm")
        mixer.norm = capture
        mixer(x)
        assert isinstance(norm, GroupShardedGatedRMSNorm) and capture.seen is not None
        captured.append((norm, *capture.seen))
    parts = [gated_squares(y, gate, norm.groups, norm.norm_before_gate)
             for norm, y, gate in captured]
    sharing = group_ranks(groups, len(ranks))
    outputs = []
    for r, (mixer, (norm, y, gate)) in enumerate(zip(ranks, captured, strict=True)):
        squares = parts[r][1]
        if norm.sharing > 1:  # the ranks holding the same group, as the sub-group sums
            holders = next(g for g in sharing if r in g)
            squares = torch.stack([parts[s][1] for s in holders]).sum(0)
        out = finish_gated_norm(parts[r][0], squares, norm.weight, norm.variance_epsilon,
                                norm.group_size, gate, y.dtype, norm.norm_before_gate,
                                norm.weight_last)
        mixer.norm = _Fixed(out)  # second pass: the rank's output
        outputs.append(mixer(x))
    return torch.stack(outputs).sum(0)
