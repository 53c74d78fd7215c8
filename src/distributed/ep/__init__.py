"""Expert parallelism (``ep``): MoE experts split over the TP ranks, tokens routed to them.

What is specific to experts, found together:

* :mod:`~torchtp.ep.experts` - :class:`~torchtp.ep.experts.ParallelExperts`,
  one rank's experts (whole experts per rank, or every expert's features split);
* :mod:`~torchtp.ep.dispatch` - how tokens reach them (``"all_reduce"``,
  ``"all_to_all"`` or ``"auto"`` per call);
* :mod:`~torchtp.ep.all_to_all` - the dispatch's autograd all-to-all of rows;
* :mod:`~torchtp.ep.styles` - the plan styles ``moe_tp_experts`` and
  ``ep_dispatch_experts``, registered with the plans' style registry here;
* :mod:`~torchtp.ep.whole_experts` - a plain MoE's per-expert Linears placed whole.

The ``ep`` ranks are the TP ranks grouped for the experts (``expert_parallel=k``:
``tp/k`` experts' groups), so ``ep`` is not a dimension of its own in the mesh.
Checkpoint files of merged experts are read by ``checkpoint/expert_files.py``;
the dispatch cost model is ``costmodel/experts.py`` (pure arithmetic). See
docs/moe.md.

Layer 4, a parallel dimension above the plans. May import: ``core``,
``costmodel``, ``comm``, ``layers``, ``plans``; never ``hf`` or anything above.
"""

from __future__ import annotations

from ..plans.registry import register_style
from .styles import ExpertsEP, ExpertsTP

register_style("moe_tp_experts", ExpertsTP())
register_style("ep_dispatch_experts", ExpertsEP())
