"""The alpha-beta cost model of a tensor-parallel Llama-style forward.

Per decoder layer and rank (``N`` = tp size, ``T`` = tokens in the step):

* compute: ``max(FLOPs / (peak * eff), bytes read / (mem_bw * mem_eff))`` with
  matmul FLOPs ``2 * T * layer_params / N`` plus attention FLOPs
  ``4 * B * S * ctx * heads*head_dim / N``, plus a fixed per-layer overhead;
* communication: two all-reduces (after ``o_proj`` and ``down_proj``) of
  ``T * hidden * dtype`` bytes, each ``steps(N) * alpha + 2(N-1)/N * bytes / busbw``.

The embedding, final norm and ``lm_head`` run once per step. Their *time* is
modelled unsplit (conservative: the HF plan splits ``lm_head`` and gathers its
output, which is faster for large vocabularies), while *weight bytes per rank*
follow the HF plan, which splits the embedding and ``lm_head`` by vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .dims import ModelDims
from .hardware import Hardware

PHASES = ("prefill", "decode")


def ring_steps(n: int, kind: str = "ring") -> int:
    """Latency-bound steps of one all-reduce over ``n`` ranks.

    ``ring``: reduce-scatter then all-gather, ``2(N-1)`` steps. ``tree``: up and
    down a binary tree, ``2*ceil(log2 N)`` steps.
    """
    if n <= 1:
        return 0
    if kind == "tree":
        return 2 * math.ceil(math.log2(n))
    if kind == "ring":
        return 2 * (n - 1)
    raise ValueError(f"unknown all-reduce step model {kind!r}; use 'ring' or 'tree'")


def allreduce_time(nbytes: float, n: int, hw: Hardware) -> float:
    """Seconds for one all-reduce of ``nbytes`` (per rank) over ``n`` ranks.

    ``latency * steps + 2(N-1)/N * nbytes / bus_bandwidth``; zero for one rank.
    """
    if n <= 1:
        return 0.0
    latency = hw.latency
    if hw.shared_cores is not None and n > hw.shared_cores and hw.oversubscribed_latency:
        latency = hw.oversubscribed_latency
    return latency * ring_steps(n, hw.steps) + 2 * (n - 1) / n * nbytes / hw.bus_bandwidth


def allgather_time(nbytes: float, n: int, hw: Hardware) -> float:
    """Seconds for one all-gather whose gathered tensor holds ``nbytes`` over ``n`` ranks.

    Half an all-reduce: ``latency * steps / 2 + (N-1)/N * nbytes / bus_bandwidth``
    (a ring all-gather is the second half of a ring all-reduce); zero for one rank.
    """
    if n <= 1:
        return 0.0
    return allreduce_time(nbytes, n, hw) / 2


def slowdown(n: int, hw: Hardware) -> float:
    """How much slower each rank computes when ``n`` ranks share the machine's cores.

    ``n / effective_cores`` (or ``n / shared_cores``) when that is above 1, else 1.
    """
    cores = hw.effective_cores or hw.shared_cores
    if cores is None or n <= cores:
        return 1.0
    return n / cores


def gemm_time(flops: float, nbytes: float, hw: Hardware) -> float:
    """Roofline time of a matmul: the slower of FLOPs at efficiency and bytes read."""
    return max(flops / (hw.peak_flops * hw.gemm_efficiency),
               nbytes / (hw.mem_bandwidth * hw.mem_efficiency))


@dataclass(frozen=True)
class Estimate:
    """Predicted time of one forward step at one tp size (all times in seconds).

    Attributes:
        tp: Tensor-parallel size.
        phase: ``"prefill"`` (``batch * seq`` new tokens) or ``"decode"`` (``batch`` new tokens).
        compute_per_layer: GEMMs, attention and fixed overhead of one decoder layer.
        comm_per_layer: Its two all-reduces.
        allreduce_bytes: Payload of one of those all-reduces, per rank.
        head: Embedding, final norm and ``lm_head`` (replicated, once per step).
        total: ``layers * (compute + comm) + head``.
        speedup: ``total`` at tp=1 divided by this ``total``.
        tokens_per_s: New tokens per second for this step shape.
        weight_bytes_per_rank: Matmul and embedding weights one rank holds, with
            the embedding and ``lm_head`` split like the HF plan does (norms ignored).
    """

    tp: int
    phase: str
    compute_per_layer: float
    comm_per_layer: float
    allreduce_bytes: float
    head: float
    total: float
    speedup: float
    tokens_per_s: float
    weight_bytes_per_rank: float

    def as_dict(self) -> dict[str, Any]:
        """The estimate as plain data."""
        return asdict(self)


def _step(dims: ModelDims, hw: Hardware, tp: int, batch: int, seq: int, phase: str,
          context: int, dtype_bytes: int) -> tuple[float, float, float, float, int]:
    """(compute/layer, comm/layer, all-reduce bytes, head, new tokens) of one step."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; use one of {PHASES}")
    new = batch * seq if phase == "prefill" else batch
    ctx = seq if phase == "prefill" else context
    slow = slowdown(tp, hw)
    flops = 2 * new * dims.layer_params / tp + 4 * new * ctx * dims.q_dim / tp
    kv_bytes = 2 * batch * ctx * dims.kv_dim * dtype_bytes / tp
    read = dims.layer_params * dtype_bytes / tp + kv_bytes
    compute = (gemm_time(flops, read, hw) + hw.layer_overhead) * slow
    nbytes = new * dims.hidden * dtype_bytes
    comm = 2 * allreduce_time(nbytes, tp, hw)
    head_flops = 2 * new * dims.hidden * dims.vocab
    head = gemm_time(head_flops, dims.hidden * dims.vocab * dtype_bytes, hw) * slow
    return compute, comm, nbytes, head, new


def estimate(dims: ModelDims, hw: Hardware, tp: int, batch: int = 1, seq: int = 128,
             phase: str = "decode", context: int | None = None,
             dtype_bytes: int | None = None) -> Estimate:
    """Predict one prefill or decode step at tensor-parallel size ``tp``.

    Args:
        dims: Model shape.
        hw: Hardware preset.
        tp: Tensor-parallel size (>= 1).
        batch: Sequences per step.
        seq: Prompt length (prefill tokens per sequence).
        phase: ``"prefill"`` or ``"decode"`` (one new token per sequence).
        context: Tokens already in the KV cache during decode; defaults to ``seq``.
        dtype_bytes: Bytes per element; defaults to the preset's.

    Raises:
        ValueError: ``tp``, ``batch`` or ``seq`` is below 1, or the phase is unknown.
    """
    for name, value in (("tp", tp), ("batch", batch), ("seq", seq)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    dt = dtype_bytes or hw.dtype_bytes
    ctx = seq if context is None else context
    compute, comm, nbytes, head, new = _step(dims, hw, tp, batch, seq, phase, ctx, dt)
    total = dims.layers * (compute + comm) + head
    c1, m1, _, h1, _ = _step(dims, hw, 1, batch, seq, phase, ctx, dt)
    base = dims.layers * (c1 + m1) + h1
    weights = (dims.layers * dims.layer_params + 2 * dims.vocab * dims.hidden) * dt / tp
    return Estimate(tp, phase, compute, comm, nbytes, head, total, base / total, new / total, weights)


def sweep(dims: ModelDims, hw: Hardware, tps: list[int], **kw: Any) -> list[Estimate]:
    """:func:`estimate` for each tp size in ``tps`` and both phases (prefill first)."""
    return [estimate(dims, hw, tp, phase=phase, **kw) for phase in PHASES for tp in tps]
