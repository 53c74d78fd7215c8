"""One pipeline stage of a HuggingFace decoder LM: its share of the decoder layers.

The stage keeps the model's own modules and names: the decoder layers of other
stages are replaced by :class:`Elsewhere` (no parameters; it hands the hidden
states on unchanged, so the model's own forward, with its rotary embeddings
and causal mask, runs as written), the embeddings live only on the first
stage and the final norm and LM head only on the last. Parameter names stay
the unsplit model's (``model.layers.5.mlp.up_proj.weight`` on the stage that
holds layer 5), so checkpoints and references line up.

The first stage reads token ids ``(B, T)``; every stage hands on hidden states
``(B, T, H)``; the last returns logits ``(B, T, V)``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core.layouts import shard_range
from ..core.log import logger
from ..hf.probe_copy import small_copy
from .balance import param_balanced_split
from .decoders import DecoderLayout, ZeroElsewhere, decoder_layout


def stage_layers(num_layers: int, stages: int, split: Sequence[int] | None = None
                 ) -> list[range]:
    """Which decoder layers each stage holds.

    Args:
        num_layers: Decoder layers of the model.
        stages: Pipeline stages.
        split: Layers per stage (summing to ``num_layers``); ``None``: the one
            balanced split rule (:func:`~torchtp.core.layouts.shard_range`:
            7 layers over 2 stages -> 4 and 3).

    Raises:
        ValueError: fewer layers than stages, or a ``split`` that does not give
            every stage at least one layer and sum to ``num_layers``.
    """
    if split is None:
        if num_layers < stages:
            raise ValueError(f"{num_layers} decoder layers cannot fill {stages} pipeline "
                             f"stages (each needs one); use at most {num_layers} stages")
        ranges = [shard_range(num_layers, stages, s) for s in range(stages)]
        return [range(start, start + n) for start, n in ranges]
    if len(split) != stages or sum(split) != num_layers or min(split) < 1:
        raise ValueError(f"split={list(split)}: give {stages} positive layer counts summing to "
                         f"the model's {num_layers} decoder layers")
    starts = [sum(split[:s]) for s in range(stages)]
    return [range(a, a + n) for a, n in zip(starts, split, strict=True)]


class Elsewhere(nn.Module):
    """A module that lives on another pipeline stage: hands its input on unchanged.

    Marked ``held_elsewhere``: the plan verification's probe compares a stage
    with its model's one-layer copy without it (:mod:`torchtp.plans.verify`).

    Args:
        what: The module it stands for (a block's index, or a name), for ``repr``.
        like: The module it stands for: its plain public attributes (str, int, float,
            bool) are kept, since a model's forward may read them off every block
            (transformers 5.3's Qwen2 picks each layer's mask by its ``attention_type``).
    """

    held_elsewhere = True

    def __init__(self, what: int | str, like: nn.Module | None = None) -> None:
        super().__init__()
        self.what = what
        if like is not None:
            for name, value in vars(like).items():
                if not name.startswith("_") and name != "training" \
                        and isinstance(value, (str, int, float, bool)):
                    setattr(self, name, value)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states

    def extra_repr(self) -> str:
        label = f"layer {self.what}" if isinstance(self.what, int) else self.what
        return f"{label}: on another pipeline stage"


class Stage(nn.Module):
    """One pipeline stage: a model holding only this stage's share of its blocks.

    What :class:`~torchtp.pipeline.schedule.PipelineSchedule` needs of a stage;
    :class:`DecoderStage` (HF decoder LMs) and
    :class:`~torchtp.pipeline.blocks.BlockStage` (``nn.Sequential`` and other
    chains of blocks) are the two kinds.

    Attributes:
        model: The model, holding only this stage's parameters (names unsplit).
        stage: This stage's index; ``stages``: how many there are.
        layers: The blocks (decoder layers) this stage holds.
        tied: The first stage's input embedding and the last stage's output
            layer are copies of one weight whose gradients are summed.
    """

    tied = False

    def __init__(self, model: nn.Module, stage: int, stages: int, layers: range) -> None:
        super().__init__()
        self.model, self.stage, self.stages, self.layers = model, stage, stages, layers

    @property
    def is_first(self) -> bool:
        """This stage reads the model's input."""
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """This stage returns the model's output (the loss is computed from it)."""
        return self.stage == self.stages - 1

    @property
    def vocab_size(self) -> int | None:
        """The token ids' and labels' range, when the model reads token ids."""
        return None

    def tied_weight(self) -> nn.Parameter | None:
        """This stage's copy of a tied weight (first and last stage), if any."""
        return None

    def extra_repr(self) -> str:
        return (f"stage {self.stage} of {self.stages}, blocks "
                f"{self.layers.start}..{self.layers.stop - 1}")


class DecoderStage(Stage):
    """This rank's stage of a decoder LM (see the module docstring).

    forward: first stage ``(B, T)`` token ids, others ``(B, T, H)`` hidden states
    -> ``(B, T, H)``, or ``(B, T, V)`` logits on the last stage. ``tied``: the
    model ties its input and output embeddings.
    """

    @property
    def vocab_size(self) -> int | None:
        """The model config's ``vocab_size``."""
        return getattr(getattr(self.model, "config", None), "vocab_size", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lm: Any = self.model  # a HuggingFace causal LM (its methods are untyped)
        decoder = lm.get_decoder()
        # The model's own decoder forward: position ids, rotary embeddings and the
        # causal mask are rebuilt from the input's shape on every stage.
        out = decoder(input_ids=x) if self.is_first else decoder(inputs_embeds=x)
        hidden = out.last_hidden_state  # (B, T, H)
        return lm.get_output_embeddings()(hidden) if self.is_last else hidden  # (B, T, V)

    def tied_weight(self) -> nn.Parameter | None:
        """This stage's copy of the tied embedding weight (first and last stage), if any."""
        if not self.tied or not (self.is_first or self.is_last):
            return None
        lm: Any = self.model
        owner = lm.get_input_embeddings() if self.is_first else lm.get_output_embeddings()
        return owner.weight

    def extra_repr(self) -> str:
        return (f"stage {self.stage} of {self.stages}, decoder layers "
                f"{self.layers.start}..{self.layers.stop - 1}")


@dataclass(frozen=True)
class _Cut:
    """How a model is cut: each stage's decoder layers, and whether embeddings are tied."""

    ranges: list[range]
    tied: bool
    layout: DecoderLayout


def decoder_stage(model: Any, stage: int, stages: int,
                  split: Sequence[int] | str | None = None) -> DecoderStage:
    """Turn ``model`` (in place) into pipeline stage ``stage`` of ``stages``.

    Args:
        model: A HuggingFace causal LM whose decoder (``get_decoder()``) has
            one of the layouts of :mod:`torchtp.pipeline.decoders`: blocks in
            ``layers`` (Llama, Mistral, Qwen2/3, their MoE variants...) or in
            ``h`` (GPT-2, GPT-Neo).
        stage: This rank's stage.
        stages: Pipeline stages (all of them, over every rank).
        split: Decoder layers per stage; ``None``: balanced layers
            (:func:`stage_layers`); ``"params"``: the split whose largest stage
            holds the fewest parameters, the embeddings counted on the first
            stage and the norm and LM head on the last
            (:func:`~torchtp.pipeline.balance.param_balanced_split`).

    Tied input and output embeddings (``tie_word_embeddings``) become two
    copies: the first stage's embedding weight and the last stage's LM head
    (``DecoderStage.tied``); :class:`~torchtp.pipeline.schedule.PipelineSchedule`
    sums their gradients after every step, so they stay identical.

    Raises:
        ValueError: the model lacks that structure, or the split is invalid.
    """
    return _cut_in_place(model, stage, stages, _plan(model, stages, split))


def decoder_stages(model: Any, stage_ids: Sequence[int], stages: int,
                   split: Sequence[int] | str | None = None) -> list[DecoderStage]:
    """Several stages of one model for one rank (interleaved and V-shaped schedules).

    Each stage is cut from its own copy of ``model``, which stays unchanged;
    a copy takes only what its stage keeps (the other stages' layers,
    embeddings, norm and head are not copied), so the copies together hold
    no more than ``model`` does.

    Args:
        model: As for :func:`decoder_stage`.
        stage_ids: The stages this rank holds
            (:func:`~torchtp.pipeline.schedule.stage_ids` gives them for a schedule).
        stages: Pipeline stages over all ranks.
        split: As for :func:`decoder_stage`.

    Raises:
        ValueError: as :func:`decoder_stage`, or a stage id outside ``[0, stages)``.
    """
    cut = _plan(model, stages, split)
    bad = [s for s in stage_ids if not 0 <= s < stages]
    if bad or not stage_ids:
        raise ValueError(f"stage_ids={list(stage_ids)}: give one or more stages in "
                         f"[0, {stages})")
    return [_cut_in_place(_copy_of_stage(model, s, stages, cut), s, stages, cut)
            for s in stage_ids]


def _plan(model: Any, stages: int, split: Sequence[int] | str | None) -> _Cut:
    decoder, layout = decoder_layout(model)
    head, blocks = model.get_output_embeddings(), getattr(decoder, layout.blocks)
    tied = stages > 1 and head.weight is model.get_input_embeddings().weight
    if split == "params":
        first = sum(_count(getattr(decoder, a)) for a in (layout.embed, *layout.first_only))
        split = param_balanced_split(first, list(map(_count, blocks)),
                                     _count(getattr(decoder, layout.norm)) + _count(head), stages)
    elif isinstance(split, str):
        raise ValueError(f"split={split!r}: give layers per stage, None (balanced layers) or "
                         "'params' (balanced parameters)")
    if stages > 1:
        _check_chain(model, layout)
    return _Cut(stage_layers(len(blocks), stages, split), tied, layout)


def _check_chain(model: Any, layout: DecoderLayout) -> None:
    """Refuse a model whose stages would not compute what its own forward does.

    A stage runs the model's decoder forward on what the stage before sent, and the
    last one applies the LM head alone. Probed on the model's one-layer copy
    (:func:`torchtp.hf.probe_copy.small_copy`, from its config): the logits must be
    the head of the decoder's output (Gemma 2's final soft-capping, Cohere's logit
    scale are not), and a stage holding none of the blocks must hand its input on
    unchanged (a decoder that scales ``inputs_embeds`` would scale every stage's).

    Raises:
        ValueError: either differs, naming what and the fix (a copy that cannot be
            built or run logs a warning instead).
    """
    with torch.device("cpu"):  # also when the caller builds on the meta device
        _check_copy(model, layout)


def _check_copy(model: Any, layout: DecoderLayout) -> None:
    probe = small_copy(model)
    if probe is None:
        logger.warning("torchtp: decoder_stage could not build a one-layer copy of %s to "
                       "check its stages against its forward", type(model).__name__)
        return
    lm: Any = probe  # a HuggingFace causal LM (its methods are untyped)
    # Two rows: transformers 5.3's Granite squeezes a batch of one off its output
    ids = torch.arange(1, 9).reshape(2, 4)  # (2, 4) token ids of the copy's vocabulary
    weight = lm.get_input_embeddings().weight  # (V, H)
    x = torch.randn(2, 4, weight.shape[-1], dtype=weight.dtype,
                    generator=torch.Generator().manual_seed(0))  # (2, 4, H)
    who = f"decoder_stage: {type(model).__name__}"
    try:
        with torch.no_grad():
            whole = lm(input_ids=ids).logits  # (2, 4, V)
            headed = lm.get_output_embeddings()(lm.get_decoder()(input_ids=ids)
                                                .last_hidden_state)
            middle = _cut_in_place(lm, 1, 3, _Cut([range(0, 1), range(1, 1), range(1, 1)],
                                                 False, layout))
            handed = middle(x)  # (2, 4, H): no block, no norm
    except Exception as err:  # a copy that does not run as built: no verdict either way
        logger.warning("torchtp: %s: the one-layer copy did not run (%s: %s), so its stages "
                       "are not checked against its forward", who, type(err).__name__, err)
        return
    if not torch.allclose(whole, headed, rtol=1e-5, atol=1e-6):
        raise ValueError(f"{who}'s logits are not its LM head applied to its decoder's output "
                         "(a soft-capping or scaling of the logits, as Gemma 2's "
                         "final_logit_softcapping or Cohere's logit_scale): its last stage "
                         "would return other logits, and the loss and every gradient would "
                         "differ; pipeline stages cut models whose logits are "
                         "lm_head(decoder(...).last_hidden_state)")
    if not torch.equal(handed, x):
        raise ValueError(f"{who}'s decoder changes the hidden states outside its blocks and "
                         "final norm (it scales inputs_embeds, for instance): every stage would "
                         "apply it again to what the stage before sent; pipeline stages cut "
                         "decoders that hand inputs_embeds to their first block unchanged")


def _count(module: nn.Module) -> int:
    """Parameters of ``module`` (a tied weight counts wherever it is held: a copy per stage)."""
    return sum(p.numel() for p in module.parameters())


def _dropped(model: Any, stage: int, stages: int, cut: _Cut) -> dict[int, Any]:
    """What stage ``stage`` does not hold, by module id, and what stands in for each."""
    decoder, layout = model.get_decoder(), cut.layout
    out: dict[int, Any] = {id(block): Elsewhere(i, block)
                           for i, block in enumerate(getattr(decoder, layout.blocks))
                           if i not in cut.ranges[stage] and not isinstance(block, Elsewhere)}
    if stage != 0:  # only the first stage reads token ids
        out[id(getattr(decoder, layout.embed))] = None
        for attr, kind in layout.first_only.items():
            out[id(getattr(decoder, attr))] = ZeroElsewhere(attr) if kind == "zero" \
                else Elsewhere(attr)
    if stage != stages - 1:  # the final norm and the LM head belong to the last stage
        out[id(getattr(decoder, layout.norm))] = Elsewhere(layout.norm)
        out[id(model.get_output_embeddings())] = None
    return out


def _copy_of_stage(model: Any, stage: int, stages: int, cut: _Cut) -> Any:
    """A deep copy of ``model`` without what stage ``stage`` drops (never copied)."""
    return copy.deepcopy(model, _dropped(model, stage, stages, cut))


def _cut_in_place(model: Any, stage: int, stages: int, cut: _Cut) -> DecoderStage:
    decoder, layout = model.get_decoder(), cut.layout
    if cut.tied and stage == stages - 1:  # the last stage's own copy of the shared weight
        head, embed = model.get_output_embeddings(), getattr(decoder, layout.embed)
        if embed is not None and head.weight is embed.weight:
            head.weight = nn.Parameter(head.weight.detach().clone(),
                                       requires_grad=head.weight.requires_grad)
    standins = _dropped(model, stage, stages, cut)
    for parent in (decoder, getattr(decoder, layout.blocks)):
        for name, child in list(parent.named_children()):
            if id(child) in standins:
                setattr(parent, name, standins[id(child)])
    if stage != stages - 1:
        model.set_output_embeddings(None)
    built = DecoderStage(model, stage, stages, cut.ranges[stage])
    built.tied = cut.tied
    return built
