"""Split state-space mixers and linear attention by heads (a resolve step), as vLLM does.

Three kinds, one style name (``ssm_heads``, on the mixer module), each part cut
by the one head-boundary rule:

* **Mamba-2 style** (``Mamba2Mixer``, Falcon-H1's): ``in_proj`` packs
  ``[z | x | B | C | dt]``, a depthwise convolution runs over ``[x | B | C]``, a
  selective scan per head reads its group's B and C, a gated norm per group,
  ``out_proj``. Split by heads, B/C by groups; one all-reduce per mixer, plus
  one ``(B, T, 1, 1)`` all-reduce in the norm when ranks share a group.
* **Mamba-1 style** (``MambaMixer``, Jamba's): ``in_proj`` ``[x | z]``, the
  convolution, ``x_proj`` computing dt/B/C from every channel, ``dt_proj``, a
  scan per channel, ``out_proj``. Split by channels; ``x_proj``'s output
  all-reduced (its gradient summed), then ``out_proj``'s.
* **Gated delta-net** (Qwen3-Next): ``in_proj_qkvz``/``in_proj_ba`` packed per key
  head, the convolution over ``[q | k | v]``, a per-head gated norm,
  ``out_proj``. Split by key heads with their value heads; one all-reduce.

:func:`split_mixers` gives each part its style
(:mod:`torchtp.plans.styles_state_space`). The cache's conv and recurrent
states take the local shapes by themselves (transformers allocates them from
the first tensors it stores; before 5.5 it allocated a Mamba-style mixer's from
the config, and those mixers stay whole there: the family's ``mixer_limit``).
Every split is confirmed by
:func:`~torchtp.plans.state_space_probe.probe_mixer` before anything is cut;
one that is not stays replicated with the reason in ``describe_plan()`` (a
user's plan is refused).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from .heads import INDEX, ssm_geometry
from .resolved import ResolvedPlan, is_user_plan
from .sources import family_of, mixer_limit
from .state_space_probe import probe_mixer
from .styles import ParallelStyle, Replicate, ReplicatedWithGradAllreduce, ShardContext
from .styles_heads import HeadColumns, HeadSplit
from .styles_state_space import (
    ChannelGeometry,
    ChannelSplit,
    DeltaGeometry,
    GatedNormSplit,
    GroupBlocks,
    MixerGeometry,
    SharedOutputColumns,
    SsmHeads,
    gated_norm_groups,
)

# Packages whose fused training kernel (mamba_split_conv1d_scan_combined) transformers
# calls instead of the mixer's torch path: it computes the norm and out_proj inside.
FUSED_KERNELS = ("mamba_ssm", "kernels")
Geometry = MixerGeometry | ChannelGeometry | DeltaGeometry


def _unsupported(module: nn.Module, geometry: Geometry | None) -> str | None:
    """Why this mixer cannot be split here, or None."""
    if geometry is None:
        return (f"{type(module).__name__} is not a Mamba-style mixer or gated delta-net (in_proj, "
                "conv1d, out_proj, A_log and the sizes its forward reads)")
    if isinstance(geometry, DeltaGeometry):  # its kernels (FLA's) work head by head
        return None
    fused = [k for k in FUSED_KERNELS if importlib.util.find_spec(k) is not None]
    if fused:
        return (f"{fused[0]} is installed: transformers' fused training kernels "
                "(mamba_split_conv1d_scan_combined, mamba_inner_fn) would compute the norm and "
                "out_proj of every rank's heads inside one call, past the all-reduce a split "
                "needs")
    limit = mixer_limit(module)
    if limit is not None:
        return limit
    if getattr(getattr(module, "config", None), "quantization_config", None) is not None:
        return ("the model is quantized: its mixer then calls dt_proj as a module, which a "
                "channel split of x_proj's gradient would count twice")
    norm = getattr(module, "norm", None)
    if (isinstance(geometry, MixerGeometry) and isinstance(norm, nn.Module)
            and isinstance(getattr(norm, "weight", None), torch.Tensor)
            and gated_norm_groups(norm, geometry.inner) != geometry.groups):
        return (f"its norm ({type(norm).__name__}) is not a gated RMS norm over n_groups="
                f"{geometry.groups} groups")
    return None


def split_mixers(model: nn.Module, plan: ResolvedPlan, ctx: ShardContext,
                 verify: bool = True) -> list[ValueError]:
    """Give the parts of every mixer the plan names ``ssm_heads`` their styles, confirmed.

    Args:
        model: The model being planned (may live on the meta device: the probe
            then runs on its family's CPU copy).
        plan: The matched plan; ``plan.checks`` gets one verdict per mixer.
        ctx: The tp size.
        verify: ``False`` (``verify_plan=False``): split without the probe.

    Returns:
        One error per mixer of a user's plan that cannot be split (empty otherwise).
    """
    modules = dict(model.named_modules())
    errors = []
    copies: list[nn.Module] = []  # the family's CPU copy, built once if a mixer is on meta
    for name, style in list(plan.assignments.items()):
        if not isinstance(style, SsmHeads):
            continue
        geometry = ssm_geometry(modules[name])
        why = _unsupported(modules[name], geometry)
        fix = (f"name the mixer module itself (e.g. '{name}.mixer'), or keep it whole"
               if geometry is None else "keep it whole")
        if why is None and ctx.world_size > 1:
            assert geometry is not None
            _assign(plan, modules, name, geometry)
            if verify:
                why = probe_mixer(_probe_target(model, name, copies), name, plan, ctx)
                fix = "keep it whole, or pass verify_plan=False to take on its exactness"
        if why is None:
            plan.checks[name] = ("tp 1: nothing to split" if ctx.world_size == 1 else
                                 "confirmed" if verify else "not verified (verify_plan=False)")
        elif is_user_plan(plan.source):
            errors.append(ValueError(
                f"plan style 'ssm_heads' for module '{name}' ({type(modules[name]).__name__}) "
                f"at world_size={ctx.world_size}: {why}; {fix} (plan= with '{name}': "
                "'replicate')"))
        else:
            _replicate(plan, modules, name, why)
    return errors


def _probe_target(model: nn.Module, name: str, copies: list[nn.Module]) -> nn.Module:
    """The module to probe: the mixer itself, or on the meta device the same-pattern mixer
    of the model family's CPU copy (when it has one)."""
    mixer = model.get_submodule(name)
    if not any(t.is_meta for t in mixer.parameters()):
        return mixer
    if not copies:
        family = family_of(model)
        small = family.probe_copy(model) if family is not None else None
        copies.append(small if small is not None else mixer)
    pattern = INDEX.sub(".*", name)
    return next((m for n, m in copies[0].named_modules()
                 if INDEX.sub(".*", n) == pattern and ssm_geometry(m) is not None), mixer)


def _assign(plan: ResolvedPlan, modules: dict[str, nn.Module], mixer: str, g: Geometry) -> None:
    """The mixer's parts' styles, each with its reason."""
    if isinstance(g, MixerGeometry):
        styles, reasons = _head_styles(modules, mixer, g)
        what = f"{g.heads} heads in {g.groups} group(s) of state-space mixer '{mixer}'"
    elif isinstance(g, ChannelGeometry):
        styles, reasons = _channel_styles(modules, mixer, g)
        what = f"{g.channels} channels of state-space mixer '{mixer}'"
    else:
        styles, reasons = _delta_styles(g)
        what = f"{g.k_heads} key and {g.v_heads} value heads of gated delta-net '{mixer}'"
    for leaf, style in styles.items():
        full = f"{mixer}.{leaf}" if leaf else mixer
        plan.assignments[full] = style
        plan.why[full] = f"{reasons[leaf]} ({what})"


Styles = tuple[dict[str, ParallelStyle], dict[str, str]]


def _delta_styles(g: DeltaGeometry) -> Styles:
    """A gated delta-net's parts by key heads, each with its value heads."""
    per_group = g.v_heads // g.k_heads
    styles: dict[str, ParallelStyle] = {
        "": SsmHeads(g),
        "in_proj_qkvz": GroupBlocks(g, ((g.k_dim, True), (g.k_dim, True),
                                        (per_group * g.v_dim, False),
                                        (per_group * g.v_dim, False))),
        "in_proj_ba": GroupBlocks(g, ((per_group, False), (per_group, False))),
        "conv1d": ChannelSplit(g.conv_parts()), "norm": ReplicatedWithGradAllreduce(),
        "out_proj": HeadColumns(g.value_part("out_proj input", g.v_dim), "ssm_heads")}
    return styles, {"": "ssm_heads: A_log and dt_bias by value heads",
                    "in_proj_qkvz": "[q | k | v | z] blocks by key heads (v, z by value heads)",
                    "in_proj_ba": "[b | a] blocks by key heads (by value heads)",
                    "conv1d": "depthwise channels [q | k | v] by key and value heads",
                    "norm": "a per-head gated norm: whole, its gradient summed",
                    "out_proj": "input columns by the value heads; one all-reduce"}


def _head_styles(modules: dict[str, nn.Module], mixer: str, g: MixerGeometry) -> Styles:
    """A Mamba-2-style mixer's parts by heads (B/C by groups)."""
    styles: dict[str, ParallelStyle] = {
        "": SsmHeads(g), "in_proj": HeadSplit(g.in_proj_parts(), "ssm_heads"),
        "conv1d": ChannelSplit(g.conv_parts()),
        "out_proj": HeadColumns(g.head_part("out_proj input"), "ssm_heads")}
    norm = getattr(modules[mixer], "norm", None)
    if isinstance(norm, nn.Module) and isinstance(getattr(norm, "weight", None), torch.Tensor):
        styles["norm"] = GatedNormSplit(g, mixer)
    return styles, {"": "ssm_heads: A_log, D and dt_bias by heads",
                    "in_proj": "[z | x | B | C | dt] rows by heads (B and C by groups)",
                    "conv1d": "depthwise channels [x | B | C] by heads and groups",
                    "norm": "gated RMS norm by the heads' channels",
                    "out_proj": "input columns by the heads' channels; one all-reduce"}


def _channel_styles(modules: dict[str, nn.Module], mixer: str, g: ChannelGeometry) -> Styles:
    """A Mamba-1-style mixer's parts by channels; ``x_proj`` reduced, its norms' gradients
    summed (each rank's channels read all of dt/B/C)."""
    styles: dict[str, ParallelStyle] = {
        "": SsmHeads(g), "in_proj": HeadSplit(g.in_proj_parts(), "ssm_heads"),
        "conv1d": ChannelSplit(g.conv_parts()), "x_proj": SharedOutputColumns(g.part("x")),
        "dt_proj": HeadSplit((g.part("dt"),), "ssm_heads"),
        "out_proj": HeadColumns(g.part("out_proj input"), "ssm_heads")}
    reasons = {"": "ssm_heads: A_log rows and D by channels",
               "in_proj": "[x | z] rows by channels", "conv1d": "depthwise channels by channels",
               "x_proj": "input columns by channels; dt/B/C all-reduced, their gradient summed",
               "dt_proj": "rows by channels (its weight is read directly)",
               "out_proj": "input columns by channels; one all-reduce"}
    for leaf in ("dt_layernorm", "b_layernorm", "c_layernorm"):
        if isinstance(getattr(modules[mixer], leaf, None), nn.Module):
            styles[leaf] = ReplicatedWithGradAllreduce()
            reasons[leaf] = "whole on every rank, its gradient summed (read by every channel)"
    return styles, reasons


def _replicate(plan: ResolvedPlan, modules: dict[str, nn.Module], mixer: str, why: str) -> None:
    """Keep the mixer and every part of it whole, saying why."""
    plan.checks[mixer] = f"kept replicated: {why}"
    for name in [mixer, *(n for n in modules if n.startswith(f"{mixer}."))]:
        if name in plan.assignments or name == mixer:
            plan.assignments[name] = Replicate()
            plan.why[name] = f"state-space mixer kept replicated: {why}"
