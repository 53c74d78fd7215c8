"""Memory per rank of one training step under a layout: what torchtp allocates.

Parameters, gradients and optimizer state are sums over the
:class:`~torchtp.planner.inventory.Inventory` of what the rank holds,
exact when the inventory is torchtp's plan:

* a pipeline stage holds its decoder layers (the balanced split of
  :func:`torchtp.pipeline.stage_layers`, or the layout's ``stage_layers``), the first also the embeddings, the
  last the final norm and LM head (a tied head is a second copy there);
* expert parallelism shares the experts out (``ep`` divides ``tp``: torchtp's
  folding; ``ep`` above ``tp`` is planned with whole experts over ``ep``
  ranks, which torchtp does not run yet);
* FSDP2 cuts every local tensor along its first dimension into ``dp``
  chunks of ``ceil(rows / dp)`` rows (``torch.chunk``); the largest rank's
  chunk (the first) is what is counted;
* AdamW keeps two states per element and a float32 step count per tensor.

Activations are the bytes autograd saves (:mod:`torchtp.planner.activations`)
times the microbatches a stage holds at once: all of them under GPipe,
``pp - stage`` (at most the microbatch count) under 1F1B, one on the last
stage, plus what PyTorch's pipeline keeps beside them (:func:`pipeline_extra`).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from ..comm.layout_file import Layout
from ..core.layouts import shard_range
from . import activations as act
from .arch import Arch
from .inventory import Inventory, Param
from .setup import Training


@dataclass(frozen=True)
class Memory:
    """Bytes on the rank that needs the most (every field is that rank's).

    Attributes:
        params: Parameters the rank holds (FSDP2: its shard, unpadded).
        grads: Their gradients.
        optimizer: Optimizer state (and master weights where the precision keeps them).
        activations: Saved activations at the peak (all microbatches in flight).
        per_microbatch: Saved activations of one microbatch on that stage.
        in_flight: Microbatches whose activations the stage holds at once.
        transient: Working memory of the largest step inside the step
            (FSDP2's unsharded layer, the logits' gradient, a recomputed layer,
            the first step's pipeline shape inference).
        buffers: Communication buffers (DDP's gradient buckets).
        stage: The pipeline stage of that rank.
    """

    params: int
    grads: int
    optimizer: int
    activations: int
    per_microbatch: int
    in_flight: float
    transient: int
    buffers: int
    stage: int

    @property
    def total(self) -> int:
        """Everything: the rank's peak."""
        return (self.params + self.grads + self.optimizer + self.activations + self.transient
                + self.buffers)

    def as_dict(self) -> dict[str, Any]:
        """The estimate as plain data (with ``total``)."""
        return asdict(self) | {"total": self.total}


def stage_range(layers: int, layout: Layout, stage: int) -> tuple[int, int]:
    """(first layer, layers) of pipeline stage ``stage``: ``layout.stage_layers`` when
    given, else the balanced split of :func:`torchtp.pipeline.stage_layers`."""
    split = layout.stage_layers
    if not split:
        return shard_range(layers, layout.pp, stage)
    if len(split) != layout.pp or sum(split) != layers:
        raise ValueError(f"stage_layers={list(split)}: give {layout.pp} layer counts summing to "
                         f"the model's {layers} layers")
    return sum(split[:stage]), split[stage]


def stage_tensors(inv: Inventory, stage: int, layout: Layout) -> list[Param]:
    """The tensors pipeline stage ``stage`` holds."""
    pp = layout.pp
    start, n = stage_range(inv.layers, layout, stage)
    out = []
    for t in inv.tensors:
        if t.place == "layer":
            keep = t.layer is not None and start <= t.layer < start + n
        elif t.place == "embed":
            keep = stage == 0
        else:
            keep = stage == pp - 1 and not (t.tied and pp == 1)  # one tensor without a pipeline
        if keep:
            out.append(t)
    return out


def _local(t: Param, rank: int, layout: Layout) -> tuple[int, int]:
    """(elements, rows along dim 0) of ``t`` on tensor-parallel rank ``rank``.

    Experts with ``ep`` above ``tp`` (planned only): whole experts, ``count / ep`` of them.
    """
    shape = t.local[rank]
    if t.expert and layout.ep > layout.tp:
        experts = math.ceil(t.full[0] / layout.ep)
        return experts * math.prod(t.full[1:]), experts
    return math.prod(shape), (shape[0] if shape else 1)


def _sharded(numel: int, rows: int, parts: int, index: int) -> int:
    """Elements of chunk ``index`` of FSDP2's cut into ``parts`` along dim 0.

    ``torch.chunk``'s rule: ``ceil(rows / parts)`` rows per chunk, the last
    ones shorter or empty (FSDP2 pads their storage to the first's size).
    """
    if parts == 1 or rows == 0:
        return numel
    chunk = math.ceil(rows / parts)
    return max(0, min(chunk, rows - index * chunk)) * (numel // rows)


_SHAPES: dict[tuple[Any, ...], tuple[Inventory, Counter[tuple[int, int, bool]]]] = {}


def _stage_shapes(inv: Inventory, stage: int, rank: int, layout: Layout
                  ) -> Counter[tuple[int, int, bool]]:
    """``(elements, rows, expert) -> how many tensors`` tensor-parallel ``rank`` of ``stage`` holds.

    Cached per inventory (layouts of one search share it): a stage holds many
    tensors of a few shapes.
    """
    beyond = layout.ep > layout.tp
    key = (id(inv), layout.pp, layout.stage_layers, stage, rank, beyond)
    hit = _SHAPES.get(key)
    if hit is not None and hit[0] is inv:
        return hit[1]
    if len(_SHAPES) > 4096:
        _SHAPES.clear()
    counts: Counter[tuple[int, int, bool]] = Counter()
    for t in stage_tensors(inv, stage, layout):
        numel, rows = _local(t, rank, layout)
        counts[(numel, rows, t.expert)] += 1
    _SHAPES[key] = (inv, counts)
    return counts


def _param_sizes(inv: Inventory, stage: int, rank: int, dp_rank: int, layout: Layout,
                 training: Training) -> tuple[int, int, int]:
    """(elements held, elements before the data-parallel cut, tensors)."""
    held = whole = count = 0
    for (numel, rows, expert), n in _stage_shapes(inv, stage, rank, layout).items():
        whole += n * numel
        count += n
        if training.data_parallel == "fsdp":
            # Experts whose ep spans data-parallel ranks shard over the rest of the stage.
            parts = layout.dp * (layout.tp * layout.cp // layout.ep
                                 if expert and layout.ep > layout.tp else 1)
            held += n * _sharded(numel, rows, parts, dp_rank)
        else:
            held += n * numel
    return held, whole, count


def held_elements(inv: Inventory, layout: Layout) -> int:
    """The most parameter elements one rank holds before any data-parallel cut."""
    return max(sum(n * numel for (numel, _, _), n in _stage_shapes(inv, s, r, layout).items())
               for s in range(layout.pp) for r in _distinct_ranks(inv))


_PER_INVENTORY: dict[int, tuple[Inventory, list[int], dict[int | None, int]]] = {}


def _facts(inv: Inventory) -> tuple[list[int], dict[int | None, int]]:
    """(one tensor-parallel rank per distinct set of local shapes, rank 0's elements per layer)."""
    hit = _PER_INVENTORY.get(id(inv))
    if hit is not None and hit[0] is inv:
        return hit[1], hit[2]
    if len(_PER_INVENTORY) > 256:
        _PER_INVENTORY.clear()
    seen: dict[tuple[tuple[int, ...], ...], int] = {}
    for r in range(inv.tp):
        seen.setdefault(tuple(t.local[r] for t in inv.tensors), r)
    per_layer: Counter[int | None] = Counter()
    for t in inv.tensors:
        per_layer[t.layer] += t.numel(0)
    _PER_INVENTORY[id(inv)] = (inv, list(seen.values()), dict(per_layer))
    return list(seen.values()), dict(per_layer)


def _distinct_ranks(inv: Inventory) -> list[int]:
    """One tensor-parallel rank per distinct set of local shapes (all ranks alike: one)."""
    return _facts(inv)[0]


def state_bytes(held: int, whole: int, tensors: int, layout: Layout,
                training: Training) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes of ``held`` elements (``whole`` before FSDP's cut).

    Precision ``"fp32"``: 4-byte parameters and gradients; optimizer state in
    float32. ``"bf16"``/``"fp8"``: under FSDP2 float32 parameter shards (the
    master copy; bf16 is gathered per layer) and float32 gradient shards;
    under DDP/ZeRO-1 bf16 parameters, float32 gradients and a float32 master
    copy kept with the optimizer state (ZeRO-1 shards both over ``dp``).
    """
    states = {"adamw": 2, "sgd": 0, "sgd-momentum": 1}[training.optimizer]
    steps = 4 * tensors if training.optimizer == "adamw" else 0  # AdamW's float32 step counts
    mixed = training.precision != "fp32"
    if training.data_parallel == "fsdp":
        return 4 * held, 4 * held, 4 * states * held + steps
    shard = math.ceil(whole / layout.dp) if training.data_parallel == "zero1" else whole
    master = 4 * shard if mixed else 0
    return (2 if mixed else 4) * whole, 4 * whole, 4 * states * shard + master + steps


def activation_bytes(arch: Arch, layout: Layout, training: Training, stage: int,
                     microbatch: int, loss_parallel: bool = False) -> tuple[int, int]:
    """Bytes one microbatch saves on pipeline stage ``stage``: (its layers, the LM head's).

    The head's are apart because the last stage runs a microbatch's backward
    right after its forward under every schedule but GPipe.
    """
    s = act.shares(arch, layout, training, microbatch)
    start, n = stage_range(arch.layers, layout, stage)
    layers = range(start, start + n)
    if training.recompute == "full":
        body = n * act.checkpointed_layer(s, arch)
    else:
        body = sum(act.layer(arch, i, s, layout, training.stack) for i in layers)
    body += act.rotary(arch, s, microbatch) + (act.embed(arch, s) if stage == 0 else 0)
    head = act.head(arch, s, layout, loss_parallel) if stage == layout.pp - 1 else 0
    return body, head


def in_flight(layout: Layout, stage: int) -> float:
    """Microbatches of a whole stage's layers whose activations a rank holds at once.

    GPipe: all ``m``; 1F1B: ``min(m, pp - stage)``; interleaved 1F1B with ``v``
    stages per rank: ``2 (pp - stage - 1) + (v - 1) pp + 1`` microbatches of one
    of its ``v`` stages (Megatron's warm-up count), over ``v``; DualPipeV:
    ``pp + 1`` chunks of half a stage (DeepSeek-V3's count), over 2.
    """
    m, pp, v = layout.microbatches, layout.pp, max(1, layout.stages_per_rank)
    if pp == 1:
        return 1
    if layout.schedule == "gpipe":
        return m
    if layout.schedule == "interleaved1f1b":
        return min(m * v, 2 * (pp - stage - 1) + (v - 1) * pp + 1) / v
    if layout.schedule == "dualpipev":
        return min(2 * m, pp + 1) / 2
    return min(m, pp - stage)


def pipeline_extra(arch: Arch, layout: Layout, training: Training, stage: int,
                   microbatch: int) -> int:
    """What PyTorch's pipeline holds beside the schedule's microbatches (measured).

    Every stage after the first: the buffer each microbatch's hidden states
    arrive in lives for the whole step, so the microbatches not in flight
    still hold theirs (``T h a`` each).
    """
    if layout.pp == 1 or stage == 0 or training.stack != "torchtp":
        return 0
    s = act.shares(arch, layout, training, microbatch)
    held = max(0.0, layout.microbatches - in_flight(layout, stage))
    return int(held * s.tokens * arch.hidden * s.a)


def microbatch_size(layout: Layout, training: Training) -> int:
    """Sequences per microbatch: ``global_batch / (dp * microbatches)``."""
    return training.global_batch // (layout.dp * layout.microbatches)


def memory_per_rank(arch: Arch, inv: Inventory, layout: Layout, training: Training,
                    loss_parallel: bool = False) -> Memory:
    """The :class:`Memory` of the rank that needs the most, over every stage and TP rank.

    Raises:
        ValueError: ``inv`` is for another tp or ep size than ``layout``.
    """
    if inv.tp != layout.tp or (inv.ep != layout.ep and layout.ep <= layout.tp):
        raise ValueError(f"memory_per_rank: the inventory is for tp={inv.tp}, ep={inv.ep}; the "
                         f"layout has tp={layout.tp}, ep={layout.ep}")
    best: Memory | None = None
    for stage in range(layout.pp):
        for rank in _distinct_ranks(inv):  # the first data-parallel chunk is the largest
            cand = rank_memory(arch, inv, layout, training, stage, rank, 0, loss_parallel)
            if best is None or cand.total > best.total:
                best = cand
    assert best is not None
    return best


def rank_memory(arch: Arch, inv: Inventory, layout: Layout, training: Training, stage: int,
                tp_rank: int, dp_rank: int = 0, loss_parallel: bool = False) -> Memory:
    """The :class:`Memory` of one rank: pipeline ``stage``, ``tp_rank``, ``dp_rank``."""
    mb = microbatch_size(layout, training)
    body, head = activation_bytes(arch, layout, training, stage, mb, loss_parallel)
    saved = body + head
    flight = in_flight(layout, stage)
    heads = layout.microbatches if layout.pp > 1 and layout.schedule == "gpipe" else 1
    peak = int(body * flight) + head * heads + pipeline_extra(arch, layout, training, stage, mb)
    held, whole, tensors = _param_sizes(inv, stage, tp_rank, dp_rank, layout, training)
    params, grads, opt = state_bytes(held, whole, tensors, layout, training)
    transient = _transient(arch, inv, layout, training, stage, mb, loss_parallel)
    if layout.pp > 1 and stage == 0 and training.stack == "torchtp":
        # A job's first step: PyTorch's pipeline infers the shapes it sends by a
        # forward of one microbatch with autograd on, whose graph lives through
        # that step (PipelineStage._forward_metadata_inference).
        transient += saved
    # DDP copies the gradients into its buckets (gradient_as_bucket_view=False).
    buffers = grads if training.data_parallel == "ddp" and layout.dp > 1 else 0
    return Memory(params, grads, opt, peak, saved, flight, transient, buffers, stage)


def _transient(arch: Arch, inv: Inventory, layout: Layout, training: Training, stage: int,
               mb: int, loss_parallel: bool) -> int:
    """The largest working set inside the step (see :class:`Memory`)."""
    s = act.shares(arch, layout, training, mb)
    out = 0
    if stage == layout.pp - 1:  # logits in the compute dtype and their float32 gradient
        vocab = arch.vocab // layout.tp if loss_parallel else arch.vocab
        out = s.tokens * vocab * (s.a + act.F32)
    start, n = stage_range(arch.layers, layout, stage)
    one_layer = max((act.layer(arch, i, s, layout, training.stack)
                     for i in range(start, start + n)), default=0)
    if training.recompute == "full":
        out = max(out, one_layer)
    if training.data_parallel == "fsdp" and layout.dp > 1:
        per_layer = _facts(inv)[1]
        layer_elems = max((per_layer.get(i, 0) for i in range(start, start + n)), default=0)
        out += 2 * layer_elems * s.a  # this layer's and the prefetched next layer's
    return out
