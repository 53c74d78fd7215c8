"""The split of a model's blocks over stages that keeps the largest stage smallest.

Balancing layers (:func:`~torchtp.pipeline.stage_layers`) ignores what the
first and last stage hold besides their layers: with a large vocabulary the
embedding and the LM head outweigh several layers (a Llama-3-8B shape at pp 4:
the largest stage 1.13 x an even share; balanced by parameters, 1.02 x).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence


def param_balanced_split(first: int, layers: Sequence[int], last: int, stages: int) -> list[int]:
    """Layers per stage minimising the largest stage's parameters (exact).

    Args:
        first: Parameters only the first stage holds (the embeddings).
        layers: Each block's parameters, in order.
        last: Parameters only the last stage holds (final norm, LM head).
        stages: Pipeline stages; each gets at least one block.

    Returns:
        Blocks per stage (summing to ``len(layers)``); among splits with the
        same largest stage, the most even one (least sum of squared stage
        sizes).

    Raises:
        ValueError: fewer blocks than stages.
    """
    n = len(layers)
    if n < stages:
        raise ValueError(f"{n} blocks cannot fill {stages} pipeline stages (each needs one); "
                         f"use at most {n} stages")
    prefix = [0, *itertools.accumulate(layers)]

    def size(s: int, i: int, j: int) -> int:  # stage s holding blocks i..j-1
        return prefix[j] - prefix[i] + (first if s == 0 else 0) + \
            (last if s == stages - 1 else 0)

    # The smallest possible largest stage, then, among splits reaching it, the most even
    # one (least sum of squares): the stages away from the ends share their blocks evenly.
    ceiling = _best(n, stages, size, lambda acc, x: max(acc, x), float("inf"))[0]
    return _best(n, stages, size, lambda acc, x: acc + x * x if x <= ceiling else float("inf"),
                 float("inf"))[1]


def _best(n: int, stages: int, size: Callable[[int, int, int], int],
          add: Callable[[float, int], float], worst: float) -> tuple[float, list[int]]:
    """Dynamic programming over the last cut: the best ``add``-accumulated cost of stages
    ``0..s`` holding blocks ``0..j-1`` (O(stages * n^2)), and its split (earliest cuts on ties)."""
    best = [[worst] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        best[0][j] = add(0.0, size(0, 0, j))
    for s in range(1, stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                value = add(best[s - 1][i], size(s, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    bounds, j = [n], n
    for s in range(stages - 1, 0, -1):
        j = cut[s][j]
        bounds.append(j)
    bounds.append(0)
    return best[stages - 1][n], [b - a for a, b in itertools.pairwise(reversed(bounds))]
