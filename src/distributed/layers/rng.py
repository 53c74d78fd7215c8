"""Model-parallel RNG streams (Megatron's tracker semantics).

Two streams per process, each a saved generator state:

* **shared**: identical on every rank of a TP group; replicated regions
  (residual dropout, a plain MLP's ``nn.Dropout`` after a pair) draw from it,
  so their masks, activations and gradients are the same on every TP rank;
* **local**: different per TP rank (``seed + 2718 + tp_rank``); sharded
  regions (between a ``RowParallelLinear`` whose output stays split and the
  ``ColumnParallelLinear`` that consumes it, e.g. attention-probability
  dropout on local heads) draw from it, so uneven work there never moves
  the shared stream.

A wrapped model in training mode runs its forward with the default
generator set to the shared stream (the user's own generator state is put
back afterwards, so whatever each rank's RNG state was does not matter);
the layers themselves switch to the local stream where a split output
leaves a ``RowParallelLinear`` (:func:`split_region_begins`) and back where
a ``ColumnParallelLinear`` reads it (:func:`split_region_ends`). They switch
inline, after checking ``TRACKER.depth`` and their mode without a call,
rather than from forward hooks: a hooked module takes ``nn.Module``'s slow
call path, about seven Python calls per layer and forward. An eval-mode
forward, or a layer used outside a wrapped model, switches nothing.
Eager mode only: under ``torch.compile`` the streams are not switched, so a
compiled wrapped model in training mode with active dropout raises
(:func:`dropout_site`, checked by the wrapper) instead of drawing different
masks on different ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..comm.objects import all_gather_object
from ..comm.runtime import ProcessGroup, get_tensor_parallel_config, group_rank, group_size

LOCAL_OFFSET = 2718  # Megatron's offset of the tensor-parallel seed
STAGE_OFFSET = 100  # Megatron's offset per pipeline stage

State = tuple[torch.Tensor, "torch.Tensor | None"]  # the CPU generator's, CUDA's if initialized

# torch.get_rng_state() / set_rng_state() are these two calls behind a Python wrapper; the
# streams switch up to four times per training forward, so they are called directly.
_CPU = torch.default_generator


def get_state() -> State:
    """The default generators' states (CPU, and CUDA's once CUDA is initialized)."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    return _CPU.get_state(), cuda


def set_state(state: State) -> None:
    """Set the default generators to ``state`` (from :func:`get_state`)."""
    _CPU.set_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


@dataclass
class Tracker:
    """This process's streams: each a saved generator state, and which one is active."""

    shared: State | None = None  # identical on every rank of a TP group
    local: State | None = None  # different per TP rank
    in_local: bool = False
    depth: int = 0  # wrapped training forwards running (nested: a model inside a model)
    user: list[Any] = field(default_factory=list)  # the caller's states, put back at the end


TRACKER = Tracker()


def to_local() -> None:
    """Default generator := this rank's local stream (the shared one saved)."""
    if not TRACKER.in_local:
        TRACKER.shared = get_state()
        assert TRACKER.local is not None
        set_state(TRACKER.local)
        TRACKER.in_local = True


def to_shared() -> None:
    """Default generator := the shared stream (the local one saved)."""
    if TRACKER.in_local:
        TRACKER.local = get_state()
        assert TRACKER.shared is not None
        set_state(TRACKER.shared)
        TRACKER.in_local = False


def split_region_begins() -> None:
    """A layer's output stays split: what follows draws from this rank's local stream.

    Called by a ``RowParallelLinear`` in training mode inside a wrapped
    model's training forward (``TRACKER.depth > 0``), which it checks itself.
    """
    if not torch.compiler.is_compiling():
        to_local()


def split_region_ends() -> None:
    """A layer reads split input: it and what follows draw from the shared stream again.

    Called as :func:`split_region_begins`, by a ``ColumnParallelLinear`` that
    reads input shards.
    """
    if not torch.compiler.is_compiling():
        to_shared()


def _seeded(seed: int) -> State:
    saved = get_state()
    torch.manual_seed(seed)
    state = get_state()
    set_state(saved)
    return state


def manual_seed(seed: int, stage: int | None = None) -> None:
    """Seed torch and both streams of this rank's pipeline stage.

    shared = ``seed + 100 * stage``, local = that ``+ 2718 + tp_rank``
    (Megatron's offsets): the TP ranks of a stage share one stream, and
    stages draw different dropout masks instead of repeating one another's.

    Args:
        seed: The same on every rank (call it after ``init_parallel``).
        stage: This rank's pipeline stage; ``None``: ``init_parallel(pp=...)``'s
            ``cfg.pp_rank`` (0 without pipeline parallelism, which keeps
            ``seed`` itself).
    """
    cfg = get_tensor_parallel_config()
    own = seed + STAGE_OFFSET * (cfg.pp_rank if stage is None else stage)
    torch.manual_seed(own)
    TRACKER.shared = get_state()
    TRACKER.local = _seeded(own + LOCAL_OFFSET + cfg.rank)


def sync(group: ProcessGroup | None) -> None:
    """Start the streams from a common generator state unless this rank has them already.

    Collective over ``group`` on **every** call (one object gather), called by
    the wrapper: a rank that wrapped another model before (its streams
    started, or :func:`manual_seed` ran) still takes part, so a second wrap
    over a group mixing such ranks with new ones cannot leave the new ones
    waiting. Ranks without streams take the first started rank's shared
    stream (TP rank 0's generator when none started) and a local stream
    seeded from that rank's seed and their own TP rank.
    """
    started = TRACKER.shared is not None
    seed = torch.initial_seed()
    state = TRACKER.shared if started else get_state()
    assert state is not None
    if group is not None and group_size(group) > 1:
        everyone = all_gather_object((started, seed, state), group, "the RNG sync")
        seed, state = next(((s, st) for ok, s, st in everyone if ok),
                           (everyone[0][1], everyone[0][2]))
    if started:
        return
    TRACKER.shared = (state[0].clone(), None if state[1] is None else state[1].clone())
    TRACKER.local = _seeded(seed + LOCAL_OFFSET + group_rank(group))


def enter_model() -> None:
    """Forward of a wrapped model starts: default generator := shared stream."""
    if TRACKER.depth == 0:
        TRACKER.user.append(get_state())
        assert TRACKER.shared is not None
        set_state(TRACKER.shared)
    TRACKER.depth += 1


def exit_model() -> None:
    """Forward ends: remember the streams, give the user back their generator state."""
    TRACKER.depth -= 1
    if TRACKER.depth:
        return
    to_shared()
    TRACKER.shared = get_state()
    set_state(TRACKER.user.pop())


_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                    nn.FeatureAlphaDropout)
# Float probabilities HF attention modules pass to F.dropout / SDPA in training
# (Llama/Mistral/Qwen: attention_dropout; others: dropout, attn_dropout, ...).
_DROPOUT_ATTRS = ("attention_dropout", "attn_dropout", "dropout", "dropout_p", "attn_pdrop",
                  "resid_pdrop", "embd_pdrop", "hidden_dropout", "dropout_rate")


def dropout_site(model: nn.Module) -> str | None:
    """The first module (and attribute) of ``model`` that would drop out in training mode.

    ``nn.Dropout``-family modules with ``p > 0`` and float dropout
    probabilities > 0 stored on a module (HF attention's
    ``attention_dropout``). A functional ``F.dropout`` with a literal
    probability is not visible here.
    """
    for name, module in model.named_modules():
        if isinstance(module, _DROPOUT_MODULES) and module.p > 0:
            return f"{name or type(module).__name__} (p={module.p})"
        for attr in _DROPOUT_ATTRS:
            value = module.__dict__.get(attr)
            if isinstance(value, float) and value > 0:
                return f"{name or type(module).__name__}.{attr}={value}"
    return None


def refuse_compiled_dropout(site: str, size: int) -> RuntimeError:
    """The error for a compiled TP model in training mode with dropout at ``site``."""
    return RuntimeError(
        f"torch.compile of a tensor-parallel model (tp={size}) in training mode with dropout at "
        f"{site}: torchtp switches to its shared/local RNG streams in eager mode only, so "
        "compiled dropout could draw different masks for replicated activations on different "
        "ranks; set the dropout probabilities to 0 (HF: config attention_dropout=0.0 etc.), "
        "compile the model in eval mode, or train it eagerly")
