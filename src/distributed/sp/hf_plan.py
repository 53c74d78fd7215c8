"""Sequence parallelism for HuggingFace decoder models (the model types of :data:`LAYOUTS`).

Per decoder layer, with ``T`` tokens and ``S = ceil(T / tp)``::

    residual (B, S, d)  shard ──┬─────────────────────────────────────────┐
    input norm (B, S, d)        │ sequence_parallel style: grads summed   │
    all-gather ─► (B, T, d)     │ attention pre-hook                      │
    q/k/v  (weight rows split)  │ no all-reduce in backward               │
    attention on full sequence  │ rotary, position ids, masks: full T     │
    o_proj (weight columns split) ─► reduce-scatter ─► (B, S, d) + residual
    (the same for the MLP: all-gather at its input, reduce-scatter after down_proj)

The first layer's input is cut into shards (:func:`scatter_to_sequence_shards`)
and the final norm's output is gathered again, so the model's outputs,
``last_hidden_state`` and the LM head see the full sequence.

A block that has no colwise-in/rowwise-out form (a MoE block: router, experts and
shared experts; a latent attention: replicated down-projections) runs **whole**:
its input is all-gathered (backward: keep this rank's shard of the gradient), the
block runs exactly as under plain tensor parallelism (every rank the whole
sequence, its own all-reduces), and its output is cut into shards again
(backward: all-gather)::

    (B, S, d) ─► all-gather ─► (B, T, d) ─► block as plain TP (all-reduce) ─► keep (B, S, d)
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..comm import overlap
from ..comm.group_ref import WeakGroup
from ..comm.runtime import ProcessGroup
from ..comm.sequence_parallel import (
    gather_for_tensor_parallel,
    gather_from_sequence_shards,
    scatter_to_sequence_shards,
    shard_length,
)
from ..core.errors import UnsupportedStyleError
from ..hf.detect import is_hf_model
from ..layers import ColumnParallelLinear, RowParallelLinear
from ..layers.grad_sync import GradSync, mark
from ..layers.rng import (
    TRACKER,
    sequence_region_begins,
    sequence_region_ends,
    whole_region_begins,
    whole_region_ends,
)
from ..plans import ResolvedPlan, ShardContext
from ..plans.linear_view import linear_view
from ..plans.registry import STYLES
from ..plans.sources import experts_layout, inner_model
from ..plans.styles import Colwise, Rowwise
from ..plans.styles_partial import RowwisePartial
from .style import SequenceParallel

SEQ_DIM = 1  # HF hidden states are (B, T, d)
WHO = "DistributedModelWrapper(sequence_parallel=True)"


@dataclass(frozen=True)
class Layout:
    """Where a decoder architecture keeps its blocks (attribute names).

    ``mixers``: names a layer's token mixer has instead of ``attention`` in some
    layers (a hybrid's linear attention), called without position ids;
    ``mixer_norms``: the norms of such a layer, when they are not ``norms``.
    """

    layers: str
    attention: str
    mlp: str
    norms: tuple[str, ...]
    final_norm: str
    mixers: tuple[str, ...] = ()
    mixer_norms: tuple[str, ...] | None = None

    def norms_of(self, mixer: str) -> tuple[str, ...]:
        """The norms of a layer whose token mixer is ``mixer``."""
        return self.norms if mixer == self.attention or self.mixer_norms is None \
            else self.mixer_norms


def _decoder(*norms: str, mixers: tuple[str, ...] = (),
             mixer_norms: tuple[str, ...] | None = None) -> Layout:
    """An HF decoder's ``model.layers[i]`` with ``self_attn`` (or one of ``mixers``),
    ``mlp`` and ``norms`` (``mixer_norms`` in a layer with one of ``mixers``)."""
    return Layout("layers", "self_attn", "mlp", norms, "norm", mixers, mixer_norms)


# A norm before each block (Llama)
_PRE = _decoder("input_layernorm", "post_attention_layernorm")
# A norm before and after each block (Gemma 2 to 4)
_SANDWICH = _decoder("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm")
# A norm after each block only (OLMo 2)
_POST = _decoder("post_attention_layernorm", "post_feedforward_layernorm")
# Model types whose every op outside the attention and MLP blocks is token-wise
# (norms, residual adds, scalings, dropout), each checked exact against one process
# by tests/distributed/hf_zoo.py (--option sequence_parallel, with and without
# memory, loss_parallel and checkpointing, at tp 2 and 3; docs/compat.md). Cohere runs
# both blocks on one norm's output, side by side. From "aria_text" on, the types whose
# MoE blocks or latent attention run whole (whole_reason; decision 183), checked alike,
# then hybrids and more dense types. Not listed though their names fit: GPT-NeoX-Japanese
# (its attention returns a bias its layer adds on the shards: the sweep found that
# gradient each rank's part, silently), NanoChat (a block output bypasses the
# reduce-scatter: the shard-length check raises), BLOOM and MPT (ALiBi attention gets no
# position ids to read the length from).
LAYOUTS: dict[str, Layout] = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3", "arcee", "cwm", "ernie4_5", "exaone",
                     "flint", "gemma", "glm", "granite", "granite_swa", "helium",
                     "hunyuan_v1_dense", "internlm3", "iquestcoder", "jais2", "ministral",
                     "ministral3", "moshi", "nemotron", "olmo", "phi3", "seed_oss", "smollm3",
                     "stablelm", "starcoder2"), _PRE),
    **dict.fromkeys(("gemma2", "gemma3_text", "gemma4_unified_text", "beam"), _SANDWICH),
    **dict.fromkeys(("olmo2", "olmo3", "exaone4"), _POST),
    **dict.fromkeys(("apertus", "apertus1p5_text"),
                    _decoder("attention_layernorm", "feedforward_layernorm")),
    **dict.fromkeys(("cohere", "cohere2"), _decoder("input_layernorm")),
    "glm4": _decoder("input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm",
                     "post_mlp_layernorm"),
    "hyperclovax": _decoder("input_layernorm", "post_attention_layernorm", "post_norm1",
                            "post_norm2"),
    "vaultgemma": _decoder("input_layernorm", "pre_feedforward_layernorm"),
    **dict.fromkeys(("aria_text", "axk1", "deepseek_v2", "deepseek_v3", "deepseek_v32",
                     "dots3_note_text", "ernie4_5_moe", "exaone_moe", "glm4_moe", "glm4_moe_lite",
                     "glm_moe_dsa", "gpt_oss", "hunyuan_v1_moe", "hy_v3", "laguna", "mellum",
                     "mimo_v2_flash", "minimax_m2", "minimax_m3_vl_text", "mixtral", "olmoe",
                     "phimoe", "qwen2_moe", "qwen3_moe", "sarvam_mla", "sarvam_moe", "solar_open",
                     "minicpm3"), _PRE),
    "flex_olmo": _POST,
    "cohere2_moe": _decoder("input_layernorm"),
    "kolibri1": _decoder("input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm",
                         "post_mlp_layernorm"),
    "afmoe": _decoder("input_layernorm", "post_attention_layernorm", "pre_mlp_layernorm",
                      "post_mlp_layernorm"),
    **dict.fromkeys(("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "lara_mini"),
                    _decoder("input_layernorm", "post_attention_layernorm",
                             mixers=("linear_attn",))),
    # OLMo 2's norms after each block, and a norm before each in the linear-attention layers
    "olmo_hybrid": _decoder("post_attention_layernorm", "post_feedforward_layernorm",
                            mixers=("linear_attn",),
                            mixer_norms=("input_layernorm", "post_attention_layernorm")),
    "youtu": _PRE,
    "persimmon": Layout("layers", "self_attn", "mlp", _PRE.norms, "final_layernorm"),
    # Attention and MLP side by side on the same residual (use_parallel_residual)
    "gpt_neox": Layout("layers", "attention", "mlp", _PRE.norms, "final_layer_norm"),
    "phi": Layout("layers", "self_attn", "mlp", ("input_layernorm",), "final_layernorm"),
    "modernbert-decoder": Layout("layers", "attn", "mlp", ("attn_norm", "mlp_norm"), "final_norm"),
    "gpt2": Layout("h", "attn", "mlp", ("ln_1", "ln_2"), "ln_f"),
}


@dataclass
class SequencePlan:
    """Module names the hooks go on (full names in the wrapped model).

    ``end``: the module whose output is gathered into the full sequence again: the
    final norm, or in a pipeline stage without it, the last decoder layer it holds
    (the next stage receives full sequences). ``whole``: the attention/MLP blocks
    that run on the whole sequence, with what makes them (:func:`whole_reason`).
    ``mixed``: the layers whose token mixer reads no position ids, with that mixer
    (its length is read from the layer's).
    """

    base: str
    first_layer: str
    attentions: list[str] = field(default_factory=list)
    mlps: list[str] = field(default_factory=list)
    final_norm: str = ""
    end: str = ""
    whole: dict[str, str] = field(default_factory=dict)
    mixed: dict[str, str] = field(default_factory=dict)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def plan_sequence_parallel(model: nn.Module, plan: ResolvedPlan, ctx: ShardContext) -> SequencePlan:
    """Give every norm of the decoder the ``sequence_parallel`` style and check the blocks.

    A pipeline stage (decoder layers held by other stages) runs its own layers on
    sequence shards: cut where its first layer starts, gathered where its last one
    (or the final norm, on the last stage) ends. A model hosting the decoder (a
    ``PeftModel``) is planned through the decoder inside it.

    Raises:
        ValueError: the architecture is not supported, a decoder layer holds a
            module its layout does not name, or the plan marks a module outside
            the decoder's norms ``sequence_parallel``.
        UnsupportedStyleError: an attention/MLP block is not split as colwise
            in-projections + one rowwise out-projection and does not run whole
            (:func:`whole_reason`), or a whole one leaves a partial sum.
    """
    hosted = inner_model(model)
    decoder = model if hosted is None else hosted[1]
    layout = _layout(decoder)
    base = decoder.base_model
    prefix = next(n for n, m in model.named_modules() if m is base)
    layers = getattr(base, layout.layers)
    held = [i for i, layer in enumerate(layers) if not getattr(layer, "held_elsewhere", False)]
    _check_layers(decoder, {i: layers[i] for i in held}, layout)
    sp = SequencePlan(prefix, _join(prefix, f"{layout.layers}.{held[0]}"),
                      final_norm=_join(prefix, layout.final_norm))
    norms_here = not getattr(getattr(base, layout.final_norm), "held_elsewhere", False)
    sp.end = sp.final_norm if norms_here else _join(prefix, f"{layout.layers}.{held[-1]}")
    rule = _join(prefix, f"{layout.layers}.*")
    by_rule: dict[str, list[str]] = {}
    for i in held:
        layer = _join(prefix, f"{layout.layers}.{i}")
        mixer = _mixer(layers[i], layout)
        for n in layout.norms_of(mixer):
            by_rule.setdefault(f"{rule}.{n}", []).append(f"{layer}.{n}")
        sp.attentions.append(f"{layer}.{mixer}")
        if mixer != layout.attention:
            sp.mixed[layer] = f"{layer}.{mixer}"
        sp.mlps.append(f"{layer}.{layout.mlp}")
    if norms_here:
        by_rule[sp.final_norm] = [sp.final_norm]
    _assign_norms(decoder, plan, by_rule, sp.final_norm)
    modules = dict(model.named_modules())
    mixers = set(sp.mixed.values())
    for block in sp.attentions + sp.mlps:
        why = whole_reason(modules[block])
        problem = None if why is not None else _sharded_problem(block, modules, plan)
        if problem is not None and block not in mixers:
            raise UnsupportedStyleError(problem)
        if problem is not None:  # a hybrid's linear attention its plan keeps whole
            why = "linear attention"
        if why is not None:
            _check_whole_block(block, modules, plan)
            sp.whole[block] = why
    if ctx.world_size > 1:
        plan.notes.append(f"sequence parallelism: norms, dropout and residual adds of "
                          f"{len(held)} layers run on sequence shards")
        for why in sorted(set(sp.whole.values())):
            blocks = [b for b, w in sp.whole.items() if w == why]
            plan.notes.append(f"sequence parallelism: {why} blocks run whole ({len(blocks)}, "
                              f"e.g. '{blocks[0]}'): the sequence gathered in, each rank's "
                              "shard kept out, plain tensor parallelism inside")
    return sp


def _assign_norms(model: nn.Module, plan: ResolvedPlan, by_rule: dict[str, list[str]],
                  example: str) -> None:
    """Give the norms (``by_rule``: pattern -> module names) the ``sequence_parallel``
    style; refuse it anywhere else."""
    norms = [name for names in by_rule.values() for name in names]
    for name, style in plan.assignments.items():
        if isinstance(style, SequenceParallel) and name not in norms:
            raise ValueError(
                f"plan style 'sequence_parallel' for module '{name}': in "
                f"{type(model).__name__} only the decoder's norms run on sequence shards "
                f"(e.g. '{example}'); give '{name}' another style")
    for name in norms:
        plan.assignments[name] = STYLES["sequence_parallel"]
    for pattern, names in by_rule.items():
        plan.rules[pattern], plan.matches[pattern] = "sequence_parallel", names
        for name in names:
            plan.why[name] = "sequence_parallel=True: runs on sequence shards"


def _layout(model: nn.Module) -> Layout:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not is_hf_model(model) or model_type not in LAYOUTS:
        raise ValueError(
            f"{WHO}: {type(model).__name__} (model_type={model_type!r}) is not supported; "
            f"sequence parallelism is implemented for model types {sorted(LAYOUTS)}. "
            "Wrap it without sequence_parallel")
    if getattr(model.config, "add_cross_attention", False):
        raise ValueError(f"{WHO}: {type(model).__name__} has cross-attention, which is not "
                         "sequence-parallel; wrap it without sequence_parallel")
    return LAYOUTS[model_type]


def _mixer(layer: nn.Module, layout: Layout) -> str:
    """The name of ``layer``'s token mixer: the attention's, or one of the layout's mixers."""
    return next((n for n in layout.mixers if hasattr(layer, n)), layout.attention)


def _check_layers(model: nn.Module, layers: dict[int, nn.Module], layout: Layout) -> None:
    """Every decoder layer holds the layout's blocks and norms and nothing else (dropout
    aside): a module the layout does not name would run on sequence shards unchecked (a
    newer transformers release adding one to a listed model type)."""
    for i, layer in layers.items():
        mixer = _mixer(layer, layout)
        known = {mixer, layout.mlp, *layout.norms_of(mixer)}
        names = {n for n, m in layer.named_children() if not isinstance(m, nn.Dropout)}
        if names != known:
            raise ValueError(
                f"{WHO}: decoder layer {i} of {type(model).__name__} does not match torchtp's "
                f"sequence-parallel layout for model_type="
                f"{getattr(model.config, 'model_type', None)!r}: it holds {sorted(names)}, the "
                f"layout names {sorted(known)} (a module it does not name would run on "
                "sequence shards unchecked; a transformers release may have changed the "
                "layer); wrap it without sequence_parallel")


def whole_reason(block: nn.Module) -> str | None:
    """What makes ``block`` run on the whole sequence, or None.

    MoE experts (a module a model family knows as experts: the router, the
    experts' partial sums and any shared experts run as under plain tensor
    parallelism) and latent attention (a ``kv_b_proj``: replicated latent
    down-projections and norms before the heads' split up-projections) have
    no colwise-in/rowwise-out form. (A hybrid's linear attention whose plan
    has none runs whole too: decided from the plan, in
    :func:`plan_sequence_parallel`.)
    """
    for name, module in block.named_modules():
        if experts_layout(module) is not None:
            return "MoE experts"
        if name.rpartition(".")[2] == "kv_b_proj":
            return "latent attention"
    return None


def _check_whole_block(block: str, modules: dict[str, nn.Module], plan: ResolvedPlan) -> None:
    """A whole block must return complete sums: no projection's partial sum may leave it.

    Raises:
        UnsupportedStyleError: a ``rowwise_partial`` projection inside (summed later,
            outside the block, where the hidden states are sequence shards).
    """
    for name, _ in modules[block].named_modules():
        full = f"{block}.{name}" if name else block
        if isinstance(plan.assignments.get(full), RowwisePartial):
            raise UnsupportedStyleError(
                f"{WHO}: '{full}' is 'rowwise_partial' (its output summed later with other "
                f"layers'), but '{block}' runs on the whole sequence and must return complete "
                f"sums; pass plan={{'{full}': 'rowwise', ...}} or wrap without "
                "sequence_parallel")


def _sharded_problem(block: str, modules: dict[str, nn.Module], plan: ResolvedPlan) -> str | None:
    """Why ``block`` cannot run on shards, if it cannot: it needs colwise in-projections
    (output not gathered) and exactly one rowwise out-projection.

    The caller raises it as :class:`UnsupportedStyleError` (the cost choice then
    discards that candidate plan, ``torchtp.plans.choose``), or runs a token mixer
    whole instead.
    """
    outs = []
    for name, mod in modules[block].named_modules():
        if linear_view(mod) is None:
            continue
        full = f"{block}.{name}"
        style = plan.assignments.get(full)
        if isinstance(style, RowwisePartial):
            return (f"{WHO}: '{full}' is 'rowwise_partial' (its output summed later with other "
                    "layers'), which has no sequence-parallel form; pass "
                    f"plan={{'{full}': 'rowwise', ...}} or wrap without sequence_parallel")
        if isinstance(style, Rowwise) and not style.split_input:
            outs.append(full)
        elif not (isinstance(style, Colwise) and not style.gather_output):
            return (f"{WHO}: '{full}' is {style.name if style else 'replicated'}, but every "
                    f"projection in '{block}' must be split: 'colwise' (weight rows) for the "
                    "projections reading the block's input, 'rowwise' (weight columns) for the "
                    "one writing its output")
    if len(outs) != 1:
        return (f"{WHO}: '{block}' needs exactly one 'rowwise' output projection (weight "
                f"columns split), found {outs or 'none'}")
    return None


class _Hooks:
    """The forward hooks that move hidden states between shards and full sequences."""

    group: WeakGroup[ProcessGroup | None] = WeakGroup()  # held weakly (comm.group_ref)

    who = WHO
    # Seeds the shards' RNG stream (layers/rng.py); whether the last training forward
    # switched the streams, so that its recomputation does too
    stream_key = zlib.crc32(b"sequence shards")
    streamed = False

    def __init__(self, ctx: ShardContext, config: object) -> None:
        self.group = ctx.group
        self.config = config
        self.length = 0  # tokens of the current forward (set where the shards are cut)
        # Tokens of the running layer: its attention's position ids (so that a layer
        # recomputed under gradient checkpointing reads its own forward's)
        self.layer_length = 0
        self.size = ctx.world_size
        # Per attention/MLP block, the weight-rows-split projections reading its input.
        self.inputs: dict[nn.Module, list[RowParallelLinear]] = {}
        # Per block run whole, the key of its RNG stream (layers/rng.py)
        self.whole: dict[nn.Module, int] = {}
        # The attentions, which read the length from their position ids; the other blocks
        # (MLPs, a hybrid's linear attention) take their layer's
        self.reads_positions: set[nn.Module] = set()

    def check_outputs(self, _mod: nn.Module, _args: tuple, kwargs: dict) -> None:
        wanted = kwargs.get("output_hidden_states")
        if wanted or (wanted is None and getattr(self.config, "output_hidden_states", False)):
            raise ValueError(f"{WHO}: output_hidden_states=True is not supported (the "
                             "decoder layers' outputs are sequence shards); call without it")

    def scatter(self, mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if mod.training and (TRACKER.depth or self.streamed):  # dropout on shards (rng.py)
            self.streamed = sequence_region_begins(self)

        def cut(x: torch.Tensor) -> torch.Tensor:
            self.length = x.shape[SEQ_DIM]
            return scatter_to_sequence_shards(x, self.group, SEQ_DIM)  # (B, S, d)
        return _map_hidden(args, kwargs, cut)

    def gather_attention(self, mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        length = self._length(mod, kwargs)
        return _map_hidden(args, kwargs, lambda x: self._gather(mod, x, length))  # (B, T, d)

    def _length(self, mod: nn.Module, kwargs: dict) -> int:
        """The running layer's tokens: an attention's position ids, else the layer's (an
        MLP runs after its layer's attention; a linear attention's layer read them)."""
        return self._attention_length(kwargs) if mod in self.reads_positions \
            else self.layer_length

    def _attention_length(self, kwargs: dict, what: str = "attention module") -> int:
        # The length comes from this call's position ids, so a recomputation under
        # gradient checkpointing uses the same length as the original forward.
        positions = kwargs.get("position_ids")
        if not isinstance(positions, torch.Tensor):
            raise RuntimeError(f"{WHO}: the {what} got no position_ids tensor, so the "
                               "sequence length (to drop the shard padding) is unknown")
        self.layer_length = positions.shape[-1]
        return self.layer_length

    def read_length(self, _mod: nn.Module, _args: tuple, kwargs: dict) -> None:
        """A layer whose token mixer reads no position ids: the length from the layer's."""
        self._attention_length(kwargs, "decoder layer")

    def gather_whole(self, mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A block run whole: every rank gets the whole sequence (B, T, d), padding dropped
        (a router would count padding rows); backward: this rank's shard of the gradient,
        which the block's own all-reduces made complete."""
        length = self._length(mod, kwargs)

        def gather(x: torch.Tensor) -> torch.Tensor:
            if x.shape[SEQ_DIM] != shard_length(length, self.size):
                raise RuntimeError(
                    f"{WHO}: {type(mod).__name__} got {x.shape[SEQ_DIM]} positions where "
                    f"this rank's shard of its layer's {length} tokens (tp={self.size}) has "
                    f"{shard_length(length, self.size)}; wrap the model without "
                    "sequence_parallel")
            return gather_from_sequence_shards(x, self.group, SEQ_DIM, length)  # (B, T, d)
        mapped = _map_hidden(args, kwargs, gather)
        if mod.training and (TRACKER.depth or self.streamed):  # the same draws on every rank
            whole_region_begins(self.whole[mod])
        return mapped

    def split_whole(self, mod: nn.Module, _args: tuple, out: Any) -> Any:
        """A block run whole returns complete sums on every rank: keep this rank's shard
        (B, S, d); backward: all-gather."""
        if mod.training and (TRACKER.depth or self.streamed):
            whole_region_ends()
        hidden = out[0] if isinstance(out, tuple) else out  # (B, T, d)
        if hidden.dim() < 2 or hidden.shape[SEQ_DIM] != self.layer_length:
            # Same shapes on every rank, so every rank raises.
            raise RuntimeError(
                f"{WHO}: {type(mod).__name__} (run on the whole sequence of "
                f"{self.layer_length} tokens) returned shape {tuple(hidden.shape)}, not "
                f"(batch, {self.layer_length}, ...): torchtp cannot cut it into sequence shards; "
                "wrap the model without sequence_parallel")
        shard = scatter_to_sequence_shards(hidden, self.group, SEQ_DIM)  # (B, S, d)
        return (shard, *out[1:]) if isinstance(out, tuple) else shard

    def gather_mlp(self, mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # Token-wise: the padding rows may pass through (B, S*tp, d).
        return _map_hidden(args, kwargs, lambda x: self._gather(mod, x, None))

    def _gather(self, block: nn.Module, x: torch.Tensor, length: int | None) -> torch.Tensor:
        """All-gather the block input; with the ``"sequence"`` overlap, in pieces, each
        beside the products of the previous one with the block's input projections."""
        layers = self.inputs.get(block, [])
        if not layers or torch.compiler.is_compiling() \
                or not overlap.enabled("sequence", layers[0].overlap, x.device):
            return gather_for_tensor_parallel(x, self.group, SEQ_DIM, length)
        return gather_for_tensor_parallel(x, self.group, SEQ_DIM, length,
                                          [(p.weight, p.bias) for p in layers], overlap.chunks())

    def gather_output(self, mod: nn.Module, _args: tuple, out: Any) -> Any:
        """The end of the shards (the final norm, or a pipeline stage's last layer, whose
        output may be a tuple with the hidden states first): the full sequence again."""
        if mod.training and (TRACKER.depth or self.streamed):
            self.streamed = sequence_region_ends(self)
        hidden = out[0] if isinstance(out, tuple) else out  # (B, S, d)
        shard = shard_length(self.length, self.size)  # S = ceil(T / tp)
        if hidden.shape[SEQ_DIM] != shard:
            # A block whose output bypassed its reduce-scatter, broadcast into the
            # residual: the same on every rank, so every rank raises.
            raise RuntimeError(
                f"{WHO}: {type(mod).__name__} returned {hidden.shape[SEQ_DIM]} positions where "
                f"this rank's sequence shard has {shard} ({self.length} tokens over "
                f"tp={self.size}): some block's output did not leave through its "
                "weight-columns-split projection's reduce-scatter; wrap the model without "
                "sequence_parallel")
        full = gather_from_sequence_shards(hidden, self.group, SEQ_DIM, self.length)  # (B, T, d)
        return (full, *out[1:]) if isinstance(out, tuple) else full


def _map_hidden(args: tuple, kwargs: dict, fn: Any) -> tuple[tuple, dict]:
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    raise RuntimeError(f"{WHO}: found no hidden_states argument to shard or gather")


def install_sequence_parallel(model: nn.Module, sp: SequencePlan, ctx: ShardContext) -> None:
    """After the swap: mark the projections and register the shard/gather hooks.

    Call :func:`torchtp.layers.grad_sync.install` afterwards (the out-projection
    biases' gradients are summed over the TP group).
    """
    if ctx.world_size == 1:
        return
    hooks = _Hooks(ctx, model.config)
    model.get_submodule(sp.base).register_forward_pre_hook(hooks.check_outputs, with_kwargs=True)
    model.get_submodule(sp.first_layer).register_forward_pre_hook(hooks.scatter,
                                                                  with_kwargs=True)
    for decoder_layer in sp.mixed:
        model.get_submodule(decoder_layer).register_forward_pre_hook(hooks.read_length,
                                                                     with_kwargs=True)
    hooks.reads_positions = {model.get_submodule(a) for a in sp.attentions
                             if a not in sp.mixed.values()}
    for block in sp.attentions + sp.mlps:
        module = model.get_submodule(block)
        if block in sp.whole:  # plain tensor parallelism inside: its layers as they are
            hooks.whole[module] = zlib.crc32(block.encode())
            module.register_forward_pre_hook(hooks.gather_whole, with_kwargs=True)
            module.register_forward_hook(hooks.split_whole)
            continue
        gather = hooks.gather_attention if block in sp.attentions else hooks.gather_mlp
        module.register_forward_pre_hook(gather, with_kwargs=True)
        hooks.inputs[module] = [m for m in module.modules() if isinstance(m, RowParallelLinear)]
        for layer in module.modules():
            if isinstance(layer, (RowParallelLinear, ColumnParallelLinear)):
                layer.sequence_dim = SEQ_DIM
            if isinstance(layer, ColumnParallelLinear) and layer.bias is not None:
                # Added to this rank's tokens only: the gradient is a partial sum.
                mark(layer, "bias", (GradSync(ctx.group),))
    # Through a function, not the bound method: PEFT's modules_to_save deep-copies the
    # final norm with its hooks, and a bound method's _Hooks would be copied with it (its
    # length stale); a function is shared, so the copy reads this forward's length.
    model.get_submodule(sp.end).register_forward_hook(
        lambda mod, args, out: hooks.gather_output(mod, args, out))
