"""Gather one picklable object per rank, with the tensors kept safe for exit.

``torch.distributed.all_gather_object`` builds its byte tensors inside torch
and drops them as soon as the collective's wait returns; Gloo's worker thread
lets go of the collective a moment later and may then free those tensors
itself, after the interpreter began shutting down, which aborts the process
(see ``torchtp.comm.health._hold``). This version sends the same bytes through
two all-gathers into one tensor whose tensors torchtp holds until the
worker released them, like every other torchtp collective.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from . import health as _health
from .ops import gather_single
from .runtime import ProcessGroup


def object_device(group: ProcessGroup | None) -> torch.device:
    """Where the group's small host-side collectives run: the current GPU for NCCL-only
    groups, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather(tensor: torch.Tensor, st: _health.GroupState, what: str) -> torch.Tensor:
    """Every rank's 1-D ``tensor`` (same length on every rank), concatenated: ``(world * n,)``."""
    out = torch.empty(st.size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    work = gather_single(out, tensor, group=st.group, async_op=True)
    _health.wait_and_hold(work, st, (tensor, out), what)
    return out


def all_gather_object(obj: Any, group: ProcessGroup | None,
                      what: str = "an object gather") -> list[Any]:
    """Return every rank's ``obj`` (index = group rank); collective over ``group``.

    Args:
        obj: A picklable value.
        group: The process group (every rank must call this); ``None``: the default group.
        what: The operation, for the error raised if a rank died or timed out.

    Raises:
        InconsistentGroupError: the group is out of step, or the collective
            failed (naming the rank that caused it when it told us).
    """
    st = _health.state(group)
    _health.raise_if_poisoned(st)
    device = object_device(st.group)
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    sizes = _gather(torch.tensor([payload.numel()], dtype=torch.long, device=device), st, what)
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)  # (longest,) bytes
    padded[:payload.numel()] = payload
    rows = _gather(padded, st, what).view(st.size, longest).cpu()
    return [pickle.loads(rows[r, :int(sizes[r])].numpy().tobytes()) for r in range(st.size)]
