"""Rank-side checks: overlapped communication gives the plain path's outputs and gradients.

The plain path (overlap off) is the reference for exactness: every output and
gradient of the overlapped path must equal it. Both are also compared with
an unsharded float64 model built from the same seed, so neither can be wrong
in the same way.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import torchtp
from torchtp.comm import ops as comm_ops
from torchtp.comm import overlap as overlap_switch
from torchtp.comm.sequence_parallel import (
    gather_for_tensor_parallel,
    gather_from_sequence_shards,
    scatter_to_sequence_shards,
)
from torchtp.core.layouts import shard_range
from torchtp.layers import ColumnParallelLinear, RowParallelLinear

# Unsharded float64 reference vs the sharded model: the sharded sums are the same
# terms in another order (partials over out/tp or in/tp rows, then a sum over ranks).
# With float64 and O(1) values over a fan-in of <= 64 the difference is a few ulps.
REF = {"rtol": 1e-12, "atol": 1e-12}
# Overlap on vs off: the same products. Bitwise equal except where the backend sums a
# chunked reduce-scatter over 3 or more ranks in another order (a few ulps of float64).
SAME = {"rtol": 1e-13, "atol": 1e-13}
D, HID = 12, 10  # model width and per-projection width (divisible by neither 3 nor 4)


def _subgroups(world_size: int) -> dict[int, Any]:
    """One group per tp size 2..world_size on the first ranks (every rank creates every group)."""
    return {tp: dist.new_group(list(range(tp))) for tp in range(2, world_size + 1)}


class _Block(nn.Module):
    """An attention-like block: three weight-rows-split siblings read one input, one
    weight-columns-split projection writes the output."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, HID, dtype=torch.float64) for _ in range(3))
        self.o = nn.Linear(HID, D, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.q(x) * torch.sigmoid(self.k(x)) + self.v(x))


def _split(block: _Block, group: Any, overlap: bool | None, sequence: bool) -> _Block:
    for name in ("q", "k", "v"):
        layer = RowParallelLinear.from_linear(getattr(block, name), group=group)
        layer.overlap = overlap
        layer.sequence_dim = 1 if sequence else None
        setattr(block, name, layer)
    out = ColumnParallelLinear.from_linear(block.o, group=group)
    out.overlap, out.sequence_dim = overlap, 1 if sequence else None
    block.o = out
    return block


def _inputs(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A non-contiguous input ``(2, seq, D)`` and an output gradient, the same on every rank."""
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(seq, 2, D, generator=gen, dtype=torch.float64)
    return base.transpose(0, 1), torch.randn(2, seq, D, generator=gen, dtype=torch.float64)


def _run(block: _Block, x: torch.Tensor, gy: torch.Tensor, group: Any, sequence: bool,
         chunks: int) -> dict[str, torch.Tensor]:
    """Output and every gradient of ``block`` (sequence parallel: around the block, as the
    HF hooks do)."""
    xs = x.detach().clone().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    assert not xs.is_contiguous()
    if sequence:
        shard = scatter_to_sequence_shards(xs, group, 1)
        projections = [(p.weight, p.bias) for p in (block.q, block.k, block.v)]
        full = gather_for_tensor_parallel(shard, group, 1, x.shape[1],
                                          projections if chunks else (), chunks)
        y = gather_from_sequence_shards(block(full), group, 1, x.shape[1])
    else:
        y = block(xs)
    (y * gy).sum().backward()
    if sequence:  # the output bias was added to this rank's tokens only (the wrapper's GradSync)
        dist.all_reduce(block.o.bias.grad, group=group)
    grads = {f"grad {n}": p.grad for n, p in block.named_parameters()}
    return {"out": y.detach(), "grad x": xs.grad, **grads}


def _compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: dict,
             what: str) -> int:
    assert got.keys() == want.keys(), what
    for key in want:
        torch.testing.assert_close(got[key], want[key], **tol, msg=lambda m, k=key: f"{what} {k}: {m}")
    return len(want)


def _reference(x: torch.Tensor, gy: torch.Tensor, group: Any) -> dict[str, torch.Tensor]:
    """The unsharded block's output and gradients, each cut as rank ``group rank`` holds it."""
    torch.manual_seed(0)
    block = _Block()
    xr = x.detach().clone().requires_grad_()
    y = block(xr)
    (y * gy).sum().backward()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = shard_range  # (start, length) of the balanced rule
    out = {"out": y.detach(), "grad x": xr.grad}
    for name in ("q", "k", "v"):
        start, n = rows(HID, size, rank)
        lin = getattr(block, name)
        out[f"grad {name}.weight"] = lin.weight.grad[start:start + n]
        out[f"grad {name}.bias"] = lin.bias.grad[start:start + n]
    start, n = rows(HID, size, rank)
    out["grad o.weight"] = block.o.weight.grad[:, start:start + n]
    out["grad o.bias"] = block.o.bias.grad
    return out


# (label, layers' overlap, TP_OVERLAP, sequence parallel, chunks): every mode the layers
# have; the environment variable decides where the layers' attribute is None.
MODES = [("plain", False, "", False, 0), ("grad_reduce", True, "", False, 0),
         ("sp plain", False, "", True, 0), ("sp grad_reduce", None, "grad_reduce", True, 0),
         ("sp sequence", None, "sequence", True, 2), ("sp overlap", True, "", True, 2),
         ("sp overlap, 4 chunks", True, "", True, 4)]
PAIRS = [("grad_reduce", "plain"), ("sp grad_reduce", "sp plain"), ("sp sequence", "sp plain"),
         ("sp overlap", "sp plain"), ("sp overlap, 4 chunks", "sp plain")]


@contextmanager
def _env(overlap: str, chunks: int) -> Iterator[None]:
    """``TP_OVERLAP=overlap`` and ``TP_OVERLAP_CHUNKS=chunks`` for the block (read afresh)."""
    os.environ[overlap_switch.ENV] = overlap
    os.environ[overlap_switch.CHUNKS_ENV] = str(chunks or 1)
    overlap_switch.reset()
    try:
        yield
    finally:
        del os.environ[overlap_switch.ENV], os.environ[overlap_switch.CHUNKS_ENV]
        overlap_switch.reset()


def check_layers(rank: int, world_size: int, seq: int) -> dict[str, int]:
    """Overlap on vs off and vs the unsharded block, at tp 2..world_size (subgroups),
    sequence parallel on and off, a non-contiguous input and a sequence that leaves
    the shards padded and the last chunk shorter."""
    checked: dict[str, int] = {}
    for tp, group in _subgroups(world_size).items():
        if rank >= tp:
            continue
        x, gy = _inputs(seq)
        want = _reference(x, gy, group)
        results = {}
        for label, overlap, env, sequence, chunks in MODES:
            torch.manual_seed(0)
            block = _split(_Block(), group, overlap, sequence)
            with _env(env, chunks):
                results[label] = _run(block, x, gy, group, sequence, chunks)
            checked[f"tp{tp} {label} vs unsharded"] = _compare(
                results[label], want, REF, f"tp{tp} {label}")
        for label, plain in PAIRS:
            checked[f"tp{tp} {label} vs {plain}"] = _compare(
                results[label], results[plain], SAME, f"tp{tp} {label} vs {plain}")
        bitwise = all(torch.equal(results["grad_reduce"][k], results["plain"][k])
                      for k in results["plain"])
        checked[f"tp{tp} grad_reduce bitwise"] = int(bitwise)
    return checked


def check_unused_sibling_and_retain(rank: int, world_size: int) -> int:
    """A sibling whose output is unused (the entry node's fallback reduces) and a second
    backward through a retained graph give the plain path's gradients."""
    group = dist.group.WORLD
    x, gy = _inputs(5)
    runs = []
    for overlap in (False, True):
        torch.manual_seed(0)
        block = _split(_Block(), group, overlap, False)
        xs = x.detach().clone().requires_grad_()
        unused = block.k(xs)  # counted as a sibling, never reached by the backward
        y = block(xs)
        loss = (y * gy).sum()
        loss.backward(retain_graph=True)
        first = xs.grad.clone()
        loss.backward()  # accumulates: twice the first gradient
        runs.append((first, xs.grad, [p.grad for p in block.parameters()], unused))
    (f0, g0, p0, _), (f1, g1, p1, _) = runs
    assert torch.equal(f0, f1) and torch.equal(g0, g1)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1, strict=True))
    torch.testing.assert_close(g1, 2 * f1, **REF)
    return len(p0) + 2


def check_hf(rank: int, world_size: int, seq: int) -> dict[str, Any]:
    """A tiny HF Llama wrapped with overlap on vs off, sequence parallel on and off, at
    tp ``world_size``: equal losses, logits and every gradient (also vs the unsharded
    model); per mode the collectives counted per kind and whether the overlapped
    gradients are bitwise the plain ones."""
    from ._hf_models import build
    from ._sp_checks import batch

    data = batch(seq)
    ref = build("llama").train()
    ref(**data).loss.backward()
    found: dict[str, Any] = {}
    for sp in (False, True):
        runs = {}
        for overlap in (False, True):
            model = torchtp.DistributedModelWrapper(build("llama").train(),
                                                    sequence_parallel=sp, overlap=overlap)
            with torchtp.count_collectives() as counted:
                out = model(**data)
                out.loss.backward()
            runs[overlap] = (model, out, dict(counted.counts))
            found[f"sp={sp} overlap={overlap} grads vs unsharded"] = \
                _grads_vs_unsharded(model, ref)
        (m0, o0, c0), (m1, o1, c1) = runs[False], runs[True]
        # fp32, the same products; only the chunked reduce-scatter may sum over >= 3 ranks
        # in another order (a few ulps).
        torch.testing.assert_close(o1.loss, o0.loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(o1.logits, o0.logits, rtol=1e-6, atol=1e-6)
        pairs = list(zip(m0.named_parameters(), m1.named_parameters(), strict=True))
        for (n, p0), (_, p1) in pairs:
            torch.testing.assert_close(p1.grad, p0.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=n, sp=sp: f"sp={sp} {n}: {m}")
        found[f"sp={sp} collectives"] = (c0, c1)
        found[f"sp={sp} bitwise"] = torch.equal(o0.logits, o1.logits) and all(
            torch.equal(p0.grad, p1.grad) for (_, p0), (_, p1) in pairs)
    return found


def _grads_vs_unsharded(wrapped: nn.Module, ref: nn.Module) -> int:
    """Every gradient of ``wrapped`` equals this rank's part of the unsharded model's
    (``_hf_checks.compare_params`` without its broadcast over the default group)."""
    from ._hf_checks import GRADS, expected_local

    ref_params = dict(ref.named_parameters())
    for name, p in wrapped.base_model.named_parameters():
        module = wrapped.base_model.get_submodule(name.rpartition(".")[0])
        want = expected_local(module, name.rpartition(".")[2], ref_params[name].grad)
        assert p.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(p.grad, want, **GRADS, msg=lambda m, n=name: f"{n}: {m}")
    return len(ref_params)


@contextmanager
def _recording(events: list) -> Iterator[None]:
    """Append ``("compute", aten op name, data_ptrs, thread)`` for every aten op that runs
    to ``events``, the backward's included (a dispatch mode sees them; a function mode does
    not). Gloo's worker threads run with the mode too: their ops (writing a collective's
    output) carry another thread id."""

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                               kwargs: dict | None = None) -> Any:
            flat = [*args, *(kwargs or {}).values()]
            flat += [t for a in flat if isinstance(a, (list, tuple)) for t in a]
            ptrs = {a.data_ptr() for a in flat if isinstance(a, torch.Tensor) and a.numel()}
            events.append(("compute", func.overloadpacket.__name__, ptrs, threading.get_ident()))
            return func(*args, **(kwargs or {}))

    with Record():
        yield


PRODUCTS = {"mm", "addmm", "bmm", "sum"}  # the compute an overlapped collective runs beside


def _overlapped(events: list, op: str) -> list[dict[str, Any]]:
    """For each ``op`` issued: the products this thread computed before its wait began,
    whether any of its ops read the output buffer before the wait was done, and whether
    one read it after (the result was used)."""
    found, me = [], threading.get_ident()

    def mine(lo: int, hi: int) -> list[tuple]:
        return [e for e in events[lo:hi] if isinstance(e, tuple) and e[3] == me]

    def marker(start: int, kind: str, index: int | None) -> int:
        return next(k for k in range(start, len(events))
                    if isinstance(events[k], comm_ops.TraceEvent) and events[k].kind == kind
                    and events[k].op == op and events[k].index == index)

    for i, event in enumerate(events):
        if not isinstance(event, comm_ops.TraceEvent) or event.kind != "issue" or event.op != op:
            continue
        wait = marker(i, "wait", event.index)
        done = marker(wait, "done", event.index)
        # The backend's own ops during the wait (Gloo's final copy) are the collective.
        found.append({"products": sorted({e[1] for e in mine(i + 1, wait)} & PRODUCTS),
                      "read early": any(event.data_ptr in e[2] for e in mine(i + 1, wait)),
                      "read after": any(event.data_ptr in e[2] for e in mine(done, len(events)))})
    return found


@contextmanager
def _debug_log() -> Iterator[list[str]]:
    """The ``torchtp`` logger's debug messages (what ``TP_DEBUG=1`` shows) while inside."""
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    log, handler = logging.getLogger("torchtp"), Keep()
    level = log.level
    log.setLevel(logging.DEBUG)
    log.addHandler(handler)
    try:
        yield messages
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def trace_overlaps(rank: int, world_size: int) -> dict[str, list[dict[str, Any]]]:
    """Record the backward of the overlapped paths: each collective's issue, the torch
    calls after it, and its wait (no collective mocked: the real Gloo ones run)."""
    group = dist.group.WORLD
    x, gy = _inputs(7)
    traces: dict[str, list] = {}
    for label, sequence, chunks in (("grad_reduce", False, 0), ("sequence", True, 2)):
        torch.manual_seed(0)
        block = _split(_Block(), group, True, sequence)
        xs = x.detach().clone().requires_grad_()
        with _env("", chunks), _debug_log() as logged, comm_ops.trace_collectives() as events, \
                _recording(events):
            if sequence:
                shard = scatter_to_sequence_shards(xs, group, 1)
                full = gather_for_tensor_parallel(
                    shard, group, 1, x.shape[1],
                    [(p.weight, p.bias) for p in (block.q, block.k, block.v)], chunks)
                y = gather_from_sequence_shards(block(full), group, 1, x.shape[1])
            else:
                y = block(xs)
            (y * gy).sum().backward()
        traces[label] = {op: _overlapped(events, op)
                         for op in ("all_reduce", "all_gather", "reduce_scatter")}
        traces[label]["TP_DEBUG"] = [m for m in logged if m.startswith("overlap:")]
    return traces


def check_all_layers(rank: int, world_size: int, seq: int) -> dict[str, Any]:
    """Every layer-level check in one launch (the suite must stay fast)."""
    return {"layers": check_layers(rank, world_size, seq),
            "unused sibling, retained graph": check_unused_sibling_and_retain(rank, world_size),
            "traces": trace_overlaps(rank, world_size)}
