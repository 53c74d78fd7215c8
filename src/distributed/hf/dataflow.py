"""Which projections feed which in a HF model: one probe forward on its dummy inputs.

Structural detection pairs projections by shape and tree order; this checks
the pairing against real dataflow, recorded by the same probe the automatic
plan for any model uses (:mod:`torchtp.plans.dataflow`): walking back from an
output projection's input must reach exactly the projections paired with it,
and no others (a wrong pair reaches the residual stream and earlier blocks).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from ..plans.dataflow import record
from .compat import dummy_inputs


def trace_sources(model: nn.Module, names: Iterable[str]) -> dict[str, set[str]] | None:
    """For each module in ``names``, the Linear-like modules its input comes from.

    Runs ``model(**model.dummy_inputs)`` once. Returns ``None`` when the model
    cannot run on its dummy inputs.
    """
    dummy = dummy_inputs(model)
    if dummy is None:
        return None
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    dummy = {k: (v.clamp(0, vocab - 1) if k == "input_ids" and vocab else v)
             for k, v in dummy.items()}
    try:
        trace = record(model, ((), dummy))
    except Exception:  # any model-specific failure just means: no dataflow evidence
        return None
    return {n: trace.sources(n) for n in names if n in trace.calls}
