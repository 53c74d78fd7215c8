"""Report an error that escapes a wrapped model's forward or backward on one rank.

An exception raised on some ranks only between two collectives of a forward
leaves the ranks' collective sequences misaligned: if the user catches it and
goes on, every later collective pairs with the wrong one. The wrapper puts
:func:`guard_module`'s hooks on the model it wraps, which report it like
:func:`torchtp._health.fail` (the group stays usable if every rank raised at
the same point, else it is poisoned on every rank), however the model is
called: through the wrapper, or directly (``TensorParallelTrainer`` and
HF's ``generate`` call the HF model itself). A backward through the model's
outputs that raised on this rank is reported the same way at its next forward.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import _logging, _torch_compat
from ._health import REPORTED, GroupState, fail, inconsistent, post, state
from .errors import InconsistentGroupError, RankMismatchError
from .runtime import ProcessGroup


def guard_module(group: ProcessGroup | None, module: nn.Module) -> None:
    """Report an exception escaping ``module``'s forward (the wrapped model) to the group.

    However the model is called (through the wrapper, by ``TensorParallelTrainer``,
    by HF's ``generate``), three forward hooks do it: the pre-hook reports a
    backward through an earlier output that raised on this rank, then marks
    the call pending; a forward hook clears the mark when the forward
    returned (and, with gradients, watches the backward through the output);
    a hook torch also runs when the forward raised an ``Exception``
    (``always_call``) reports that exception if the mark is still set. Torch
    runs no hook for a ``BaseException`` such as ``KeyboardInterrupt``: the
    wrapper's forward reports those with :func:`report_interrupted`. Costs a
    few microseconds per forward; nothing under ``torch.compile``.
    """
    pending = [False]

    def active() -> GroupState | None:
        if torch.compiler.is_compiling() or not dist.is_initialized():
            return None
        st = state(group)
        return None if st.size == 1 else st

    def before(_module: nn.Module, _args: tuple) -> None:
        st = active()
        if st is None:
            return
        pending[0] = False
        if st.backward_open and not _torch_compat.in_backward():
            _report_failed_backward(st)
        pending[0] = True

    def returned(_module: nn.Module, _args: tuple, out: Any) -> None:
        st = active()
        if st is not None and pending[0]:
            pending[0] = False
            if torch.is_grad_enabled():
                _watch_backward(st, out)

    def after(_module: nn.Module, _args: tuple, _out: Any) -> None:
        st = active()
        if st is not None and pending[0]:  # the forward raised: "returned" did not run
            pending[0] = False
            err = sys.exc_info()[1]  # torch calls always_call hooks inside its except
            if err is not None:
                _report_escaped(st, err)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(returned)
    module.register_forward_hook(after, always_call=True)


def report_interrupted(group: ProcessGroup | None, err: BaseException) -> None:
    """Report a ``BaseException`` (``KeyboardInterrupt``, ``SystemExit``) that left a forward.

    :func:`guard_module`'s hooks report ``Exception``s only; the wrapper's
    forward calls this for the rest. ``Exception``s are ignored here.
    """
    if isinstance(err, Exception) or not dist.is_initialized():
        return
    st = state(group)
    if st.size > 1:
        _report_escaped(st, err)


def _report_escaped(st: GroupState, err: BaseException) -> None:
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


def _report_failed_backward(st: GroupState) -> None:
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


def _watch_backward(st: GroupState, out: Any) -> None:
    """Mark a backward through ``out`` as open until it completes (hooks on the grad_fns)."""

    def finished() -> None:
        st.backward_open = False

    def started(_grads: Any) -> None:
        if not st.backward_open:
            st.backward_open = True
            _torch_compat.at_end_of_backward(finished)

    values = out.values() if isinstance(out, Mapping) else out \
        if isinstance(out, (tuple, list)) else (out,)
    for value in values:
        node = getattr(value, "grad_fn", None) if isinstance(value, torch.Tensor) else None
        if node is not None:
            node.register_prehook(started)
