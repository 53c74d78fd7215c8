"""Report an error that escapes a wrapped model's forward or backward on one rank.

An exception raised on some ranks only between two collectives of a forward
leaves the ranks' collective sequences misaligned: if the user catches it and
goes on, every later collective pairs with the wrong one. The forward door
(:mod:`torchtp.guards.forward_door`) calls :func:`report_escaped` for one that
left a forward of the model it guards, which reports it like
:func:`torchtp.comm.health.fail` (the group stays usable if every rank raised at
the same point, else it is poisoned on every rank), however the model is
called: through the wrapper, or directly (``TensorParallelTrainer`` and
HF's ``generate`` call the HF model itself). A backward through the model's
outputs that raised on this rank (:func:`watch_backward`) is reported the same
way at its next forward (:func:`report_failed_backward`). Torch runs no hook
for a ``BaseException`` such as ``KeyboardInterrupt``: the wrapper's forward
reports those with :func:`report_interrupted`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..comm.health import REPORTED, GroupState, fail, inconsistent, post, state
from ..comm.runtime import ProcessGroup
from ..core import log as _logging
from ..core import torch_compat as _torch_compat
from ..core.errors import InconsistentGroupError, RankMismatchError


def report_interrupted(group: ProcessGroup | None, err: BaseException) -> None:
    """Report a ``BaseException`` (``KeyboardInterrupt``, ``SystemExit``) that left a forward.

    The forward door's hooks report ``Exception``s only; the wrapper's forward
    calls this for the rest. ``Exception``s are ignored here.
    """
    if isinstance(err, Exception) or not dist.is_initialized():
        return
    st = state(group)
    if st.size > 1:
        report_escaped(st, err)


def report_escaped(st: GroupState, err: BaseException) -> None:
    """Report ``err`` (escaping a forward on this rank) unless every rank already knows."""
    if st.poisoned is not None or getattr(err, REPORTED, False) \
            or isinstance(err, (RankMismatchError, InconsistentGroupError)):
        return  # raised on every rank at the same collective, or the group is poisoned
    setattr(err, REPORTED, True)
    what = f"{type(err).__name__}: {err}"
    if not isinstance(err, Exception):
        # KeyboardInterrupt, SystemExit: tell the others, but do not wait for them.
        post(st, st.seq, "fail", what.replace("|", "/"))
        st.poisoned = inconsistent(st.rank, f"rank {st.rank} raised {what} in a forward")
        return
    try:
        fail(st.group, err)
    except Exception:  # a rank died meanwhile: the group is poisoned; raise the user's error
        _logging.logger.debug("reporting an error that left a forward failed", exc_info=True)
        if st.poisoned is None:
            st.poisoned = inconsistent(st.rank, f"rank {st.rank} raised {what} in a forward")


def report_failed_backward(st: GroupState) -> None:
    """The last backward through a wrapped model raised on this rank: report it, then raise.

    Raises:
        InconsistentGroupError: the other ranks' backward did not fail at the
            same point (or the group was poisoned already).
    """
    st.backward_open = False
    if st.poisoned is None:
        err = RuntimeError("the backward through the tensor-parallel model raised on rank "
                           f"{st.rank} and was abandoned")
        try:
            fail(st.group, err)
        except Exception:  # a rank died meanwhile
            st.poisoned = st.poisoned or inconsistent(st.rank, str(err))
        if st.poisoned is None:
            return  # every rank's backward raised at the same point: still in step
    raise InconsistentGroupError(st.poisoned)


def watch_backward(st: GroupState, out: Any) -> None:
    """Mark a backward through ``out`` as open until it completes (hooks on the grad_fns)."""

    def finished() -> None:
        st.backward_open = False

    def started() -> None:
        st.backward_open = True

    after_backward(out, finished, started)


def after_backward(out: Any, finished: Callable[[], None],
                   started: Callable[[], None] | None = None) -> bool:
    """Call ``finished`` at the end of each backward pass through ``out`` that succeeds.

    ``out``: a forward's output (a tensor, a tuple or list, or a mapping such as
    HF's ``ModelOutput``). ``started`` runs when such a backward reaches ``out``.
    Hooks on the outputs' ``grad_fn`` nodes; the end is the autograd engine's own
    (:func:`torchtp.core.torch_compat.at_end_of_backward`), so callbacks queued
    first run first.

    Returns:
        Whether any output has a ``grad_fn`` (else no backward can reach it).
    """
    active = [False]

    def done() -> None:
        active[0] = False
        finished()

    def begin(_grads: Any) -> None:
        if not active[0]:  # once per backward pass, whichever output it reaches first
            active[0] = True
            if started is not None:
                started()
            _torch_compat.at_end_of_backward(done)

    values = out.values() if isinstance(out, Mapping) else out \
        if isinstance(out, (tuple, list)) else (out,)
    nodes = [node for value in values if isinstance(value, torch.Tensor)
             and (node := value.grad_fn) is not None]
    for node in nodes:
        node.register_prehook(begin)
    return bool(nodes)
