"""Every valid layout of a model on a cluster, predicted, ranked and explained.

:func:`plan_layouts` enumerates ``pp x dp x cp x tp`` over the cluster's
GPUs (with ``ep`` for MoE models, the microbatch count and the pipeline
schedule), keeps the valid ones (each rule below names what it refuses),
predicts each one's memory (:func:`~torchtp.planner.memory.memory_per_rank`)
and step time (:func:`~torchtp.planner.steptime.step_time`), and ranks them:
those that fit before those that do not, then by the objective (``"time"``:
the fastest step; ``"tokens"``: the most tokens a rank could hold).

Valid: ``tp`` inside one node, dividing the query heads (and the KV heads,
or a multiple of them: torchtp replicates a KV head over the ranks that
share it); ``cp`` splitting the sequence into ``2 cp`` chunks; ``pp`` at most
the layers; ``dp`` dividing the global batch into microbatches of at least
one sequence; 1F1B with at least ``pp`` microbatches; ``ep`` dividing the
experts, inside the TP group (torchtp's folding) or across data-parallel
ranks (planned only: torchtp does not run it yet, and the table says so).
A pipeline's layers are split balanced, and also with one layer fewer on its
first and last stages where that comes out even.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from ..comm.layout_file import Layout
from ..cp.hf_attention import SUPPORTED as CP_FAMILIES
from ..sp.hf_plan import LAYOUTS as SP_FAMILIES
from .arch import Arch
from .cluster import Cluster
from .inventory import Inventory, inventory_from_arch
from .memory import Memory, held_elements, memory_per_rank
from .setup import Training
from .steptime import SCHEDULES, StepTime, step_time

OBJECTIVES = ("time", "tokens")


@dataclass(frozen=True)
class Candidate:
    """One layout with its predictions.

    Attributes:
        layout: The layout.
        memory: Memory of its fullest rank.
        time: Its step time.
        fits: ``memory.total`` within the GPU's memory.
        runs: torchtp runs this layout today (``False``: planned only, see ``why``).
        why: Why torchtp does not run it, or ``""``.
        recompute: Full recomputation is on.
    """

    layout: Layout
    memory: Memory
    time: StepTime
    fits: bool
    runs: bool
    why: str
    recompute: bool

    def as_dict(self) -> dict[str, Any]:
        """The candidate as plain data."""
        return {"layout": self.layout.as_dict(), "memory": self.memory.as_dict(),
                "time": self.time.as_dict(), "fits": self.fits, "runs": self.runs,
                "why": self.why, "recompute": self.recompute}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_ok(arch: Arch, tp: int, cluster: Cluster) -> bool:
    kv_ok = arch.kv_heads % tp == 0 or tp % arch.kv_heads == 0
    inside = cluster.gpus_per_node % tp == 0  # consecutive ranks: a group never straddles nodes
    return inside and arch.heads % tp == 0 and (kv_ok or arch.latent is not None)


def _ep_sizes(arch: Arch, tp: int, stage_ranks: int) -> list[int]:
    if arch.experts is None:
        return [1]
    count = arch.experts.count
    inside = [e for e in _divisors(tp) if count % e == 0]
    beyond = [e for e in _divisors(stage_ranks) if e > tp and e % tp == 0 and count % e == 0]
    return inside + beyond


def layouts(arch: Arch, cluster: Cluster, training: Training) -> Iterator[Layout]:
    """Every valid layout of ``arch`` on all of ``cluster``'s GPUs (module docstring's rules)."""
    world = cluster.gpus
    for tp in _divisors(world):
        if not _tp_ok(arch, tp, cluster):
            continue
        for cp in _divisors(world // tp):
            if training.seq % (2 * cp) and cp > 1:
                continue
            for pp in _divisors(world // (tp * cp)):
                if pp > arch.layers:
                    continue
                dp = world // (tp * cp * pp)
                if training.global_batch % dp:
                    continue
                per_replica = training.global_batch // dp
                for ep in _ep_sizes(arch, tp, dp * cp * tp):
                    for sp in _sp(arch, tp):
                        yield from _schedules(Layout(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep,
                                                     sequence_parallel=sp,
                                                     data_parallel=training.data_parallel),
                                              per_replica, arch.layers)


def _sp(arch: Arch, tp: int) -> list[bool]:
    """Sequence parallelism to try: on with tp for the families torchtp covers (a shape
    written by hand: assumed covered), pipeline stages included."""
    kind = arch.extra.get("model_type")
    if tp == 1 or (kind is not None and kind not in SP_FAMILIES):
        return [False]
    return [True]


def _microbatches(per_replica: int) -> list[int]:
    """Microbatch counts to try: the powers of two that divide a replica's batch, and the
    batch itself (one sequence a microbatch)."""
    counts = [m for m in _divisors(per_replica) if m & (m - 1) == 0]
    return sorted(set(counts) | {per_replica})


def _splits(pp: int, layers: int) -> list[tuple[int, ...]]:
    """Layer splits to try: the balanced one (``()``) and, when it comes out even, one layer
    fewer on the first and last stages, which also hold the embeddings and the LM head (as
    Llama 3 405B was trained)."""
    out: list[tuple[int, ...]] = [()]
    if pp > 2 and (layers + 2) % pp == 0 and (layers + 2) // pp > 1:
        k = (layers + 2) // pp
        out.append((k - 1, *[k] * (pp - 2), k - 1))
    return out


def _schedules(base: Layout, per_replica: int, layers: int) -> Iterator[Layout]:
    if base.pp == 1:  # gradient accumulation over microbatches
        for m in _microbatches(per_replica):
            yield replace(base, microbatches=m)
        return
    for split in _splits(base.pp, layers):
        yield from _pipelined(replace(base, stage_layers=split), per_replica, layers)


def _pipelined(base: Layout, per_replica: int, layers: int) -> Iterator[Layout]:
    for m in _microbatches(per_replica):
        for schedule in SCHEDULES:
            if m < base.pp and schedule != "gpipe":
                continue  # 1F1B needs a microbatch per stage in flight
            if schedule == "interleaved1f1b":
                if m % base.pp:
                    continue  # PyTorch's interleaved schedule takes multiples of pp
                for v in (2, 4):
                    if v * base.pp <= layers:
                        yield replace(base, microbatches=m, schedule=schedule, stages_per_rank=v)
                continue
            if schedule == "dualpipev" and 2 * base.pp > layers:
                continue
            yield replace(base, microbatches=m, schedule=schedule,
                          stages_per_rank=2 if schedule == "dualpipev" else 1)


def runs_in_torchtp(arch: Arch, layout: Layout, training: Training) -> str:
    """Why torchtp cannot run ``layout`` today, or ``""`` when it can."""
    if layout.ep > layout.tp:
        return (f"ep {layout.ep} spans data-parallel ranks; torchtp folds experts into the TP "
                f"group (ep must divide tp={layout.tp})")
    if training.data_parallel == "zero1" and layout.dp > 1:
        return "ZeRO-1 (optimizer state sharded over dp) is planned only; use fsdp or ddp"
    if layout.pp > 1 and layout.cp > 1 and layout.tp > 1:
        return "pp x cp x tp is not composed yet (pp x cp and cp x tp are)"
    if layout.cp > 1:
        kind = arch.extra.get("model_type")
        if arch.latent is not None:
            return "context parallelism does not cover latent attention yet"
        if kind and kind not in CP_FAMILIES:
            return f"context parallelism does not cover model_type={kind!r} yet"
    return ""


def plan_layouts(arch: Arch, cluster: Cluster, training: Training,
                 inventory: Callable[[int, int], Inventory] | None = None,
                 objective: str = "time", recompute: str | None = None,
                 only_runnable: bool = False, prefer_runnable: bool = True) -> list[Candidate]:
    """Every valid layout, predicted and ranked (best first).

    Args:
        arch: The model.
        cluster: The machines; every GPU is used.
        training: The step (its ``recompute`` unless ``recompute`` is given).
        inventory: ``(tp, ep) -> Inventory``; default the even split of
            :func:`~torchtp.planner.inventory.inventory_from_arch`. Give torchtp's
            own plan (:func:`~torchtp.planner.inventory.inventory_from_model`)
            for exact parameter bytes.
        objective: ``"time"`` (fastest step first) or ``"tokens"`` (the most
            tokens a rank could hold first).
        recompute: ``"auto"``: try with and without full recomputation.
        only_runnable: Drop layouts torchtp does not run yet.
        prefer_runnable: Rank layouts torchtp runs before those it does not (among
            those that fit); ``False``: by the objective alone.

    Raises:
        ValueError: an unknown objective, or no valid layout at all (naming why).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"plan_layouts: objective={objective!r}; use one of {list(OBJECTIVES)}")
    make = inventory or (lambda tp, ep: inventory_from_arch(arch, tp, ep if ep <= tp else 1))
    cache: dict[tuple[int, int], Inventory] = {}
    modes = ["none", "full"] if (recompute or training.recompute) == "auto" \
        else [recompute or training.recompute]
    out = []
    for layout in layouts(arch, cluster, training):
        key = (layout.tp, layout.ep if layout.ep <= layout.tp else 1)
        if key not in cache:
            cache[key] = make(*key)
        why = runs_in_torchtp(arch, layout, training)
        if only_runnable and why:
            continue
        for mode in modes:
            out.append(_candidate(arch, cluster, replace(training, recompute=mode), layout,
                                  cache[key], why))
    if not out:
        raise ValueError(f"plan_layouts: no valid layout of {arch.name} on {cluster.gpus} GPUs "
                         f"({cluster.nodes} x {cluster.gpus_per_node}): check that the global "
                         f"batch ({training.global_batch}) divides over data-parallel replicas, "
                         f"that some tp <= {cluster.gpus_per_node} divides {arch.heads} heads, "
                         f"and that the sequence ({training.seq}) splits")
    return sorted(out, key=_rank_key(objective, cluster, training, prefer_runnable))


def _candidate(arch: Arch, cluster: Cluster, training: Training, layout: Layout,
               inv: Inventory, why: str) -> Candidate:
    mem = memory_per_rank(arch, inv, layout, training)
    dtype = 4 if training.precision == "fp32" else 2
    held = held_elements(inv, layout)
    t = step_time(arch, layout, training, cluster, held * dtype)
    return Candidate(layout, mem, t, mem.total <= cluster.gpu.memory, not why, why,
                     training.recompute == "full")


def tokens_that_fit(c: Candidate, memory: float, training: Training) -> float:
    """Tokens one microbatch on a rank could hold in ``memory``: its tokens times how many
    times its activations and working memory fit beside the parameters and states."""
    static = c.memory.params + c.memory.grads + c.memory.optimizer + c.memory.buffers
    working = max(1, c.memory.activations + c.memory.transient)
    per_rank = training.global_batch // (c.layout.dp * c.layout.microbatches) * training.seq \
        / c.layout.cp
    return max(0.0, (memory - static) / working) * per_rank


def _rank_key(objective: str, cluster: Cluster, training: Training,
              prefer_runnable: bool) -> Callable[[Candidate], tuple[Any, ...]]:
    def key(c: Candidate) -> tuple[Any, ...]:
        head = (not c.fits, prefer_runnable and not c.runs)
        if objective == "time":
            return (*head, c.time.total, c.memory.total)
        return (*head, -tokens_that_fit(c, cluster.gpu.memory, training), c.time.total)
    return key
