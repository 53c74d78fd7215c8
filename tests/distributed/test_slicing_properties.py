"""Property tests: slicing then gathering is the identity; slices tile the tensor."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchtp.slicing import SlicingStrategy, gather, slice_tensor


@st.composite
def cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    strategy = draw(st.sampled_from([s for s in SlicingStrategy
                                     if ndim >= 2 or s not in (SlicingStrategy.COLUMN,
                                                               SlicingStrategy.BLOCK)]))
    balance = draw(st.booleans())
    kw: dict = {"balance": balance, "overlap": draw(st.integers(0, 3))}
    if strategy is SlicingStrategy.CUSTOM:
        axis = draw(st.integers(0, ndim - 1))
        points = draw(st.lists(st.integers(1, max(shape[axis] - 1, 1)), unique=True,
                               max_size=4)) if shape[axis] > 1 else []
        kw.update(axis=axis, split_points=sorted(points))
        return shape, strategy, None, kw
    if strategy is SlicingStrategy.BLOCK:
        limit = shape[0] * shape[1] if balance else 12
        n = draw(st.integers(1, min(limit, 12)))
        rows = draw(st.sampled_from([r for r in range(1, n + 1) if n % r == 0
                                     and (not balance or (r <= shape[0]
                                                          and n // r <= shape[1]))] or [1]))
        if n % rows or (balance and (rows > shape[0] or n // rows > shape[1])):
            n, rows = 1, 1
        kw["grid"] = (rows, n // rows)
        return shape, strategy, n, kw
    dim = {SlicingStrategy.COLUMN: 1}.get(strategy, 0)
    n = draw(st.integers(1, shape[dim] if balance else 12))
    return shape, strategy, n, kw


def _coverage(shape, part) -> np.ndarray:
    count = np.zeros(shape, dtype=np.int64)
    for spec in part.slices:
        count[spec.core_region] += 1
    return count


@settings(max_examples=150, deadline=None)
@given(cases(), st.booleans())
def test_slice_then_concat_is_identity_and_tiles(case, use_numpy):
    shape, strategy, n, kw = case
    data = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    tensor = data if use_numpy else torch.from_numpy(data)
    part = slice_tensor(tensor, strategy, n, **kw)
    rebuilt = gather(part)
    assert type(rebuilt) is type(tensor)
    assert np.array_equal(np.asarray(rebuilt), data)
    # Own parts tile the tensor exactly once: no gaps, no double cover.
    assert (_coverage(shape, part) == 1).all()
    # Every slice holds exactly its region (halo included), halos clipped at the edges.
    for spec, piece in zip(part.slices, part.data, strict=True):
        assert np.array_equal(np.asarray(piece), data[spec.region])
        ov = kw["overlap"]
        for d in range(len(shape)):
            assert spec.start[d] == max(spec.core_start[d] - ov, 0)
            assert spec.stop[d] == min(spec.core_stop[d] + ov, shape[d])
    if kw["balance"] and strategy is not SlicingStrategy.CUSTOM:
        for d in range(len(shape)):
            sizes = {s.core_stop[d] - s.core_start[d] for s in part.slices}
            assert max(sizes) - min(sizes) <= 1
