"""Confirm every whole-head attention split on the real module before any weight is cut.

Rules from any source (the model's HF plan, torchtp's built-in plans, a plan
passed by the user) only name styles; whether a module's forward then reads
its heads where the split put them depends on its code. CodeGen, for one,
packs ``qkv_proj``'s out_features (weight rows) in ``mp_num=4`` groups that no
style describes, so a ``colwise`` split of it runs and gives wrong numbers.

The check is the automatic plan's probe (:func:`torchtp.plans.auto._simulate`):
for each rank, the model runs with the q/k/v producers returning that rank's
slice of their recorded output and the attention module's head counts set to
their local values; what reaches the output projection (the consumer, found
by dataflow, wherever it lives) must equal that rank's slice of its recorded
input, cut as its own style splits in_features (weight columns). Every rank
simulates every rank on the same fixed-seed inputs, so all reach the same
verdict, which is part of the wrap's fingerprint.

A HuggingFace model is probed on a one-layer CPU copy built from its config
with random weights (fixed seed), whose verdicts apply to every layer of the
same name pattern: a model on the meta device (``from_pretrained``) cannot run
at all, and the copy costs a few layers' work instead of ``tp + 1`` forwards of
the whole model. A model whose modules differ from the copy's (replaced by the
user), one given ``example_inputs`` and any other model are probed themselves.

A confirmed split whose heads pass through a norm over ``head_dim`` (Qwen3's
``q_norm``) that the plan keeps plainly replicated gets that norm as
``replicated_with_grad_allreduce``, with a note: each rank's gradient of it
covers only its heads (transformers 5.25's Param2MoE plan leaves it out).

A plainly replicated module whose parameters a split region reads (Apertus's
xIELU activation, with learnable scalars, between ``up_proj`` and
``down_proj``) gets ``replicated_with_grad_allreduce`` too, with a note: found on
the same probe, for every pair of a weight-rows split Linear and the
weight-columns split one reading it, within their common parent module.

A split that is not confirmed stays replicated with the reason in
``describe_plan()`` when the plan comes from a source torchtp does not
control; a plan the user passed is refused with the reason, unless
``verify_plan=False`` makes it their responsibility.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Hashable, Iterator
from contextlib import contextmanager

from torch import nn

from .auto import Pair, _as_inputs, _derive, _head_dim_norms, _simulate
from .dataflow import Trace, record
from .heads import HeadInfo
from .linear_view import linear_view
from .resolved import ResolvedPlan, is_user_plan
from .sources import family_of, head_config
from .styles import Colwise, ParallelStyle, Replicate, ReplicatedWithGradAllreduce, Rowwise, ShardContext
from .styles_heads import HeadNorm, HeadParams, RopeKey

CONFIRMED = "whole heads confirmed by the local probe"
OPT_OUT = "verify_plan=False"
UNVERIFIABLE = "could not be verified"
CACHE_SIZE = 32  # verdicts of distinct (model class, config, plan, tp) kept per process
# Per name pattern: (why not confirmed or None, consumer, attention, head_dim norms), as probed
Verdict = tuple[str | None, str | None, str, tuple[str, ...]]
# A probe's verdicts, and the name patterns of the plainly replicated modules whose
# parameters a split region reads (:func:`_region_parameters`)
Probed = tuple[dict[str, Verdict], tuple[str, ...]]
_CACHE: dict[Hashable, Probed] = {}


def verify_heads(model: nn.Module, plan: ResolvedPlan, ctx: ShardContext,
                 example_inputs: object = None, verify: bool = True) -> list[ValueError]:
    """Confirm each attention split in ``plan.heads``; undo or refuse the others.

    Args:
        model: The model being planned (may live on the meta device).
        plan: The matched plan after :func:`~torchtp.plans.head_split.split_whole_heads`;
            ``plan.checks`` gets one verdict per attention module, and
            unconfirmed splits are reverted to ``replicate`` unless the plan is
            the user's.
        ctx: The tp size.
        example_inputs: Inputs for the probe forward (as for the automatic plan).
        verify: ``False`` (the user's opt-out): record that nothing was checked.

    Returns:
        One error per unconfirmed attention split of a user plan (empty otherwise).
    """
    if not plan.heads or ctx.world_size == 1:
        return []
    if not verify:
        for attention in plan.heads:
            plan.checks[attention] = f"not verified ({OPT_OUT}): the user's responsibility"
        plan.notes.append(f"attention splits not verified ({OPT_OUT}): exactness of "
                          f"{sorted(plan.heads)} is the user's responsibility")
        return []
    errors = []
    # A split that does not fit this tp raises while its layers are planned, naming the size.
    unfit = {a for a in plan.heads if not _fits(model, plan, a, ctx)}
    verdicts, regions = _verdicts(model, plan, ctx, example_inputs, unfit)
    for attention, (why, consumer, norms) in verdicts.items():
        members = [n for n in plan.assignments if n.startswith(f"{attention}.")]
        outside = [consumer] if consumer is not None else _output_projections(model, plan,
                                                                             attention)
        members += [n for n in outside if n in plan.assignments and n not in members]
        if why is None:
            plan.checks[attention] = "confirmed"
            for name in members:
                plan.why[name] = f"{plan.why.get(name, '')}; {CONFIRMED}"
            _sum_norm_gradients(plan, attention, norms)
        elif is_user_plan(plan.source):
            plan.checks[attention] = f"refused: {why}"
            errors.append(_refusal(model, plan, attention, members, why, ctx))
        else:
            plan.checks[attention] = f"kept replicated: {why}"
            _replicate(plan, attention, members, why)
    _sum_region_gradients(model, plan, regions)
    return errors


def _sum_norm_gradients(plan: ResolvedPlan, attention: str, norms: tuple[str, ...]) -> None:
    """Sum the gradients of the norms over ``head_dim`` inside a confirmed split.

    Such a norm (Qwen3's ``q_norm``) runs on this rank's heads only, so each
    rank's gradient of its weight covers only those heads. A plan that keeps
    it plainly replicated (transformers 5.25's Param2MoE plan, a plan written
    for PyTorch's ``parallelize_module``) would train it on partial gradients:
    it gets ``replicated_with_grad_allreduce``, as the automatic plan gives it.
    """
    for name in norms:
        if isinstance(plan.assignments.get(name), ReplicatedWithGradAllreduce):
            continue
        _grad_allreduce(plan, name, (
            f"a norm over head_dim inside '{attention}', whose heads are split; each rank's "
            "gradient covers only its heads, so it is summed over the group"), (
            "kept this norm over head_dim plainly replicated inside a head split, which would "
            "leave each rank the gradient of its own heads only"))


def _sum_region_gradients(model: nn.Module, plan: ResolvedPlan, patterns: tuple[str, ...]) -> None:
    """Sum the gradients of plainly replicated parameters that a split region reads.

    Apertus's xIELU activation between ``up_proj`` (weight rows split) and
    ``down_proj`` (weight columns split) has learnable scalars ``alpha_p`` and
    ``alpha_n``: each rank applies them to its share of the intermediate
    features only, so each rank's gradient of them is a partial sum. Such a
    parameter broadcasts over the split features (a tensor indexed by them
    could not run on a share), so the sum over the group is its gradient:
    ``replicated_with_grad_allreduce``, with a note.
    """
    for name, module in model.named_modules():
        pattern = _stars(name)
        if pattern not in patterns or not any(True for _ in module.parameters(recurse=False)):
            continue
        style = plan.assignments.get(name)
        if style is not None and not isinstance(style, Replicate):
            continue
        _grad_allreduce(plan, name, (
            "its parameters are read inside a split region (between a weight-rows split and a "
            "weight-columns split Linear); each rank's gradient covers only its share of the "
            "split features, so it is summed over the group"), (
            "kept it plainly replicated, but a split region reads its parameters, which would "
            "leave each rank the gradient of its own share of the features only"))


def _grad_allreduce(plan: ResolvedPlan, name: str, why: str, kept: str) -> None:
    """``name`` becomes ``replicated_with_grad_allreduce`` with ``why``; the note (once per
    layer pattern) says what the plan ``kept``."""
    plan.assignments[name] = ReplicatedWithGradAllreduce()
    plan.why[name] = f"replicated_with_grad_allreduce: {why}"
    note = f"'{_stars(name)}' gets replicated_with_grad_allreduce: the plan ({plan.source}) {kept}"
    if note not in plan.notes:
        plan.notes.append(note)


def _output_projections(model: nn.Module, plan: ResolvedPlan, attention: str) -> list[str]:
    """Without a probe: the in_features-split Linears near ``attention`` that read its heads.

    Inside it, or (BERT's ``attention.output.dense``) under its parent, not
    below a sibling that splits out_features itself (an MLP), with
    in_features equal to the query heads' width.
    """
    info = plan.heads[attention]
    parent = attention.rpartition(".")[0]
    lead = f"{parent}." if parent else ""
    own = {n.rpartition(".")[0] for n, s in plan.assignments.items()
           if isinstance(s, Colwise) and not n.startswith(f"{attention}.")}
    out = []
    for name, style in plan.assignments.items():
        view = linear_view(model.get_submodule(name))
        if (isinstance(style, Rowwise) and not style.split_input and name.startswith(lead)
                and view is not None and view.in_features == info.heads * info.value_dim
                and not any(name.startswith(f"{o}.") for o in own if o != parent)):
            out.append(name)
    return out


def _fits(model: nn.Module, plan: ResolvedPlan, attention: str, ctx: ShardContext) -> bool:
    """Every split module inside ``attention`` plans and fits at ``ctx.world_size``."""
    for name, style in plan.assignments.items():
        if name.startswith(f"{attention}."):
            try:
                if not style.plan(model.get_submodule(name), name, ctx).fits(ctx.world_size):
                    return False
            except (TypeError, ValueError):
                return False
    return True


def _verdicts(model: nn.Module, plan: ResolvedPlan, ctx: ShardContext, example_inputs: object,
              unfit: set[str]
              ) -> tuple[dict[str, tuple[str | None, str | None, tuple[str, ...]]],
                         tuple[str, ...]]:
    """Per attention module in ``plan.heads``: (``None`` or why not confirmed, its consumer,
    the norms over ``head_dim`` on the way to it); and the name patterns of the plainly
    replicated modules whose parameters a split region reads.

    One layer per name pattern is checked (``h.*.attn``); its verdict holds for all.
    Verdicts from a one-layer copy depend only on the model's class, config,
    module types, plan and tp: they are cached (another wrap of the same model
    at the same tp, e.g. one per test or per process restart, probes once).
    """
    heads = {a: i for a, i in plan.heads.items() if a not in unfit}
    if not heads:
        return {}, ()
    key = _cache_key(model, plan, heads, ctx) if example_inputs is None else None
    entry = _CACHE.get(key) if key is not None else None
    if entry is None:
        entry, from_copy = _probe_patterns(model, plan, heads, ctx, example_inputs)
        if key is not None and from_copy:
            if len(_CACHE) >= CACHE_SIZE:
                del _CACHE[next(iter(_CACHE))]
            _CACHE[key] = entry
    found, regions = entry
    out = {}
    for a in heads:  # the probed layer's names renumbered to this layer's
        why, consumer, probed, norms = found[_stars(a)]
        renamed = (_renumber(n, probed, a) for n in norms)
        out[a] = (why, _renumber(consumer, probed, a), tuple(n for n in renamed if n is not None))
    return out, regions


def _probe_patterns(model: nn.Module, plan: ResolvedPlan, heads: dict[str, HeadInfo],
                    ctx: ShardContext, example_inputs: object) -> tuple[Probed, bool]:
    """Per name pattern: (why not confirmed or ``None``, consumer, attention, norms over
    ``head_dim`` on the way) as probed, the patterns :func:`_region_parameters` finds,
    and whether the probe was the one-layer copy."""
    with _probe_model(model, example_inputs) as (probe, trace, why):
        if trace is None or probe is None:
            return ({_stars(a): (f"{UNVERIFIABLE}: {why}", None, a, ()) for a in heads}, ()), False
        names = _names_by_pattern(probe)
        pairs: dict[str, Pair] = {}
        out: dict[str, Verdict] = {}
        for attention, info in heads.items():
            key = _stars(attention)
            if key not in pairs and key not in out:
                pair = _pair(probe, trace, plan, attention, info, names)
                if isinstance(pair, str):
                    out[key] = (pair, None, names.get(key, attention), ())
                else:
                    pairs[key] = pair
        # Every layer of a checked pattern runs split, as after the wrap: a value one layer
        # hands the next per head (T5's position bias) is then local where it is read.
        try:
            verdicts, _ = _simulate(probe, trace,
                                    [*pairs.values(), *_every_layer(probe, trace, pairs)], ctx)
        except Exception as err:  # a layer the pattern's split does not fit (Gemma 4's
            # full-attention layers with another head_dim): no split of it is confirmed
            failed = f"the split run failed ({type(err).__name__}: {err})"
            verdicts = {pair.consumer: failed for pair in pairs.values()}
        for key, pair in pairs.items():
            why_not = verdicts[pair.consumer]
            out[key] = (None if why_not is None else (
                "with its projections split by whole heads, the local probe does not "
                f"reproduce each rank's slice of its output projection's input ({why_not})"),
                pair.consumer, names[key], pair.norms)
        return (out, _region_parameters(probe, trace, plan, names)), probe is not model


def _region_parameters(probe: nn.Module, trace: Trace, plan: ResolvedPlan,
                       names: dict[str, str]) -> tuple[str, ...]:
    """Name patterns of the plainly replicated modules whose parameters are read between a
    weight-rows split (``colwise``) Linear and the weight-columns split (``rowwise``) one
    that reads its output, within their common parent module (see
    :func:`_sum_region_gradients`)."""
    splits = {names.get(_stars(n)): s for n, s in plan.assignments.items()}
    owners = {id(p): m for m, mod in probe.named_modules() for p in mod.parameters(recurse=False)}
    found: set[str] = set()
    for consumer, style in splits.items():
        if consumer is None or consumer not in trace.calls or not isinstance(style, Rowwise) \
                or style.split_input:
            continue
        region = trace.region(consumer)
        producers = {splits.get(p) for p in region.producers}
        if not region.producers or not all(isinstance(s, Colwise) and not s.gather_output
                                           for s in producers):
            continue
        parent = _common_parent([consumer, *region.producers])
        for tensor in region.tensors:
            owner = owners.get(id(tensor))
            if owner is not None and owner.startswith(parent):
                found.add(_stars(owner))
    return tuple(sorted(found))


def _common_parent(names: list[str]) -> str:
    """The longest module-name prefix (ending in a dot, or empty) the ``names`` share."""
    parts = [n.split(".")[:-1] for n in names]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common) + "." if common else ""


def _every_layer(probe: nn.Module, trace: Trace, pairs: dict[str, Pair]) -> list[Pair]:
    """The pairs of the probe's other layers of each checked pattern (its modules named
    with their layer numbers), so every layer runs split as after the wrap."""
    out = []
    for key, pair in pairs.items():
        assert pair.attention is not None  # head pairs only
        for name, _ in probe.named_modules():
            if name == pair.attention or _stars(name) != key:
                continue
            styles = {renamed: s for n, s in pair.styles.items()
                      if (renamed := _renumber(n, pair.attention, name)) is not None}
            consumer = _renumber(pair.consumer, pair.attention, name)
            norms = {_renumber(n, pair.attention, name): (s, _renumber(src, pair.attention, name))
                     for n, (s, src) in pair.head_norms.items()}
            if consumer is not None and len(styles) == len(pair.styles) \
                    and all(n in trace.calls for n in styles) \
                    and all(src in trace.calls for _, src in norms.values()):
                out.append(dataclasses.replace(
                    pair, consumer=consumer, styles=styles, attention=name,
                    head_norms={n: (s, src) for n, (s, src) in norms.items()
                                if n is not None and src is not None}))
    return out


def _cache_key(model: nn.Module, plan: ResolvedPlan, heads: dict[str, HeadInfo],
               ctx: ShardContext) -> Hashable | None:
    """What a one-layer copy's verdicts depend on, or ``None`` (no family's model, or no key)."""
    family = family_of(model)
    config = family.copy_key(model) if family is not None else None
    if config is None:
        return None
    types = frozenset((_stars(n), type(m)) for n, m in model.named_modules())
    # Only the styles the probe reads (_pair, _consumer): another candidate or the cost
    # model's choice for a head or an embedding does not change a verdict.
    styles = frozenset((_stars(n), type(s), s.name, getattr(s, "parts", None),
                        getattr(s, "heads", None), getattr(s, "part", None))
                       for n, s in plan.assignments.items()
                       if (isinstance(s, Colwise) and not s.gather_output)
                       or (isinstance(s, Rowwise) and not s.split_input)
                       or isinstance(s, HeadNorm))
    return (type(model), config, types, styles,
            frozenset((_stars(a), i) for a, i in heads.items()), ctx.world_size)


def _renumber(consumer: str | None, probed: str, attention: str) -> str | None:
    """The consumer of ``attention`` given the probed layer's (same layer numbers as it)."""
    if consumer is None:
        return None
    a, c = probed.split("."), consumer.split(".")
    common = next((i for i, (x, y) in enumerate(zip(a, c, strict=False)) if x != y),
                  min(len(a), len(c)))
    return ".".join(attention.split(".")[:common] + c[common:])


@contextmanager
def _probe_model(model: nn.Module, example_inputs: object
                 ) -> Iterator[tuple[nn.Module | None, Trace | None, str]]:
    """The model to probe and its trace.

    A model of a registered family (HuggingFace) is probed on its family's
    one-layer CPU copy (a few layers' worth of work instead of ``tp + 1``
    forwards of the whole model) when every module of the copy has the type of
    the model's module of the same name; the model itself otherwise, or when
    ``example_inputs`` are given. A meta model
    cannot run: the copy or nothing.
    """
    probe = model
    meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    family = family_of(model)
    if meta or (example_inputs is None and family is not None):
        small = family.probe_copy(model) if family is not None else None
        if small is not None and (meta or _same_types(small, model)):
            probe, example_inputs = small, None
        elif meta:
            yield None, None, ("the model is on the meta device and no copy can be built from a "
                               "HuggingFace config")
            return
    probe_family = family_of(probe)
    if example_inputs is None and probe_family is not None:
        example_inputs = probe_family.probe_inputs(probe)
    inputs = _as_inputs(example_inputs) if example_inputs is not None else _derive(probe)
    if inputs is None:
        yield None, None, "no example inputs could be derived (pass example_inputs=)"
        return
    try:
        trace = record(probe, inputs)
    except Exception as err:  # any model-specific failure: unverifiable
        yield None, None, f"the probe forward failed ({type(err).__name__}: {err})"
        return
    yield probe, trace, ""


def _same_types(small: nn.Module, model: nn.Module) -> bool:
    """Every module of ``small`` has the type of ``model``'s module of the same name.

    Where ``model`` has no such module, or only a placeholder marked
    ``held_elsewhere`` (a pipeline stage holds other layers, embeddings or
    head than the copy's first ones), the modules of the same name pattern
    (block indices as ``*``) that it does hold must all be of that type: what
    the stage holds is the copy's, so the copy's verdicts hold for it.
    """
    modules = dict(model.named_modules())
    kinds: dict[str, set[type]] = {}
    for name, m in modules.items():
        if not getattr(m, "held_elsewhere", False):
            kinds.setdefault(_INDEX.sub(".*", name), set()).add(type(m))
    for name, m in small.named_modules():
        mine = modules.get(name)
        if mine is not None and not getattr(mine, "held_elsewhere", False):
            if type(mine) is not type(m):
                return False
        elif kinds.get(_INDEX.sub(".*", name), {type(m)}) != {type(m)}:
            return False
    return True


_INDEX = re.compile(r"\.\d+(?=\.|$)")  # a block index in a module name: "layers.3.mlp"


def _names_by_pattern(model: nn.Module) -> dict[str, str]:
    """Module name with layer numbers as ``*`` -> the first such module's name."""
    out: dict[str, str] = {}
    for name, _ in model.named_modules():
        out.setdefault(_stars(name), name)
    return out


def _pair(probe: nn.Module, trace: Trace, plan: ResolvedPlan, attention: str, info: HeadInfo,
          names: dict[str, str]) -> Pair | str:
    """The producers and consumer of ``attention``'s split, named as in ``probe``."""
    producers = {names.get(_stars(n)): s for n, s in plan.assignments.items()
                 if n.startswith(f"{attention}.") and isinstance(s, Colwise)
                 and not s.gather_output}
    if None in producers or not producers:
        return f"{UNVERIFIABLE}: its projections are not in the probe model"
    local = {n for n in producers if n is not None and n in trace.calls}
    if len(local) != len(producers):
        return f"{UNVERIFIABLE}: the probe forward did not call its projections"
    owner = names.get(_stars(attention))
    # A latent attention's rope key projection is whole on every rank, read by every head.
    whole = {names.get(_stars(n)) for n, s in plan.assignments.items()
             if n.startswith(f"{attention}.") and isinstance(s, RopeKey) and s.rope}
    consumer = _consumer(probe, trace, plan, local | {n for n in whole if n is not None}, names)
    if consumer is None or owner is None:
        return (f"{UNVERIFIABLE}: no output projection split by in_features (weight columns, "
                "'rowwise') reads only its split heads")
    styles: dict[str, ParallelStyle] = {n: s for n, s in producers.items() if n is not None}
    styles[consumer[0]] = consumer[1]
    norms = {names.get(_stars(n)): (s, names.get(_stars(s.source)))
             for n, s in plan.assignments.items()
             if n.startswith(f"{attention}.") and isinstance(s, HeadNorm)}
    if any(n is None or src not in local for n, (_, src) in norms.items()):
        return f"{UNVERIFIABLE}: its norms over all heads are not in the probe model"
    head_norms = {n: (s, src) for n, (s, src) in norms.items() if n is not None and src}
    # Norms over head_dim on the way (Qwen3's q_norm): their gradients need summing.
    synced = _head_dim_norms(probe, trace.region(consumer[0]), sorted(local), consumer[0],
                             head_config(probe))
    return Pair(consumer[0], styles, owner, info, "whole heads", norms=synced or (),
                head_norms=head_norms)


def _consumer(probe: nn.Module, trace: Trace, plan: ResolvedPlan, producers: set[str],
              names: dict[str, str]) -> tuple[str, ParallelStyle] | None:
    """The in_features-split Linear whose input is made only from ``producers``."""
    styles = {names.get(_stars(n)): s for n, s in plan.assignments.items()
              if isinstance(s, Rowwise) and not s.split_input}
    for name, style in styles.items():
        if name is None or name not in trace.calls or linear_view(probe.get_submodule(name)) \
                is None:
            continue
        sources = trace.sources(name)
        if sources and sources <= producers:
            return name, style
    return None


def _replicate(plan: ResolvedPlan, attention: str, members: list[str], why: str) -> None:
    """Keep ``attention``'s split modules whole (per-head norms too) and say why."""
    plan.heads.pop(attention, None)
    if isinstance(plan.assignments.get(attention), HeadParams):  # its sinks stay whole too
        plan.assignments[attention] = HeadParams()
    for name in members:
        plan.assignments[name] = Replicate()
        plan.why[name] = f"kept replicated: attention '{attention}' {why}"
    note = f"'{_stars(attention)}' kept replicated: {why}; {list(map(_stars, members))} stay whole"
    if note not in plan.notes:  # once per layer pattern
        plan.notes.append(note)


def _refusal(model: nn.Module, plan: ResolvedPlan, attention: str, members: list[str],
             why: str, ctx: ShardContext) -> ValueError:
    info = plan.heads[attention]
    shapes = []
    # Producers first, then the output projection, whatever the modules' registration order.
    for name in sorted(members, key=lambda n: isinstance(plan.assignments[n], Rowwise)):
        view, style = linear_view(model.get_submodule(name)), plan.assignments[name]
        if view is not None and isinstance(style, (Colwise, Rowwise)):
            split = (f"out_features={view.out_features} (weight rows)" if isinstance(style, Colwise)
                     else f"in_features={view.in_features} (weight columns)")
            shapes.append(f"'{name}' ({style.name}: splits {split})")
    kind = type(model.get_submodule(attention)).__name__
    if why.startswith(UNVERIFIABLE):
        fix = ("Fix: pass example_inputs=(...) to DistributedModelWrapper so the probe can run "
               "(from_pretrained: a one-layer copy is built from the HuggingFace config), mark "
               f"these modules 'replicate' in the plan, or pass {OPT_OUT} if you have checked "
               "the split yourself")
    else:
        fix = ("Its forward probably lays out its heads in a way the styles do not describe "
               "(e.g. CodeGen packs qkv_proj's out_features in mp_num=4 groups). Fix: mark "
               f"these modules 'replicate' in the plan, or pass {OPT_OUT} to "
               "DistributedModelWrapper if you have checked the split yourself")
    return ValueError(
        f"plan ({plan.source}): attention '{attention}' ({kind}, num_attention_heads="
        f"{info.heads}, num_key_value_heads={info.kv_heads}, head_dim={info.head_dim}) split by "
        f"whole heads at world_size={ctx.world_size} via {', '.join(shapes)}: {why}. {fix}")


def _stars(name: str) -> str:
    """Layer numbers inside module names as ``*`` (``h.3.attn`` -> ``h.*.attn``)."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)
