"""Styles that split state-space mixers and gated delta-nets by their heads.

Three geometries say how a mixer splits: :class:`MixerGeometry` (Mamba-2: heads
in B/C groups), :class:`ChannelGeometry` (Mamba-1: channels) and
:class:`DeltaGeometry` (gated delta-net: key heads with their value heads).
Heads read their B/C group (or key head) as attention's query heads read their
KV head, so every cut follows the head-boundary rule
(:func:`torchtp.core.layouts.head_share`, groups in the role of KV heads): a
rank keeps whole groups while tp <= their count; with more ranks, each group
is replicated on the ranks that use it, its heads split over them and its
gradient summed over them.

* :class:`SsmHeads` - the mixer itself: its own per-head (or per-channel)
  parameters (``A_log``, ``D``, ``dt_bias``) and any buffer as wide as
  ``in_proj``'s output (Falcon-H1's ``mup_vector``) cut, its size attributes
  set to this rank's.
* :class:`ChannelSplit` - the depthwise convolution, channel part by channel
  part (``[x | B | C]``, ``[x]`` or ``[q | k | v]``).
* :class:`SharedOutputColumns` - a Mamba-1 mixer's ``x_proj``: the dt/B/C it
  computes from every channel, all-reduced, read by every channel.
* :class:`GatedNormSplit` - a Mamba-2 mixer's gated RMS norm over the heads'
  channels (:class:`~torchtp.layers.gated_norm.GroupShardedGatedRMSNorm`).
* :class:`GroupBlocks` - a delta-net's projections packed per key head.

The other projections take :class:`~torchtp.plans.styles_heads.HeadSplit` (rows
by parts) and :class:`~torchtp.plans.styles_heads.HeadColumns`;
:mod:`torchtp.plans.state_space` finds the mixers and hands each part its style.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..core.layouts import ParamLayout, group_ranks, head_share
from ..layers.gated_norm import GroupShardedGatedRMSNorm
from ..layers.grad_sync import GradSync, mark
from ..layers.owned import hold_shards
from ..layers.shared_by_heads import SharedFeaturesEntry
from .constraints import Constraint
from .linear_view import LinearView
from .styles import Colwise, LayerPlan, ParallelStyle, ShardContext
from .styles_heads import (
    HeadColumns,
    Part,
    part_constraints,
    part_segments,
    shared_part_syncs,
)
from .subgroups import sharing_subgroup

# The mixer's attributes its forward reads as sizes (transformers 5.3-5.24: Mamba-2,
# Falcon-H1, Bamba, Zamba-2, NemotronH, GraniteMoeHybrid).
PER_HEAD = ("A_log", "D", "dt_bias")


@dataclass(frozen=True)
class MixerGeometry:
    """Heads, groups and sizes of one Mamba-2-style mixer.

    Attributes:
        heads: ``num_heads``.
        head_dim: Channels per head (``intermediate_size = heads * head_dim``).
        groups: ``n_groups`` (B/C groups; heads per group = heads / groups).
        state: ``ssm_state_size`` (B and C features per group).
    """

    heads: int
    head_dim: int
    groups: int
    state: int

    @property
    def inner(self) -> int:
        """``intermediate_size``: the scan's channels."""
        return self.heads * self.head_dim

    def head_part(self, name: str, size: int | None = None) -> Part:
        """A part of ``size`` rows (the heads' channels by default) split by whole heads."""
        return Part(self.inner if size is None else size, self.heads,
                    f"num_heads ({name})", kv_groups=self.groups)

    def group_part(self, name: str) -> Part:
        """B or C: one block of ``state`` features per group, replicated past ``groups`` ranks."""
        return Part(self.groups * self.state, self.groups, f"n_groups ({name})",
                    kv_groups=self.groups, is_kv=True)

    def conv_parts(self) -> tuple[Part, ...]:
        """The convolution's channels: ``[x | B | C]``."""
        return (self.head_part("x"), self.group_part("B"), self.group_part("C"))

    def in_proj_parts(self) -> tuple[Part, ...]:
        """``in_proj``'s output rows: ``[z | x | B | C | dt]``."""
        return (self.head_part("z"), *self.conv_parts(), self.head_part("dt", self.heads))

    def local(self, ctx: ShardContext) -> tuple[int, int]:
        """This rank's ``(heads, groups)``."""
        return (self.head_part("x").unit_range(ctx)[1],
                self.group_part("B").unit_range(ctx)[1])

    def sharing(self, ctx: ShardContext) -> int:
        """Ranks that hold this rank's group (1 while tp <= groups)."""
        if ctx.world_size <= self.groups:
            return 1
        return next(len(r) for r in group_ranks(self.groups, ctx.world_size) if ctx.rank in r)

    def own_part(self) -> Part:
        """How the mixer's own parameters split: ``A_log``, ``D``, ``dt_bias`` by heads."""
        return self.head_part("A_log, D, dt_bias", self.heads)

    def own_layouts(self, ctx: ShardContext) -> dict[str, ParamLayout]:
        """This rank's slice of each of the mixer's own parameters."""
        layout = ParamLayout((self.heads,), 0, (self.own_part().segment(0, ctx),))
        return {p: layout for p in PER_HEAD}

    def local_sizes(self, ctx: ShardContext) -> dict[str, int]:
        """The size attributes the mixer's forward reads, at this rank's share."""
        heads, groups = self.local(ctx)
        inner = heads * self.head_dim
        return {"num_heads": heads, "n_groups": groups, "intermediate_size": inner,
                "conv_dim": inner + 2 * groups * self.state,
                "groups_time_state_size": groups * self.state}

    def summary(self, ctx: ShardContext) -> str:
        """The split on this rank, for ``describe_plan()``."""
        heads, groups = self.local(ctx)
        return (f"{self.heads} heads in {self.groups} groups: {heads} heads, {groups} "
                "group(s) on this rank")


@dataclass(frozen=True)
class ChannelGeometry:
    """Channels of one Mamba-1-style mixer (Mamba, Falcon-Mamba, Jamba).

    Every channel has its own ``A_log`` row, ``D``, ``dt`` and scan state; the
    ``dt``/B/C that ``x_proj`` computes from all channels are read by every channel.

    Attributes:
        channels: ``intermediate_size``.
        state: ``ssm_state_size``.
        rank: ``time_step_rank`` (the ``dt`` features ``x_proj`` yields).
    """

    channels: int
    state: int
    rank: int

    def part(self, name: str) -> Part:
        """``channels`` rows split by channel."""
        return Part(self.channels, self.channels, f"intermediate_size ({name})")

    def in_proj_parts(self) -> tuple[Part, ...]:
        """``in_proj``'s output rows: ``[x | z]``."""
        return (self.part("x"), self.part("z"))

    def conv_parts(self) -> tuple[Part, ...]:
        """The convolution's channels: ``x``."""
        return (self.part("x"),)

    def own_part(self) -> Part:
        """How ``A_log`` (rows) and ``D`` split: by channel."""
        return self.part("A_log, D")

    def own_layouts(self, ctx: ShardContext) -> dict[str, ParamLayout]:
        """This rank's rows of ``A_log`` ``(channels, state)`` and ``D`` ``(channels,)``."""
        segment = (self.own_part().segment(0, ctx),)
        return {"A_log": ParamLayout((self.channels, self.state), 0, segment),
                "D": ParamLayout((self.channels,), 0, segment)}

    def local_sizes(self, ctx: ShardContext) -> dict[str, int]:
        """``intermediate_size`` at this rank's share."""
        return {"intermediate_size": self.own_part().unit_range(ctx)[1]}

    def summary(self, ctx: ShardContext) -> str:
        """The split on this rank, for ``describe_plan()``."""
        return (f"{self.channels} channels: {self.own_part().unit_range(ctx)[1]} on this rank; "
                "x_proj's dt/B/C all-reduced (forward), their gradient summed (backward)")


class SsmHeads(ParallelStyle):
    """The mixer module: its own per-head (or per-channel) parameters cut, its sizes made local.

    Args:
        geometry: The mixer's heads and groups, or channels (``None``: the style
            named in a plan, resolved by :mod:`torchtp.plans.state_space`).
    """

    name = "ssm_heads"

    def __init__(self, geometry: MixerGeometry | ChannelGeometry | DeltaGeometry | None = None
                 ) -> None:
        self.geometry = geometry

    def plan(self, module: nn.Module, fqn: str, ctx: ShardContext) -> LayerPlan:
        g = self.geometry
        if g is None:
            raise TypeError(f"plan style {self.name!r} for module '{fqn}' "
                            f"({type(module).__name__}) needs a Mamba-style mixer or a gated "
                            "delta-net (projections, conv1d, A_log and its sizes)")
        constraints = part_constraints(fqn, self.name, (g.own_part(),))
        full = g.own_layouts(ctx)["A_log"].full_shape
        if not all(c.ok(ctx.world_size) for c in constraints):
            return LayerPlan(fqn, self.name, constraints, full)
        layouts = g.own_layouts(ctx)
        return LayerPlan(fqn, self.name, constraints, full, layouts["A_log"].local_shape,
                         layouts, (), g.summary(ctx))

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        if ctx.world_size == 1 or not layer.layouts:
            return module
        g = self.geometry
        assert g is not None  # plan() refused otherwise
        width = sum(p.size for p in g.in_proj_parts())
        rows = [torch.arange(s, s + n) for s, n in part_segments(g.in_proj_parts(), ctx)]
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf.shape and buf.shape[-1] == width:  # Falcon-H1's mup_vector, (1, 1, width)
                setattr(module, name, buf.index_select(-1, torch.cat(rows).to(buf.device)))
        module.__dict__.update({k: v for k, v in g.local_sizes(ctx).items() if hasattr(module, k)})
        return hold_shards(module, dict(layer.layouts))


class ChannelSplit(ParallelStyle):
    """A depthwise ``nn.Conv1d`` cut channel part by channel part.

    Args:
        parts: The channels' parts, in order (the mixer's ``[x | B | C]``).
    """

    name = "ssm_conv_channels"

    def __init__(self, parts: tuple[Part, ...]) -> None:
        self.parts = parts

    def plan(self, module: nn.Module, fqn: str, ctx: ShardContext) -> LayerPlan:
        channels = sum(p.size for p in self.parts)
        if not (isinstance(module, nn.Conv1d) and module.groups == module.in_channels
                == module.out_channels == channels):
            raise TypeError(f"plan style {self.name!r} for module '{fqn}' "
                            f"({type(module).__name__}) needs a depthwise nn.Conv1d of {channels} "
                            "channels (groups = in_channels = out_channels)")
        constraints = part_constraints(fqn, self.name, self.parts)
        full = tuple(module.weight.shape)  # (channels, 1, kernel)
        if not all(c.ok(ctx.world_size) for c in constraints):
            return LayerPlan(fqn, self.name, constraints, full)
        segments = part_segments(self.parts, ctx)
        layouts = {"weight": ParamLayout(full, 0, segments)}
        if module.bias is not None:
            layouts["bias"] = ParamLayout((channels,), 0, segments)
        return LayerPlan(fqn, self.name, constraints, full, layouts["weight"].local_shape,
                         layouts, (), "channels split like in_proj's rows")

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        if ctx.world_size == 1 or not layer.layouts:
            return module
        channels = layer.layouts["weight"].local_shape[0]
        module.__dict__.update(in_channels=channels, out_channels=channels, groups=channels)
        syncs = shared_part_syncs(self.parts, ctx)
        held = hold_shards(module, dict(layer.layouts))
        if syncs:
            for name in layer.layouts:
                mark(held, name, syncs)
        return held


def gated_norm_groups(module: nn.Module, width: int) -> int | None:
    """Groups of a transformers gated RMS norm over ``width`` channels, or None if not one."""
    group_size = getattr(module, "group_size", None)
    if isinstance(group_size, int) and group_size > 0 and width % group_size == 0:
        return width // group_size
    groups = getattr(module, "n_groups", None)
    return groups if isinstance(groups, int) and groups > 0 and width % groups == 0 else None


class GatedNormSplit(ParallelStyle):
    """A mixer's gated RMS norm, its weight split like the heads' channels.

    Args:
        geometry: The mixer's heads and groups.
        mixer: The mixer's name (for ``describe_plan()``).
    """

    name = "ssm_gated_norm"

    def __init__(self, geometry: MixerGeometry, mixer: str) -> None:
        self.geometry = geometry
        self.mixer = mixer

    def plan(self, module: nn.Module, fqn: str, ctx: ShardContext) -> LayerPlan:
        g = self.geometry
        weight = getattr(module, "weight", None)
        eps = getattr(module, "variance_epsilon", None)
        if (not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (g.inner,)
                or not isinstance(eps, float) or gated_norm_groups(module, g.inner) != g.groups):
            raise TypeError(f"plan style {self.name!r} for module '{fqn}' "
                            f"({type(module).__name__}) needs a gated RMS norm of {g.inner} "
                            f"channels in {g.groups} groups with a variance_epsilon")
        part = g.head_part("gated norm channels")
        constraints = part_constraints(fqn, self.name, (part,))
        full = (g.inner,)
        if not all(c.ok(ctx.world_size) for c in constraints):
            return LayerPlan(fqn, self.name, constraints, full)
        layout = ParamLayout(full, 0, (part.segment(0, ctx),))
        shared = ctx.world_size > g.groups  # the same on every rank: plans are compared
        how = ("a group's sum of squares summed over the ranks sharing it (one all-reduce "
               "of (B, T, 1, 1))" if shared else "whole groups on every rank: no collective")
        return LayerPlan(fqn, self.name, constraints, full, layout.local_shape,
                         {"weight": layout}, ("all_reduce",) if shared else (),
                         f"weight split like the heads of '{self.mixer}'; {how}")

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        if ctx.world_size == 1 or not layer.layouts:
            return module
        g = self.geometry
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        local = nn.Parameter(layer.layouts["weight"].take(weight),
                             requires_grad=weight.requires_grad)
        sharing = g.sharing(ctx)
        groups = g.local(ctx)[1] if sharing == 1 else 1
        # Every rank asks for the sub-groups (creating them is collective), whatever it holds.
        shared = sharing_subgroup(ctx, g.groups) if ctx.world_size > g.groups else None
        group = shared if sharing > 1 else None
        before = bool(getattr(module, "norm_before_gate", False))
        eps = module.variance_epsilon
        assert isinstance(eps, float)  # plan() checked it
        return GroupShardedGatedRMSNorm(local, eps, g.inner // g.groups,
                                        groups, before, not hasattr(module, "norm_before_gate"),
                                        group, sharing, dict(layer.layouts), layer.fqn)


class SharedOutputColumns(HeadColumns):
    """A Mamba-1 mixer's ``x_proj``: input columns by channels, its output all-reduced, and
    its output's gradient summed over the ranks (each rank's channels read all of dt/B/C).

    Args:
        channels: The channels' part (``x_proj``'s in_features).
    """

    def __init__(self, channels: Part) -> None:
        super().__init__(channels, "ssm_heads")

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        swapped = super().apply(module, layer, ctx)
        if ctx.world_size > 1 and layer.layouts:
            out = layer.layouts["weight"].full_shape[0]
            swapped.register_forward_hook(SharedFeaturesEntry(out, ctx.group))
            # A LoRA branch beside it would miss the hook's gradient sum: PEFT refuses one.
            swapped.tp_partial_grad_output = True  # type: ignore[assignment]
        return swapped


@dataclass(frozen=True)
class DeltaGeometry:
    """Heads of one gated delta-net linear attention (Qwen3-Next).

    Each key head (q and k) serves ``v_heads / k_heads`` value heads (v, z, and
    the per-head ``b``/``a``, ``A_log``, ``dt_bias``): the roles of attention's KV
    and query heads in the head-boundary rule, so with more ranks than key heads
    a key head is replicated on the ranks that share its value heads.

    Attributes:
        k_heads: ``num_k_heads``.
        v_heads: ``num_v_heads``.
        k_dim: ``head_k_dim``.
        v_dim: ``head_v_dim``.
    """

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int

    def value_part(self, name: str, per_head: int) -> Part:
        """``per_head`` rows per value head, split by value heads (whole key groups)."""
        return Part(self.v_heads * per_head, self.v_heads, f"num_v_heads ({name})",
                    kv_groups=self.k_heads)

    def key_part(self, name: str) -> Part:
        """q or k: one block per key head, replicated past ``k_heads`` ranks."""
        return Part(self.k_heads * self.k_dim, self.k_heads, f"num_k_heads ({name})",
                    kv_groups=self.k_heads, is_kv=True)

    def conv_parts(self) -> tuple[Part, ...]:
        """The convolution's channels: ``[q | k | v]``."""
        return (self.key_part("q"), self.key_part("k"), self.value_part("v", self.v_dim))

    def in_proj_parts(self) -> tuple[Part, ...]:
        """No buffer follows the packed projections' rows."""
        return ()

    def own_part(self) -> Part:
        """``A_log`` and ``dt_bias``: by value heads."""
        return self.value_part("A_log, dt_bias", 1)

    def own_layouts(self, ctx: ShardContext) -> dict[str, ParamLayout]:
        """This rank's value heads of ``A_log`` and ``dt_bias``."""
        layout = ParamLayout((self.v_heads,), 0, (self.own_part().segment(0, ctx),))
        return {"A_log": layout, "dt_bias": layout}

    def local(self, ctx: ShardContext) -> tuple[int, int]:
        """This rank's ``(key heads, value heads)``."""
        return self.key_part("k").unit_range(ctx)[1], self.own_part().unit_range(ctx)[1]

    def local_sizes(self, ctx: ShardContext) -> dict[str, int]:
        """The size attributes the forward reads, at this rank's share."""
        k, v = self.local(ctx)
        return {"num_k_heads": k, "num_v_heads": v, "key_dim": k * self.k_dim,
                "value_dim": v * self.v_dim, "conv_dim": 2 * k * self.k_dim + v * self.v_dim}

    def summary(self, ctx: ShardContext) -> str:
        """The split on this rank, for ``describe_plan()``."""
        k, v = self.local(ctx)
        return (f"{self.k_heads} key heads, {self.v_heads} value heads: {k} key and {v} value "
                "head(s) on this rank")


class GroupBlocks(Colwise):
    """A projection packed per key head: ``[q_g | k_g | v_g | z_g]`` (or ``[b_g | a_g]``) for
    each key head ``g`` in turn; each rank keeps its key heads' blocks, or (more ranks than key
    heads) its key head's shared pieces whole and its share of the value heads' pieces.

    Args:
        geometry: The heads.
        pieces: Per key head, ``(rows, shared)`` in order: ``shared`` pieces (q, k) are
            read by all of the group's value heads; the others hold one slice per value head.
    """

    def __init__(self, geometry: DeltaGeometry, pieces: tuple[tuple[int, bool], ...]) -> None:
        super().__init__()
        self.name = "ssm_heads"
        self.geometry = geometry
        self.pieces = pieces

    def constraints(self, view: LinearView, fqn: str) -> list[Constraint]:
        return list(part_constraints(fqn, self.name, (self.geometry.own_part(),)))

    def _blocks(self, ctx: ShardContext) -> list[tuple[int, int, bool]]:
        """This rank's ``(start, rows, shared)`` pieces, in full-tensor rows."""
        g = self.geometry
        block, per_group = sum(r for r, _ in self.pieces), g.v_heads // g.k_heads
        (v_start, v_count), (k_start, k_count) = head_share(g.v_heads, g.k_heads,
                                                            ctx.world_size, ctx.rank)
        if v_count == k_count * per_group:  # whole key groups
            return [(k_start * block, k_count * block, False)]
        out, offset = [], k_start * block
        for rows, shared in self.pieces:
            unit = rows // per_group
            out.append((offset, rows, True) if shared else
                       (offset + (v_start - k_start * per_group) * unit, v_count * unit, False))
            offset += rows
        return out

    def row_segments(self, view: LinearView, ctx: ShardContext) -> tuple[tuple[int, int], ...]:
        return tuple((s, n) for s, n, _ in self._blocks(ctx))

    def detail(self, view: LinearView) -> str:
        return (f"blocks of {self.geometry.k_heads} key heads, each with its "
                f"{self.geometry.v_heads // self.geometry.k_heads} value heads")

    def apply(self, module: nn.Module, layer: LayerPlan, ctx: ShardContext) -> nn.Module:
        swapped = super().apply(module, layer, ctx)
        k_heads = self.geometry.k_heads
        # Every rank asks for the sub-groups (creating them is collective), whatever it holds.
        group = sharing_subgroup(ctx, k_heads) if ctx.world_size > k_heads else None
        syncs, local = [], 0
        for _, rows, shared in self._blocks(ctx):
            if shared:  # a replicated key head: each rank's gradient covers its value heads
                syncs.append(GradSync(group, (local, rows)))
            local += rows
        if syncs:
            for name, _ in swapped.named_parameters(recurse=False):
                mark(swapped, name, tuple(syncs))
        return swapped
