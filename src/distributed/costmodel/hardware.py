"""Hardware presets for the cost model, as data with their sources.

Every number is either a vendor datasheet figure, a published measurement
(see ``docs/performance.md`` and the sources listed per preset), or was
calibrated on the machine named in the preset's ``source`` by
``benchmarks/costmodel_validate.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Hardware:
    """One device type and its interconnect, as the alpha-beta model sees them.

    Attributes:
        name: Preset name used on the command line.
        peak_flops: Dense matmul peak of one device, FLOP/s, in the preset's dtype.
        gemm_efficiency: Fraction of ``peak_flops`` a large GEMM reaches.
        mem_bandwidth: Memory bandwidth of one device, bytes/s (weights and KV
            cache are read from it every decode step).
        mem_efficiency: Fraction of ``mem_bandwidth`` reached while streaming weights.
        bus_bandwidth: All-reduce *bus* bandwidth (nccl-tests ``busbw``), bytes/s.
        latency: Latency per all-reduce step, seconds (alpha).
        steps: ``"ring"`` (``2(N-1)`` steps, Gloo and NCCL ring) or ``"tree"``
            (``2*ceil(log2 N)`` steps, NCCL's small-message tree/LL protocols).
        layer_overhead: Fixed per-decoder-layer time outside GEMMs and
            collectives (kernel launches, Python, norms, rotary), seconds.
        shared_cores: When set, all ranks share this many physical cores (CPU
            processes on one machine); with more ranks than cores an all-reduce
            step waits for the OS to schedule its peer and costs
            ``oversubscribed_latency`` instead of ``latency``.
        effective_cores: Cores' worth of compute the ranks get together (less
            than ``shared_cores`` when other jobs use the machine): with more
            ranks every rank's compute and overhead slow down by
            ``ranks / effective_cores``.
        oversubscribed_latency: Per-step all-reduce latency with more ranks
            than ``shared_cores``, seconds.
        dtype_bytes: Default bytes per element (2 for bf16, 4 for fp32).
        source: Where the numbers come from.
    """

    name: str
    peak_flops: float
    gemm_efficiency: float
    mem_bandwidth: float
    mem_efficiency: float
    bus_bandwidth: float
    latency: float
    steps: str
    layer_overhead: float
    shared_cores: int | None
    dtype_bytes: int
    source: str
    effective_cores: float | None = None
    oversubscribed_latency: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The preset as plain data (for ``--json``)."""
        return asdict(self)


_GPT_FAST = ("alpha (4 us per tree step) and memory efficiency (0.65) chosen so the model "
             "reproduces gpt-fast's Llama-2-7B batch-1 bf16 A100 tokens/s (104.9/168.8/254.0/328.4 "
             "at tp 1/2/4/8) within 10%; no per-layer overhead because gpt-fast decodes under "
             "torch.compile/CUDA graphs (eager PyTorch adds launch overhead not modelled here)")

PRESETS: dict[str, Hardware] = {
    "h100-nvlink": Hardware(
        name="h100-nvlink", peak_flops=989e12, gemm_efficiency=0.6,
        mem_bandwidth=3.35e12, mem_efficiency=0.65, bus_bandwidth=365e9, latency=4e-6,
        steps="tree", layer_overhead=0.0, shared_cores=None, dtype_bytes=2,
        source="NVIDIA H100 SXM datasheet (989 TFLOP/s dense bf16, 3.35 TB/s HBM3); NCCL "
               "all-reduce busbw ~365-370 GB/s on an H100 NVLink ring (published nccl-tests "
               f"all_reduce_perf results); alpha, efficiencies and overhead as a100-nvlink ({_GPT_FAST})"),
    "a100-nvlink": Hardware(
        name="a100-nvlink", peak_flops=312e12, gemm_efficiency=0.6,
        mem_bandwidth=2.0e12, mem_efficiency=0.65, bus_bandwidth=230e9, latency=4e-6,
        steps="tree", layer_overhead=0.0, shared_cores=None, dtype_bytes=2,
        source="NVIDIA A100 80GB SXM datasheet (312 TFLOP/s dense bf16, 2.0 TB/s HBM2e); "
               f"NCCL all-reduce busbw ~230 GB/s over NVLink (published nccl-tests all_reduce_perf "
               f"results); {_GPT_FAST}"),
    "pcie4": Hardware(
        name="pcie4", peak_flops=312e12, gemm_efficiency=0.6,
        mem_bandwidth=1.555e12, mem_efficiency=0.65, bus_bandwidth=20e9, latency=10e-6,
        steps="ring", layer_overhead=0.0, shared_cores=None, dtype_bytes=2,
        source="A100 40GB PCIe GPUs without NVLink (datasheet: 312 TFLOP/s bf16, 1.555 TB/s); "
               "PCIe 4.0 x16 is 32 GB/s per direction raw, ~20 GB/s all-reduce busbw assumed "
               "(typical nccl-tests over PCIe, not measured here); 10 us per ring step assumed"),
    "cpu-gloo": Hardware(
        name="cpu-gloo", peak_flops=8.3e10, gemm_efficiency=1.0,
        mem_bandwidth=6.4e10, mem_efficiency=1.0, bus_bandwidth=1.1e9, latency=0.5e-3,
        steps="ring", layer_overhead=1.0e-3, shared_cores=2, dtype_bytes=4,
        effective_cores=1.0, oversubscribed_latency=1.2e-3,
        source="calibrated on this project's 2-core CPU machine, shared with other jobs "
               "(load average 4-5), by benchmarks/costmodel_validate.py: fp32, one thread per "
               "rank, medians of 3 runs; GEMM 8.3e10 FLOP/s in 60-GEMM loops; Gloo all-reduce "
               "timed between computations as a forward issues it: ~1 ms at tp=2 for small "
               "messages (~0.35 ms when timed in isolation after a barrier; the rest is "
               "waiting for a preempted peer), ~1.1 GB/s bus bandwidth, 1.2 ms per ring "
               "step with 4 ranks on 2 cores; the other jobs leave our ranks about 1 core in "
               "total; 1.0 ms per decoder layer of Python/dispatch "
               "overhead (HF Llama decode at tp=1)"),
}


def get_hardware(name: str) -> Hardware:
    """Look up a preset by name.

    Raises:
        ValueError: unknown preset; the message lists the valid names.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown hardware preset {name!r}; valid presets: "
                         + ", ".join(sorted(PRESETS)))
    return PRESETS[name]
