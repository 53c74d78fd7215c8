"""Keep every rank of a group in step: shape agreement, failures and deaths.

A collective that one rank never enters blocks the others inside Gloo/NCCL
until the group's timeout, and a collective entered with different shapes
returns garbage (equal element counts) or aborts the process (different
counts). torchtp therefore talks through the group's *store* (the rendezvous
key-value store, reachable without the group's collectives) whenever ranks may
disagree:

* **Shape agreement.** Before a collective whose shape or dtype differs from
  the one the group last agreed on for that op *after the same previous
  collectives* (so the first of each, and every shape change; every call
  under ``TP_CHECK_SHAPES=1``), the rank posts
  the collective's signature and waits for every rank's. A rank whose shape
  did *not* change is then blocked inside its own collective; while blocked it
  polls the store, sees the request and answers with its signature, so every
  rank raises :class:`RankMismatchError`, even though only some ranks decided
  to check.
* **Failures.** A rank-local error raised just before a collective (a wrong
  input on one rank) is posted; ranks blocked in that collective see it
  within :data:`POLL_S` and raise :class:`InconsistentGroupError` naming the
  rank. If every rank failed at the same point the group is still in step and
  nobody is poisoned; otherwise the group is *poisoned* on every rank: every
  later torchtp collective raises at once instead of computing on misaligned
  collectives.
* **Errors escaping a forward or backward.** An exception that leaves a
  wrapped model's forward on one rank (raised in user code between two
  parallel layers, after some collectives ran) is reported like a failure
  (:mod:`torchtp.guards.forward_guard`); so is a backward through the model that raised on
  this rank, at the model's next forward. A user who catches it and goes on
  with the next batch then gets :class:`InconsistentGroupError` on every rank
  instead of outputs computed on misaligned collectives.
* **Deaths and exits.** A rank dying on an exception posts it (the
  ``sys.excepthook`` of :func:`protect_exit`), so the others' error names it;
  at exit torchtp lets the backend release its collectives first.

Store keys are per collective index ``n`` (the count of torchtp collectives
issued on the group, identical on every rank that is in step).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..core import log as _logging
from ..core import torch_compat as _torch_compat
from ..core.errors import InconsistentGroupError, RankMismatchError
from .group_ref import destroyed
from .timeout import collective_timeout

ProcessGroup = dist.ProcessGroup

# How long a blocked collective waits before it looks at the store. Only a
# collective that is already slow pays the store round trip.
POLL_S = 0.2
_POLL = timedelta(seconds=POLL_S)
_FAILURES = "torchtp/failures"
# The exit barrier's bound after an entry barrier gave up (see entry_barrier).
AFTER_MISSED_S = 2.0
# The name the optimizer-step check's all-reduce is agreed under (guards/step_check.py): a
# rank whose step was skipped meets the others' check with another collective
STEP_CHECK = "step_check"
# Set on an exception once every rank that must hear of it was told (or
# raises it too), so an enclosing forward does not report it again.
REPORTED = "_torchtp_reported"


@dataclass
class GroupState:
    """torchtp's view of one process group on this rank.

    Lives exactly as long as its group: it holds the group weakly (``ref``,
    :mod:`torchtp.comm.group_ref`), and the group's death removes it from
    :data:`_STATES`, so a destroyed group takes its state (store, held tensors,
    waiting rides) with it.
    """

    rank: int
    size: int
    ref: weakref.ref[ProcessGroup]  # the group, held weakly
    # CPU tensors go to Gloo (alone, or as "cpu:gloo" beside another backend), which
    # sums a list of tensors in one collective (the riding all-reduce's fast path)
    cpu_gloo: bool = False
    seq: int = 0  # index of the next torchtp collective
    # (op, values riding, context) -> the signature last agreed there; the context sums
    # up the previous collectives (see _advance)
    agreed: dict[tuple[str, int, Any], tuple[torch.Size, torch.dtype]] = field(
        default_factory=dict)
    # The last collectives as runs of equal signatures (see _advance): the finished
    # runs as ((op, shape, dtype), count), the current one's signature and count, and
    # the count of the last finished run with the current one's signature (0: none).
    runs: tuple[tuple[Any, int], ...] = ()
    current: Any = None
    count: int = 0
    earlier: int = 0
    context: tuple[Any, ...] = ((), 0, False)  # what the next collective's memory is keyed by
    agreements: int = 0  # signatures agreed through the store (each a store round trip)
    # Collectives whose signature this rank checked through the store and whose key it
    # has not deleted yet (deleted once every rank is known to have read it).
    checks: list[int] = field(default_factory=list)
    completed: int = -1  # highest index of a collective this rank has waited for
    poisoned: str | None = None
    entries: dict[str, int] = field(default_factory=dict)  # entry_barrier calls per name
    missed_entry: bool = False  # the last entry_barrier gave up (see exit_barrier)
    failures: list[tuple[int, int, str, str]] = field(default_factory=list)  # read so far
    backward_open: bool = False  # a backward through a wrapped model started, not yet finished
    # Tensors of finished CPU collectives that Gloo's worker may still hold,
    # with the first one's use count while the work was alive (see _hold).
    held: collections.deque[tuple[tuple[torch.Tensor, ...], int]] = field(
        default_factory=lambda: collections.deque(maxlen=HELD))
    # Values waiting to travel with the group's next all-reduce or all-gather, in
    # order (torchtp.comm.ops.Ride: the input check's hash bits, an MoE route check)
    rides: list[Any] = field(default_factory=list)
    _store: Any = None

    @property
    def group(self) -> ProcessGroup:
        """The group (raises :class:`~torchtp.core.errors.GroupDestroyedError` once destroyed)."""
        group = self.ref()
        if group is None:
            raise destroyed("torchtp's state of a process group")
        return group

    @property
    def store(self) -> Any:
        """The group's key-value store (created lazily; only slow paths use it)."""
        if self._store is None:
            self._store = self.group.get_group_store()
        return self._store


# Tensors of the last collectives held until Gloo's worker let go of them (see _hold)
HELD = 64
# id(group) -> its state; an entry leaves when its group dies (GroupState.ref's
# callback), so an id is never mistaken for a later group's.
_STATES: dict[int, GroupState] = {}


def state(group: ProcessGroup | None) -> GroupState:
    """Return (creating it on first use) the state of ``group`` (``None``: the default group)."""
    pg = dist.group.WORLD if group is None else group
    st = _STATES.get(id(pg))
    return st if st is not None else _new_state(pg)


def _new_state(pg: ProcessGroup | None) -> GroupState:
    assert pg is not None, "a collective needs a process group"
    key = id(pg)
    backend = str(dist.get_backend(pg))
    st = GroupState(dist.get_rank(pg), dist.get_world_size(pg),
                    weakref.ref(pg, lambda _ref: _forget(key)),
                    cpu_gloo=backend == "gloo" or "cpu:gloo" in backend)
    _STATES[key] = st
    # First use of this group by torchtp, whoever started it: from here on
    # torchtp's collectives hold tensors that must be released before exit.
    protect_exit()
    return st


def _forget(key: int) -> None:
    """The group of ``_STATES[key]`` died: its state lets go of what it kept for it (a
    layer or hook may still hold the state itself)."""
    st = _STATES.pop(key, None)
    if st is not None:
        st._store = None
        st.held.clear()
        st.rides.clear()


def forget_all() -> None:
    """Drop every group's state (the groups were destroyed)."""
    _STATES.clear()


def poisoned_groups() -> list[GroupState]:
    """The groups this rank knows to be out of step."""
    return [st for st in _STATES.values() if st.poisoned is not None]


def inconsistent(rank: int, what: str) -> str:
    """The message every later collective of a poisoned group raises."""
    return (f"a previous error on rank {rank} left the tensor-parallel group inconsistent "
            f"({what}); the ranks' collectives no longer line up, so nothing more can be "
            "computed in this group: fix the cause and restart every rank")


def raise_if_poisoned(st: GroupState) -> None:
    """Raise :class:`InconsistentGroupError` if the group is poisoned."""
    if st.poisoned is not None:
        raise InconsistentGroupError(st.poisoned)


def before(op: str, tensor: torch.Tensor, st: GroupState, riding: int = 0) -> int:
    """Run before every torchtp collective; returns its index.

    Raises if the group is poisoned, and agrees on the signature when it
    differs from the last one agreed for ``op`` (or always, under
    ``TP_CHECK_SHAPES=1``). ``riding``: values of torchtp's checks travelling
    in the same collective (:func:`torchtp.comm.ops.ride_next_collective`), part
    of the signature, so ranks that disagree on them raise instead of mixing them.
    """
    if st.poisoned is not None:
        raise InconsistentGroupError(st.poisoned)
    n = st.seq
    st.seq = n + 1
    # Remembered per (op, context of the previous collectives): ranks in step so far
    # passed the same previous signatures (agreed, or equal to agreed ones), so they
    # all consult the same memory, and a rank whose shape differs from it checks while
    # the others answer from inside their collective. Nothing rank-local may enter the
    # key (not even forward vs backward: ranks on different code paths are what this
    # catches), and each key remembers one signature, so two ranks with different
    # shapes can never both skip.
    # The values riding are keyed like the op (a collective that carries them and one
    # that does not each have their memory), and left out of the context.
    key = (op, riding, st.context)
    agreed = st.agreed.get(key)
    if _logging.CHECK_SHAPES or agreed is None or agreed[0] != tensor.shape \
            or agreed[1] != tensor.dtype:
        _agree_signature(st, n, op, tensor, riding)
        st.agreements += 1
        if len(st.agreed) >= _MEMORY:  # shapes that vary step to step: start afresh
            st.agreed.clear()
        st.agreed[key] = (tensor.shape, tensor.dtype)
    _advance(st, (op, tensor.shape, tensor.dtype))
    return n


_MEMORY = 512  # remembered signatures per group
_CONTEXT = 3  # runs of the history (and the first counts of the last one) in the key
_RUNS = 4  # runs kept: the key's, and one more to find where the current signature ran before


def _advance(st: GroupState, sig: tuple[str, torch.Size, torch.dtype]) -> None:
    """Add collective ``sig`` to the history and set the next collective's context.

    The context is the signatures of the last :data:`_CONTEXT` runs of equal
    signatures, the current run's length up to :data:`_CONTEXT`, and whether
    that run is as long as the last earlier run of the same signature. The
    flag tells the end of a run from its middle: a model whose forwards
    alternate shapes (prefill ``(1, 128, H)`` then decode ``(1, 1, H)``, 8
    all-reduces each) meets the context "3 prefill all-reduces before" both
    inside the prefill and at the decode's first all-reduce; keyed by that
    alone, the memory would flip twice per pair of forwards, a store round trip
    each. A model alternating single collectives (an MoE layer's ``(N, H)``
    all-reduce between the attention's ``(B, T, H)`` ones) is remembered too.
    Everything here comes from the group's own collectives, the same on every
    rank in step.
    """
    if sig == st.current:
        st.count += 1
        if st.count > _CONTEXT and st.count != st.earlier:
            return  # neither a counted length nor the earlier run's reached: same context
    else:
        if st.current is not None:
            st.runs = (*st.runs[2 - _RUNS:], (st.current, st.count))
        st.earlier = next((c for s, c in reversed(st.runs) if s == sig), 0)
        st.current, st.count = sig, 1
    sigs = (*(s for s, _ in st.runs[1 - _CONTEXT:]), st.current)
    st.context = (sigs, min(st.count, _CONTEXT), 0 < st.earlier <= st.count)


def _signature(op: str, tensor: torch.Tensor, riding: int = 0) -> str:
    if riding:
        return repr((op, tuple(tensor.shape), str(tensor.dtype), f"+{riding} check values"))
    return repr((op, tuple(tensor.shape), str(tensor.dtype)))


def _agree_signature(st: GroupState, n: int, op: str, tensor: torch.Tensor,
                     riding: int) -> None:
    store = st.store
    mine = _signature(op, tensor, riding)
    store.set(f"torchtp/sig/{n}/{st.rank}", "check " + mine)
    if st.checks:
        # Everyone has read the keys of the checks up to the last collective this rank
        # completed: every rank issued it, after finishing its checks before it. (With
        # collectives started without waiting, ops.Pending, a check's collective may
        # still be in flight at the next check: its key stays until it completed.)
        kept = []
        for m in st.checks:
            if m <= st.completed:
                _delete(store, f"torchtp/sig/{m}/{st.rank}")
            else:
                kept.append(m)
        st.checks = kept
    values = _gather(st, "sig", n, checking=True)
    _compare_signatures(st, n, op, values, dangling=False)
    st.checks.append(n)


def _compare_signatures(st: GroupState, n: int, op: str, values: list[str],
                        dangling: bool) -> None:
    sigs = [v.split(" ", 1)[1] for v in values]
    if all(s == sigs[0] for s in sigs):
        return
    # A rank that answered from inside its collective has an operation in flight
    # that will never be matched: the group cannot be used any more.
    if dangling or any(v.startswith("blocked ") for v in values):
        st.poisoned = inconsistent(st.rank, f"ranks passed different tensors to collective {n}")
    raise RankMismatchError(
        f"ranks passed different tensors to {op}: "
        + ", ".join(f"rank {r}: {s}" for r, s in enumerate(sigs))
        + f" (torchtp collective {n} of this group); " + _likely_cause(sigs))


def _likely_cause(sigs: list[str]) -> str:
    """What makes ranks issue different collectives: an optimizer step some ranks skipped
    (the optimizer-step check's collective meets another), or different models or inputs."""
    if 0 < sum(f"all_reduce:{STEP_CHECK}" in s for s in sigs) < len(sigs):
        return ("an optimizer step ran on some ranks only: torch.amp.GradScaler skips "
                "optimizer.step() on a rank whose own shards' gradients are not finite; use "
                "torchtp.GradScaler, which skips on every rank together")
    return ("every rank of a tensor-parallel group must run the same model on inputs of the "
            "same shape and dtype")


def _gather(st: GroupState, kind: str, n: int, checking: bool = False) -> list[str]:
    """Wait (bounded) until every rank posted ``torchtp/{kind}/{n}/{rank}``; return the values.

    ``checking``: this rank is agreeing on the signature of collective ``n``,
    so another rank's failure at ``n`` means it skips ``n`` with that rank.
    """
    keys = [f"torchtp/{kind}/{n}/{r}" for r in range(st.size)]
    deadline = time.monotonic() + collective_timeout()
    while True:
        try:
            st.store.wait(keys, _POLL)
            break
        except RuntimeError:  # DistStoreError: not all there yet
            _check_failures(st, n, checking)
            if time.monotonic() > deadline:
                missing = [r for r, k in enumerate(keys) if not st.store.check([k])]
                st.poisoned = inconsistent(st.rank, f"ranks {missing} never reached "
                                           f"torchtp collective {n}")
                raise InconsistentGroupError(
                    f"rank {st.rank}: ranks {missing} did not reach torchtp collective {n} of "
                    f"the tensor-parallel group within {collective_timeout():.0f} s (the "
                    "collective timeout, TP_TIMEOUT); they are stuck, dead or took another "
                    "code path") from None
    return [st.store.get(k).decode() for k in keys]


def _failure_records(st: GroupState) -> list[tuple[int, int, str, str]]:
    """Every posted ``(rank, collective index, kind, message)``, oldest first.

    Records already read are kept on the state, so each poll reads only new ones.
    """
    count = st.store.add(_FAILURES, 0)
    while len(st.failures) < count:
        key = f"torchtp/failure/{len(st.failures) + 1}"
        if not st.store.check([key]):
            break  # counted but not written yet: next poll
        rank, n, kind, msg = st.store.get(key).decode().split("|", 3)
        st.failures.append((int(rank), int(n), kind, msg))
    return st.failures


def _check_failures(st: GroupState, n: int, checking: bool) -> None:
    for rank, m, kind, msg in _failure_records(st):
        if rank == st.rank:
            continue
        if kind in ("died", "exit"):
            st.poisoned = inconsistent(rank, f"rank {rank} exited with {msg}" if kind == "died"
                                       else f"rank {rank} reached the end of its program")
            raise InconsistentGroupError(st.poisoned)
        if checking and m == n:
            # That rank raised instead of collective n; so does this one.
            _skip_together(st, n, f"rank {rank} raised {msg}")
            err = RuntimeError(f"rank {rank} of the tensor-parallel group raised {msg} (rank "
                               f"{st.rank} stops at the same collective)")
            setattr(err, REPORTED, True)
            raise err


def _skip_together(st: GroupState, n: int, what: str) -> None:
    """This rank skips collective ``n``; poison the group unless every rank skipped it."""
    st.store.set(f"torchtp/ack/{n}/{st.rank}", "skipped")
    acks = _gather(st, "ack", n)
    if any(a != "skipped" for a in acks):
        st.poisoned = inconsistent(st.rank, what)


def post(st: GroupState, n: int, kind: str, message: str) -> None:
    """Append a failure record for the other ranks to find."""
    i = st.store.add(_FAILURES, 1)
    st.store.set(f"torchtp/failure/{i}", f"{st.rank}|{n}|{kind}|{message}")


def fail(group: ProcessGroup | None, error: BaseException) -> BaseException:
    """Tell the other ranks that this rank raises ``error`` instead of its next collective.

    Waits (bounded) for every rank to say whether it also skipped that
    collective. If all did (the same error on every rank), the group is still
    in step; otherwise it is poisoned here, and the ranks blocked in that
    collective raise :class:`InconsistentGroupError` naming this rank.

    Returns:
        ``error``, for ``raise fail(group, err)``.
    """
    setattr(error, REPORTED, True)
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return error
    st = state(group)
    if st.poisoned is not None:
        return error
    n = st.seq
    st.seq = n + 1
    what = f"{type(error).__name__}: {error}"
    post(st, n, "fail", what)
    _skip_together(st, n, what)
    return error


def finish(work: Any, st: GroupState, n: int, op: str, tensor: torch.Tensor,
           out: torch.Tensor | None = None, shown: torch.Tensor | None = None,
           riding: int = 0) -> None:
    """Wait for collective ``n``; while it is slow, answer the store and watch for failures.

    ``out``: the collective's output when it is not ``tensor``. ``shown``: the
    tensor whose signature was agreed, when ``tensor`` carries more values
    (:func:`torchtp.comm.ops.ride_next_collective`).
    """
    if tensor.device.type != "cpu":
        # NCCL's wait only orders streams; its own watchdog bounds the time.
        _wait_converting(work, st, n)
        _completed(st, n, op)
        return
    try:
        while not _waited(work, st, n):
            _answer_store(st, n, op, tensor if shown is None else shown, work, riding)
        if n > st.completed and op not in _ROOTED:  # _completed, inline: every collective
            st.completed = n
    finally:
        # Also when this rank raises instead (a handled RankMismatchError, another
        # rank's failure): the collective is still in the backend's hands. Inline
        # _hold: this runs on every collective.
        st.held.append(((tensor,) if out is None else (tensor, out), _use_count(tensor)))


# Collectives a rank may finish before every other rank issued them: a broadcast's
# source, or a rank the source already served, is done while a late rank may still
# be reading the broadcast's shape agreement.
_ROOTED = ("broadcast",)


def _completed(st: GroupState, n: int, op: str) -> None:
    """Note collective ``n`` as done where that proves every rank issued it.

    :func:`_agree_signature` deletes this rank's agreement keys up to
    ``st.completed``, which is safe only when every rank has read them, that
    is, issued the collective. A rooted collective proves nothing about the
    other ranks, so it does not move the mark.
    """
    if op not in _ROOTED:
        st.completed = max(st.completed, n)


def wait_and_hold(work: Any, st: GroupState, tensors: tuple[torch.Tensor, ...],
                  what: str) -> None:
    """Wait for a collective torchtp issued outside :func:`finish`; hold its CPU tensors.

    Raises:
        InconsistentGroupError: the collective failed (see :func:`raise_converted`).
    """
    try:
        work.wait()
    except RuntimeError as err:
        raise_converted(st, what, err)
    finally:
        if tensors[0].device.type == "cpu":
            _hold(st, tensors)


def _hold(st: GroupState, tensors: tuple[torch.Tensor, ...]) -> None:
    """Keep the tensors of a finished collective alive until Gloo's worker thread lets go of it.

    Gloo's worker drops its reference to a finished collective a moment after
    the waiter returns (later on a loaded machine). When that is the last
    reference to a tensor whose Python object is already gone, the worker must
    take the GIL to free it, and during interpreter shutdown taking the GIL
    ends the thread inside a C++ destructor: the process aborts with
    "terminate called without an active exception" after all its work is
    done. While torchtp holds the Python tensors, the worker's release frees
    nothing Python-owned; :func:`settle` waits for the releases at exit.
    Called with ``work`` still alive, so the use count includes its references.
    The last :data:`HELD` collectives are held (a deque: no scan per collective);
    Gloo's worker lets go of a collective microseconds after it completes, long
    before 64 more have run.
    """
    st.held.append((tensors, _use_count(tensors[0])))


_use_count = _torch_compat.use_count


def _lent(held: tuple[tuple[torch.Tensor, ...], int]) -> bool:
    """Whether the collective of ``held`` still exists (its tensors are still referenced by it).

    A count of 1 while it existed is the Python object's alone: the backend worked on
    views or copies of the tensor (Gloo's reduce-scatter splits its input into views),
    so no release of it can come, and none needs the GIL.
    """
    return held[1] > 1 and _use_count(held[0][0]) >= held[1]


def settle(timeout: float, warn: bool = True) -> bool:
    """Wait (at most ``timeout`` s) until the backend released every collective torchtp ran.

    Runs at exit before the interpreter shuts down (see :func:`_hold`).
    ``warn=False`` (exiting on an error, where a collective this rank left by
    raising may never be released) logs a timeout at debug level only, so the
    error stays the last thing the rank printed.

    Returns:
        True when every worker let go in time.
    """
    deadline = time.monotonic() + timeout
    for st in list(_STATES.values()):
        while True:
            kept = [h for h in st.held if _lent(h)]
            st.held.clear()
            st.held.extend(kept)
            if not kept:
                break
            if time.monotonic() > deadline:
                log = _logging.logger.warning if warn else _logging.logger.debug
                log("rank %d: a collective of the backend was not released within %.1f s of "
                    "exit", st.rank, timeout)
                return False
            time.sleep(0.001)
    return True


def _waited(work: Any, st: GroupState, n: int) -> bool:
    """Wait up to :data:`POLL_S` for ``work``; True when it completed."""
    try:
        work.wait(_POLL)
        return True
    except RuntimeError:
        if not work.is_completed():
            return False  # merely slow
    # It completed after the timed-out wait gave up (a race a loaded machine widens):
    # an untimed wait now returns at once, and raises only if the collective failed.
    try:
        work.wait()
    except RuntimeError as err:
        raise_converted(st, f"collective {n}", err)
    return True


def _waited_grace(work: Any, st: GroupState, n: int, seconds: float = 1.0) -> bool:
    """Give ``work`` ``seconds`` more: a rank that has left may have sent its last data."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _waited(work, st, n):
            return True
    return False


def _wait_converting(work: Any, st: GroupState, n: int) -> None:
    try:
        work.wait()
    except RuntimeError as err:
        raise_converted(st, f"collective {n}", err)


def _answer_store(st: GroupState, n: int, op: str, tensor: torch.Tensor, work: Any,
                  riding: int = 0) -> None:
    """(Blocked in collective ``n``) react to another rank's failure, exit or shape check."""
    for rank, m, kind, msg in _failure_records(st):
        if kind == "exit" and rank != st.rank and not _waited_grace(work, st, n):
            st.poisoned = inconsistent(rank, f"rank {rank} reached the end of its program "
                                       f"(or called sys.exit) while this rank waits in "
                                       f"torchtp collective {n}")
            raise InconsistentGroupError(st.poisoned)
        if rank != st.rank and (kind == "died" or (kind == "fail" and m >= n)):
            if kind == "fail":
                st.store.set(f"torchtp/ack/{m}/{st.rank}", "in flight")
            st.poisoned = inconsistent(rank, f"rank {rank} raised {msg}" if kind == "fail"
                                       else f"rank {rank} exited with {msg}")
            raise InconsistentGroupError(st.poisoned)
    requested = any(st.store.check([f"torchtp/sig/{n}/{r}"])
                    for r in range(st.size) if r != st.rank)
    if requested:
        st.store.set(f"torchtp/sig/{n}/{st.rank}", "blocked " + _signature(op, tensor, riding))
        _compare_signatures(st, n, op, _gather(st, "sig", n), dangling=True)


def raise_converted(st: GroupState, what: str, err: RuntimeError) -> None:
    """``what`` failed inside torch: poison the group and raise, naming the rank that caused it.

    Raises:
        InconsistentGroupError: always.
    """
    try:
        records = [r for r in _failure_records(st) if r[0] != st.rank]
    except RuntimeError:  # the store itself is gone (its host rank died)
        records = []
    if records:
        # The newest death, else the newest failure, is the likeliest cause.
        rank, _m, kind, msg = next((r for r in reversed(records) if r[2] == "died"), records[-1])
        cause = f"rank {rank} raised {msg}" if kind == "fail" else f"rank {rank} exited with {msg}"
        st.poisoned = inconsistent(rank, cause)
    else:
        st.poisoned = (f"{what} of the tensor-parallel group failed on rank {st.rank} "
                       f"and no rank reported why (a rank was killed, or it timed out after "
                       f"TP_TIMEOUT={collective_timeout():.0f} s): {err}")
    raise InconsistentGroupError(st.poisoned) from err


def _delete(store: Any, key: str) -> None:
    # Stores without deletion (rare) keep the small key.
    with contextlib.suppress(RuntimeError):
        store.delete_key(key)


def known_groups() -> list[GroupState]:
    """Every group this rank has run a torchtp collective on, plus the default group."""
    if dist.is_initialized():
        state(None)
    return list(_STATES.values())


def exit_barrier(group: ProcessGroup | None, timeout: float) -> bool:
    """Wait until every rank of ``group`` arrives here, at most ``timeout`` seconds.

    Gives up early when a rank posted that it died or that it stopped waiting
    here (so a timeout is never paid twice), or when the store is gone (its
    host, rank 0, has exited), and waits at most :data:`AFTER_MISSED_S` after
    an entry barrier gave up. Uses the store, not a collective, so a rank that
    never comes cannot block this one past the bound.

    Returns:
        True when every rank arrived.
    """
    st = state(group)
    if any(other.missed_entry for other in _STATES.values()):
        timeout = min(timeout, AFTER_MISSED_S)
    try:
        return _exit_barrier(st, timeout)
    except RuntimeError:  # DistStoreError: the store's host (rank 0) has exited
        _logging.logger.debug("rank %d: the store is gone at exit", st.rank, exc_info=True)
        return False


def _exit_barrier(st: GroupState, timeout: float) -> bool:
    # Ranks still waiting in a collective learn that this one will never enter it.
    post(st, st.seq, "exit", "normal exit")
    st.store.add("torchtp/exit", 1)
    deadline = time.monotonic() + timeout
    delay = 0.001
    while st.store.add("torchtp/exit", 0) < st.size:
        gone = any(kind in ("died", "left") for _r, _n, kind, _m in _failure_records(st))
        if gone or time.monotonic() > deadline:
            if not gone:  # later ranks stop at once instead of waiting their own timeout
                post(st, st.seq, "left", "stopped waiting at exit")
            _logging.logger.warning(
                "rank %d: not every rank reached the end of the program within %.0f s "
                "(or one died); exiting without waiting for them", st.rank, timeout)
            return False
        time.sleep(delay)
        delay = min(2 * delay, 0.05)
    return True


def entry_barrier(group: ProcessGroup | None, name: str, timeout: float) -> str | None:
    """Wait until every rank of ``group`` enters ``name``, at most ``timeout`` seconds.

    Ranks meet at the k-th *successful* entry of ``name``: a rank that gives up
    withdraws its arrival, so a call made on a subset of the ranks does not
    shift the later calls that every rank makes. It gives up early when a
    missing rank posted that it exited, died or raised at or after this point
    (it will never come). Until an entry barrier completes again, the exit
    barrier waits at most :data:`AFTER_MISSED_S` (the missing ranks may be
    blocked in a collective this rank never enters: no second timeout).

    Returns:
        ``None`` when every rank arrived, else which ranks did not and why.
    """
    st = state(group)
    done = st.entries.get(name, 0)
    key = f"torchtp/enter/{name}/{done}"
    st.store.set(f"{key}/{st.rank}", "1")
    count = st.store.add(key, 1)
    deadline = time.monotonic() + timeout
    delay = 0.001
    gone: str | None = None
    while count < st.size and time.monotonic() < deadline and gone is None:
        time.sleep(delay)
        delay = min(2 * delay, 0.05)
        count = st.store.add(key, 0)
        gone = _gone(st, key) if count < st.size else None
    if count >= st.size:
        st.entries[name] = done + 1
        st.missed_entry = False
        return None
    st.store.add(key, -1)
    _delete(st.store, f"{key}/{st.rank}")
    missing = [r for r in range(st.size)
               if r != st.rank and not st.store.check([f"{key}/{r}"])]
    st.missed_entry = True
    why = f"will never arrive {gone}" if gone else f"did not arrive within {timeout:.0f} s"
    return f"ranks {missing} {why}"


def _gone(st: GroupState, key: str) -> str | None:
    """Why a rank missing from ``key`` will never arrive (it exited, died or raised), if it posted."""
    for rank, m, kind, msg in _failure_records(st):
        if rank == st.rank or st.store.check([f"{key}/{rank}"]):
            continue
        if kind in ("exit", "died") or (kind == "fail" and m >= st.seq):
            return (f"(rank {rank} reached the end of its program)" if kind == "exit"
                    else f"(rank {rank} {'exited with' if kind == 'died' else 'raised'} {msg})")
    return None


# Exit protection (docs/decisions.md row 76): installed at torchtp's first use
# of any group (:func:`state`) or by ``init_tensor_parallel``, never at import.
SETTLE_S = 5.0  # at most this long at exit for the backend to release finished collectives
_EXIT_PROTECTED = False  # _at_exit and the excepthook are installed
_DYING: str | None = None  # "ExcType: message" once the process exits on an exception
_END: Callable[[], None] | None = None  # ends the group torchtp started (at exit)


def protect_exit() -> None:
    """Install torchtp's exit handling in this process, once.

    Called on torchtp's first use of any process group (its first collective
    or agreement) and by ``init_tensor_parallel``, so groups started with
    ``dist.init_process_group`` (Trainer, accelerate, Lightning) are covered
    too. Process-wide, installed at first use, never at import: an ``atexit``
    handler (:func:`_at_exit`) and a ``sys.excepthook`` that chains to the
    previous one and tells the other ranks when this one dies on an exception.
    """
    global _EXIT_PROTECTED
    if _EXIT_PROTECTED:
        return
    _EXIT_PROTECTED = True
    atexit.register(_at_exit)
    _install_excepthook()


def end_at_exit(end: Callable[[], None]) -> None:
    """torchtp started the default group: at exit call ``end`` (which ends it), then protect."""
    global _END
    _END = end
    protect_exit()


def dying() -> str | None:
    """``"ExcType: message"`` once this process exits on an exception, else ``None``."""
    return _DYING


def _at_exit() -> None:
    """Before the interpreter shuts down: let the backend release torchtp's collectives.

    A group torchtp started is ended by the function given to
    :func:`end_at_exit` (``shutdown_tensor_parallel``). For a group the user
    started (and maybe destroyed) torchtp only waits until Gloo's workers
    released every collective torchtp ran (bounded; see :func:`_hold`) and then
    drops its references to the groups, so a destroyed group's threads are
    joined while the interpreter is still whole.
    """
    if _END is not None:
        _END()
    else:
        release_collectives()


def release_collectives() -> None:
    """Wait (bounded) until the backend let go of torchtp's collectives, then forget the groups."""
    failing = _DYING is not None or bool(poisoned_groups())
    # A collective left in flight by a failure may never be released: wait briefly
    # (the exit code is non-zero either way).
    if settle(0.5 if failing else SETTLE_S, warn=not failing):
        forget_all()


def _install_excepthook() -> None:
    previous = sys.excepthook
    if getattr(previous, "_torchtp", False):
        return

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        global _DYING
        _DYING = f"{exc_type.__name__}: {exc}"
        _announce_death(_DYING)
        previous(exc_type, exc, tb)

    hook._torchtp = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _announce_death(message: str) -> None:
    """Post ``message`` for the other ranks, giving up after 2 s (the store may be gone)."""

    def post_all() -> None:
        try:
            for st in known_groups():
                post(st, st.seq, "died", message.replace("|", "/"))
        except Exception:  # the store died with its host rank: nobody is left to tell
            _logging.logger.debug("could not post this rank's failure", exc_info=True)

    thread = threading.Thread(target=post_all, daemon=True)
    thread.start()
    thread.join(2.0)
