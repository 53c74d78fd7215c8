"""Context-parallel attention for HuggingFace models, through transformers' attention interface.

transformers calls attention through ``ALL_ATTENTION_FUNCTIONS`` by the
name in ``config._attn_implementation``. :func:`prepare` registers
torchtp's function under :data:`NAME` (``AttentionInterface.register``, the
public extension point; done when a model is wrapped, never at import), sets
the model's implementation to it (``set_attn_implementation``) and hands
each attention module the wrapper's :class:`CPState`. transformers builds no
mask for an implementation it does not know, so nothing is computed from
the local tokens; :func:`cp_attention_forward` builds the global one.

Only the families listed in :data:`SUPPORTED` are accepted: their attention
is causal (or sliding-window) softmax attention with at most sinks, which
this function reproduces exactly. Any other family is refused at wrap time:
a mask rule this function does not know (a prefix-LM, images attending
bidirectionally, soft-capped logits) would otherwise be silently replaced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..comm.group_ref import WeakGroup
from ..comm.runtime import ProcessGroup
from .attention import Algorithm, check_algorithm, choose, context_attention
from .batch import LocalBatch
from .masks import MaskRule

NAME = "torchtp_cp"
"""The attention implementation's name in transformers' registry."""

SUPPORTED: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral",
                              "gpt_oss", "olmo2", "phi3", "gpt2")
"""``config.model_type`` of the families whose attention torchtp reproduces exactly."""

NO_PACKING: tuple[str, ...] = ("gpt_oss",)
"""Families whose transformers mask ignores packed position ids (GPT-OSS builds its masks
without them), so documents would attend to each other in one process: packed rows
are refused for them rather than masked differently."""

BATCH_KWARG = "torchtp_cp_batch"
"""The keyword that carries the batch from ``ContextParallel`` to every attention call,
through transformers' ``**kwargs`` (so a layer that transformers' gradient
checkpointing recomputes in the backward still gets it)."""


@dataclass
class CPState:
    """What the attention of every layer needs for the current batch.

    Attributes:
        group: The context-parallel group (held weakly).
        algorithm: ``"auto"``, ``"allgather"``, ``"ulysses"`` or ``"ring"``.
        recompute: Recompute attention in the backward instead of saving the
            full sequence's keys, values and mask (:func:`~torchtp.cp.attention.context_attention`).
        batch: The current step's :class:`LocalBatch` for pipeline stages (set by
            ``PipelineSchedule``); ``ContextParallel`` hands its batch to every
            attention call through :data:`BATCH_KWARG` instead.
        chosen: The algorithm used per ``(heads, kv_heads)`` (shown by ``describe()``).
        pipeline: Prepared by a ``PipelineSchedule`` (pp x cp), not by ``ContextParallel``.
    """

    group: WeakGroup[ProcessGroup | None] = WeakGroup(required=True)
    algorithm: str = "auto"
    recompute: bool = True
    batch: LocalBatch | None = None
    chosen: dict[tuple[int, int], Algorithm] = field(default_factory=dict)
    pipeline: bool = False

    def pick(self, heads: int, kv_heads: int, cp: int, who: str) -> Algorithm:
        """The algorithm for a layer of ``heads`` query and ``kv_heads`` KV heads (per TP rank)."""
        key = (heads, kv_heads)
        if key not in self.chosen:
            check_algorithm(self.algorithm, heads, cp, who)
            self.chosen[key] = (choose(heads, kv_heads, cp) if self.algorithm == "auto"
                                else self.algorithm)  # type: ignore[assignment]
        return self.chosen[key]


def hf_model_of(model: nn.Module) -> nn.Module | None:
    """The outermost HuggingFace ``PreTrainedModel`` in ``model`` (itself, or wrapped)."""
    return next((m for m in model.modules() if hasattr(m, "set_attn_implementation")
                 and hasattr(m, "config")), None)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that call the attention interface: ``*Attention`` modules of a layer
    (a ``scaling``, or a ``layer_idx`` as GPT-2's before transformers 5.24)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention")
            and (hasattr(m, "scaling") or hasattr(m, "layer_idx"))]


def _scale(module: nn.Module, scaling: float | None, head_dim: int) -> float:
    """The factor on ``q k^T``: the one passed, else the module's own rule.

    GPT-2 before transformers 5.24 passes none and keeps its rule in two flags
    (``scale_attn_weights``, ``scale_attn_by_inverse_layer_idx``), which its
    eager attention applies; later releases pass them folded into ``scaling``.
    """
    if scaling is not None:
        return scaling
    own = getattr(module, "scaling", None)
    if own is not None:
        return float(own)
    scale = head_dim ** -0.5 if getattr(module, "scale_attn_weights", True) else 1.0
    if getattr(module, "scale_attn_by_inverse_layer_idx", False):
        scale /= float(getattr(module, "layer_idx", 0) + 1)
    return scale


def prepare(model: nn.Module, state: CPState, who: str) -> nn.Module:
    """Route every attention layer of the HF model in ``model`` through :func:`cp_attention_forward`.

    Raises:
        ValueError: no HF model inside, or a family not in :data:`SUPPORTED`
            (naming them), or no attention layer found.
    """
    hf = hf_model_of(model)
    if hf is None:
        raise ValueError(f"{who}: context parallelism needs a HuggingFace model (its attention "
                         "interface); no PreTrainedModel found in the model given")
    kind = getattr(hf.config, "model_type", None)
    if kind not in SUPPORTED:
        raise ValueError(f"{who}: context parallelism supports the attention of {list(SUPPORTED)}; "
                         f"model_type={kind!r} may use a mask rule torchtp does not reproduce "
                         "(docs/context_parallel.md, 'What is not supported yet')")
    if getattr(hf.config, "output_router_logits", False):
        raise ValueError(f"{who}: output_router_logits=True: the router's auxiliary loss would "
                         "be computed over this rank's tokens only; set it to False under "
                         "context parallelism (docs/context_parallel.md)")
    layers = attention_modules(hf)
    if not layers:
        raise ValueError(f"{who}: no attention layer of {type(hf).__name__} calls the attention "
                         "interface; context parallelism cannot reach its attention")
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, cp_attention_forward)
    hf.set_attn_implementation(NAME)  # type: ignore[operator]
    for layer in layers:
        layer.torchtp_cp = state  # type: ignore[assignment]
    return hf


def _refuse(module: nn.Module, why: str) -> ValueError:
    return ValueError(f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}): "
                      f"{why} under context parallelism")


def cp_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None,
                         dropout: float = 0.0, scaling: float | None = None,
                         sliding_window: int | None = None, s_aux: torch.Tensor | None = None,
                         softcap: float | None = None,
                         **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``(B, H, T/cp, D)`` in, ``(B, T/cp, H, D)`` out.

    ``attention_mask`` is ignored: transformers builds none for this
    implementation, and the mask comes from the whole batch instead.

    Raises:
        ValueError: the module was not prepared by :class:`~torchtp.cp.ContextParallel`,
            is called outside its forward, uses attention dropout or soft-capping.
    """
    state: CPState | None = getattr(module, "torchtp_cp", None)
    batch: LocalBatch | None = kwargs.pop(BATCH_KWARG, None)
    if batch is None and state is not None:
        batch = state.batch  # pipeline stages: set for the step by PipelineSchedule
    if state is None or batch is None:
        raise _refuse(module, "the model's attention is torchtp's context-parallel attention, "
                      "but it was called outside ContextParallel's forward; call the "
                      "ContextParallel wrapper, not the model inside it,")
    if dropout:
        raise _refuse(module, f"attention dropout {dropout} is not reproduced (each rank would "
                      "drop different weights than one process); set the config's attention "
                      "dropout to 0")
    if softcap is not None:
        raise _refuse(module, f"softcap={softcap} is not supported")
    group = state.group
    cp = 1 if group is None else torch.distributed.get_world_size(group)
    algorithm = state.pick(query.shape[1], key.shape[1], cp, type(module).__name__)
    scale = _scale(module, scaling, query.shape[-1])
    rule = MaskRule(causal=getattr(module, "is_causal", True), window=sliding_window)
    out, _ = context_attention(query, key, value, layout=batch.layout,
                               meta=batch.meta, rule=rule, group=group, scale=scale,
                               algorithm=algorithm, sinks=s_aux, recompute=state.recompute)
    return out.transpose(1, 2).contiguous(), None
