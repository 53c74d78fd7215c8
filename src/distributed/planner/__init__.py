"""The layout planner: which ``dp x tp x pp x ep x cp`` layout to train a model on, and why.

Given a model (:class:`Arch`, from a HuggingFace config or by hand), a
cluster (:class:`Cluster` of :class:`Gpu` nodes) and a training step
(:class:`Training`), :func:`plan_layouts` enumerates every valid layout
(with its microbatches and pipeline schedule), predicts each one's memory
per rank (:mod:`~torchtp.planner.memory`) and step time
(:mod:`~torchtp.planner.steptime`), and ranks them; :func:`explain` prints
the table and says why the winner wins and each runner-up loses. The chosen layout is a small
file (:func:`~torchtp.comm.layout_file.write_layout`) that
``init_parallel(layout=...)`` reads. The memory model is what torchtp
allocates: parameter, gradient and optimizer bytes are sums over torchtp's
own plan (:func:`inventory_from_model`). See docs/planning.md.

A service beside the core: it hands the core a layout (data) and changes
nothing at run time. May import: ``core``, ``comm``, ``costmodel``,
``plans``, ``training``, ``pipeline``, ``hf`` (the model's plan), ``sp`` and
``cp`` (the families they cover), not the
wrapper, the integrations or ``cli``.
"""

from __future__ import annotations

from ..comm.layout_file import Layout, read_layout, write_layout
from .arch import Arch, Experts, Latent, arch_from_config
from .cluster import GPUS, Cluster, Gpu, get_gpu
from .explain import table as explain
from .inventory import Inventory, Param, inventory_from_arch, inventory_from_model
from .memory import Memory, memory_per_rank, rank_memory
from .search import Candidate, plan_layouts
from .setup import Training
from .steptime import StepTime, step_time

__all__ = ["GPUS", "Arch", "Candidate", "Cluster", "Experts", "Gpu", "Inventory", "Latent",
           "Layout", "Memory", "Param", "StepTime", "Training", "arch_from_config", "explain",
           "get_gpu", "inventory_from_arch", "inventory_from_model", "memory_per_rank",
           "plan_layouts", "rank_memory", "read_layout", "step_time", "write_layout"]
