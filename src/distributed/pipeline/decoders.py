"""Where a HuggingFace decoder LM keeps what a pipeline stage cuts.

Two layouts cover the decoder LMs a stage is cut from:

* Llama-style (Llama, Mistral, Qwen2/3, their MoE variants, ...): the decoder
  holds its blocks in ``layers``, the final norm in ``norm`` and the token
  embeddings in ``embed_tokens``;
* GPT-2-style (GPT-2, GPT-Neo, ...): blocks in ``h``, the final norm in
  ``ln_f``, token embeddings in ``wte``, and two more modules only the first
  stage runs: learned position embeddings ``wpe``, added to the input
  embeddings (a later stage, handed hidden states as ``inputs_embeds``, must
  add nothing: its stand-in returns 0) and the embedding dropout ``drop``
  (applied once, on the first stage: its stand-in hands its input on).

Found by attributes, not by class: a model with either shape is cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class DecoderLayout:
    """Attribute names of a decoder's parts (see the module docstring).

    Attributes:
        blocks: The ``nn.ModuleList`` of decoder blocks.
        norm: The final norm (last stage).
        embed: The token embeddings (first stage).
        first_only: Other modules only the first stage runs, each with the
            stand-in the other stages get: ``"zero"`` (adds nothing) or
            ``"pass"`` (hands its input on).
    """

    blocks: str
    norm: str
    embed: str
    first_only: dict[str, str] = field(default_factory=dict)


_LAYOUTS = (
    DecoderLayout("layers", "norm", "embed_tokens"),
    DecoderLayout("h", "ln_f", "wte", {"wpe": "zero", "drop": "pass"}),
)


def decoder_layout(model: Any) -> tuple[Any, DecoderLayout]:
    """``model``'s decoder (``get_decoder()``) and the layout it has.

    Raises:
        ValueError: no known layout fits, naming what is missing.
    """
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    for layout in _LAYOUTS:
        if decoder is not None and isinstance(getattr(decoder, layout.blocks, None), nn.ModuleList) \
                and all(hasattr(decoder, a) for a in (layout.norm, layout.embed, *layout.first_only)) \
                and model.get_output_embeddings() is not None:
            return decoder, layout
    raise ValueError(f"{type(model).__name__}: decoder_stage needs a HuggingFace causal LM "
                     "whose decoder (get_decoder()) holds its blocks in `layers` with its final "
                     "norm in `norm` and embeddings in `embed_tokens` (Llama-style), or in `h` "
                     "with `ln_f` and `wte` (GPT-2-style), and an output embedding (the LM head); "
                     "for another chain of blocks use block_stage")


class ZeroElsewhere(nn.Module):
    """Stands in for a module whose output another stage already added: returns 0.

    A 0-dim zero, so adding it changes neither the value nor the dtype of the
    hidden states. Marked ``held_elsewhere`` like
    :class:`~torchtp.pipeline.stage.Elsewhere`.
    """

    held_elsewhere = True

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros((), device=x.device)

    def extra_repr(self) -> str:
        return f"{self.what}: on the first pipeline stage (adds nothing here)"
