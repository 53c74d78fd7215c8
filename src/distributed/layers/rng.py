"""Model-parallel RNG streams (Megatron's tracker semantics).

Two kinds of stream per process:

* **shared**: identical on every rank of a TP group; replicated regions
  (residual dropout, a plain MLP's ``nn.Dropout`` after a pair) draw from it,
  so their masks, activations and gradients are the same on every TP rank;
* **local**: different per TP rank; sharded regions (between a
  ``RowParallelLinear`` whose output stays split and the
  ``ColumnParallelLinear`` that consumes it, e.g. attention-probability
  dropout on local heads) draw from it, so uneven work there never moves the
  shared stream. Each split region starts a fresh local stream, seeded from
  a draw of the shared stream's current state (not taken from it: the shared
  stream goes on where it was), the layer that opens the region, and
  ``2718 + tp_rank`` (Megatron's offset). Replicated regions therefore draw
  what one process would after the same ``torch.manual_seed``; the shared
  stream moves one draw on after each training forward that opened a region,
  so the next forward's local streams differ.

A wrapped model in training mode runs its forward with the default
generator set to the shared stream (the user's own generator state is put
back afterwards, so whatever each rank's RNG state was does not matter),
however it is called: the forward door's hooks on the wrapped model switch it
(:func:`enter_model`, :func:`exit_model`), through the wrapper, a PEFT model
around it or ``wrapped.base_model(...)`` alike;
the layers themselves switch to a local stream where a split output
leaves a ``RowParallelLinear`` (:func:`split_region_begins`) and back where
a ``ColumnParallelLinear`` reads it (:func:`split_region_ends`). They switch
inline, after checking ``TRACKER.depth`` and their mode without a call,
rather than from forward hooks: a hooked module takes ``nn.Module``'s slow
call path, about seven Python calls per layer and forward. An eval-mode
forward, or a layer used outside a wrapped model, switches nothing.

Dropout on **token shards** (tokens split over ranks, not features) draws
from a stream per shard, as the parts of one mask over the whole sequence
would be, never from the shared stream (which gave every shard the same
mask): sequence parallelism's hooks open such a region where the hidden
states are cut into sequence shards and close it where they are gathered
(:func:`sequence_region_begins`, :func:`sequence_region_ends`: a stream per
TP rank); ``ContextParallel`` runs its training forward in one
(:func:`own_tokens`: a stream per cp rank, shared by its TP ranks). A split
region inside a token region starts from it and returns to it; the streams
nest (``Tracker.saved``). A block that sequence parallelism runs on the whole
sequence (MoE, latent attention) draws from a stream the same on every TP rank
(:func:`whole_region_begins`), as a replicated region draws from the shared one.

Activation checkpointing replays the streams: torch restores the default
generator at the start of a recomputed segment (the shared stream, for a
segment that starts on replicated activations: a decoder layer, a block),
and the layers of a wrapped model switch again while autograd recomputes
(:data:`REPLAY`, one per recomputed segment), so each local stream is seeded
from the same draw and every mask is the one the forward drew. Not replayed,
and refused when the model has dropout: a checkpoint around the whole wrapped
model (its forward starts from the shared stream's current state, not the
recorded one; checkpoint its blocks instead), and a recomputed segment that
starts inside a split region and leaves it (:func:`split_region_ends` with no
region open). A layer replays only what its forward switched (``streamed``):
a layer called outside a wrapped model's forward (a decoder layer on its own)
draws from the caller's generator in its forward and in its recomputation alike.

Eager mode only: under ``torch.compile`` the streams are not switched, so a
compiled wrapped model in training mode with active dropout raises
(:func:`dropout_site`, checked by the forward door when traced) instead of drawing different
masks on different ranks.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..comm.objects import all_gather_object
from ..comm.runtime import ProcessGroup, get_tensor_parallel_config, group_rank, group_size
from ..core import torch_compat

LOCAL_OFFSET = 2718  # Megatron's offset of the tensor-parallel seed
STAGE_OFFSET = 100  # Megatron's offset per pipeline stage
SEEDS = 2**62  # a local stream's seed is drawn below this (plus the offset: still < 2**63)

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
    """This process's streams: the shared one, the ones to go back to, and whether a split
    region's local one is active."""

    shared: State | None = None  # TRACKER: identical on every rank of a TP group
    offset: int = LOCAL_OFFSET  # + this rank's TP rank: what makes a local stream per-rank
    in_local: bool = False  # a split region's local stream is active
    # The streams to go back to, innermost last: a split region's, and token regions'
    # (sequence shards, context parallelism) it may nest in
    saved: list[State] = field(default_factory=list)
    # Token regions opened around the wrapped model (context parallelism): (key, offset)
    outer: list[tuple[int, int]] = field(default_factory=list)
    depth: int = 0  # wrapped training forwards running (nested: a model inside a model)
    user: list[Any] = field(default_factory=list)  # the caller's states, put back at the end
    # The last wrapped model run in training (held weakly): its dropout site is looked
    # up only where a refusal needs it (site())
    model: weakref.ref[nn.Module] | None = None
    regions: int = 0  # split regions opened in the running wrapped forward
    node: Any = None  # REPLAY only: the autograd node whose recomputation it follows


TRACKER = Tracker()
REPLAY = Tracker()  # the streams of the segment autograd recomputes now


def site() -> str | None:
    """The first dropout site (:func:`dropout_site`) of the last wrapped model run in
    training, or None. Looked up when asked, on the refusals' paths only: adapters added
    after the wrap (PEFT's LoRA dropout) count, and no forward pays for the walk."""
    model = TRACKER.model() if TRACKER.model is not None else None
    return None if model is None else dropout_site(model)


def fork(t: Tracker, key: int, offset: int) -> None:
    """Default generator := a fresh stream seeded from a draw of the current one.

    The current state is saved first (and put back by :func:`join`, so the draw
    takes nothing from it); the seed mixes in ``key`` (who opens the stream: streams
    opened on the same state by different layers differ, and a rebuilt model draws
    the same masks) and ``offset`` (what tells the ranks apart). A recomputation
    that restores the current state derives the same seed.
    """
    t.saved.append(get_state())
    _reseed(key, offset)
    t.regions += 1


def _reseed(key: int, offset: int, start: int | None = None) -> None:
    """Seed the default generators with ``(start + key) % SEEDS + offset``; ``start``: a draw
    of the current stream unless given."""
    first = int(torch.randint(SEEDS, ())) if start is None else start
    seed = (first + key) % SEEDS + offset
    _CPU.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed(seed)


def join(t: Tracker) -> None:
    """Default generator := the stream the innermost :func:`fork` began on."""
    set_state(t.saved.pop())


def unwind(t: Tracker) -> None:
    """Default generator := the stream the outermost :func:`fork` began on; none open."""
    if t.saved:
        set_state(t.saved[0])
        t.saved.clear()
    t.in_local = False


def to_local(t: Tracker, key: int) -> None:
    """Default generator := a fresh local stream for the split region ``key`` opens here
    (``key``: the opening layer's ``stream_key``), unless one is active."""
    if not t.in_local:
        fork(t, key, TRACKER.offset)
        t.in_local = True


def to_shared(t: Tracker) -> None:
    """Default generator := the stream the split region began on (the shared one, or a
    token region's)."""
    if t.in_local:
        set_state(t.saved.pop())  # join(t), inline: per split region and forward
        t.in_local = False


def split_region_begins(layer: Any) -> bool:
    """``layer``'s output stays split: what follows draws from this rank's local stream.

    ``layer.stream_key`` (set by the wrapper) tells its region's stream apart.

    Called by a ``RowParallelLinear`` in training mode inside a wrapped
    model's training forward (``TRACKER.depth > 0``), or while autograd
    recomputes one (a ``streamed`` layer), which it checks itself.

    Returns:
        Whether the streams switched: in a wrapped training forward or its
        recomputation. The layer keeps it as ``streamed``: a forward called
        outside a wrapped model's (a decoder layer on its own) switches
        nothing, and then neither does its recomputation.
    """
    if torch.compiler.is_compiling():  # _active() inline: this runs per layer and forward
        return False
    t = TRACKER if TRACKER.depth else _replaying()
    if t is not None:
        to_local(t, layer.stream_key)
    return t is not None


def split_region_ends(layer: Any) -> bool:
    """A layer reads split input: it and what follows draw from the shared stream again.

    Called as :func:`split_region_begins`, by a ``ColumnParallelLinear`` that
    reads input shards (``layer``, named in the error); returns the same.

    Raises:
        RuntimeError: autograd recomputes a segment that started inside the
            split region this layer leaves, and the model has dropout.
    """
    if torch.compiler.is_compiling():  # _active() inline, as in split_region_begins
        return False
    t = TRACKER if TRACKER.depth else _replaying()
    if t is None:
        return False
    where = site() if t is REPLAY and not t.in_local else None
    if where is not None:
        raise RuntimeError(
            f"{layer._name()}: activation checkpointing recomputes a segment that starts "
            "inside the split region this layer (weight columns = in_features split) "
            f"leaves, in a model with dropout at {where}: torchtp cannot replay the "
            "shared RNG stream there, so the recomputed dropout masks would differ from the "
            "forward's; checkpoint whole blocks (HF gradient_checkpointing_enable(), one "
            "checkpoint per decoder layer) or set the dropout probabilities to 0")
    to_shared(t)
    return True


def sequence_region_begins(owner: Any) -> bool:
    """Hidden states are cut into sequence shards here (sequence parallelism).

    Up to :func:`sequence_region_ends`, each rank's tokens draw from a stream
    of their own (seeded as a split region's, from ``owner.stream_key``), so
    dropout on the shards (GPT-2's residual dropout) draws independent masks,
    as one mask over the whole sequence would be; from the shared stream,
    every shard would get the same mask. Split regions inside it (attention,
    MLP) start from it and return to it. Called by the sequence-parallel
    hooks as :func:`split_region_begins` is by a layer; returns the same.
    """
    t = _active()
    if t is None:
        return False
    to_shared(t)  # the shards are cut from replicated hidden states
    fork(t, owner.stream_key, TRACKER.offset)
    return True


def sequence_region_ends(owner: Any) -> bool:
    """The sequence shards are gathered again: the stream the region began on.

    Raises:
        RuntimeError: autograd recomputes a segment that started inside the
            sequence-parallel region and leaves it, and the model has dropout.
    """
    t = _active()
    if t is None:
        return False
    to_shared(t)
    if t.saved:
        join(t)
    elif t is REPLAY and (where := site()) is not None:
        raise RuntimeError(
            f"{owner.who}: activation checkpointing recomputes a segment that starts on "
            "sequence shards and ends where they are gathered again (the final norm), in a "
            f"model with dropout at {where}: torchtp cannot replay the shared RNG "
            "stream there, so the recomputed dropout masks would differ from the forward's; "
            "checkpoint the decoder layers only (HF gradient_checkpointing_enable()) or set "
            "the dropout probabilities to 0")
    return True


def whole_region_begins(key: int) -> bool:
    """Sequence shards are gathered here for a block every rank runs alike on the whole
    sequence (MoE routing and experts, latent attention; sequence parallelism).

    Up to :func:`whole_region_ends`, draws come from a stream that is the same on
    every TP rank, as the shared stream is for a replicated region: different draws
    (a router's jitter or sampling) would route the ranks' copies of a token to
    different experts. Its seed is the sequence shards' stream's seed
    (:func:`sequence_region_begins`) without this rank's offset, plus ``key`` (the
    block's): a recomputation under activation checkpointing restores that stream, so
    it derives the same seed, and each block and forward gets its own stream.

    Returns:
        Whether the streams switched (as :func:`split_region_begins`).
    """
    t = _active()
    if t is None:
        return False
    to_shared(t)
    t.saved.append(get_state())
    # The generator state carries the seed it was last seeded with (restored by set_state).
    _reseed(key, 0, _CPU.initial_seed() - TRACKER.offset)
    return True


def whole_region_ends() -> bool:
    """The whole-sequence block's output is split into shards again: the shards' stream."""
    t = _active()
    if t is None:
        return False
    to_shared(t)
    join(t)
    return True


@contextmanager
def own_tokens(key: int, offset: int, site: str) -> Iterator[None]:
    """A training forward on this rank's tokens only (context parallelism).

    Every dropout inside draws from a stream of this rank's tokens: seeded from
    a draw of the stream the forward starts on, ``key`` and ``offset`` (the
    same on ranks that hold the same tokens, different otherwise), so the
    ranks' masks are independent, as one mask over the whole sequence would
    be. A wrapped tensor-parallel model inside starts its shared stream the
    same way (:func:`enter_model`), so its TP ranks still agree. Outside any
    wrapped forward, the caller's generator is the stream: it is put back
    and moved one draw on, so the next forward draws other masks; a
    recomputation (a checkpoint around the whole model) restores it first
    and draws the same ones.

    Args:
        key: Who opens the stream (a constant of the caller).
        offset: The same on ranks holding the same tokens, different otherwise.
        site: The model's first dropout site (:func:`dropout_site`), for the error.

    Raises:
        RuntimeError: under ``torch.compile``, which would not switch the stream.
    """
    if torch.compiler.is_compiling():
        raise RuntimeError(
            f"torch.compile of a context-parallel model in training mode with dropout at "
            f"{site}: torchtp switches to a stream per rank's tokens in eager mode only, so "
            "compiled dropout would draw the same masks on every rank's tokens; set the "
            "dropout probabilities to 0, compile in eval mode, or train eagerly")
    t = _active()
    if t is not None:  # inside a wrapped forward or its recomputation
        fork(t, key, offset)
        try:
            yield
        finally:
            to_shared(t)
            join(t)
        return
    user = get_state()
    _reseed(key, offset)
    TRACKER.outer.append((key, offset))
    try:
        yield
    finally:
        TRACKER.outer.pop()
        set_state(user)
        torch.randint(SEEDS, ())


def _active() -> Tracker | None:
    """The streams to switch: in a wrapped training forward, or while autograd recomputes
    one; None otherwise (and in compiled code)."""
    if torch.compiler.is_compiling():
        return None
    return TRACKER if TRACKER.depth else _replaying()


def streams_switch() -> bool:
    """Whether the streams switch now: in a wrapped training forward or its recomputation."""
    return TRACKER.depth > 0 or _replaying() is not None


def _replaying() -> Tracker | None:
    """:data:`REPLAY`, reset for each recomputed segment, or None outside a backward pass."""
    node = torch_compat.backward_node()
    if node is None:
        return None
    if REPLAY.node is not node:
        # Let go of the node when this backward ends (a backward that raises drops the
        # callback: the next wrapped forward lets go, enter_model).
        torch_compat.at_end_of_backward(_forget_replay)
        REPLAY.node = node
        _reset(REPLAY)
    return REPLAY


def _forget_replay() -> None:
    REPLAY.node = None
    _reset(REPLAY)


def _reset(t: Tracker) -> None:
    t.in_local = False
    t.saved.clear()


def in_split_region() -> bool:
    """Whether a split region's local stream is active (in a wrapped forward or its replay)."""
    if TRACKER.depth:
        return TRACKER.in_local
    replay = _replaying()
    return replay is not None and replay.in_local


def manual_seed(seed: int, stage: int | None = None) -> None:
    """Seed torch and the streams of this rank's pipeline stage.

    shared = ``seed + 100 * stage`` (Megatron's offset): the TP ranks of a
    stage share one stream, and stages draw different dropout masks instead
    of repeating one another's; each split region's local stream is seeded
    from it (see the module docstring).

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
    TRACKER.offset = LOCAL_OFFSET + cfg.rank


def sync(group: ProcessGroup | None) -> None:
    """Start the streams from a common generator state unless this rank has them already.

    Collective over ``group`` on **every** call (one object gather), called by
    the wrapper: a rank that wrapped another model before (its streams
    started, or :func:`manual_seed` ran) still takes part, so a second wrap
    over a group mixing such ranks with new ones cannot leave the new ones
    waiting. Ranks without streams take the first started rank's shared
    stream (TP rank 0's generator when none started) and their own TP rank's
    offset for the local streams. Under pipeline parallelism (``cfg.pp_rank``
    > 0) that state is first moved to the stage's own stream, as
    :func:`manual_seed` does: ranks seeded alike (torch's fixed default seed,
    or one ``torch.manual_seed`` on every rank) would otherwise draw every
    stage's dropout masks position for position the same.
    """
    started = TRACKER.shared is not None
    state = TRACKER.shared if started else get_state()
    assert state is not None
    ahead = started  # the state is a started stream (already the stage's own)
    if group is not None and group_size(group) > 1:
        everyone = all_gather_object((started, state), group, "the RNG sync")
        state, ahead = next(((st, True) for ok, st in everyone if ok), (everyone[0][1], False))
    if started:
        return
    stage = 0 if ahead else get_tensor_parallel_config().pp_rank
    TRACKER.shared = _stage_stream(state, stage)
    TRACKER.offset = LOCAL_OFFSET + group_rank(group)


@contextmanager
def first_rank_generator(everyone: list[State], rank: int) -> Iterator[None]:
    """Inside the block this rank draws what its group's first rank's default generators
    would (``generate(do_sample=True)``: every rank samples the same tokens).

    ``everyone``: every rank's :func:`get_state` (gathered by the caller, in rank order),
    ``rank``: this rank's place in it. Where the states agree already (one seed on every
    rank) nothing changes: each rank draws, and moves on, as one process would.
    Otherwise every rank takes the first rank's state for the block, and the others get
    their own back after it (their streams, seeded per rank on purpose, stay theirs).
    """
    first, own = everyone[0], everyone[rank]
    if all(_same_state(s, first) for s in everyone):
        yield
        return
    set_state((first[0], first[1] if torch.cuda.is_initialized() else None))
    try:
        yield
    finally:
        if rank != 0:
            set_state(own)


def _same_state(a: State, b: State) -> bool:
    """Whether two :func:`get_state` results are the same generators' states."""
    return torch.equal(a[0], b[0]) and (
        (a[1] is None and b[1] is None)
        or (a[1] is not None and b[1] is not None and torch.equal(a[1], b[1])))


def _stage_stream(state: State, stage: int) -> State:
    """Pipeline stage ``stage``'s shared stream from ``state``: a copy of it for stage 0
    (no pipeline, or a stream a TP peer started: one process's masks), else a stream
    seeded from one draw of it plus ``STAGE_OFFSET * stage`` (Megatron's per-stage
    offset)."""
    if stage == 0:
        return state[0].clone(), None if state[1] is None else state[1].clone()
    user = get_state()
    # A peer's CUDA state on a rank whose CUDA is not initialized would only be queued
    # for CUDA's start (nothing here could undo it): such a rank draws on the CPU.
    set_state((state[0], state[1] if torch.cuda.is_initialized() else None))
    _reseed(STAGE_OFFSET * stage, 0)
    own = get_state()
    set_state(user)
    return own


def enter_model(model: weakref.ref[nn.Module]) -> None:
    """Forward of a wrapped model in training mode starts: default generator := shared stream.

    Called by the forward door (``torchtp.guards.forward_door``) however the model is
    called: through the wrapper, by a PEFT model around it, directly.

    Args:
        model: The wrapped model, held weakly (its dropout site is looked up only for
            a refusal: :func:`site`).

    Raises:
        RuntimeError: autograd recomputes the whole wrapped model (a checkpoint
            around it) and it has dropout: its streams cannot be replayed.
    """
    if TRACKER.depth == 0:
        TRACKER.model = model
        where = site() if torch_compat.graph_task_id() != -1 else None  # a recomputation
        if where is not None:
            raise RuntimeError(
                f"activation checkpointing recomputes a whole tensor-parallel model with dropout "
                f"at {where}: torchtp's RNG streams have moved on since its forward, so the "
                "recomputed dropout masks would differ from the forward's; checkpoint its blocks "
                "instead (HF gradient_checkpointing_enable(), one checkpoint per decoder layer), "
                "or set the dropout probabilities to 0")
        if REPLAY.node is not None:  # left by a backward that raised
            _forget_replay()
        TRACKER.user.append(get_state())
        assert TRACKER.shared is not None
        set_state(TRACKER.shared)
        for key, offset in TRACKER.outer:  # this rank's tokens only (context parallelism)
            fork(TRACKER, key, offset)
    TRACKER.depth += 1


def exit_model() -> None:
    """Forward ends: remember the streams, give the user back their generator state."""
    TRACKER.depth -= 1
    if TRACKER.depth:
        return
    unwind(TRACKER)
    if TRACKER.regions:  # local streams derive from the shared state: move it on
        torch.randint(SEEDS, ())
        TRACKER.regions = 0
    TRACKER.shared = get_state()
    set_state(TRACKER.user.pop())


_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                    nn.FeatureAlphaDropout)
# Float probabilities HF attention modules pass to F.dropout / SDPA in training
# (Llama/Mistral/Qwen: attention_dropout; others: dropout, attn_dropout, ...).
_DROPOUT_ATTRS = ("attention_dropout", "attn_dropout", "dropout", "dropout_p", "attn_pdrop",
                  "resid_pdrop", "embd_pdrop", "hidden_dropout", "dropout_rate",
                  # MoE routers' multiplicative noise in training (Mixtral, PhiMoE)
                  "jitter_noise", "router_jitter_noise")


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
