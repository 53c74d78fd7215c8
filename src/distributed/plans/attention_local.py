"""Give an attention module whose heads are split this rank's head counts and widths.

After the swap (:func:`localize_attention`), and during the automatic plan's
local probe (:func:`local_overrides`), the attributes an attention module's
forward reads are set to one rank's values: head counts, widths, the query
heads per KV head, and whatever a model family adds through
:func:`torchtp.plans.sources.attention_overrides` (HuggingFace: a per-module
copy of ``config``). Per-head biases passed into the module (ALiBi) are
narrowed to the rank's heads (:func:`narrow_head_biases`).

The attribute names are public attributes of attention modules across model
families; the HuggingFace ones were checked against transformers 5.3.0,
5.23.0, 5.24.0.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..core.layouts import cut, head_share
from .heads import HEAD_ATTRS, KV_ATTRS, HeadInfo
from .sources import attention_overrides
from .styles import ShardContext

# Widths that hold ``heads * head_dim``, and the query heads per KV head; the head
# count families are in :mod:`torchtp.plans.heads`.
WIDTH_ATTRS = ("all_head_size", "split_size", "embed_dim", "inner_dim", "hidden_size",
               "hidden_size_per_partition", "inner_size", "n_embd", "attn_dim")
GROUP_ATTRS = ("num_key_value_groups", "n_rep")  # query heads per KV head

# Per-head attention biases (ALiBi) that some models compute once, outside their
# attention modules, and pass in by keyword: keyword -> whether dim 0 is
# (batch * heads) (Bloom's ``alibi``, ``(B*H, 1, kv)``) or heads (MPT's
# ``position_bias``, ``(H, 1, kv)``). T5's ``position_bias`` ``(B, H, q, k)`` (heads
# on dim 1) is narrowed when it arrives whole; the first layer computes it through
# ``compute_bias``, which :func:`local_overrides` narrows, so later layers get it local.
HEAD_BIAS_KWARGS = {"alibi": True, "position_bias": False}


def local_heads(info: HeadInfo, ctx: ShardContext) -> tuple[int, int]:
    """This rank's ``(query heads, KV heads)`` by :func:`torchtp.core.layouts.head_share`."""
    (_, heads), (_, kv) = head_share(info.heads, info.kv_heads, ctx.world_size, ctx.rank)
    return heads, kv


def localize_attention(model: nn.Module, infos: dict[str, HeadInfo], ctx: ShardContext) -> None:
    """Set each head-split attention module's head counts and widths to this rank's values.

    Per-head biases passed into the module (ALiBi) are narrowed to its heads too.
    """
    for name, info in infos.items():
        module = model.get_submodule(name)
        for attr, value in local_overrides(module, info, ctx).items():
            setattr(module, attr, value)
        narrow_head_biases(module, info, ctx)


def local_overrides(module: nn.Module, info: HeadInfo, ctx: ShardContext) -> dict[str, object]:
    """The attributes of ``module`` to set on this rank when its heads are split.

    Every attribute of the families above that holds the full value, the query
    heads per KV head (``num_key_value_groups``, ``n_rep``), and what the model
    family adds (:func:`torchtp.plans.sources.attention_overrides`).
    """
    heads, kv = local_heads(info, ctx)
    out: dict[str, object] = dict(local_values(module, info.heads, info.kv_heads, info.head_dim,
                                               heads, kv))
    for attr in GROUP_ATTRS:
        if getattr(module, attr, None) == info.heads // info.kv_heads:
            out[attr] = heads // kv
    out.update(attention_overrides(module, info.heads, info.kv_heads, info.head_dim, heads, kv))
    if callable(getattr(module, "compute_bias", None)):
        out["compute_bias"] = _local_bias(module.compute_bias, _head_range(info, ctx))
    return out


def _head_range(info: HeadInfo, ctx: ShardContext) -> tuple[tuple[int, int], ...]:
    """This rank's query heads as one ``(first, count)`` segment."""
    (first, count), _ = head_share(info.heads, info.kv_heads, ctx.world_size, ctx.rank)
    return ((first, count),)


def _local_bias(compute: Any, share: tuple[tuple[int, int], ...]) -> Any:
    """A T5-style ``compute_bias`` (the relative position bias of every head,
    ``(1, H, q, k)``, from a table held whole on every rank) that returns this rank's
    heads only. The table's gradient then covers this rank's heads' columns; its
    style (``replicated_with_grad_allreduce``) sums it over the group."""

    def local(*args: Any, **kwargs: Any) -> torch.Tensor:
        return cut(compute(*args, **kwargs), 1, share)  # (1, H/tp, q, k)

    return local


def local_values(obj: object, heads: int, kv_heads: int, head_dim: int, local_heads: int,
                 local_kv: int) -> dict[str, int]:
    """Attributes of ``obj`` holding full head counts/widths -> this rank's values."""
    width = heads * head_dim
    out: dict[str, int] = {}
    for attr in HEAD_ATTRS:
        if getattr(obj, attr, None) == heads:
            out[attr] = local_heads
    for attr in KV_ATTRS:
        if getattr(obj, attr, None) == kv_heads:
            out[attr] = local_kv
    for attr in WIDTH_ATTRS:
        if getattr(obj, attr, None) == width:
            out[attr] = local_heads * head_dim
    return out


def narrow_head_biases(module: nn.Module, info: HeadInfo, ctx: ShardContext
                       ) -> RemovableHandle | None:
    """Pass ``module`` only this rank's query heads of the per-head biases it reads.

    Installs a forward pre-hook when ``module.forward`` takes one of
    :data:`HEAD_BIAS_KWARGS` (``None`` otherwise); a bias whose head dimension
    is not the full head count is passed unchanged, so a shape error downstream
    names the mismatch.
    """
    (first, count), _ = head_share(info.heads, info.kv_heads, ctx.world_size, ctx.rank)
    share, heads = ((first, count),), info.heads
    params = inspect.signature(module.forward).parameters
    keys = {k: batched for k, batched in HEAD_BIAS_KWARGS.items() if k in params}
    if not keys:
        return None

    def hook(_mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        for key, batched in keys.items():
            bias = kwargs.get(key)
            if not isinstance(bias, torch.Tensor):
                continue
            if bias.dim() == 4 and bias.shape[1] == heads:  # T5: (B, H, q, k) -> (B, count, ...)
                kwargs[key] = cut(bias, 1, share)
            elif bias.dim() != 3:
                continue
            elif batched and bias.shape[0] % heads == 0:  # (B*H, 1, kv) -> (B*count, 1, kv)
                kwargs[key] = cut(bias.unflatten(0, (-1, heads)), 1, share).flatten(0, 1)
            elif not batched and bias.shape[0] == heads:  # (H, 1, kv) -> (count, 1, kv)
                kwargs[key] = cut(bias, 0, share)
        return args, kwargs

    return module.register_forward_pre_hook(hook, with_kwargs=True)
