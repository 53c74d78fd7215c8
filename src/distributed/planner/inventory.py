"""Every parameter of a model with the shape each tensor-parallel rank holds.

The planner's parameter, gradient and optimizer bytes are sums over an
:class:`Inventory`, so they are exactly what a run allocates when the
inventory is what the run holds. Two ways to make one:

* :func:`inventory_from_model`: torchtp's own plan, resolved for a model on
  the meta device (nothing allocated), every rank's local shape read from
  the layouts the wrapper would build (:func:`torchtp.plans.resolve_plan`,
  as ``torchtp plan --tp`` does). Exact for any model torchtp can wrap.
* :func:`inventory_from_arch`: the shapes of an :class:`~torchtp.planner.arch.Arch`
  written out, split evenly as the HF plans split them (q/k/v and the MLP
  up-projections by rows, o and down by columns, embeddings and the LM head
  by vocabulary, norms whole). For published models with no config here.

A tensor's *place* says which pipeline stage holds it: ``"embed"`` the
first, ``"layer"`` the stage of its decoder layer, ``"head"`` (final norm,
LM head) the last.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

from ..core.layouts import shard_sizes
from .arch import Arch


@dataclass(frozen=True)
class Param:
    """One parameter and what each tensor-parallel rank holds of it.

    Attributes:
        name: The parameter's name in the model.
        place: ``"embed"``, ``"layer"`` or ``"head"`` (which stage holds it).
        layer: Its decoder layer (``place == "layer"``), else ``None``.
        expert: An expert's weight (split by expert parallelism).
        full: Its unsplit shape.
        local: Its shape on each tensor-parallel rank, rank order.
        tied: The LM head's weight that is the input embedding (held once
            without a pipeline; each end stage holds a copy with one).
    """

    name: str
    place: str
    layer: int | None
    expert: bool
    full: tuple[int, ...]
    local: tuple[tuple[int, ...], ...]
    tied: bool = False

    def numel(self, rank: int) -> int:
        """Elements tensor-parallel rank ``rank`` holds."""
        return math.prod(self.local[rank])


@dataclass(frozen=True)
class Inventory:
    """Every parameter at one ``tp`` (and expert-parallel ``ep``) size.

    Attributes:
        tp: Tensor-parallel ranks the shapes are for.
        ep: Expert-parallel ranks inside the TP group (torchtp's folding).
        layers: Decoder layers of the model.
        tensors: Every parameter.
        exact: Read from torchtp's plan (``True``) or written out from a shape.
    """

    tp: int
    ep: int
    layers: int
    tensors: tuple[Param, ...]
    exact: bool

    def total(self) -> int:
        """Elements of the unsplit model (a tied weight once)."""
        return sum(math.prod(t.full) for t in self.tensors if not t.tied)


_LAYER = re.compile(r"\.(?:layers|h)\.(\d+)\.")


def _place(name: str, head: set[str]) -> tuple[str, int | None]:
    found = _LAYER.search(f".{name}")
    if found:
        return "layer", int(found.group(1))
    return ("head", None) if name in head else ("embed", None)


def inventory_from_model(model: Any, tp: int, ep: int = 1, plan: Any = None,
                         sequence_parallel: bool = False) -> Inventory:
    """torchtp's plan of ``model`` at ``tp``: every rank's parameter shapes, exactly.

    Args:
        model: A HuggingFace causal LM, best on the meta device.
        tp: Tensor-parallel size.
        ep: Experts shared out over ``ep`` blocks of the TP group
            (``DistributedModelWrapper(expert_parallel=ep)``); 1: every expert's
            features over the whole group.
        plan: As ``DistributedModelWrapper(plan=...)``.
        sequence_parallel: As the wrapper's option (it can change the plan).

    Raises:
        ValueError: torchtp cannot split the model at ``tp`` (the plan's first problem).
    """
    from ..plans import ShardContext, resolve_plan
    from ..training.options import Options

    ctx = ShardContext(tp, 0, None, type(model).__name__)
    adjust = Options(False, sequence_parallel, ep if ep > 1 else False).adjust
    resolved = resolve_plan(model, plan, ctx, adjust=adjust)
    modules = dict(model.named_modules())
    per_rank: dict[str, list[tuple[int, ...]]] = {}
    for name in resolved.layers:
        style = resolved.assignments[name]
        plans = [style.plan(modules[name], name, replace(ctx, rank=r)) for r in range(tp)]
        for attr in plans[0].layouts:
            per_rank[f"{name}.{attr}"] = [tuple(rp.layouts[attr].local_shape) for rp in plans]
    head_names = _head_names(model)
    embed = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    tensors = []
    for name, p in model.named_parameters(remove_duplicate=False):
        place, layer = _place(name, head_names)
        tied = place == "head" and p is embed
        local = per_rank.get(name, [tuple(p.shape)] * tp)
        tensors.append(Param(name, place, layer, ".experts." in f".{name}.", tuple(p.shape),
                              tuple(local), tied))
    layers = 1 + max((t.layer for t in tensors if t.layer is not None), default=-1)
    return Inventory(tp, ep, layers, tuple(tensors), exact=True)


def _head_names(model: Any) -> set[str]:
    """Names of the final norm's and the LM head's parameters."""
    from ..pipeline.decoders import decoder_layout

    decoder, layout = decoder_layout(model)
    prefix = next(n for n, m in model.named_modules() if m is decoder)
    norm = getattr(decoder, layout.norm)
    head = model.get_output_embeddings()
    names = set()
    for module, base in ((norm, f"{prefix}.{layout.norm}" if prefix else layout.norm),
                         (head, next(n for n, m in model.named_modules() if m is head))):
        names |= {f"{base}.{n}" for n, _ in module.named_parameters()}
    return names


def _even(shape: tuple[int, ...], dim: int | None, tp: int) -> tuple[tuple[int, ...], ...]:
    """Every rank's shape of ``shape`` split over ``tp`` along ``dim`` (balanced)."""
    if dim is None:
        return (shape,) * tp
    return tuple(tuple(n if i == dim else s for i, s in enumerate(shape))
                 for n in shard_sizes(shape[dim], tp))


def inventory_from_arch(arch: Arch, tp: int, ep: int = 1) -> Inventory:
    """The parameters of ``arch`` split as the HF plans split them (see the module docstring)."""
    if tp % ep:
        raise ValueError(f"inventory_from_arch: ep={ep} must divide tp={tp} (experts are shared "
                         "out over ep blocks of the TP group)")
    h, out = arch.hidden, []

    def add(name: str, shape: tuple[int, ...], dim: int | None, place: str = "layer",
            layer: int | None = None, expert: bool = False, tied: bool = False) -> None:
        local = _folded(shape, dim, tp, ep) if expert else _even(shape, dim, tp)
        out.append(Param(name, place, layer, expert, shape, local, tied))

    add("embed_tokens.weight", (arch.vocab, h), 0, "embed")
    if arch.positions:
        add("wpe.weight", (arch.positions, h), None, "embed")
    for i in range(arch.layers):
        for name, shape, dim, expert in _layer_tensors(arch, i):
            add(f"layers.{i}.{name}", shape, dim, layer=i, expert=expert)
    for name in _norm_names(arch, "norm"):
        add(name, (h,), None, "head")
    add("lm_head.weight", (arch.vocab, h), 0, "head", tied=arch.tied)
    return Inventory(tp, ep, arch.layers, tuple(out), exact=False)


def _folded(shape: tuple[int, ...], dim: int | None, tp: int,
            ep: int) -> tuple[tuple[int, ...], ...]:
    """Expert weights under folding: experts (dim 0) over ``ep`` blocks of ``tp/ep``
    consecutive ranks, each expert's features (``dim``) over the ranks of its block."""
    parts = tp // ep
    shapes = []
    for experts in shard_sizes(shape[0], ep):
        for n in shard_sizes(shape[dim], parts) if dim is not None else [0] * parts:
            s = list(shape)
            s[0] = experts
            if dim is not None:
                s[dim] = n
            shapes.append(tuple(s))
    return tuple(shapes)


def _norm_names(arch: Arch, base: str) -> list[str]:
    return [f"{base}.weight"] + ([f"{base}.bias"] if arch.norm == "layer" else [])


Row = tuple[str, tuple[int, ...], int | None, bool]
"""(name, full shape, split dimension or ``None`` for whole, an expert's weight)."""


def _layer_tensors(arch: Arch, i: int) -> list[Row]:
    """The parameters of decoder layer ``i``."""
    h = arch.hidden
    norms = _norm_names(arch, "input_layernorm") + _norm_names(arch, "post_attention_layernorm")
    rows: list[Row] = [(n, (h,), None, False) for n in norms]
    rows += _attention_tensors(arch)
    if not arch.is_moe_layer(i):
        return rows + _mlp_tensors(arch, arch.ffn, "mlp")
    assert arch.experts is not None
    e = arch.experts
    rows.append(("mlp.gate.weight", (e.count, h), None, False))
    if e.router_bias:
        rows.append(("mlp.gate.e_score_correction_bias", (e.count,), None, False))
    rows += [("mlp.experts.gate_up_proj", (e.count, 2 * e.ffn, h), 1, True),
             ("mlp.experts.down_proj", (e.count, h, e.ffn), 2, True)]
    if e.shared_ffn:
        rows += _mlp_tensors(arch, e.shared_ffn, "mlp.shared_experts")
    return rows


def _attention_tensors(arch: Arch) -> list[Row]:
    h, a = arch.hidden, "self_attn"
    if arch.latent is not None:
        lat, rows = arch.latent, []
        head_qk = lat.nope_dim + lat.rope_dim
        if lat.q_rank:
            rows += [(f"{a}.q_a_proj.weight", (lat.q_rank, h), None, False),
                     (f"{a}.q_a_layernorm.weight", (lat.q_rank,), None, False),
                     (f"{a}.q_b_proj.weight", (arch.heads * head_qk, lat.q_rank), 0, False)]
        else:
            rows.append((f"{a}.q_proj.weight", (arch.heads * head_qk, h), 0, False))
        rows += [(f"{a}.kv_a_proj_with_mqa.weight", (lat.kv_rank + lat.rope_dim, h), None, False),
                 (f"{a}.kv_a_layernorm.weight", (lat.kv_rank,), None, False),
                 (f"{a}.kv_b_proj.weight", (arch.heads * (lat.nope_dim + lat.v_dim), lat.kv_rank),
                  0, False),
                 (f"{a}.o_proj.weight", (h, arch.heads * lat.v_dim), 1, False)]
        return rows
    rows = [(f"{a}.q_proj.weight", (arch.q_dim, h), 0, False),
            (f"{a}.k_proj.weight", (arch.kv_dim, h), 0, False),
            (f"{a}.v_proj.weight", (arch.kv_dim, h), 0, False),
            (f"{a}.o_proj.weight", (h, arch.q_dim), 1, False)]
    if arch.bias in ("qkv", "all"):
        rows += [(f"{a}.{p}_proj.bias", (w,), 0, False)
                 for p, w in (("q", arch.q_dim), ("k", arch.kv_dim), ("v", arch.kv_dim))]
    if arch.bias == "all":
        rows.append((f"{a}.o_proj.bias", (h,), None, False))
    if arch.qk_norm:
        rows += [(f"{a}.{p}_norm.weight", (arch.head_dim,), None, False) for p in "qk"]
    return rows


def _mlp_tensors(arch: Arch, ffn: int, base: str) -> list[Row]:
    h = arch.hidden
    ups = ["gate_proj", "up_proj"] if arch.mlp == "gated" else ["up_proj"]
    rows: list[Row] = [(f"{base}.{u}.weight", (ffn, h), 0, False) for u in ups]
    rows.append((f"{base}.down_proj.weight", (h, ffn), 1, False))
    if arch.bias == "all":
        rows += [(f"{base}.{u}.bias", (ffn,), 0, False) for u in ups]
        rows.append((f"{base}.down_proj.bias", (h,), None, False))
    return rows
