"""Raw (non-autograd) collectives used by every torchtp operator.

Each function returns a tensor the caller owns: inputs are never modified
unless the caller passes one it created itself (``*_`` functions).

The collectives are plain: they shape buffers and call the process group.
What torchtp adds to a collective attaches at one hook point, a pair of
calls every eager collective makes and nothing else of the safety machinery:

* :func:`enter`, before it is issued: the group's health (an earlier failure
  left it out of step: :class:`~torchtp.InconsistentGroupError`), the shape
  agreement, the count (:func:`count_collectives`) and the ``TP_DEBUG`` log.
  When the shape or dtype differs from the last one agreed for that op (the
  first of each op, every shape change; every call with ``TP_CHECK_SHAPES=1``),
  all ranks agree on it through the group's store, so different shapes raise
  :class:`~torchtp.RankMismatchError` on every rank instead of garbage (Gloo
  silently accepts equal element counts) or an abort;
* :func:`leave`, after it is issued: the bounded wait, which watches the
  store for another rank's failure while the collective is slow, and the hold
  on Gloo's tensors until its worker lets go of them (:mod:`torchtp.comm.health`).

The values of torchtp's checks that ride a collective (:func:`ride_next_collective`)
are taken by the two collectives that can carry them (a floating-point sum
all-reduce, an all-gather), which pass the hook with the number riding. Inside
``torch.compile`` the hook is skipped: the graph holds the collectives.

The ``*_start`` functions (:func:`all_reduce_start`, :func:`all_gather_start`,
:func:`reduce_scatter_start`) issue a collective without waiting and return a
:class:`Pending` whose :meth:`~Pending.wait` is the same bounded wait, so
compute can run while it travels (:mod:`torchtp.comm.overlap`);
:func:`trace_collectives` records when each is issued and waited for.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch.overrides import has_torch_function_unary

from ..core.layouts import cut, shard_range, shard_sizes
from ..core.log import logger
from . import health as _health
from .reductions import TorchOp, torch_op
from .runtime import ProcessGroup

# New names in torch 2.13; the old ones remain for torch>=2.4.
gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CollectiveRecord:
    """One collective call: its op name, the local shape, dtype and group size."""

    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    group_size: int


@dataclass
class CollectiveCounter:
    """Collectives issued while a :func:`count_collectives` block was active."""

    records: list[CollectiveRecord] = field(default_factory=list)

    @property
    def counts(self) -> Counter[str]:
        """Number of calls per op name, e.g. ``{"all_reduce": 8}``."""
        return Counter(r.op for r in self.records)

    @property
    def total(self) -> int:
        """Number of collectives recorded."""
        return len(self.records)

    def bytes_moved(self) -> int:
        """Sum of local payload bytes over all recorded collectives."""
        return sum(
            torch.Size(r.shape).numel() * torch.empty((), dtype=r.dtype).element_size()
            for r in self.records
        )


_COUNTERS: list[CollectiveCounter] = []


# Whether torch.compile is tracing (the graph then holds the collectives); the function
# itself, not a wrapper: it runs on every collective
_compiling = torch.compiler.is_compiling


@contextmanager
def count_collectives() -> Iterator[CollectiveCounter]:
    """Record every torchtp collective issued inside the block.

    Example:
        >>> with count_collectives() as c:
        ...     model(x)
        >>> c.counts["all_reduce"]
    """
    counter = CollectiveCounter()
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


def enter(op: str, tensor: torch.Tensor, group: ProcessGroup | None,
          st: _health.GroupState | None = None, riding: int = 0,
          counted: torch.Tensor | None = None) -> int | None:
    """The hook point, before collective ``op`` of ``tensor`` is issued; its index in the group.

    Checks the group's health and agrees on the signature (:func:`torchtp.comm.health.before`),
    counts and (under TP_DEBUG) logs it. Eager only: inside ``torch.compile``
    this is skipped and returns ``None`` (the compiled graph holds the
    collectives; logging, counters and store checks cannot be traced). This runs
    on every collective of every forward: without counters or debug logging it
    costs a dict look-up and a shape comparison.

    Args:
        op: The op name it is agreed and counted as.
        tensor: The tensor whose shape and dtype every rank must pass.
        group: The process group (``None``: the default group).
        st: The group's state, when the caller has looked it up already (outside
            ``torch.compile``).
        riding: Values of torchtp's checks travelling in the same collective.
        counted: The tensor counted (its bytes moved), when it is not ``tensor``.

    Raises:
        InconsistentGroupError: an earlier failure left the group out of step.
        RankMismatchError: ranks pass different shapes or dtypes.
    """
    if st is None:  # a state is only looked up outside torch.compile
        if _compiling():
            return None
        st = _health.state(group)
    n = _health.before(op, tensor, st, riding)
    if _COUNTERS or logger.isEnabledFor(logging.DEBUG):
        count(op, tensor if counted is None else counted, group)
    return n


def count(op: str, tensor: torch.Tensor, group: ProcessGroup | None) -> None:
    """Count and (under TP_DEBUG) log one collective, without checking it.

    For collectives that not every rank of ``group`` enters alike (send/recv),
    which therefore cannot take part in the group's shape agreement.
    """
    if _compiling():
        return
    debug = logger.isEnabledFor(logging.DEBUG)
    if not (_COUNTERS or debug):
        return
    size = dist.get_world_size(group)
    if _COUNTERS:
        rec = CollectiveRecord(op, tuple(tensor.shape), tensor.dtype, size)
        for counter in _COUNTERS:
            counter.records.append(rec)
    if debug:
        logger.debug("%s shape=%s dtype=%s group_size=%d", op, tuple(tensor.shape),
                     tensor.dtype, size)


def ordered(group: ProcessGroup | None, n: int | None) -> None:
    """Note collective ``n`` (from :func:`enter`) as waited for, without a work handle.

    For a fused op that issues and orders its communication on the device's
    stream itself (NCCL), as a CUDA collective's wait does.
    """
    if n is not None:
        st = _health.state(group)
        st.completed = max(st.completed, n)


def leave(work: dist.Work | None, n: int | None, op: str, tensor: torch.Tensor,
          group: ProcessGroup | None, st: _health.GroupState | None = None,
          out: torch.Tensor | None = None, shown: torch.Tensor | None = None,
          riding: int = 0) -> None:
    """The hook point, after collective ``n`` (from :func:`enter`) was issued: wait for it.

    The wait is bounded (:func:`torchtp.comm.health.finish`); nothing to wait for
    when the collective ran synchronously (``work`` or ``n`` is ``None``).

    Args:
        work: The backend's handle.
        n: The collective's index in its group.
        op: Its op name.
        tensor: What it sent.
        group: The process group.
        st: The group's state, when the caller has looked it up already.
        out: The output, when it is not ``tensor`` (kept alive with it until
            the backend's worker thread has let go of the collective).
        shown: The tensor whose signature was agreed, when ``tensor`` carries
            riding values as well.
        riding: The number of values riding.
    """
    if work is not None and n is not None:
        _health.finish(work, _health.state(group) if st is None else st, n, op, tensor, out,
                       shown, riding)


@dataclass(frozen=True)
class TraceEvent:
    """One step of an overlapped collective, recorded by :func:`trace_collectives`.

    Attributes:
        kind: ``"issue"`` (handed to the backend, not waited for), ``"wait"``
            (the wait begins; the backend may still write the output, e.g.
            Gloo's final copy) or ``"done"`` (the result is complete and may be read).
        op: The op name (``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``).
        index: The collective's index in its group (``None`` when not recorded).
        data_ptr: Address of the collective's output buffer, so a reader of the
            result can be matched to it.
    """

    kind: str
    op: str
    index: int | None
    data_ptr: int


_TRACES: list[list[TraceEvent]] = []


@contextmanager
def trace_collectives() -> Iterator[list[TraceEvent]]:
    """Record, in order, when each collective started with ``*_start`` is issued and waited for.

    A debugging and test hook: together with a record of the compute that ran
    (e.g. a ``torch.overrides.TorchFunctionMode``), it shows that an overlapped
    collective was issued before the compute it overlaps and waited for before
    its result was read. Costs one list check per collective when unused.
    """
    events: list[TraceEvent] = []
    _TRACES.append(events)
    try:
        yield events
    finally:
        _TRACES.remove(events)


def _trace(kind: str, op: str, index: int | None, out: torch.Tensor) -> None:
    event = TraceEvent(kind, op, index, out.data_ptr())
    for events in _TRACES:
        events.append(event)


@dataclass(eq=False)
class Pending:
    """A collective handed to the backend without waiting (``async_op=True``).

    Compute that does not read :attr:`out` may run until :meth:`wait`; the
    caller must not touch the buffers before that. The wait is bounded and
    watches the group's health like every blocking collective (see
    :func:`torchtp.comm.health.finish`).

    Attributes:
        out: The result buffer (complete only after :meth:`wait`).
    """

    work: dist.Work | None
    index: int | None
    op: str
    tensor: torch.Tensor
    st: _health.GroupState | None  # holds the group weakly; None: nothing to wait for
    out: torch.Tensor
    done: bool = False

    def wait(self) -> torch.Tensor:
        """Wait for the collective (once; later calls return at once) and return :attr:`out`."""
        if not self.done:
            self.done = True
            if _TRACES:
                _trace("wait", self.op, self.index, self.out)
            if self.st is not None:
                leave(self.work, self.index, self.op, self.tensor, None, self.st,
                      None if self.out is self.tensor else self.out)
            if _TRACES:
                _trace("done", self.op, self.index, self.out)
        return self.out


def _issued(work: dist.Work | None, n: int | None, op: str, tensor: torch.Tensor,
            st: _health.GroupState | None, out: torch.Tensor) -> Pending:
    if _TRACES:
        _trace("issue", op, n, out)
    return Pending(work, n, op, tensor, st, out, done=work is None)


def all_reduce_start(tensor: torch.Tensor, group: ProcessGroup | None) -> Pending:
    """Start summing ``tensor`` in place across ``group``; :meth:`Pending.wait` returns it.

    ``tensor`` must be contiguous and owned by the caller. Counted, logged and
    shape-agreed as an ``all_reduce``, like :func:`all_reduce_`. While rides
    wait for the group's next collective (:func:`ride_next_collective`), or
    under ``torch.compile``, it runs as the blocking :func:`all_reduce_` does
    (the returned handle is already complete), so the collectives issued are
    the same either way.
    """
    assert tensor.is_contiguous(), "all_reduce_start needs a contiguous tensor"
    if _compiling() or has_torch_function_unary(tensor) or _riding(_health.state(group), tensor):
        out = all_reduce_(tensor, group)
        return _issued(None, None, "all_reduce", out, None, out)
    st = _health.state(group)
    n = enter("all_reduce", tensor, group, st)
    work = st.group.allreduce([tensor], _OPT_SUM)  # as all_reduce_ does
    return _issued(work, n, "all_reduce", tensor, st, tensor)


def all_gather_start(tensor: torch.Tensor, group: ProcessGroup | None) -> Pending:
    """Start gathering every rank's ``tensor`` ``(d0, ...)`` into ``(world * d0, ...)`` (dim 0).

    Equal shapes on every rank; the caller pads and rearranges. Counted and
    agreed as an ``all_gather``, like :func:`all_gather`. While rides wait for the
    group, it runs blocking with them on board (:func:`all_gather`), as
    :func:`all_reduce_start` does.
    """
    local = tensor.contiguous()
    st = None if _compiling() else _health.state(group)
    if st is not None and _riding(st, local):
        out = _all_gather_riding(local, group, st)
        return _issued(None, None, "all_gather", local, None, out)
    world = dist.get_world_size(group)
    out = torch.empty((world * local.shape[0], *local.shape[1:]), dtype=local.dtype,
                      device=local.device)
    n = enter("all_gather", local, group, st)
    work = gather_single(out, local, group=group, async_op=n is not None)
    return _issued(work, n, "all_gather", local, st, out)


def reduce_scatter_start(tensor: torch.Tensor, group: ProcessGroup | None) -> Pending:
    """Start summing ``tensor`` ``(world * d0, ...)`` across ``group``; keep share ``(d0, ...)``.

    Rank ``r``'s share is rows ``r*d0 : (r+1)*d0`` of dim 0 (equal shares; the
    caller pads). Counted and agreed as a ``reduce_scatter``, like :func:`reduce_scatter`.
    """
    full = tensor.contiguous()
    world = dist.get_world_size(group)
    out = torch.empty((full.shape[0] // world, *full.shape[1:]), dtype=full.dtype,
                      device=full.device)
    n = enter("reduce_scatter", full, group)
    work = reduce_scatter_single(out, full, group=group, async_op=n is not None)
    st = None if n is None else _health.state(group)
    return _issued(work, n, "reduce_scatter", full, st, out)


@dataclass(eq=False)  # rides are found by identity (their values are tensors)
class Ride:
    """A few values summed over a group, travelling with its next float all-reduce or
    all-gather (:func:`ride_next_collective`).

    :mod:`torchtp.guards.input_check` uses it so that checking a forward's inputs
    costs no collective of its own wherever the step has one.
    """

    values: torch.Tensor  # (k,) 0 or 1: sums over <= 256 ranks are exact in every float dtype
    device: torch.device  # for the separate all-reduce when no collective carried them
    # (k,) the sums over the group on the collective's device, once reduced; read on
    # the host (ride_result) only when asked, so a GPU forward is not stopped halfway
    sums: torch.Tensor | None = None


_RIDE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SUM = torch_op("sum")  # what rides and sum-like reductions (average) communicate


def ride_next_collective(group: ProcessGroup | None, values: torch.Tensor,
                         device: torch.device) -> Ride:
    """Sum ``values`` (``(k,)``, each 0 or 1) over ``group`` with its next collective that
    can carry them: a floating-point sum all-reduce or all-gather, forward or backward.

    That collective's own tensor is reduced or gathered as without them (the
    values travel beside it; over more than 2 ranks an all-reduce may add in
    another order, identical on every rank); it is counted as the model's own
    op and agreed with the number of values riding, so every rank of ``group``
    must make the same calls before it. Several rides waiting for the same
    collective (the input check's and an experts layer's route check) travel
    together, in order. Read the sums with :func:`ride_result`: it runs one
    small all-reduce if no collective carried them.
    """
    ride = Ride(values, device)
    _health.state(group).rides.append(ride)
    return ride


def cancel_ride(group: ProcessGroup | None, ride: Ride) -> None:
    """Stop ``ride`` from joining a later collective (its forward raised)."""
    waiting = _health.state(group).rides
    if ride in waiting:
        waiting.remove(ride)


# The 8 bits of each byte value, high bit first, as 8 float32 0.0/1.0 (32 bytes)
_BYTE_BITS = [np.unpackbits(np.array([b], dtype=np.uint8)).astype(np.float32).tobytes()
              for b in range(256)]


def ride_hash(group: ProcessGroup | None, data: bytes, device: torch.device) -> Ride:
    """Ride the 64 bits of a blake2b hash of ``data`` (values 0 or 1) on the next collective.

    Read the verdict with :func:`ride_agrees` after that collective ran.
    """
    return ride_digest(group, hashlib.blake2b(data, digest_size=8).digest(), device)


def ride_digest(group: ProcessGroup | None, digest: bytes, device: torch.device) -> Ride:
    """Ride the bits of ``digest`` (8 bytes: 64 values 0 or 1) on the next collective.

    Read the verdict with :func:`ride_agrees` after that collective ran.
    """
    # (64,) float32 bits from a byte table and one torch call: this runs before every
    # forward, right after the last one evicted the caches, where every further
    # library call (numpy's unpackbits, a dtype conversion) costs ~10 us of misses.
    bits = torch.frombuffer(bytearray(b"".join([_BYTE_BITS[b] for b in digest])),
                            dtype=torch.float32)
    if device.type != "cpu":
        # Moved to the device now, before the forward: a copy from pageable host
        # memory waits for the device's queue, which mid-forward would stop the host.
        bits = bits.to(device)
    return ride_next_collective(group, bits, device)


def ride_agrees(group: ProcessGroup | None, ride: Ride, size: int) -> bool:
    """Whether every rank of ``group`` (``size`` ranks) rode the same hash (:func:`ride_hash`).

    Every rank reads the same sums, so every rank gives the same verdict.
    """
    sums = ride_result(group, ride)
    return sums.count(0.0) + sums.count(float(size)) == len(sums)


def ride_result(group: ProcessGroup | None, ride: Ride) -> list[float]:
    """The sums of ``ride``'s values over ``group``: one small all-reduce if none carried them."""
    if ride.sums is None:
        cancel_ride(group, ride)
        ride.sums = all_reduce_(ride.values.to(device=ride.device, dtype=torch.float64), group)
    return ride.sums.tolist()


def _riding(st: _health.GroupState, tensor: torch.Tensor) -> bool:
    """Whether rides wait for ``st``'s group and can travel in ``tensor``'s collective."""
    return bool(st.rides) and tensor.dtype in _RIDE_DTYPES and st.size <= 256


def _take_rides(st: _health.GroupState, like: torch.Tensor) -> tuple[list[Ride], torch.Tensor]:
    """The rides waiting for ``st``'s group, and their values ``(k,)`` in ``like``'s dtype
    and on its device (0 and 1: exact in every float dtype)."""
    rides, st.rides = st.rides, []
    extra = rides[0].values if len(rides) == 1 else torch.cat([r.values for r in rides])
    if extra.device != like.device or extra.dtype != like.dtype:
        extra = extra.to(device=like.device, dtype=like.dtype)
    return rides, extra


def _hand_sums(rides: list[Ride], sums: torch.Tensor) -> None:
    """Give each ride its slice of ``sums`` ``(k,)``, in the order they travelled."""
    if len(rides) == 1:  # the usual case: its sums are the whole tensor, no slicing op
        rides[0].sums = sums
        return
    start = 0
    for ride in rides:
        k = ride.values.numel()
        ride.sums, start = sums[start:start + k], start + k


def _all_reduce_riding(tensor: torch.Tensor, group: ProcessGroup | None,
                       st: _health.GroupState) -> torch.Tensor:
    """Sum ``tensor`` (contiguous, ``(...)``) and the waiting rides' values in one collective."""
    rides, extra = _take_rides(st, tensor)
    # Agreed as the model's all-reduce with k values riding, counted as the model's own
    op, k = "all_reduce", extra.numel()
    n = enter(op, tensor, group, st, riding=k)
    if st.cpu_gloo and tensor.device.type == "cpu":
        # Gloo sums a list of tensors as one collective, packing them in C++: the
        # activation is neither copied into a longer buffer nor copied back here.
        work = st.group.allreduce_coalesced([tensor, extra], _COALESCED)
        leave(work, n, op, tensor, group, st, out=extra, riding=k)
        sums = extra
    else:
        # Other backends and devices (NCCL, Gloo's CUDA path) get one buffer: (numel + k,)
        flat = tensor.view(-1)
        buf = torch.cat([flat, extra])
        work = st.group.allreduce([buf], _OPT_SUM)  # as all_reduce_ does
        leave(work, n, op, buf, group, st, shown=tensor, riding=k)
        flat.copy_(buf[:flat.numel()])
        # A copy of the (k,) sums, not a view that would keep the activation-sized
        # buffer alive; still on the device: ride_result reads them when asked.
        sums = buf[flat.numel():].clone()
    _hand_sums(rides, sums)
    return tensor


def _all_gather_riding(local: torch.Tensor, group: ProcessGroup | None,
                       st: _health.GroupState) -> torch.Tensor:
    """Gather ``local`` (contiguous, ``(d0, ...)``) into ``(world * d0, ...)`` with the
    waiting rides' values in the same collective.

    Each rank sends ``(numel + k,)``: its tensor, then its ``k`` values; the values
    of every rank arrive, and their sums over the ranks are what a riding
    all-reduce gives. Costs one copy of the gathered tensor (its rows are
    interleaved with the values).
    """
    rides, extra = _take_rides(st, local)
    op, k, numel, world = "all_gather", extra.numel(), local.numel(), st.size
    buf = torch.cat([local.view(-1), extra])  # (numel + k,)
    flat = buf.new_empty(world * buf.numel())  # (world * (numel + k),)
    n = enter(op, local, group, st, riding=k)  # agreed with k riding, counted as the model's own
    work = gather_single(flat, buf, group=group, async_op=True)
    leave(work, n, op, buf, group, st, out=flat, shown=local, riding=k)
    gathered = flat.view(world, buf.numel())  # (world, numel + k)
    # (k,) every rank's values summed: 0/1 over at most 256 ranks, exact in any float dtype
    _hand_sums(rides, gathered[:, numel:].sum(0, dtype=torch.float64))
    return gathered[:, :numel].reshape(world * local.shape[0], *local.shape[1:])


def all_reduce_(tensor: torch.Tensor, group: ProcessGroup | None, op: str = "sum",
                name: str = "all_reduce") -> torch.Tensor:
    """Sum ``tensor`` in place across ``group``; it must be contiguous and owned by the caller.

    ``name``: the op it is recorded, counted and shape-agreed as (see :func:`all_reduce_as`).
    """
    assert tensor.is_contiguous(), "all_reduce_ needs a contiguous tensor"
    reduce_op = _SUM if op == "sum" else torch_op(op)
    if _compiling() or has_torch_function_unary(tensor):
        # Traced (the graph holds the collective; nothing to record) or a tensor
        # subclass: torch.distributed's own dispatch handles both.
        dist.all_reduce(tensor, op=reduce_op, group=group)
        return tensor
    st = _health.state(group)
    if st.rides and name == "all_reduce" and reduce_op == _SUM and _riding(st, tensor):
        return _all_reduce_riding(tensor, group, st)
    n = enter(name, tensor, group, st)
    # Straight to the process group: dist.all_reduce's Python wrapper (its logging
    # decorator, group-membership and tensor checks, which state() and enter() make
    # redundant here) costs about 10 us per call, paid by every forward's all-reduces.
    pg = group if group is not None else st.group
    opts = _OPT_SUM if reduce_op is _SUM else _allreduce_options(reduce_op)
    leave(pg.allreduce([tensor], opts), n, name, tensor, group, st)
    return tensor


_OPTIONS: dict[object, dist.AllreduceOptions] = {}
_OPT_SUM = dist.AllreduceOptions()  # the sum's, built once: every forward's all-reduces use it
_OPT_SUM.reduceOp = dist.ReduceOp(_SUM)
_COALESCED = dist.AllreduceCoalescedOptions()  # a riding all-reduce's options on Gloo: a sum
_COALESCED.reduceOp = dist.ReduceOp(_SUM)


def _allreduce_options(reduce_op: TorchOp) -> dist.AllreduceOptions:
    """The backend's options for ``reduce_op`` (built once per op)."""
    opts = _OPTIONS.get(reduce_op)
    if opts is None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(reduce_op)
        _OPTIONS[reduce_op] = opts
    return opts


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, op: str = "sum") -> torch.Tensor:
    """Return the reduction of ``tensor`` across ``group`` in a fresh tensor."""
    return all_reduce_(tensor.clone(memory_format=torch.contiguous_format), group, op)


def all_reduce_as(tensor: torch.Tensor, group: ProcessGroup | None, op: str,
                  name: str) -> torch.Tensor:
    """:func:`all_reduce` recorded, counted and shape-agreed as op ``all_reduce:<name>``.

    For a check that runs beside the model's own all-reduces (the optimizer-step
    check): its own op name keeps its agreed shape apart from theirs, so neither
    forces a store round trip on every call, and counts show it separately.
    """
    return all_reduce_(tensor.clone(memory_format=torch.contiguous_format), group, op,
                       f"all_reduce:{name}")


def all_gather(tensor: torch.Tensor, dim: int, group: ProcessGroup | None,
               size: int | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (fresh tensor).

    Args:
        tensor: This rank's shard.
        dim: The dimension the shards are joined along.
        group: The process group.
        size: Full size along ``dim`` when the shards follow the balanced split
            rule (:func:`torchtp.core.layouts.shard_sizes`) and may differ by one;
            ``None`` means equal shards. Uneven shards cost the same single
            collective: each is padded to the largest, gathered, then narrowed.
    """
    world = dist.get_world_size(group)
    dim = dim % tensor.dim()
    sizes = None if size is None else shard_sizes(size, world)
    pad = 0 if sizes is None else max(sizes) - tensor.shape[dim]
    local = tensor
    if pad:  # pad this shard to the largest so every rank sends the same shape
        widths = list(tensor.shape)
        widths[dim] = pad
        local = torch.cat([tensor, tensor.new_zeros(widths)], dim)
    local = local.contiguous()
    # Gather into (world * d0, ...) along dim 0, where collectives are contiguous.
    st = None if _compiling() or has_torch_function_unary(local) else _health.state(group)
    if st is not None and _riding(st, local):
        out = _all_gather_riding(local, group, st)
    else:
        out = torch.empty((world * local.shape[0], *local.shape[1:]), dtype=local.dtype,
                          device=local.device)
        n = enter("all_gather", local, group, st)
        work = gather_single(out, local, group=group, async_op=n is not None)
        leave(work, n, "all_gather", local, group, st, out)
    if dim == 0 and sizes is None:
        return out
    chunks = out.chunk(world, dim=0)
    if sizes is not None:
        chunks = tuple(c.narrow(dim, 0, n) for c, n in zip(chunks, sizes, strict=True))
    return torch.cat(chunks, dim=dim)


def reduce_scatter(tensor: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Sum ``tensor`` across ``group`` and return this rank's share along ``dim``.

    Shares follow the balanced split rule (:func:`torchtp.core.layouts.shard_sizes`);
    uneven ones cost the same single collective (each share padded to the largest).
    """
    world = dist.get_world_size(group)
    dim = dim % tensor.dim()
    sizes = shard_sizes(tensor.shape[dim], world)
    # Put the scattered dim first so each rank's share is contiguous.
    full = tensor.movedim(dim, 0) if dim else tensor
    if len(set(sizes)) > 1:
        step = max(sizes)
        padded = full.new_zeros((world * step, *full.shape[1:]))
        start = 0
        for i, share in enumerate(sizes):
            padded[i * step:i * step + share] = full[start:start + share]
            start += share
        full = padded
    full = full.contiguous()
    out = torch.empty((full.shape[0] // world, *full.shape[1:]), dtype=full.dtype,
                      device=full.device)
    n = enter("reduce_scatter", full, group)
    work = reduce_scatter_single(out, full, group=group, async_op=n is not None)
    leave(work, n, "reduce_scatter", full, group, out=out)
    out = out[:sizes[dist.get_rank(group)]]
    return out.movedim(0, dim).contiguous() if dim else out


def all_to_all(tensor: torch.Tensor, send: list[int], recv: list[int],
               group: ProcessGroup | None) -> torch.Tensor:
    """Send ``send[j]`` rows of ``tensor`` (dim 0, in order) to group rank ``j``; return the
    ``recv[j]`` rows received from each rank ``j``, concatenated in rank order (fresh tensor).

    The row counts differ from rank to rank (each rank's tokens for each other
    rank's experts), so what the ranks agree on is the row shape and dtype:
    the signature checked is that of a ``(group size, *row shape)`` tensor.
    The counts themselves must be consistent (``recv`` here is ``send[me]`` on
    every other rank); the caller exchanges and checks them first.
    """
    local = tensor.contiguous()
    out = local.new_empty((sum(recv), *local.shape[1:]))
    shown = torch.empty((len(send), *local.shape[1:]), dtype=local.dtype, device="meta")
    n = enter("all_to_all", shown, group, counted=local)  # counted with the rows this rank sends
    work = dist.all_to_all_single(out, local, output_split_sizes=recv, input_split_sizes=send,
                                  group=group, async_op=n is not None)
    leave(work, n, "all_to_all", local, group, out=out, shown=shown)
    return out


def ring_shift(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Send ``tensor`` to the next rank of ``group`` and return the previous rank's (fresh tensor).

    Group rank ``r`` sends to ``(r + 1) % size`` and receives from
    ``(r - 1) % size``: one step of a ring (ring attention's key/value
    blocks). It is one :func:`all_to_all` in which each rank sends its one row
    to the next rank only, so it gets that collective's shape agreement and
    bounded wait; every rank's ``tensor`` has the same shape and dtype.
    """
    world, me = dist.get_world_size(group), dist.get_rank(group)
    send, recv = [0] * world, [0] * world
    send[(me + 1) % world] = recv[(me - 1) % world] = 1
    return all_to_all(tensor.unsqueeze(0), send, recv, group)[0]


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None) -> torch.Tensor:
    """Return ``src``'s ``tensor`` on every rank (fresh tensor; ``src`` is a group rank)."""
    out = tensor.clone(memory_format=torch.contiguous_format)
    n = enter("broadcast", out, group)
    global_src = src if group is None else dist.get_global_rank(group, src)
    work = dist.broadcast(out, src=global_src, group=group, async_op=n is not None)
    leave(work, n, "broadcast", out, group)
    return out


def split(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """Return rank ``rank``'s share of ``tensor`` along ``dim`` (balanced split rule).

    The result is contiguous; it is a view (no copy) when the share already is,
    which autograd handles, so no caller ever writes into it.
    """
    return cut(tensor, dim, (shard_range(tensor.shape[dim], size, rank),)).contiguous()
