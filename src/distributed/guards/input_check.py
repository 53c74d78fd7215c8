"""Check on every forward of a wrapped model that all TP ranks got the same inputs.

Hooks on the wrapped model (``base_model``) run however it is called: through
the wrapper, directly (``TensorParallelTrainer``), by HF's ``generate``, or by
a PEFT model around it. Training and eval alike.

Cost: before the forward, every input tensor's name, shape, dtype and a
strided sample of at most 256 elements
(:func:`torchtp.guards.fingerprints.sample_bytes`) are hashed into one 64-bit
hash. Its bits, as 64 values 0 or 1, ride the group's next collective that can
carry them (:func:`torchtp.comm.ops.ride_next_collective`): the forward's first
floating-point sum all-reduce or all-gather, so checking adds no collective to
a step that has one. The ranks' hashes are all equal exactly when every sum is
0 or ``tp`` (exact in any float dtype up to 256 ranks), and every rank reads the
same sums, so every rank gives the same verdict. Where the forward itself issues
no collective (every layer weight-rows-split, its output kept split: PyTorch's
``ColwiseParallel``) but whose backward all-reduces the gradient of an input
that needs one, the hash waits for that all-reduce and the verdict is read at
the end of the backward, before any optimizer step. A step with no collective at
all (eval or ``torch.no_grad()`` through such a model, a replicated model) pays
one all-reduce of the 64 values at the end of the forward. Only on a mismatch does an
``all_gather_object`` of per-argument digests name the argument and the
ranks. The hashing and the verdict use as few Python calls as they can: between
two forwards every call runs with cold caches (about 10 us each on a CPU),
which, not the work, is the check's cost (docs/benchmarks.md, "Input check").
On GPU, hashing copies each input's sample to the host and moves the
hash bits to the device before the forward (where the host waits for the
device's queue anyway); the sums stay on the device until the verdict is read,
the one other synchronisation, so the host never waits in the middle of the
forward.

Inputs of a first parallel layer that takes this rank's input shard (a
``ColumnParallelLinear``, weight columns = ``in_features`` split, style
``"rowwise"``): floating tensors whose last dimension is this rank's share of
``in_features`` are compared by shape only (the last dimension excluded: the
balanced split may give ranks shares that differ by one).

Not checked: keyword arguments that hold a cache (``past_key_values``: each
rank's heads), forwards inside ``torch.compile``, groups of one rank, and
everything under ``TP_CHECK_INPUTS=0``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..comm import ops as _comm
from ..comm import regions
from ..comm.health import GroupState
from ..comm.objects import all_gather_object
from ..comm.runtime import ProcessGroup
from ..core import log as _logging
from ..core.errors import RankMismatchError
from ..layers import ColumnParallelLinear
from . import step_check
from .fingerprints import named_tensors, raise_different_inputs, sample_bytes, tensor_digest
from .forward_guard import after_backward

_SKIP = ("past", "cache")  # keyword arguments holding each rank's shard of a KV cache


@dataclass
class _Forward:
    """One forward's check: its inputs and, on every ``TP_STEP_CHECK``-th forward, the
    replicated weights (for the slow, naming path), and the riding digest."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    weights: list[tuple[str, torch.Tensor]]
    ride: _comm.Ride
    training: bool  # the wrapped model's mode: ranks in train() and eval() would mix them


class InputCheck:
    """Check the wrapped model's inputs on every forward (see the module docstring).

    :mod:`torchtp.guards.forward_door` calls :meth:`before` from its pre-hook, :meth:`returned`
    when the forward returned and :meth:`cleanup` after it, raised or not.

    Args:
        module: The wrapped model.
        st: The TP group's state (more than one rank; it holds the group weakly).
        shard_width: This rank's share of ``in_features`` when the model's first
            parallel layer takes input shards; ``None`` otherwise.
    """

    def __init__(self, module: nn.Module, st: GroupState, shard_width: int | None) -> None:
        self.module, self.st, self.shard_width = module, st, shard_width
        self.pending: _Forward | None = None  # the forward running now
        self.open: list[_Forward] = []  # returned forwards whose verdict is still to be read
        # Forwards so far, and every how many the replicated weights join the hash (the
        # optimizer-step check's period: eval-only use is checked too; 0: never)
        self.forwards, self.period = 0, step_check.period_from_env()

    def before(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Hash the inputs; the hash rides the group's next collective.

        Called by the forward door once it saw a process group running.
        """
        if not _logging.CHECK_INPUTS:
            return
        self.pending = None
        # Earlier forwards whose hashes travelled since (a backward's all-reduce carried
        # them but the forward was never backwarded to its end): their verdicts first.
        self.settle(carried_only=True)
        # Every rank rides, with or without tensor arguments: the riding collective
        # must carry the same number of values on every rank.
        weights = self._weights()
        training = self.module.training
        digest, device = _digest(args, kwargs, self.shard_width, weights, training)
        if device is None:
            device = next(self.module.parameters(), torch.empty(0)).device
        self.pending = _Forward(args, kwargs, weights,
                                _comm.ride_digest(self.st.group, digest, device), training)

    def _weights(self) -> list[tuple[str, torch.Tensor]]:
        """The replicated weights on every ``period``-th forward, the first included: a
        rank-local change to one (an edit, a wrong file) is caught in eval-only use too,
        where no optimizer step checks them. The same forwards on every rank in step."""
        due = self.period and self.forwards % self.period == 0
        self.forwards += 1
        if not due:
            return []
        return [(f"replicated weight '{n}'", step_check.local(p))
                for n, p in step_check.replicated_parameters(self.module)]

    def returned(self, out: Any) -> None:
        """The forward returned ``out``: read its verdict, or leave it to its backward.

        A forward whose collectives carried the hash is judged now. One that
        issued none but whose backward will all-reduce an input gradient over
        the group (a weight-rows-split layer fed a tensor that needs a
        gradient) leaves the hash waiting for that all-reduce and is judged at
        the end of the backward through ``out``, before any optimizer step.
        Otherwise the step has no collective at all, and the hash travels in
        one all-reduce of its own now. Every rank takes the same path.
        """
        fwd, self.pending = self.pending, None
        if fwd is None:
            return
        self.open.append(fwd)
        if fwd.ride.sums is None and torch.is_grad_enabled() \
                and regions.reduces_in_backward(self.st.group) \
                and after_backward(out, self.settle):
            return
        self.settle()

    def cleanup(self) -> None:
        """After the forward: a forward that raised must not leave its hash riding."""
        fwd, self.pending = self.pending, None
        if fwd is not None:
            _comm.cancel_ride(self.st.group, fwd.ride)

    def settle(self, carried_only: bool = False) -> None:
        """Read the verdict of every open forward, oldest first; raise on a mismatch.

        Hashes that no collective carried travel in one small all-reduce
        (:func:`torchtp.comm.ops.ride_result`), unless ``carried_only``.

        Raises:
            RankMismatchError: a forward's inputs differ across the ranks (on
                every rank: the sums are the same everywhere).
        """
        while self.open and (not carried_only or self.open[0].ride.sums is not None):
            fwd = self.open.pop(0)
            group = self.st.group
            if not _comm.ride_agrees(group, fwd.ride, self.st.size):
                for later in self.open:  # the group's rides stay aligned on every rank
                    _comm.cancel_ride(group, later.ride)
                self.open.clear()
                _raise_mismatch(fwd, group, self.shard_width)


def describe(world_size: int, collectives: dict[str, int]) -> str:
    """How the input check travels for a model whose forward issues ``collectives``
    (one line for ``describe_plan()``)."""
    if world_size == 1:
        return "input check: none at tp 1 (one rank: nothing to compare)"
    if not _logging.CHECK_INPUTS:
        return "input check: off (TP_CHECK_INPUTS=0)"
    if collectives.get("all_reduce") or collectives.get("all_gather"):
        return ("input check: every forward; its hash rides the forward's first all-reduce or "
                "all-gather (no collective of its own)")
    return ("input check: every forward; the forward has no collective, so in training its hash "
            "rides the backward's input-gradient all-reduce (verdict at the end of the backward, "
            "before any optimizer step); a step with no collective at all (eval, no_grad, an "
            "input that needs no gradient) pays one all-reduce of 64 values")


def first_layer_shard_width(model: nn.Module, layer_names: list[str]) -> int | None:
    """This rank's share of ``in_features`` if the first parallel layer takes input shards."""
    if not layer_names:
        return None
    first = model.get_submodule(layer_names[0])
    if isinstance(first, ColumnParallelLinear) and first.input_is_parallel:
        return int(first.in_features_local)
    return None


def _shape_only(t: torch.Tensor, shard_width: int | None) -> bool:
    return shard_width is not None and t.is_floating_point() and t.dim() > 0 \
        and t.shape[-1] == shard_width


def _detail(t: torch.Tensor, shard_width: int | None) -> str:
    """One argument's digest: sampled values, or the shape alone for an input shard."""
    if _shape_only(t, shard_width):
        return f"shape {tuple(t.shape[:-1])} + this rank's input shard, {t.dtype}"
    return tensor_digest(t)


def _digest(args: tuple[Any, ...], kwargs: dict[str, Any], shard_width: int | None,
            weights: list[tuple[str, torch.Tensor]],
            training: bool) -> tuple[bytes, torch.device | None]:
    """The 8-byte hash the ranks compare: the model's mode (a rank in ``eval()`` beside
    one in ``train()`` would drop out half a split activation), every argument's name,
    shape, dtype and sampled values (the shape alone for an input shard), then
    ``weights``' the same way; and the inputs' device (``None``: no tensors). Few calls:
    it runs before every forward, right after the last one evicted the caches, where
    each call costs microseconds of misses."""
    h = hashlib.blake2b(b"train" if training else b"eval", digest_size=8)
    found = named_tensors(args, kwargs, _SKIP)
    for name, t in found:
        if shard_width is not None and _shape_only(t, shard_width):
            h.update(f"{name}={t.shape[:-1]}+shard{t.dtype};".encode())
        else:
            h.update(f"{name}={t.shape}{t.dtype}:".encode())
            h.update(sample_bytes(t))
    for name, t in weights:
        h.update(f"{name}={t.shape}{t.dtype}:".encode())
        h.update(sample_bytes(t))
    return h.digest(), (found[0][1].device if found else None)


def _raise_mismatch(fwd: _Forward, group: ProcessGroup | None, shard_width: int | None) -> None:
    """The ranks' hashes differ: raise :class:`RankMismatchError` on every rank, naming
    the argument (or replicated weight) and the ranks (one ``all_gather_object`` of
    per-argument digests)."""
    mine = {"the model's mode": "train()" if fwd.training else "eval()"}
    mine.update((name, _detail(t, shard_width))
                for name, t in named_tensors(fwd.args, fwd.kwargs, _SKIP))
    mine.update((name, tensor_digest(t)) for name, t in fwd.weights)
    everyone = all_gather_object(mine, group, "the input check")
    first = everyone[0]
    differ = [n for n in mine if any(d.get(n) != first.get(n) for d in everyone)]
    mode = "the model's mode"
    if mode in differ:
        modes = {r: d[mode] for r, d in enumerate(everyone)}
        raise RankMismatchError(
            f"tensor-parallel ranks run the model in different modes ({modes}, by TP rank): "
            "dropout would draw on some ranks only, half a split activation dropped and half "
            "not; call model.train() or model.eval() on every rank alike")
    if differ and all(n.startswith("replicated weight") for n in differ):
        ranks = [r for r, d in enumerate(everyone) if d.get(differ[0]) != first.get(differ[0])]
        raise RankMismatchError(
            f"{differ[0]} differs on TP ranks {ranks} from TP rank 0 (the replicated weights "
            f"are checked every {step_check.ENV} forwards, eval included; every TP rank must "
            f"hold the same copy of a parameter no layout splits): likely "
            f"{step_check.CAUSE_WEIGHT}")
    raise_different_inputs(everyone, "every forward")
