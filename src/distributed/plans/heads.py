"""Head geometry: which modules are attention (or state-space mixers), and how their
projections map to heads.

Head counts are read from the module's own attributes (the families below,
across HuggingFace, torchtitan and timm naming; the HuggingFace ones checked
against transformers 5.3.0, 5.23.0, 5.24.0), then from a config object (a
HuggingFace model's text config, handed in by its model family, see
:mod:`torchtp.plans.sources`). Nothing here reads a weight or depends on one
model family.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from .linear_view import linear_view
from .styles_heads import Part
from .styles_state_space import PER_HEAD, ChannelGeometry, DeltaGeometry, MixerGeometry

# Attribute families attention modules read in their forward, across model
# families (Llama/Mistral/Qwen2: num_heads or config-only + head_dim and
# num_key_value_groups; GPT-2: num_heads/split_size/embed_dim; Falcon:
# num_heads/num_kv_heads; GPT-NeoX: head_size; Phi-3: reads self.config), and in
# hand-written models (torchtitan: n_heads/n_kv_heads/n_rep; timm: num_heads/attn_dim).
HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "num_attention_heads_per_partition")
KV_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_head_kv", "num_kv")
# A Mamba-2-style mixer's sizes, as its forward reads them (transformers 5.3-5.24).
MIXER_SIZES = ("num_heads", "head_dim", "n_groups", "ssm_state_size", "intermediate_size",
               "conv_dim")
INDEX = re.compile(r"\.\d+(?=\.|$)")  # a block index in a module name: "layers.3.mixer"
HEAD_DIM_ATTRS = ("head_dim", "head_size", "attention_head_size", "attn_head_size",
                  "key_value_proj_dim")  # the last: T5


@dataclass(frozen=True)
class HeadInfo:
    """Head geometry of one attention module.

    Attributes:
        heads: Query heads.
        kv_heads: Key/value heads.
        head_dim: Features per head of the query/key projections.
        value_dim: Features per head of the attention's output (its output
            projection reads ``heads * value_dim``); ``head_dim`` unless the module
            says otherwise (multi-head latent attention's ``v_head_dim``).
    """

    heads: int
    kv_heads: int
    head_dim: int
    value_dim: int = 0

    def __post_init__(self) -> None:
        if not self.value_dim:
            object.__setattr__(self, "value_dim", self.head_dim)


def _first_int(obj: object, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def head_info(module: nn.Module, config: object) -> HeadInfo | None:
    """Heads, KV heads and head size of ``module`` (its own attributes first, then config)."""
    heads = _first_int(module, HEAD_ATTRS) or _first_int(config, ("num_attention_heads", "n_head"))
    if heads is None:
        return None
    kv = _first_int(module, KV_ATTRS) or _first_int(config, ("num_key_value_heads", "num_kv_heads",
                                                             "n_head_kv"))
    if kv is None:
        kv = 1 if getattr(config, "multi_query", False) else heads
    hidden = _first_int(config, ("hidden_size", "n_embd", "d_model"))
    head_dim = (_first_int(module, HEAD_DIM_ATTRS) or _first_int(config, ("head_dim", "d_kv"))
                or (hidden // heads if hidden else None))
    if not head_dim:
        return None
    return HeadInfo(heads, kv, head_dim, _first_int(module, ("v_head_dim",)) or head_dim)


def is_attention(module: nn.Module) -> bool:
    """Whether ``module`` looks like an attention module (head attributes, or its class name)."""
    if any(hasattr(module, a) for a in HEAD_ATTRS + KV_ATTRS + HEAD_DIM_ATTRS):
        return True
    return "attention" in type(module).__name__.lower() or "attn" in type(module).__name__.lower()


def query_part(info: HeadInfo) -> Part:
    """The query heads as a part split by whole heads, keeping KV groups together."""
    return Part(info.heads * info.head_dim, info.heads, "num_attention_heads (query heads)",
                kv_groups=info.kv_heads)


def output_part(info: HeadInfo) -> Part:
    """The attention output's features (``value_dim`` per query head), split like the heads."""
    return Part(info.heads * info.value_dim, info.heads, "num_attention_heads (query heads)",
                kv_groups=info.kv_heads)


def head_parts(rows: int, style_name: str, info: HeadInfo) -> tuple[Part, ...] | None:
    """How a projection's output rows map to heads, or None if they do not."""
    h, k, d = info.heads, info.kv_heads, info.head_dim
    q = query_part(info)
    kv = Part(k * d, k, "num_key_value_heads (key/value heads)", kv_groups=k, is_kv=True)
    if rows == h * d:
        return (q,)
    if rows == k * d:
        return (kv,)
    if rows == (h + 2 * k) * d:
        if style_name == "packed_colwise":  # [q | k | v] stacked
            return (q, kv, kv)
        if k == h:  # per-head interleaved [q k v] groups (GPT-NeoX): whole heads stay together
            return (Part(rows, h, "num_attention_heads (fused q/k/v heads)"),)
    if h % k == 0 and rows % h == 0:
        # Every query head's own block of rows, one after another: Qwen3-Next's gated q_proj
        # ([q, gate] per head), latent attention's up-projections (nope + rope, or nope +
        # value, per head), Falcon's new architecture when its KV groups ([its query heads,
        # k, v] each) divide into heads. Whole KV groups per rank while tp <= KV heads; the
        # plan probe confirms the layout before anything is cut.
        return (Part(rows, h, f"num_attention_heads ({rows // h} rows per query head)",
                     kv_groups=k),)
    if rows == (h + 2 * k) * d and h % k == 0:
        # KV groups one after another, each [its query heads, k, v] (Falcon's new
        # architecture): whole groups per rank (fewer groups than ranks cannot split)
        return (Part(rows, k, "KV groups (each: its query heads, a key and a value head)"),)
    return None


def _all_ints(module: nn.Module, names: tuple[str, ...]) -> list[int] | None:
    """Every attribute in ``names`` as a positive int (as :func:`_first_int` reads one), or None."""
    values = [_first_int(module, (name,)) for name in names]
    return None if None in values else [v for v in values if v is not None]


def _shaped(module: nn.Module, names: tuple[str, ...], shape: tuple[int, ...]) -> bool:
    """Whether every attribute in ``names`` is a tensor of ``shape``."""
    return all(isinstance(t := getattr(module, n, None), torch.Tensor) and tuple(t.shape) == shape
               for n in names)


def mixer_geometry(module: nn.Module) -> MixerGeometry | None:
    """The heads and groups of a Mamba-2-style mixer, or None when ``module`` is not one."""
    sizes = _all_ints(module, MIXER_SIZES)
    if sizes is None:
        return None
    heads, head_dim, groups, state, inner, conv = sizes
    into_module, out_module = getattr(module, "in_proj", None), getattr(module, "out_proj", None)
    if not (isinstance(into_module, nn.Module) and isinstance(out_module, nn.Module)
            and isinstance(getattr(module, "conv1d", None), nn.Conv1d)):
        return None
    into, out = linear_view(into_module), linear_view(out_module)
    if (into is None or out is None or heads * head_dim != inner or heads % groups
            or conv != inner + 2 * groups * state or into.out_features != inner + conv + heads
            or out.in_features != inner):
        return None
    return MixerGeometry(heads, head_dim, groups, state) if _shaped(module, PER_HEAD, (heads,)) \
        else None


def channel_geometry(module: nn.Module) -> ChannelGeometry | None:
    """The channels of a Mamba-1-style mixer (Mamba, Falcon-Mamba, Jamba), or None."""
    sizes = _all_ints(module, ("intermediate_size", "ssm_state_size", "time_step_rank"))
    if sizes is None or not isinstance(getattr(module, "conv1d", None), nn.Conv1d):
        return None
    inner, state, rank = sizes
    views = {n: linear_view(m) if isinstance(m := getattr(module, n, None), nn.Module) else None
             for n in ("in_proj", "x_proj", "dt_proj", "out_proj")}
    shapes = {n: (v.out_features, v.in_features) for n, v in views.items() if v is not None}
    if shapes != {"in_proj": (2 * inner, shapes.get("in_proj", (0, 0))[1]),
                  "x_proj": (rank + 2 * state, inner), "dt_proj": (inner, rank),
                  "out_proj": (shapes.get("out_proj", (0, 0))[0], inner)}:
        return None
    if not (_shaped(module, ("A_log",), (inner, state)) and _shaped(module, ("D",), (inner,))):
        return None
    return ChannelGeometry(inner, state, rank)


def delta_geometry(module: nn.Module) -> DeltaGeometry | None:
    """The heads of a gated delta-net linear attention (Qwen3-Next), or None."""
    sizes = _all_ints(module, ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"))
    if sizes is None or sizes[1] % sizes[0] or not isinstance(getattr(module, "conv1d", None),
                                                               nn.Conv1d):
        return None
    g = DeltaGeometry(*sizes)
    key, value = g.k_heads * g.k_dim, g.v_heads * g.v_dim
    views = {n: linear_view(m) if isinstance(m := getattr(module, n, None), nn.Module) else None
             for n in ("in_proj_qkvz", "in_proj_ba", "out_proj")}
    rows = {n: v.out_features if n != "out_proj" else v.in_features
            for n, v in views.items() if v is not None}
    norm = getattr(getattr(module, "norm", None), "weight", None)
    if (rows != {"in_proj_qkvz": 2 * key + 2 * value, "in_proj_ba": 2 * g.v_heads,
                 "out_proj": value} or getattr(module, "conv_dim", None) != 2 * key + value
            or not isinstance(norm, torch.Tensor) or tuple(norm.shape) != (g.v_dim,)):
        return None
    return g if _shaped(module, ("A_log", "dt_bias"), (g.v_heads,)) else None


def ssm_geometry(module: nn.Module) -> MixerGeometry | ChannelGeometry | DeltaGeometry | None:
    """A state-space mixer's heads (Mamba-2 style), channels (Mamba-1 style) or a gated
    delta-net's key and value heads, or None."""
    return mixer_geometry(module) or channel_geometry(module) or delta_geometry(module)


def mixer_names(model: nn.Module) -> list[str]:
    """The names of ``model``'s state-space mixers (Mamba-1 or Mamba-2 style)."""
    return [name for name, module in model.named_modules() if ssm_geometry(module) is not None]


def mixer_rules(model: nn.Module) -> dict[str, str]:
    """``{pattern: "ssm_heads"}`` for every state-space mixer of ``model`` (layers as ``*``)."""
    return {INDEX.sub(".*", name): "ssm_heads" for name in mixer_names(model)}
