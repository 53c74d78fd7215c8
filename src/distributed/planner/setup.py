"""What a training step is: batch, sequence, precision, optimizer, sharding, recomputation."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

PRECISIONS = ("fp32", "bf16", "fp8")
OPTIMIZERS = ("adamw", "sgd", "sgd-momentum")
DATA_PARALLEL = ("ddp", "zero1", "fsdp")
RECOMPUTE = ("none", "full", "auto")
STACKS = ("torchtp", "fused")


@dataclass(frozen=True)
class Training:
    """One optimizer step of training.

    Attributes:
        global_batch: Sequences per optimizer step, over every replica.
        seq: Tokens per sequence.
        precision: ``"fp32"`` (everything in float32); ``"bf16"`` (bfloat16
            compute and activations, float32 gradients, master weights and
            optimizer state: FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
            reduce_dtype=fp32)``, or bf16 weights with fp32 main gradients and
            master weights under DDP/ZeRO-1, as Megatron); ``"fp8"``: ``"bf16"``
            with the matmuls at the FP8 rate.
        optimizer: ``"adamw"`` (two states per parameter and a step count per
            tensor), ``"sgd"`` (none) or ``"sgd-momentum"`` (one).
        data_parallel: ``"ddp"``, ``"zero1"`` (optimizer state and master weights
            sharded over ``dp``) or ``"fsdp"`` (parameters, gradients and optimizer
            state sharded over ``dp``, FSDP2's full sharding).
        recompute: ``"none"``, ``"full"`` (every decoder layer recomputed in the
            backward from its input: HF ``gradient_checkpointing_enable()``) or,
            for the planner only, ``"auto"`` (both tried).
        overlap: Tensor-parallel gradient reductions run beside the weight-gradient
            matmuls (``DistributedModelWrapper(overlap=True)``), and data-parallel
            collectives beside the backward.
        flash: Attention never materializes its ``(heads, seq, seq)`` scores (SDPA's
            flash and memory-efficient kernels); ``False``: scores, softmax and
            dropout are written out per layer (Megatron-LM in 2021), which the
            step time counts as memory traffic.
        stack: The software whose memory is modeled: ``"torchtp"`` (HuggingFace's
            modules under torchtp and PyTorch's pipeline, measured: RMSNorm keeps a
            float32 copy of its input, the gated MLP four tensors, a pipeline
            stage a receive buffer per microbatch) or ``"fused"`` (fused norm and
            SwiGLU kernels and reused pipeline buffers, as Megatron-LM: a norm
            keeps its input and output, the MLP its up-projections and their
            product; for published runs, not measured here).
    """

    global_batch: int
    seq: int
    precision: str = "bf16"
    optimizer: str = "adamw"
    data_parallel: str = "fsdp"
    recompute: str = "none"
    overlap: bool = True
    flash: bool = True
    stack: str = "torchtp"

    def __post_init__(self) -> None:
        for name, value, allowed in (("precision", self.precision, PRECISIONS),
                                     ("optimizer", self.optimizer, OPTIMIZERS),
                                     ("data_parallel", self.data_parallel, DATA_PARALLEL),
                                     ("recompute", self.recompute, RECOMPUTE),
                                     ("stack", self.stack, STACKS)):
            if value not in allowed:
                raise ValueError(f"Training: {name}={value!r} is not one of {list(allowed)}")
        for name, size in (("global_batch", self.global_batch), ("seq", self.seq)):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"Training: {name} must be a positive int, got {size!r}")

    @property
    def activation_bytes(self) -> int:
        """Bytes per activation element: 4 in float32, 2 in bfloat16 (FP8 keeps bf16 ones)."""
        return 4 if self.precision == "fp32" else 2

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step."""
        return self.global_batch * self.seq

    def as_dict(self) -> dict[str, Any]:
        """The setup as plain data."""
        return asdict(self)
