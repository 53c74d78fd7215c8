"""Step time of a layout: compute at the GPU's achieved rate, collectives by the alpha-beta model.

Per microbatch and pipeline stage, on the rank with the most work:

* **compute**: matmul and attention FLOPs (forward ``F``, backward ``2F``,
  ``F`` more under full recomputation) at ``gpu.rate(precision)``; a token's
  forward FLOPs are ``2 x`` its active matmul weights (routed experts: ``top_k``
  of them) plus ``4 x (seq/2) x`` query width for causal attention, split over
  ``tp`` (attention heads, MLP features) and ``cp`` (tokens); plus, per
  pass, the bytes the memory-bound work moves at the memory bandwidth (the
  weights each matmul reads, and the operators between the matmuls: norms,
  activations, residuals, which move about what the layer saves) and a fixed
  cost per layer (``gpu.layer_overhead``: its few dozen kernel launches and tails);
* **tensor parallelism**: per layer two all-reduces of ``T h a`` bytes
  forward and two backward (or the equal all-gathers and reduce-scatters of
  sequence parallelism); with ``overlap`` the backward's beside the
  weight-gradient matmuls (torchtp's ``TP_OVERLAP``), the forward's exposed;
* **context parallelism**: per attention layer the all-gather of K/V forward
  and, in the backward, one more (recomputed) and a reduce-scatter;
* **expert parallelism** beyond the TP group: dispatch and combine all-to-alls
  of the routed tokens, forward and backward;
* **pipeline**: each microbatch's activations sent to the next stage and its
  gradient sent back.

A step is ``(m + bubble) x`` the slowest stage's microbatch time
(:func:`bubble`; under DualPipeV the expert and pipeline exchanges run
beside the other chunk's compute), plus the data-parallel collectives the backward
does not hide (gradient all-reduce, or FSDP2's all-gathers and
reduce-scatter, each overlapped with the compute of the microbatch it
serves; at least one layer's share of each stays exposed), plus the
optimizer step (memory-bound: 28 bytes an element for AdamW).

A collective of ``B`` bytes per rank over ``n`` ranks takes ``steps x
latency + factor x B / bus_bandwidth`` on the link it crosses
(:meth:`Cluster.link`): all-reduce ``2(n-1)`` steps and factor
``2(n-1)/n``, all-gather and reduce-scatter half of that, all-to-all
``n - 1`` steps and ``(n-1)/n``. Ranks are laid out as ``init_parallel``
lays them (``tp`` innermost, then ``cp``, ``dp``, ``pp``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..comm.layout_file import Layout
from . import activations as act
from .arch import Arch
from .cluster import Cluster
from .memory import microbatch_size, stage_range
from .setup import Training

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "dualpipev")


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step and where they go (the slowest stage).

    Attributes:
        compute: Matmuls and attention over all microbatches.
        tp: Tensor-parallel collectives (not overlapped).
        cp: Context-parallel K/V exchanges.
        ep: Expert all-to-alls beyond the TP group.
        pp: Pipeline sends of activations and gradients.
        bubble: Pipeline fill and drain.
        dp: Data-parallel collectives the compute does not hide.
        optimizer: The optimizer step.
        total: The step.
        tokens_per_s: Tokens of the global batch per second.
        mfu: Model FLOPs (``6 N_active`` per token plus causal attention, no
            recomputation) per second over every GPU's peak.
    """

    compute: float
    tp: float
    cp: float
    ep: float
    pp: float
    bubble: float
    dp: float
    optimizer: float
    total: float
    tokens_per_s: float
    mfu: float

    def as_dict(self) -> dict[str, Any]:
        """The breakdown as plain data."""
        return asdict(self)


def active_params(arch: Arch) -> tuple[float, float]:
    """(matmul weights a token passes through per layer on average, LM head weights)."""
    h = arch.hidden
    if arch.latent is not None:
        lat = arch.latent
        qk = lat.nope_dim + lat.rope_dim
        q = h * lat.q_rank + lat.q_rank * arch.heads * qk if lat.q_rank else h * arch.heads * qk
        attn = q + h * (lat.kv_rank + lat.rope_dim) \
            + lat.kv_rank * arch.heads * (lat.nope_dim + lat.v_dim) + arch.heads * lat.v_dim * h
    else:
        attn = h * (2 * arch.q_dim + 2 * arch.kv_dim)
    ups = 3 if arch.mlp == "gated" else 2
    dense = ups * h * arch.ffn
    total = 0.0
    for i in range(arch.layers):
        if arch.is_moe_layer(i):
            assert arch.experts is not None
            e = arch.experts
            total += attn + h * e.count + 3 * h * (e.top_k * e.ffn + e.shared_ffn)
        else:
            total += attn + dense
    return total / arch.layers, float(h * arch.vocab)


def model_flops_per_token(arch: Arch, seq: int) -> float:
    """Training FLOPs of one token without recomputation: ``6 N_active`` and causal attention."""
    per_layer, head = active_params(arch)
    attn = 4 * (seq / 2) * arch.q_dim  # QK^T and AV over the keys before the query (forward)
    return 3 * (2 * (arch.layers * per_layer + head) + arch.layers * attn)


def bubble(layout: Layout) -> float:
    """Pipeline fill and drain, in microbatch times of one stage (forward and backward).

    GPipe and 1F1B: ``pp - 1``; interleaved 1F1B with ``v`` stages per rank:
    ``(pp - 1) / v``; DualPipeV: ``(pp - 2) / 3`` (DeepSeek-V3's
    ``(pp/2 - 1)(F&B + B - 3W)`` with a backward twice a forward and its
    weight half of that).
    """
    pp = layout.pp
    if pp == 1:
        return 0.0
    if layout.schedule == "interleaved1f1b":
        return (pp - 1) / max(1, layout.stages_per_rank)
    if layout.schedule == "dualpipev":
        return max(0.0, (pp - 2) / 3)
    return float(pp - 1)


def _elementwise(arch: Arch, layout: Layout, training: Training, microbatch: int,
                 layers: int) -> float:
    """Bytes one pass of a microbatch's non-matmul operators moves on a rank (norms,
    activations, residuals, softmax statistics): each writes what the layer saves once
    (:func:`torchtp.planner.activations.layer`)."""
    s = act.shares(arch, layout, training, microbatch)
    moved = act.layer(arch, arch.layers - 1, s, layout, training.stack)
    if not training.flash:  # scores, softmax output, dropout mask and output: 2+2+1+2 bytes
        moved += 7 * microbatch * s.heads * (training.seq // layout.cp) * training.seq
    return float(layers * moved)


def _collective(kind: str, nbytes: float, n: int, bw: float, latency: float) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    steps, factor = {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n),
                     "all_gather": (n - 1, (n - 1) / n),
                     "reduce_scatter": (n - 1, (n - 1) / n),
                     "all_to_all": (n - 1, (n - 1) / n),
                     "send": (1, 1.0)}[kind]
    return steps * latency + factor * nbytes / bw


def step_time(arch: Arch, layout: Layout, training: Training, cluster: Cluster,
              param_bytes: float) -> StepTime:
    """Predict one optimizer step of ``layout`` (see the module docstring).

    Args:
        arch: The model.
        layout: The layout (its ``microbatches`` and ``schedule`` included).
        training: The step.
        cluster: The machines.
        param_bytes: Bytes of parameters one rank holds before any data-parallel
            sharding (what its data-parallel collectives move, in the parameters' dtype).
    """
    gpu, a = cluster.gpu, training.activation_bytes
    mb = microbatch_size(layout, training)
    m, pp, tp, cp, ep, dp = (layout.microbatches, layout.pp, layout.tp, layout.cp, layout.ep,
                             layout.dp)
    tokens = mb * training.seq // cp  # per microbatch on one rank
    layers = max(stage_range(arch.layers, layout, s)[1] for s in range(pp))  # the largest stage
    per_layer, head = active_params(arch)
    # QK^T and AV over the keys before each query (flash kernels skip the masked half).
    attn = 4 * (training.seq / (2 if training.flash else 1)) * arch.q_dim
    fwd = tokens * (layers * (2 * per_layer + attn) + 2 * head) / tp  # the last stage: + LM head
    recompute = training.recompute == "full"
    passes = 4 if recompute else 3
    matmuls = passes * fwd / gpu.rate(training.precision)
    weights = layers * per_layer / tp * a  # each matmul reads its weights once a pass
    moved = _elementwise(arch, layout, training, mb, layers) + weights
    compute = matmuls + passes * (moved / gpu.mem_bandwidth + layers * gpu.layer_overhead)
    tp_bw, tp_lat, _ = cluster.link(1, tp)
    one = 2 * _collective("all_reduce", tokens * arch.hidden * a, tp, tp_bw, tp_lat)  # a layer's
    # Forward (and recomputed forward) exposed; the backward's input-gradient reduction runs
    # beside the weight-gradient matmuls when overlap is on (torchtp's TP_OVERLAP).
    backward = one if not training.overlap else max(0.0, one - matmuls / passes / layers)
    t_tp = layers * ((2 if recompute else 1) * one + backward)
    cp_bw, cp_lat, _ = cluster.link(tp, cp)
    kv = 2 * tokens * max(1, arch.kv_heads // tp) * arch.head_dim * a
    t_cp = layers * 3 * _collective("all_gather", kv * cp, cp, cp_bw, cp_lat)
    t_ep = 0.0
    if ep > tp and arch.experts is not None:
        ep_bw, ep_lat, _ = cluster.link(1, ep)
        routed = tokens * arch.experts.top_k * arch.hidden * a
        moe_layers = max(sum(arch.is_moe_layer(i) for i in range(a, a + n))
                         for a, n in (stage_range(arch.layers, layout, s) for s in range(pp)))
        t_ep = moe_layers * 4 * _collective("all_to_all", routed, ep, ep_bw, ep_lat)
    pp_bw, pp_lat, _ = cluster.link(dp * cp * tp, pp)
    t_pp = 2 * _collective("send", tokens * arch.hidden * a, 2, pp_bw, pp_lat) if pp > 1 else 0.0
    if layout.schedule == "dualpipev":  # a forward and a backward chunk side by side
        t_ep, t_pp = max(0.0, t_ep - compute), max(0.0, t_pp - compute)
    per_mb = compute + t_tp + t_cp + t_ep + t_pp
    bubble_slots = bubble(layout)
    t_dp = _dp_exposed(layout, training, cluster, param_bytes, compute, layers)
    # AdamW reads parameter, gradient and two states and writes three: 28 bytes an element.
    elements = param_bytes / _param_dtype_bytes(training)
    sharded = training.data_parallel != "ddp"
    optimizer = elements / (dp if sharded else 1) * 28 / gpu.mem_bandwidth
    total = (m + bubble_slots) * per_mb + t_dp + optimizer
    tps = training.tokens / total
    mfu = model_flops_per_token(arch, training.seq) * tps / (layout.world
                                                              * gpu.peak[training.precision])
    return StepTime(compute * m, t_tp * m, t_cp * m, t_ep * m, t_pp * m,
                    bubble_slots * per_mb, t_dp, optimizer, total, tps, mfu)


def _param_dtype_bytes(training: Training) -> int:
    """Bytes of the parameters the data-parallel collectives move (bf16 under mixed precision)."""
    return 4 if training.precision == "fp32" else 2


def _hidden(comm: float, compute: float, layers: int) -> float:
    """What of ``comm`` stays exposed beside ``compute``: the excess, at least one layer's share
    (the first all-gather before any compute, the last reduction after it)."""
    return max(comm - compute, comm / max(layers, 1))


def _dp_exposed(layout: Layout, training: Training, cluster: Cluster, param_bytes: float,
                compute_per_mb: float, layers: int) -> float:
    """Data-parallel collective time the compute does not hide (see the module docstring)."""
    dp = layout.dp
    if dp <= 1:
        return 0.0
    bw, lat, _ = cluster.link(layout.cp * layout.tp, dp)
    elements = param_bytes / _param_dtype_bytes(training)
    grads = 4 * elements  # gradients are reduced in float32
    backward = compute_per_mb * 2 / 3
    if training.data_parallel == "ddp":  # the last microbatch's backward hides the all-reduce
        return _hidden(_collective("all_reduce", grads, dp, bw, lat), backward, layers)
    gather = _collective("all_gather", elements * _param_dtype_bytes(training), dp, bw, lat)
    scatter = _collective("reduce_scatter", grads, dp, bw, lat)
    if training.data_parallel == "zero1":  # gathered beside the first microbatch's forward
        return _hidden(gather, compute_per_mb / 3, layers) + _hidden(scatter, backward, layers)
    # FSDP2: parameters gathered for each microbatch's forward and backward, the
    # gradients reduce-scattered in the last backward; each beside the compute it serves.
    return layout.microbatches * _hidden(2 * gather, compute_per_mb, layers) \
        + _hidden(scatter, backward, layers)
