"""The machines a layout runs on: one GPU's profile and how many of them, in how many nodes.

A :class:`Gpu` profile is data with its sources: memory, peak matmul rates
per precision (datasheets), the fraction of peak a training step's matmuls
reach (``efficiency``), and the collective bandwidth and latency inside a
node and across nodes (NCCL bus bandwidth, as ``nccl-tests`` reports it).
``efficiency`` is the one fitted number: it is calibrated on one published
run per GPU type (named in ``source``) and every other run is a prediction
(docs/planning.md, "Validation").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Gpu:
    """One accelerator type and its links, as the planner's time and memory model sees them.

    Attributes:
        name: Preset name (``--hardware``).
        memory: Bytes one device can use.
        peak: Dense matmul peak per precision (``"fp32"``, ``"bf16"``, ``"fp8"``), FLOP/s.
        efficiency: Fraction of ``peak`` a training step's matmuls and
            attention reach on this GPU (the calibrated number; see ``source``).
        mem_bandwidth: Memory bandwidth, bytes/s (optimizer steps are bound by it).
        intra_bw: Collective bus bandwidth between GPUs of one node, bytes/s.
        intra_latency: Per-step latency inside a node, seconds.
        inter_bw: Collective bus bandwidth per GPU across nodes, bytes/s.
        inter_latency: Per-step latency across nodes, seconds.
        layer_overhead: Fixed time of one decoder layer's pass beside its FLOPs and
            bytes: a few dozen kernel launches and tails, seconds (assumed:
            40 kernels of 5 us).
        gpus_per_node: GPUs in one node (the default of :class:`Cluster`).
        source: Where every number comes from.
    """

    name: str
    memory: float
    peak: dict[str, float]
    efficiency: float
    mem_bandwidth: float
    intra_bw: float
    intra_latency: float
    inter_bw: float
    inter_latency: float
    layer_overhead: float
    gpus_per_node: int
    source: str

    def rate(self, precision: str) -> float:
        """Achieved matmul FLOP/s at ``precision`` (``peak * efficiency``)."""
        return self.peak[precision] * self.efficiency

    def as_dict(self) -> dict[str, Any]:
        """The profile as plain data."""
        return asdict(self)


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``gpus_per_node`` GPUs of one type.

    Attributes:
        gpu: The GPU profile.
        nodes: Nodes.
        gpus_per_node: GPUs per node (NVLink domain); ranks are laid out
            node by node, so a group of consecutive ranks that fits in a node
            talks over the node's links.
    """

    gpu: Gpu
    nodes: int = 1
    gpus_per_node: int = 0

    def __post_init__(self) -> None:
        if self.gpus_per_node == 0:
            object.__setattr__(self, "gpus_per_node", self.gpu.gpus_per_node)
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"Cluster: nodes={self.nodes} and gpus_per_node="
                             f"{self.gpus_per_node} must be >= 1")

    @property
    def gpus(self) -> int:
        """GPUs in all."""
        return self.nodes * self.gpus_per_node

    def link(self, stride: int, size: int) -> tuple[float, float, str]:
        """(bus bandwidth, latency, "node"/"network") of a group of ``size`` ranks ``stride`` apart.

        The group stays inside a node when its span (``stride * size``) divides the
        node (groups are aligned to nodes, as ``init_parallel`` lays them).
        """
        span = stride * size
        if size <= 1 or (span <= self.gpus_per_node and self.gpus_per_node % span == 0):
            return self.gpu.intra_bw, self.gpu.intra_latency, "node"
        return self.gpu.inter_bw, self.gpu.inter_latency, "network"


_NCCL = ("NCCL bus bandwidth as nccl-tests reports it for large messages (all_reduce_perf "
         "busbw)")

GPUS: dict[str, Gpu] = {
    "a100-80gb": Gpu(
        name="a100-80gb", memory=80e9, peak={"fp32": 19.5e12, "bf16": 312e12, "fp8": 312e12},
        efficiency=0.696, mem_bandwidth=2.039e12, intra_bw=230e9, intra_latency=8e-6,
        inter_bw=22e9, inter_latency=15e-6, layer_overhead=200e-6, gpus_per_node=8,
        source="NVIDIA A100 80GB SXM datasheet (312 TFLOP/s dense bf16, 19.5 fp32, no fp8; "
               "2.039 TB/s); DGX A100: NVLink 3 (~230 GB/s all-reduce busbw) and 8 HDR 200 Gb/s "
               f"InfiniBand links per node (25 GB/s per GPU, ~22 GB/s busbw); {_NCCL}; "
               "efficiency calibrated on Megatron-LM's 145.6B run (SC21 Table 1, 47% of peak)"),
    "h100-80gb": Gpu(
        name="h100-80gb", memory=80e9, peak={"fp32": 67e12, "bf16": 989e12, "fp8": 1979e12},
        efficiency=0.681, mem_bandwidth=3.35e12, intra_bw=360e9, intra_latency=6e-6,
        inter_bw=45e9, inter_latency=12e-6, layer_overhead=200e-6, gpus_per_node=8,
        source="NVIDIA H100 SXM datasheet (989 TFLOP/s dense bf16, 1979 fp8, 67 fp32; 3.35 "
               "TB/s HBM3); NVLink 4 (~360 GB/s all-reduce busbw) and one 400 Gb/s NIC per GPU "
               f"(50 GB/s, ~45 GB/s busbw); {_NCCL}; efficiency calibrated on Megatron-Core's "
               "177B run (README table, 44% MFU)"),
    "h800-80gb": Gpu(
        name="h800-80gb", memory=80e9, peak={"fp32": 67e12, "bf16": 989e12, "fp8": 1979e12},
        efficiency=0.681, mem_bandwidth=3.35e12, intra_bw=160e9, intra_latency=6e-6,
        inter_bw=45e9, inter_latency=12e-6, layer_overhead=200e-6, gpus_per_node=8,
        source="H100's compute with NVLink cut to 400 GB/s (DeepSeek-V3 report: ~160 GB/s "
               "achieved over NVLink, 50 GB/s InfiniBand per GPU); efficiency: H100's"),
}


def get_gpu(name: str) -> Gpu:
    """A GPU preset by name.

    Raises:
        ValueError: unknown name, listing the presets.
    """
    if name not in GPUS:
        raise ValueError(f"unknown GPU profile {name!r}; presets: {sorted(GPUS)}")
    return GPUS[name]
