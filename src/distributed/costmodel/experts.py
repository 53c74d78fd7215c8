"""How the two expert-parallel dispatch paths compare: seconds per MoE layer forward.

Whole experts per rank, ``N`` tokens of ``H`` values (``b`` bytes each), top-``k``
routing over ``n`` ranks (see :mod:`torchtp.ep.dispatch`):

* ``all_reduce``: one all-reduce of ``N H b`` bytes (:func:`allreduce_time`);
* ``all_to_all``: a route-hash all-gather (latency only), two all-to-alls that
  each move ``(N/n) k H b (n-1)/n`` bytes per rank (uniform routing assumed:
  the estimate must not depend on the routes, so every rank chooses alike),
  and an all-gather of ``N H b (n-1)/n`` bytes; each of the four collectives
  pays ``n-1`` latency steps.

Pure arithmetic, like the rest of the cost model: the numbers say which path
moves fewer bytes per unit of latency, not how long a step takes.
"""

from __future__ import annotations

from .hardware import Hardware
from .model import allreduce_time


def expert_dispatch_times(tokens: int, hidden: int, k: int, n: int, elem_bytes: int,
                          hw: Hardware) -> dict[str, float]:
    """Estimated seconds of each dispatch path for one MoE layer's forward.

    Args:
        tokens: Tokens in the call (``N``), on every rank.
        hidden: Hidden size (``H``).
        k: Experts per token.
        n: Ranks holding the experts.
        elem_bytes: Bytes per value of the token states.
        hw: The hardware preset.

    Returns:
        ``{"all_reduce": seconds, "all_to_all": seconds}`` (both 0 for one rank).
    """
    if n <= 1:
        return {"all_reduce": 0.0, "all_to_all": 0.0}
    latency = hw.latency
    if hw.shared_cores is not None and n > hw.shared_cores and hw.oversubscribed_latency:
        latency = hw.oversubscribed_latency
    rows = tokens * hidden * elem_bytes  # bytes of the whole (N, H)
    moved = 2 * (tokens / n) * k * hidden * elem_bytes * (n - 1) / n  # dispatch + combine
    gathered = rows * (n - 1) / n
    a2a = 4 * (n - 1) * latency + (moved + gathered) / hw.bus_bandwidth
    return {"all_reduce": allreduce_time(rows, n, hw), "all_to_all": a2a}
