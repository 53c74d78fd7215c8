"""Published large training runs, as data, and the planner's predictions for them.

Each :class:`Run` is a model, a cluster, a training step and the layout its
authors used, with the figure they reported and where (docs/planning.md
cites every source and quotes the passages). :func:`check` predicts the
run with the planner and compares like with like: a run's own FLOP count
for its utilization (Megatron's eq. 3 counts the recomputed forward; MFU
counts ``6 N + 12 l h q s`` per token), tokens per second per GPU where that
is what was reported.

The GPU profiles' one fitted number (``efficiency``) is calibrated on one
run per GPU type (:data:`CALIBRATION`); every other run is a prediction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..comm.layout_file import Layout
from .arch import Arch, Experts, Latent
from .cluster import Cluster, get_gpu
from .inventory import inventory_from_arch
from .memory import held_elements, memory_per_rank
from .search import plan_layouts
from .setup import Training
from .steptime import StepTime, active_params, step_time


@dataclass(frozen=True)
class Run:
    """One published run.

    Attributes:
        name: Short name.
        source: Citation (paper and table, or repository, commit and file).
        arch: The model.
        gpu: GPU profile name.
        gpus: GPUs used.
        training: The step.
        layout: The published layout.
        metric: ``"megatron"`` (TFLOP/s per GPU by Megatron's eq. 3, over peak),
            ``"mfu"`` (``6 N + 12 l h q s`` FLOPs per token, over the bf16 peak)
            or ``"tokens"`` (tokens per second per GPU).
        reported: The reported figure (a fraction for utilizations).
    """

    name: str
    source: str
    arch: Arch
    gpu: str
    gpus: int
    training: Training
    layout: Layout
    metric: str
    reported: float

    @property
    def cluster(self) -> Cluster:
        """The run's machines (8 GPUs a node)."""
        return Cluster(get_gpu(self.gpu), nodes=self.gpus // 8, gpus_per_node=8)


def _gpt(name: str, h: int, heads: int, layers: int, vocab: int = 51200) -> Arch:
    """Megatron's GPT: plain GELU MLP of 4h, LayerNorm, biases, learned positions, tied."""
    return Arch(name=name, hidden=h, layers=layers, heads=heads, kv_heads=heads,
                head_dim=h // heads, ffn=4 * h, vocab=vocab, mlp="plain", norm="layer",
                bias="all", tied=True, positions=2048)


_SC21 = ("Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters "
         "Using Megatron-LM, SC21 (arXiv:2104.04473), Table 1")
_MEGATRON_TABLE = [  # params, heads, hidden, layers, tp, pp, gpus, batch, reported % of peak
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 0.44), ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 0.44),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 0.46), ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 0.43),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 0.44), ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 0.45),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 0.47),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 0.50),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 0.52),
    ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 0.52),
]


def _gpt_table(table: list[tuple[Any, ...]], name: str, arch: Any, gpu: str,
               training: Training, source: str, metric: str, microbatch_alone: int,
               sequence_parallel: bool) -> list[Run]:
    """One run per row of a Megatron GPT table: ``(name, heads, hidden, layers, tp, pp,
    gpus, batch, reported)``, ``arch(size, hidden, heads, layers)`` the model.

    Not published, so assumed: ``microbatch_alone`` sequences a microbatch
    without a pipeline, one with, and 2 stages per rank of the interleaved schedule.
    """
    runs = []
    for size, heads, h, layers, tp, pp, gpus, batch, reported in table:
        dp = gpus // (tp * pp)
        layout = Layout(pp=pp, dp=dp, tp=tp,
                        microbatches=batch // dp // (microbatch_alone if pp == 1 else 1),
                        schedule="interleaved1f1b" if pp > 1 else "1f1b",
                        stages_per_rank=2 if pp > 1 else 1,
                        sequence_parallel=tp > 1 and sequence_parallel,
                        data_parallel=training.data_parallel)
        runs.append(Run(name.format(size), source, arch(size, h, heads, layers), gpu, gpus,
                        replace(training, global_batch=batch), layout, metric, reported))
    return runs


def _megatron_runs() -> list[Run]:
    # Megatron-LM 2021: no sequence parallelism or overlap, attention scores written out,
    # full recomputation ("equation (3) assumes activation recomputation"); 4 sequences a
    # microbatch without a pipeline (the paper's section 3.4 finds 4 best).
    training = Training(1, 2048, precision="bf16", optimizer="adamw", data_parallel="ddp",
                        recompute="full", overlap=False, flash=False, stack="fused")
    return _gpt_table(_MEGATRON_TABLE, "Megatron GPT {}", _gpt, "a100-80gb", training, _SC21,
                      "megatron", 4, sequence_parallel=False)


_LLAMA3 = ("The Llama 3 Herd of Models (arXiv:2407.21783), Table 4; architecture Table 3 "
           "(vocabulary 128,256 as released)")
LLAMA3_405B = Arch(name="Llama 3 405B", hidden=16384, layers=126, heads=128, kv_heads=8,
                   head_dim=128, ffn=53248, vocab=128256)


def _llama3_runs() -> list[Run]:
    rows = [("8K seq, 8,192 GPUs", 8192, 8, 1, 16, 64, 8192, 32, 0.43),
            ("8K seq, 16,384 GPUs", 16384, 8, 1, 16, 128, 8192, 16, 0.41),
            ("128K seq, 16,384 GPUs", 16384, 8, 16, 16, 8, 131072, 16, 0.38)]
    runs = []
    for label, gpus, tp, cp, pp, dp, seq, per_dp, mfu in rows:
        # "we could pre-train Llama 3 on sequences of 8K tokens without activation checkpointing"
        training = Training(per_dp * dp, seq, precision="bf16", optimizer="adamw",
                            data_parallel="fsdp", recompute="none" if seq == 8192 else "full",
                            stack="fused")
        # "To balance the pipeline, we reduce one Transformer layer each from the first and
        # the last stages": 7 + 14 x 8 + 7 = 126. Not published: the microbatch size (one
        # sequence assumed) and the stages per rank (4 assumed: two layers a stage).
        layout = Layout(pp=pp, dp=dp, cp=cp, tp=tp, microbatches=per_dp,
                        schedule="interleaved1f1b", stages_per_rank=4,
                        stage_layers=(7, *[8] * 14, 7), sequence_parallel=True,
                        data_parallel="fsdp")
        runs.append(Run(f"Llama 3 405B, {label}", _LLAMA3, LLAMA3_405B, "h100-80gb", gpus,
                        training, layout, "mfu", mfu))
    return runs


_MEGATRON_H100 = ("NVIDIA/Megatron-LM README (Megatron-Core r0.8.0, images/model_table.png, "
                  "commit f2e5db402c): GPT models on H100, vocabulary 131,072, sequence 4,096")
_MEGATRON_H100_TABLE = [  # name, heads, hidden, layers, tp, pp, gpus, batch, MFU
    ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 0.41), ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 0.47),
    ("16B", 48, 6144, 32, 4, 1, 192, 192, 0.49), ("32B", 56, 7168, 48, 8, 1, 384, 192, 0.46),
    ("70B", 64, 8192, 84, 8, 2, 768, 384, 0.42), ("119B", 80, 10240, 92, 8, 4, 1536, 768, 0.43),
    ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 0.44),
    ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 0.48),
    ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 0.47),
]


def _h100_gpt(size: str, h: int, heads: int, layers: int) -> Arch:
    return replace(_gpt(size, h, heads, layers, vocab=131072), tied=False, positions=4096)


def _megatron_h100_runs() -> list[Run]:
    # Megatron-Core r0.8.0: sequence parallelism, TP and DP overlap, the distributed
    # optimizer (ZeRO-1); a replica's 4 sequences a microbatch without a pipeline.
    training = Training(1, 4096, precision="bf16", optimizer="adamw", data_parallel="zero1",
                        recompute="none", stack="fused")
    return _gpt_table(_MEGATRON_H100_TABLE, "Megatron-Core GPT {} (H100)", _h100_gpt,
                      "h100-80gb", training, _MEGATRON_H100, "mfu", 4, sequence_parallel=True)


_DEEPSEEK = ("DeepSeek-V3 Technical Report (arXiv:2412.19437), sections 3.1, 3.2, 4.2 and "
             "Table 1: 180K H800 GPU hours per trillion tokens (1,543 tokens/s per GPU)")
DEEPSEEK_V3 = Arch(name="DeepSeek-V3", hidden=7168, layers=61, heads=128, kv_heads=128,
                   head_dim=192, ffn=18432, vocab=129280,
                   experts=Experts(count=256, top_k=8, ffn=2048, shared_ffn=2048,
                                   dense_layers=3, router_bias=True),
                   latent=Latent(q_rank=1536, kv_rank=512, rope_dim=64, nope_dim=128, v_dim=128))


def _deepseek_run() -> Run:
    training = Training(15360, 4096, precision="fp8", optimizer="adamw", data_parallel="zero1",
                        recompute="none", stack="fused")
    layout = Layout(pp=16, dp=128, ep=64, microbatches=15360 // 128, schedule="dualpipev",
                    stages_per_rank=2, data_parallel="zero1")
    return Run("DeepSeek-V3 pre-training", _DEEPSEEK, DEEPSEEK_V3, "h800-80gb", 2048, training,
               layout, "tokens", 1e12 / (180e3 * 3600))


_TORCHTITAN = ("pytorch/torchtitan docs/performance.md at commit 3faaa1a0d (2024-08-23): "
               "Llama 3 70B on 64 A100 80GB, FSDP2, local batch 1, full activation "
               "checkpointing, 331 tokens/s per GPU (MFU 51.7%); sequence 8192 from "
               "train_configs/llama3_70b.toml")
LLAMA3_70B = Arch(name="Llama 3 70B", hidden=8192, layers=80, heads=64, kv_heads=8,
                  head_dim=128, ffn=28672, vocab=128256)


def _torchtitan_run() -> Run:
    training = Training(64, 8192, precision="bf16", optimizer="adamw", data_parallel="fsdp",
                        recompute="full")
    return Run("torchtitan Llama 3 70B (A100)", _TORCHTITAN, LLAMA3_70B, "a100-80gb", 64,
               training, Layout(dp=64, data_parallel="fsdp"), "tokens", 331.0)


def runs() -> list[Run]:
    """Every published run the planner is validated against."""
    return [*_megatron_runs(), *_megatron_h100_runs(), *_llama3_runs(), _torchtitan_run(),
            _deepseek_run()]


CALIBRATION = {"a100-80gb": "Megatron GPT 145.6B", "h100-80gb": "Megatron-Core GPT 177B (H100)"}
"""The run each GPU profile's ``efficiency`` is fitted to (H800: H100's compute)."""


def megatron_flops(arch: Arch, batch: int, seq: int) -> float:
    """Megatron's eq. 3: FLOPs of one iteration, the recomputed forward included."""
    h, l_, v = arch.hidden, arch.layers, arch.vocab
    return 96 * batch * seq * l_ * h * h * (1 + seq / (6 * h) + v / (16 * l_ * h))


def mfu_flops_per_token(arch: Arch, seq: int) -> float:
    """``6 N + 12 l h q s``: PaLM's MFU numerator per token (as Llama 3 and torchtitan count)."""
    per_layer, head = active_params(arch)
    n = arch.layers * per_layer + head
    return 6 * n + 12 * arch.layers * arch.q_dim * seq


@dataclass(frozen=True)
class Check:
    """A published run beside the planner's prediction.

    Attributes:
        run: The run.
        predicted: The planner's figure in the run's metric.
        error: ``predicted / reported - 1``.
        time: The planner's step time of the published layout.
        memory_gb: Predicted peak memory per rank, GB.
        fits: Predicted to fit in the GPU's memory (the run did).
        best: The planner's top layout for the same model, GPUs and step.
        best_time: Its predicted step time.
        published_rank: Where the published layout ranks among the planner's
            (1: its top choice).
    """

    run: Run
    predicted: float
    error: float
    time: StepTime
    memory_gb: float
    fits: bool
    best: Layout
    best_time: float
    published_rank: int

    def as_dict(self) -> dict[str, Any]:
        """The comparison as plain data."""
        return {"run": self.run.name, "source": self.run.source, "metric": self.run.metric,
                "reported": self.run.reported, "predicted": self.predicted,
                "error": self.error, "memory_gb": self.memory_gb, "fits": self.fits,
                "published": self.run.layout.short(), "best": self.best.short(),
                "best_step_s": self.best_time, "published_step_s": self.time.total,
                "published_rank": self.published_rank}


def predict(run: Run) -> tuple[StepTime, float]:
    """The planner's step time and peak memory (bytes per rank) of ``run``'s own layout."""
    layout, training = run.layout, run.training
    inv = inventory_from_arch(run.arch, layout.tp, layout.ep if layout.ep <= layout.tp else 1)
    mem = memory_per_rank(run.arch, inv, layout, training)
    dtype = 4 if training.precision == "fp32" else 2
    held = held_elements(inv, layout)
    return step_time(run.arch, layout, training, run.cluster, held * dtype), mem.total


def metric(run: Run, t: StepTime) -> float:
    """``run``'s reported metric computed from the predicted step time ``t``."""
    gpu = run.cluster.gpu
    if run.metric == "megatron":
        flops = megatron_flops(run.arch, run.training.global_batch, run.training.seq)
        return flops / t.total / run.gpus / gpu.peak["bf16"]
    if run.metric == "mfu":
        per_token = mfu_flops_per_token(run.arch, run.training.seq)
        return per_token * run.training.tokens / t.total / run.gpus / gpu.peak["bf16"]
    return run.training.tokens / t.total / run.gpus


def check(run: Run) -> Check:
    """Predict ``run``, compare with what was reported, and plan the same job from scratch."""
    t, mem = predict(run)
    value = metric(run, t)
    ranked = plan_layouts(run.arch, run.cluster, run.training, prefer_runnable=False)
    key = (run.layout.pp, run.layout.dp, run.layout.cp, run.layout.tp, run.layout.ep,
           run.layout.stage_layers)
    same = [i for i, c in enumerate(ranked, 1)  # the published sizes and split, any schedule
            if (c.layout.pp, c.layout.dp, c.layout.cp, c.layout.tp, c.layout.ep,
                c.layout.stage_layers) == key]
    return Check(run, value, value / run.reported - 1, t, mem / 1e9,
                 mem <= run.cluster.gpu.memory, ranked[0].layout, ranked[0].time.total,
                 same[0] if same else 0)


def calibrate(run: Run, low: float = 0.1, high: float = 1.0) -> float:
    """The GPU efficiency at which the planner reproduces ``run``'s reported figure (bisection)."""
    gpu = run.cluster.gpu
    for _ in range(40):
        mid = (low + high) / 2
        probe = replace(run, gpu=gpu.name)
        value = metric(probe, _predict_with(probe, mid))
        low, high = (mid, high) if value < run.reported else (low, mid)
    return round((low + high) / 2, 3)


def _predict_with(run: Run, efficiency: float) -> StepTime:
    """:func:`predict`'s step time with the GPU's efficiency replaced."""
    layout, training = run.layout, run.training
    cluster = replace(run.cluster, gpu=replace(run.cluster.gpu, efficiency=efficiency))
    inv = inventory_from_arch(run.arch, layout.tp, layout.ep if layout.ep <= layout.tp else 1)
    dtype = 4 if training.precision == "fp32" else 2
    return step_time(run.arch, layout, training, cluster, held_elements(inv, layout) * dtype)
