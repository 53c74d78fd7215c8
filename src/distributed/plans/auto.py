"""The automatic plan for any model: pair Linears by dataflow, split attention by whole heads.

One probe forward (:mod:`torchtp.plans.dataflow`) records which Linear feeds
which. A Linear ``B`` whose input is made only from the outputs of Linears
``A1..Ak``, through operations that do not mix the split features (elementwise
ops, activations, dropout, products of two split branches as in SwiGLU,
per-head reshapes and attention), and whose producers feed nothing else, is a
candidate pair: the ``A``'s split out_features (``colwise``), ``B`` splits
in_features (``rowwise``), one all-reduce per pair, across module boundaries.

Every candidate is confirmed by a local probe before it is used: for each
rank, the model runs with each producer returning that rank's slice of its
recorded output and, for attention, the module's head-count attributes set to
their local values; what reaches ``B`` must equal that rank's slice of ``B``'s
recorded input. A module that reads its width from its input (nanoGPT's
``C = x.size(-1)``) fails this check and stays replicated, with the reason in
``describe_plan()``; so does an attention module whose projections cannot
pair at all (e.g. per-head norms on the way): it is never gathered
projection by projection.

HuggingFace models without a plan of their own are planned here too
(:func:`torchtp.plans.resolve.pick_rules` passes the inputs and the config
where head counts live that their family gives, :mod:`torchtp.plans.sources`);
the attention attributes rewritten to local values and per-head ALiBi biases
narrowed to the rank's heads are in :mod:`torchtp.plans.attention_local`, the
per-module config copy is HuggingFace's (``torchtp.hf``).

Cost guard: a pair is split only when the bytes its all-reduce moves per
forward (on the probe's inputs) are at most the weight bytes each rank saves
by not running it replicated; ``plan="auto-memory"`` splits regardless, to
save memory. A Linear without a partner is proposed split (its output
gathered, or its input split); whether it stays split is decided by cost
with every other candidate plan (:mod:`torchtp.plans.choose`). A Linear
subclass whose forward is not the plain linear map (a quantized or grouped
Linear: :func:`torchtp.plans.fidelity.custom_forward`) is neither: it stays
whole, with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..core.layouts import cut
from ..layers.shared_by_heads import rms_norm_of_shard
from .attention_local import local_overrides, narrow_head_biases
from .dataflow import Inputs, Region, Trace, differs, probe_mode, record
from .fidelity import custom_forward
from .heads import (
    HeadInfo,
    head_info,
    head_parts,
    is_attention,
    mixer_names,
    output_part,
    query_part,
)
from .late_reduce import late_reduces
from .linear_view import linear_view
from .resolved import Rules
from .styles import Colwise, ParallelStyle, ReplicatedWithGradAllreduce, Rowwise, ShardContext
from .styles_heads import (
    HeadColumns,
    HeadNorm,
    HeadParams,
    HeadSplit,
    head_parameters,
    head_params_reason,
    local_head_parameters,
    norm_epsilon,
)
from .weight_reads import read_elsewhere

SOURCE = "auto: dataflow pairs (any model)"
EXAMPLE_TOKENS = (2, 4)  # (batch, sequence) of inputs derived from the model


@dataclass(frozen=True)
class Pair:
    """A candidate pair: producers split out_features, the consumer splits in_features.

    Attributes:
        consumer: The Linear that reads the producers' outputs.
        styles: Style per module of the pair (producers and consumer).
        attention: The attention module whose heads are split, if any.
        info: Its head geometry.
        how: How the split was found, for ``describe_plan()``.
    """

    consumer: str
    styles: dict[str, ParallelStyle]
    attention: str | None = None
    info: HeadInfo | None = None
    how: str = "feature-wise ops only"
    norms: tuple[str, ...] = ()  # per-head_dim norms on the way (Qwen3's q_norm/k_norm)
    # The attention module's own per-head parameters on the way (GPT-OSS's sinks).
    params: tuple[str, ...] = ()
    # Norms over all heads on the way (OLMo-2's q_norm/k_norm): name -> (style, producer).
    head_norms: Mapping[str, tuple[HeadNorm, str]] = dataclasses.field(default_factory=dict)

    @property
    def producers(self) -> list[str]:
        """The producers, in module order."""
        return [n for n in self.styles if n != self.consumer]


def auto_plan(model: nn.Module, ctx: ShardContext, example_inputs: object = None,
              memory: bool = False, config: object = None) -> Rules:
    """The automatic plan for ``model`` at ``ctx.world_size``.

    Args:
        model: Any ``nn.Module``.
        ctx: The tp size.
        example_inputs: Positional args (a tuple, or one tensor) or keyword args
            (a dict) for one small forward; ``None`` derives them from the first
            layer (an ``nn.Embedding`` gets token ids, an ``nn.Linear`` features).
        memory: Split even where communication costs more than replicating.
        config: Where head counts come from when an attention module does not
            hold them itself (a HuggingFace model's text config); ``None``: the
            module's attributes only.
    """
    rules = Rules(SOURCE, {}, heads={})
    linears = {n: m for n, m in model.named_modules() if linear_view(m) is not None}
    # A Linear subclass with a forward of its own is not a split candidate (nor a pair's part)
    custom = {n: why for n, m in linears.items() if (why := custom_forward(m, n)) is not None}
    linears = {n: m for n, m in linears.items() if n not in custom}
    tied = _shared_weights(model)
    trace = _probe(model, example_inputs, rules.notes)
    # A weight read outside its module would be read as a shard: kept whole, as tied ones
    elsewhere = set() if trace is None else _weights_read_elsewhere(model, trace, linears,
                                                                    rules.notes)
    whole = tied | elsewhere
    styles: dict[str, ParallelStyle | str] = {}
    blocked: dict[str, str] = {}  # attention projections that cannot pair: why
    consumers: list[str] = []
    if trace is not None:
        for pair in _confirmed(model, trace, linears, whole, ctx, rules, config, blocked):
            if _pair_pays(pair, trace, linears, memory, rules):
                _take(pair, styles, rules)
                consumers.append(pair.consumer)
    for name, why in custom.items():
        styles[name], rules.why[name] = "replicate", why
    for name, module in linears.items():
        if name in rules.why:  # in a pair that was refused: kept whole, no collective at all
            styles.setdefault(name, "replicate")
        elif id(module) in elsewhere:
            styles[name] = "replicate"
            rules.why[name] = "kept replicated: its parameters are read outside its own forward"
        elif name in blocked and name not in styles:
            styles[name], rules.why[name] = "replicate", blocked[name]
        elif name not in styles:
            styles[name], rules.why[name] = _lone(name, module, id(module) in tied, trace, ctx,
                                                   rules.notes)
    name = _token_embedding(model, whole, ctx.world_size)
    if name is not None:
        # Split by vocabulary alone: the cost model keeps it split only where the
        # bytes it saves pay for its all-reduce (torchtp.plans.choose).
        styles[name] = "embedding_rowwise"
        rules.why[name] = ("the token embedding, without a tied head: rows (vocabulary) "
                           "split, lookups all-reduced")
    if trace is not None:  # a hand-written MoE's experts: one all-reduce, not one each
        late_reduces(model, trace, consumers, styles, rules, ctx)
    for name in mixer_names(model):  # split by heads, probed when resolved
        styles[name] = "ssm_heads"
        rules.why[name] = "a Mamba-2-style state-space mixer: split by its heads"
    order = list(dict(model.named_modules()))
    rules.rules = {n: styles[n] for n in sorted(styles, key=order.index)}
    rules.trace = trace  # its shapes price every candidate (torchtp.plans.cost)
    return rules


def probe_tokens(example_inputs: object) -> int:
    """Tokens (rows) of the probe's inputs: token ids' count, or a float input's rows.

    What every module is assumed to see when no probe forward recorded it (a
    model on the meta device); the inputs derived from a model's first layer
    have ``EXAMPLE_TOKENS``.
    """
    args, kwargs = _as_inputs(example_inputs) if example_inputs is not None else ((), {})
    for value in [*args, *kwargs.values()]:
        if isinstance(value, torch.Tensor) and value.dim():
            if not value.is_floating_point():
                return int(value.numel())
            return int(value.numel() // value.shape[-1])
    return EXAMPLE_TOKENS[0] * EXAMPLE_TOKENS[1]


def _take(pair: Pair, styles: dict[str, ParallelStyle | str], rules: Rules) -> None:
    """Record a confirmed pair's styles, reasons and head geometry."""
    producers = pair.producers
    for name, style in pair.styles.items():
        styles[name] = style
        rules.why[name] = (f"dataflow: feeds '{pair.consumer}' ({pair.how})" if name != pair.consumer
                           else f"dataflow: reads only {producers}; one all-reduce")
    for name in pair.norms:  # applied to this rank's heads only: gradients partial
        styles[name] = ReplicatedWithGradAllreduce()
        rules.why[name] = (f"dataflow: a norm over head_dim inside '{pair.attention}' on the "
                           "way to its output projection; replicated, gradients summed over "
                           "the group")
    if pair.attention is not None and pair.info is not None:
        assert rules.heads is not None
        rules.heads[pair.attention] = pair.info
        if pair.params:
            styles[pair.attention] = HeadParams(query_part(pair.info))
            rules.why[pair.attention] = head_params_reason(pair.params)


def _probe(model: nn.Module, example_inputs: object, notes: list[str]) -> Trace | None:
    """Run the probe forward, or say in ``notes`` why it could not run."""
    hint = "pass example_inputs=(...) to DistributedModelWrapper, or plan={...}"
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        notes.append(f"the model is on the meta device, so no probe forward can run: every "
                     f"Linear stays replicated; {hint}")
        return None
    inputs = _as_inputs(example_inputs) if example_inputs is not None else _derive(model)
    if inputs is None:
        notes.append(f"no example inputs could be derived from the model: every Linear stays "
                     f"replicated; {hint}")
        return None
    try:
        return record(model, inputs)
    except Exception as err:  # any model-specific failure: no dataflow, no split
        notes.append(f"the probe forward failed ({type(err).__name__}: {err}): every Linear "
                     f"stays replicated; {hint}")
        return None


def _as_inputs(example: object) -> Inputs:
    if isinstance(example, Mapping):
        return (), dict(example)
    if isinstance(example, tuple):
        return example, {}
    return (example,), {}


def _derive(model: nn.Module) -> Inputs | None:
    """Inputs for the first parameterized layer in registration order, if it says its width."""
    gen = torch.Generator().manual_seed(0)  # never touches the global RNG every rank shares
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue
        if isinstance(module, nn.Embedding):
            ids = torch.randint(0, module.num_embeddings, EXAMPLE_TOKENS, generator=gen)
            return (ids.to(weight.device),), {}
        view = linear_view(module)
        if view is not None:
            x = torch.randn(*EXAMPLE_TOKENS, view.in_features, generator=gen)
            return (x.to(weight.device, weight.dtype),), {}
        return None
    return None


def _weights_read_elsewhere(model: nn.Module, trace: Trace, linears: dict[str, nn.Module],
                            notes: list[str]) -> set[int]:
    """ids of the modules whose parameters the probe forward read outside their own forward
    (:mod:`torchtp.plans.weight_reads`; a candidate Linear's with a note): kept whole, as
    tied ones (the token embedding too)."""
    try:
        found = read_elsewhere(model, trace.inputs)
    except Exception as err:  # the probe forward ran once already; this is its twin
        notes.append(f"the probe for weights read elsewhere failed ({type(err).__name__}: "
                     f"{err}): every Linear stays replicated")
        return {id(m) for m in linears.values()}
    for name, module in linears.items():
        if id(module) in found:
            notes.append(f"'{name}' kept replicated: its parameters are read outside its own "
                         f"forward ({found[id(module)]}), which would see a shard")
    return set(found)


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of modules whose parameters are also registered elsewhere (tied)."""
    owners: dict[int, list[nn.Module]] = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), []).append(mod)
    return {id(m) for mods in owners.values() if len(mods) > 1 for m in mods}


def _confirmed(model: nn.Module, trace: Trace, linears: dict[str, nn.Module], tied: set[int],
               ctx: ShardContext, rules: Rules, config: object, blocked: dict[str, str]
               ) -> list[Pair]:
    """Candidate pairs in forward order, each confirmed by the local probe.

    The members of a refused pair stay replicated (``rules.why`` says why).
    """
    candidates = _candidates(model, trace, linears, tied, ctx, rules.notes, config, blocked)
    first = [alts[0] for alts in candidates]
    verdicts, ran = _simulate(model, trace, first, ctx)
    out = []
    for alts in candidates:
        chosen, reasons = None, []
        for i, pair in enumerate(alts):
            # A joint run that raised cannot tell which pair broke it: retry alone.
            alone = i > 0 or not (ran or len(first) == 1)
            why = (_simulate(model, trace, [pair], ctx)[0] if alone else verdicts)[pair.consumer]
            if why is None:
                chosen = pair
                break
            reasons.append(why)
        if chosen is not None:
            out.append(chosen)
            continue
        where = alts[0].attention or alts[0].consumer
        why = (f"with {alts[0].producers} split, the local probe does not reproduce this "
               f"rank's slice of '{alts[0].consumer}''s input ({reasons[-1]}); the module "
               "probably reads a full size from its input (e.g. C = x.size(-1)) or a full-width "
               "tensor; pass plan= to shard it by hand")
        rules.notes.append(f"'{where}' kept replicated: {why}")
        for name in alts[0].styles:
            rules.why[name] = f"kept replicated: {why}"
    return out


def _candidates(model: nn.Module, trace: Trace, linears: dict[str, nn.Module], tied: set[int],
                ctx: ShardContext, notes: list[str], config: object, blocked: dict[str, str]
                ) -> list[list[Pair]]:
    """Per consumer (forward order), the ways its producers could be split, best first.

    An attention module whose projections cannot pair stays replicated
    (recorded in ``blocked``) rather than gathering after each projection.
    """
    taken: set[str] = set()
    out: list[list[Pair]] = []
    for b in trace.order:
        region = trace.region(b)
        producers = sorted(region.producers, key=trace.order.index)
        if not producers or b in taken:
            continue
        group = [*producers, b]
        if any(n not in linears or n in taken or len(trace.calls[n]) != 1
               or id(linears[n]) in tied for n in group):
            continue
        leaves = _head_leaves(model, region, producers, b, config)
        norms, params = leaves if leaves is not None else ((), ())
        problem = _region_problem(trace, b, region, producers, leaves is not None)
        if problem:
            notes.append(f"'{b}' not paired with {producers}: {problem}")
            _block_attention(model, group, problem, blocked, notes)
            continue
        alts = _alternatives(model, b, producers, linears, ctx, config)
        if norms or params:  # only whole heads keep a head_dim norm's input whole
            alts = [dataclasses.replace(p, norms=norms, params=params) for p in alts
                    if p.attention is not None]
        if alts:
            out.append(alts)
            taken.update(group)
    return out


def _block_attention(model: nn.Module, group: list[str], problem: str,
                     blocked: dict[str, str], notes: list[str]) -> None:
    """Record why the projections of an attention module that cannot pair stay replicated."""
    owner = _attention_owner(model, group[:-1], group[-1])
    inside = [n for n in group if owner is not None and (not owner or n.startswith(f"{owner}."))]
    if owner is None or not inside:
        return
    extra = [n for n, m in model.get_submodule(owner).named_children()
             if linear_view(m) is None and any(True for _ in m.parameters())]
    why = (f"kept replicated: attention '{owner}' cannot pair its projections ({problem}"
           + (f"; its parameterized submodules {extra}, e.g. per-head norms, would need "
              "splitting by head too" if extra else "") + "); pass plan= to shard it by hand "
           "('replicated_with_grad_allreduce' for per-head norms)")
    if not any(n in blocked for n in inside):
        notes.append(f"'{owner}' {why}")
    for name in inside:  # a consumer outside (the next MLP) may still pair with others
        blocked.setdefault(name, why)


def _head_dim_norms(model: nn.Module, region: Region, producers: list[str], b: str,
                    config: object) -> tuple[str, ...] | None:
    """The norms over ``head_dim`` among the region's leaves, if every leaf is one of those
    or a per-head parameter of the attention module (:func:`_head_leaves`)."""
    leaves = _head_leaves(model, region, producers, b, config)
    return None if leaves is None else leaves[0]


def _head_leaves(model: nn.Module, region: Region, producers: list[str], b: str,
                 config: object) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """The region's leaves as (norms over ``head_dim``, the attention module's own per-head
    parameters), or ``None`` when a leaf is neither.

    Such a norm (Qwen3's or timm's ``q_norm``/``k_norm``: one weight of
    ``head_dim`` applied to every head) works on any number of heads; a per-head
    parameter (GPT-OSS's ``sinks``) is cut with the heads; a parameter of any other
    shape (per-head-grouped, full width) is neither.
    """
    if not region.leaves:
        return (), ()
    owner = _attention_owner(model, producers, b)
    if owner is None:
        return None
    attention = model.get_submodule(owner) if owner else model
    width = linear_view(model.get_submodule(b)).in_features  # type: ignore[union-attr]
    info = head_info(attention, config if config is not None
                     else SimpleNamespace(hidden_size=width))
    if info is None or len(region.tensors) != len(region.leaves):
        return None
    owners = {id(p): name for name, m in attention.named_modules()
              if name and linear_view(m) is None for p in m.parameters(recurse=False)}
    own = {id(getattr(attention, n)): n for n in head_parameters(attention, info.heads)}
    names = {owners.get(id(t)) for t in region.tensors if id(t) not in own}
    if None in names:
        return None
    for name in names:
        params = list(attention.get_submodule(str(name)).parameters(recurse=False))
        if any(p.dim() != 1 or p.numel() != info.head_dim for p in params):
            return None
    lead = f"{owner}." if owner else ""
    return (tuple(sorted(f"{lead}{n}" for n in names)),
            tuple(sorted({own[id(t)] for t in region.tensors if id(t) in own})))


def _region_problem(trace: Trace, b: str, region: Region, producers: list[str],
                    norms_ok: bool = False) -> str | None:
    """Why the ops between the producers and ``b`` cannot run on split features, if they cannot.

    ``norms_ok``: the region's leaves are head_dim norms or per-head parameters
    (:func:`_head_leaves`).
    """
    if region.leaves and not norms_ok:
        return ("it also reads a parameter or an input on the way (e.g. a norm's weight), "
                "which would need splitting too")
    users = trace.consumers()
    allowed = set(region.nodes) | trace.internal_nodes(b)
    outs = [trace.calls[p][0].output_node for p in producers]
    returned = {id(n) for n in trace.roots}  # the model's outputs are read by the caller
    for node in [*region.nodes.values(), *outs]:
        if id(node) in returned or not users.get(id(node), set()) <= allowed:
            return "a tensor between them is also read elsewhere (e.g. a residual)"
    return None


def _alternatives(model: nn.Module, b: str, producers: list[str], linears: dict[str, nn.Module],
                  ctx: ShardContext, config: object) -> list[Pair]:
    """Ways to split the pair that satisfy the tp size, attention (whole heads) first."""
    views = {n: linear_view(linears[n]) for n in [*producers, b]}
    width = views[b].in_features  # type: ignore[union-attr]
    alts: list[Pair] = []
    owner = _attention_owner(model, producers, b)
    if owner is not None:
        info = head_info(model.get_submodule(owner),
                         config if config is not None else SimpleNamespace(hidden_size=width))
        for layout in ("packed_colwise", "colwise"):  # stacked q|k|v, then per-head groups
            pair = _head_pair(b, producers, views, info, layout, owner, width)
            if pair is not None and pair not in alts:
                alts.append(pair)
    rows = [views[p].out_features for p in producers]  # type: ignore[union-attr]
    if all(r == width for r in rows):
        alts.append(Pair(b, {**{p: Colwise() for p in producers}, b: Rowwise()}))
    elif len(producers) == 1 and rows[0] == 2 * width:
        alts.append(Pair(b, {producers[0]: HeadSplit(), b: Rowwise()},
                         how="two stacked halves, e.g. a fused gate|up"))
    return [p for p in alts if _fits(p, linears, ctx)]


def _head_pair(b: str, producers: list[str], views: dict[str, Any], info: HeadInfo | None,
               layout: str, owner: str, width: int) -> Pair | None:
    if info is None or info.heads * info.value_dim != width:
        return None
    styles: dict[str, ParallelStyle] = {}
    for p in producers:
        parts = head_parts(views[p].out_features, layout, info)
        if parts is None:
            return None
        styles[p] = HeadSplit(parts, layout if len(parts) > 1 else "colwise")
    styles[b] = HeadColumns(output_part(info))  # the same heads' columns (head_share)
    how = (f"whole heads of '{owner}' ({info.heads} heads, {info.kv_heads} KV heads, "
           f"head_dim {info.head_dim}), local head counts confirmed by the probe")
    return Pair(b, styles, owner, info, how)


def _attention_owner(model: nn.Module, producers: list[str], b: str) -> str | None:
    """The innermost attention module holding the producers, below the pair's common owner.

    Usually one module holds q/k/v and the output projection; BERT-style
    models hold q/k/v in ``attention.self`` and the output one in a sibling,
    and the head counts live with q/k/v.
    """
    inner, outer = common_owner(producers), common_owner([*producers, b])
    path = inner.split(".") if inner else []
    stop = len(outer.split(".")) if outer else 0
    for depth in range(len(path), stop - 1, -1):
        name = ".".join(path[:depth])
        if is_attention(model.get_submodule(name) if name else model):
            return name
    return None


def common_owner(names: list[str]) -> str | None:
    """The innermost module that holds all ``names`` (``None``: the model itself)."""
    parts = [n.split(".")[:-1] for n in names]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common) if common else None


def _fits(pair: Pair, linears: dict[str, nn.Module], ctx: ShardContext) -> bool:
    """Every module of the pair splits at this tp size."""
    for name, style in pair.styles.items():
        try:
            layer = style.plan(linears[name], name, ctx)
        except (TypeError, ValueError):
            return False
        if not layer.fits(ctx.world_size):
            return False
    return True


def _simulate(model: nn.Module, trace: Trace, pairs: list[Pair], ctx: ShardContext
              ) -> tuple[dict[str, str | None], bool]:
    """Run every rank's local computation between each pair.

    Returns:
        Per consumer ``None`` (exact on every rank) or why not, and whether the
        forward ran at all (if not, every pair gets the same error).
    """
    verdict: dict[str, str | None] = {p.consumer: None for p in pairs}
    # At tp 1 the local computation is the full one: nothing to confirm.
    for rank in range(ctx.world_size if pairs and ctx.world_size > 1 else 0):
        local = ShardContext(ctx.world_size, rank, None, ctx.model_name)
        seen: dict[str, torch.Tensor] = {}
        try:
            with _local_run(model, trace, pairs, local, seen), torch.no_grad():
                args, kwargs = trace.inputs
                model(*args, **kwargs)
        except Exception as err:  # the local computation does not even run
            return {p.consumer: f"rank {rank}: {type(err).__name__}: {err}" for p in pairs}, False
        for pair in pairs:
            if verdict[pair.consumer] is None:
                want = _cut(trace.calls[pair.consumer][0].input, pair.styles[pair.consumer],
                            model, pair.consumer, local, dim=1)
                verdict[pair.consumer] = differs(seen.get(pair.consumer), want, rank)
    return verdict, True


def _cut(full: torch.Tensor, style: ParallelStyle, model: nn.Module, name: str,
         ctx: ShardContext, dim: int) -> torch.Tensor:
    """This rank's features of ``full`` (last dim), as ``style`` splits weight dim ``dim``."""
    layout = style.plan(model.get_submodule(name), name, ctx).layouts["weight"]
    split = layout.dim if not layout.transposed or layout.dim is None else 1 - layout.dim
    assert split == dim, f"'{name}': expected a split of weight dim {dim}, got {split}"
    # A fresh contiguous tensor, as the stubs hand it on to modules that may write to it.
    return cut(full, -1, layout.segments).clone(memory_format=torch.contiguous_format)


@contextlib.contextmanager
def _local_run(model: nn.Module, trace: Trace, pairs: list[Pair], ctx: ShardContext,
               seen: dict[str, torch.Tensor]) -> Iterator[None]:
    """Producers return this rank's slice, consumers record their input, heads are local."""
    saved: list[tuple[nn.Module, str, object, bool]] = []
    hooks: list[RemovableHandle] = []

    def override(module: nn.Module, attr: str, value: object) -> None:
        had = attr in module.__dict__
        saved.append((module, attr, module.__dict__.get(attr), had))
        object.__setattr__(module, attr, value)

    try:
        for pair in pairs:
            for name, style in pair.styles.items():
                module = model.get_submodule(name)
                recorded = trace.calls[name][0]
                if name == pair.consumer:
                    override(module, "forward", _consumer_stub(name, recorded.output, seen))
                else:
                    part = _cut(recorded.output, style, model, name, ctx, dim=0)
                    override(module, "forward", _producer_stub(part))
            if pair.attention is not None and pair.info is not None:
                module = model.get_submodule(pair.attention)
                for attr, value in local_overrides(module, pair.info, ctx).items():
                    override(module, attr, value)
                for attr, value in local_head_parameters(module, query_part(pair.info),
                                                         ctx).items():
                    override(module, attr, value)  # (heads/tp,), shadowing the Parameter
                hook = narrow_head_biases(module, pair.info, ctx)
                hooks += [hook] if hook is not None else []
            for name, (norm, source) in pair.head_norms.items():
                module = model.get_submodule(name)
                override(module, "forward", _head_norm_stub(module, name, norm, ctx,
                                                            trace.calls[source][0].output))
        with probe_mode(model):
            yield
    finally:
        for hook in hooks:
            hook.remove()
        for module, attr, value, had in reversed(saved):
            if had:
                object.__setattr__(module, attr, value)
            else:
                del module.__dict__[attr]


def _producer_stub(part: torch.Tensor) -> Any:
    def forward(*_a: object, **_k: object) -> torch.Tensor:
        return part
    return forward


def _head_norm_stub(module: nn.Module, name: str, norm: HeadNorm, ctx: ShardContext,
                    full: torch.Tensor) -> Any:
    """The norm as :class:`~torchtp.layers.shared_by_heads.HeadShardedRMSNorm` computes it on
    this rank, with the group's sum of squares taken from its producer's recorded output."""
    layout = norm.plan(module, name, ctx).layouts["weight"]
    weight = layout.take(module.weight)  # type: ignore[arg-type]
    eps = norm_epsilon(module)
    assert eps is not None  # plan() checked it
    mine = cut(full, -1, layout.segments)
    squares = full.to(torch.float32).pow(2).sum(-1, keepdim=True)  # (B, T, 1) of every head

    def forward(x: torch.Tensor, *_a: object, **_k: object) -> torch.Tensor:
        if x.shape != mine.shape or not torch.equal(x, mine):
            raise ValueError(f"'{name}' does not read this rank's heads of '{norm.source}' "
                             "directly")
        return rms_norm_of_shard(x, squares, weight, eps, norm.part.size)
    return forward


def _consumer_stub(name: str, output: torch.Tensor, seen: dict[str, torch.Tensor]) -> Any:
    def forward(x: torch.Tensor, *_a: object, **_k: object) -> torch.Tensor:
        seen[name] = x
        return output
    return forward


def _pair_pays(pair: Pair, trace: Trace, linears: dict[str, nn.Module], memory: bool,
               rules: Rules) -> bool:
    """The cost guard for a pair: its all-reduce moves no more bytes than it saves."""
    out = trace.calls[pair.consumer][0].output
    comm = 2 * out.numel() * out.element_size()  # ring all-reduce: 2(tp-1)/tp per rank
    saved = sum(_weight_bytes(linears[n]) for n in pair.styles)  # (1-1/tp) per rank, cancels
    if comm <= saved or memory:
        return True
    why = (f"kept replicated: the pair's all-reduce ({comm} bytes per forward on the example "
           f"inputs) costs more than running it replicated ({saved} weight bytes per rank); "
           "plan='auto-memory' splits it anyway")
    rules.notes.append(f"{pair.producers} -> '{pair.consumer}' {why}")
    for name in pair.styles:
        rules.why[name] = why
    return False


def _token_embedding(model: nn.Module, tied: set[int], tp: int) -> str | None:
    """The token embedding when the vocabulary split computes it exactly (a plain untied
    ``nn.Embedding`` with a row for each of ``tp`` > 1 ranks): the model's
    ``get_input_embeddings()`` where it has one (HF), else its largest embedding.
    Position and bias tables are left alone."""
    getter = getattr(model, "get_input_embeddings", None)
    try:
        found = getter() if callable(getter) else None
    except Exception:  # a model that does not implement it
        found = None
    embeddings = [m for m in model.modules() if type(m) is nn.Embedding]
    if found is None and not callable(getter) and embeddings:
        found = max(embeddings, key=lambda m: m.num_embeddings)
    if not (type(found) is nn.Embedding and found.max_norm is None and not found.sparse
            and id(found) not in tied and found.num_embeddings >= tp > 1):
        return None
    return next(n for n, m in model.named_modules() if m is found)


def _weight_bytes(module: nn.Module) -> int:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight.numel() * weight.element_size()


def _lone(name: str, module: nn.Module, tied: bool, trace: Trace | None,
          ctx: ShardContext, notes: list[str]) -> tuple[str, str]:
    """The split of a Linear without a partner (gathered, input-split), or why it stays whole.

    Whether a split one stays split is the cost model's call
    (:mod:`torchtp.plans.choose`: replicated unless the bytes it saves pay
    for its collectives, or the memory budget needs it).
    """
    view = linear_view(module)
    assert view is not None
    if tied:
        return _noted(notes, name, "replicate", "kept replicated: its weight is shared with "
                      "another module")
    if trace is None:
        return "replicate", "kept replicated: no probe forward (see the notes)"
    if name not in trace.calls:
        return _noted(notes, name, "replicate", "kept replicated: the probe forward did not call it")
    tp = ctx.world_size
    out, inp = view.out_features, view.in_features
    if out >= tp:
        return _noted(notes, name, "colwise_gather_output", "has no partner Linear: split "
                      "out_features and gather its output (one all-gather)")
    if inp >= tp:
        return _noted(notes, name, "rowwise_split_input", "has no partner Linear: split "
                      "in_features and reduce its output (one all-reduce)")
    return _noted(notes, name, "replicate", f"kept replicated: neither out_features={out} "
                  f"nor in_features={inp} gives each of world_size={tp} ranks a share")


def _noted(notes: list[str], name: str, style: str, why: str) -> tuple[str, str]:
    notes.append(f"'{name}' {why}")
    return style, why
