"""Chunked all-gather + matmul and matmul + reduce-scatter along the sequence.

Under sequence parallelism rank ``r`` holds tokens ``r*S .. (r+1)*S`` of the
sequence (``S = ceil(T / tp)``, the last shards padded). Each function below
cuts every shard into ``chunks`` pieces along the sequence (``ceil(S /
chunks)`` tokens each, the last piece shorter when ``chunks`` does not divide
``S``) and issues one collective per piece with ``async_op``, so that piece
``i + 1`` travels while the products of piece ``i`` are computed:

===========================  ==================================================
:func:`all_gather_apply`     all-gather piece ``i + 1`` | products of piece ``i``
:func:`matmul_reduce_scatter` products of piece ``i + 1`` | reduce-scatter piece ``i``
===========================  ==================================================

Piece ``i`` of every rank's shard holds the tokens ``r*S + lo .. r*S + hi``
for all ``r``; a product is applied to those rows as it would be to the whole
sequence (a :class:`Product` is row-wise), and the rows land where the
unchunked result has them. The values are those of the unchunked path up to
the rounding of a matrix product computed in row blocks (BLAS may block the
rows differently; on the CPU builds tested here the results are bitwise
equal) and of sums over ranks taken in another order by the backend.

On CUDA with NCCL, :func:`torchtp.core.torch_compat.fused_all_gather_matmul`
and :func:`~torchtp.core.torch_compat.fused_matmul_reduce_scatter` (PyTorch's
symmetric-memory ops) replace the chunk loop where they are available; where
they are not, the chunk loop runs and ``TP_DEBUG`` says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core import torch_compat as _torch_compat
from ..core.layouts import shard_range
from . import ops as _comm
from .overlap import log_fallback
from .runtime import ProcessGroup, group_size


@dataclass(frozen=True)
class Product:
    """A row-wise matrix product applied to sequence rows ``(..., d)``.

    ``F.linear(rows, weight, bias)`` (``(..., d) -> (..., out)``), or, with
    ``transposed``, ``rows @ weight`` (``(..., out) -> (..., in)``: the input
    gradient of a linear from its output gradient; ``bias`` must be ``None``).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    transposed: bool = False

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """Apply the product to ``rows``."""
        if self.transposed:
            return rows.matmul(self.weight.to(rows.dtype))
        return F.linear(rows, self.weight, self.bias)

    def matrix(self) -> torch.Tensor:
        """The right-hand matrix ``B`` of ``rows @ B`` (for the fused ops)."""
        return self.weight if self.transposed else self.weight.t()


def pieces(shard_len: int, chunks: int) -> list[tuple[int, int]]:
    """The ``(lo, hi)`` token ranges the pieces of a shard of ``shard_len`` tokens cover.

    ``ceil(shard_len / chunks)`` tokens each, the last one shorter when
    ``chunks`` does not divide ``shard_len``; fewer pieces than ``chunks``
    when the shard is short (never an empty piece).
    """
    if shard_len == 0:
        return [(0, 0)]
    count = max(1, min(chunks, shard_len))
    ranges = [shard_range(shard_len, count, i, rule="ceil") for i in range(count)]
    return [(lo, lo + n) for lo, n in ranges if n]


def _place(dest: torch.Tensor, rows: torch.Tensor, lo: int, n: int, shard_len: int,
           world: int) -> None:
    """Copy ``rows`` ``(world * n, ...)`` (piece ``[lo, lo+n)`` of each rank's shard, rank
    order) into ``dest`` ``(L, ...)`` at tokens ``r*shard_len + lo``, dropping padding."""
    length = dest.shape[0]
    for r in range(world):
        start = r * shard_len + lo
        keep = min(n, length - start)
        if keep > 0:
            dest[start:start + keep] = rows[r * n:r * n + keep]


def all_gather_apply(shard: torch.Tensor, dim: int, group: ProcessGroup, length: int | None,
                     products: Sequence[Product], chunks: int
                     ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """All-gather sequence shards and apply ``products``, piece by piece.

    Args:
        shard: This rank's shard ``(B, S, d)`` (any layout; ``dim`` is the sequence).
        dim: The sequence dimension (not the last).
        group: The TP group.
        length: Tokens kept (the shard padding dropped); ``None`` keeps ``S * tp``.
        products: Applied to the gathered sequence.
        chunks: Pieces per shard.

    Returns:
        The gathered ``(B, L, d)`` and each product of it ``(B, L, out)``
        (contiguous, as ``F.linear`` of the whole would give).
    """
    world, dim = group_size(group), dim % shard.dim()
    shard_len = shard.shape[dim]
    length = shard_len * world if length is None else length
    fused = _fused_gather(shard, dim, group, length, products)
    if fused is not None:
        return fused
    rows_in = shard.movedim(dim, 0)  # (S, B, d): pieces along dim 0 are what travels
    full = shard.new_empty(_with(shard.shape, dim, length))  # (B, L, d)
    full_rows = full.movedim(dim, 0)  # (L, B, d) view
    outs: list[torch.Tensor] = []
    ranges = pieces(shard_len, chunks)
    pending = _comm.all_gather_start(rows_in[ranges[0][0]:ranges[0][1]], group)
    for i, (lo, hi) in enumerate(ranges):
        gathered = pending.wait()  # (world * n, B, d)
        if i + 1 < len(ranges):  # the next piece travels while this one is multiplied
            nlo, nhi = ranges[i + 1]
            pending = _comm.all_gather_start(rows_in[nlo:nhi], group)
        _place(full_rows, gathered, lo, hi - lo, shard_len, world)
        for j, product in enumerate(products):
            result = product(gathered)  # (world * n, B, out)
            if i == 0:
                shape = (*_with(shard.shape, dim, length)[:-1], result.shape[-1])
                outs.append(result.new_empty(shape))  # (B, L, out)
            _place(outs[j].movedim(dim, 0), result, lo, hi - lo, shard_len, world)
    return full, outs


def matmul_reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup, product: Product,
                          chunks: int) -> torch.Tensor:
    """``product`` of the full sequence ``x``, summed over ranks, this rank's shard kept.

    What ``reduce_scatter(pad(product(x)))`` gives, piece by piece: this
    rank's shard ``(B, S, out)`` of the sum, ``S = ceil(L / tp)``.

    Args:
        x: This rank's partial input ``(B, L, d)`` (any layout; ``dim`` the sequence).
        dim: The sequence dimension (not the last).
        group: The TP group.
        product: A product without bias (the padding rows must stay zero).
        chunks: Pieces per shard.
    """
    world, dim = group_size(group), dim % x.dim()
    length = x.shape[dim]
    shard_len = shard_range(length, world, 0, rule="ceil")[1]  # S = ceil(L / tp)
    fused = _fused_reduce_scatter(x, dim, group, product, shard_len)
    if fused is not None:
        return fused
    rows_in = x.movedim(dim, 0)  # (L, B, d)
    ranges = pieces(shard_len, chunks)
    started: list[tuple[int, int, _comm.Pending]] = []
    out: torch.Tensor | None = None
    for lo, hi in ranges:
        n = hi - lo
        rows = rows_in.new_zeros((world * n, *rows_in.shape[1:]))  # zero rows: padding
        for r in range(world):
            start = r * shard_len + lo
            keep = min(n, length - start)
            if keep > 0:
                rows[r * n:r * n + keep] = rows_in[start:start + keep]
        partial = product(rows)  # (world * n, B, out)
        if out is None:
            out = partial.new_empty((*_with(x.shape, dim, shard_len)[:-1], partial.shape[-1]))
        started.append((lo, hi, _comm.reduce_scatter_start(partial, group)))
        if len(started) > 1:  # this piece's product ran beside the previous one's collective
            _land(out, dim, *started.pop(0))
    for item in started:
        _land(out, dim, *item)  # type: ignore[arg-type]
    assert out is not None
    return out


def _land(out: torch.Tensor, dim: int, lo: int, hi: int, pending: _comm.Pending) -> None:
    out.movedim(dim, 0)[lo:hi] = pending.wait()  # (n, B, out)


def _with(shape: torch.Size, dim: int, size: int) -> tuple[int, ...]:
    return (*shape[:dim], size, *shape[dim + 1:])


def _fused_gather(shard: torch.Tensor, dim: int, group: ProcessGroup, length: int,
                  products: Sequence[Product]) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """PyTorch's fused all-gather + matmul where available (CUDA, NCCL), else ``None``."""
    reason = _torch_compat.symm_mem_unavailable(shard, group)
    if reason is None and any(p.bias is not None for p in products):
        reason = "a projection has a bias (the fused op multiplies only)"
    if reason is not None:
        log_fallback("all-gather + matmul", reason)
        return None
    # Agreed and counted as the one all-gather it replaces (NCCL bounds its own wait).
    n = _comm.enter("all_gather", shard, group)
    full, outs = _torch_compat.fused_all_gather_matmul(
        shard, [p.matrix().to(shard.dtype) for p in products], dim, group)
    _comm.ordered(group, n)
    if length != full.shape[dim]:  # drop the shard padding
        full = full.narrow(dim, 0, length).contiguous()
        outs = [o.narrow(dim, 0, length).contiguous() for o in outs]
    return full, outs


def _fused_reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup, product: Product,
                          shard_len: int) -> torch.Tensor | None:
    """PyTorch's fused matmul + reduce-scatter where available (CUDA, NCCL), else ``None``."""
    reason = _torch_compat.symm_mem_unavailable(x, group)
    if reason is not None:
        log_fallback("matmul + reduce-scatter", reason)
        return None
    world = group_size(group)
    extra = shard_len * world - x.shape[dim]
    if extra:  # zero rows up to a multiple of the group size
        x = torch.cat([x, x.new_zeros(_with(x.shape, dim, extra))], dim)
    n = _comm.enter("reduce_scatter", x, group)  # agreed and counted as the one it replaces
    out = _torch_compat.fused_matmul_reduce_scatter(x, product.matrix().to(x.dtype), dim, group)
    _comm.ordered(group, n)
    return out
