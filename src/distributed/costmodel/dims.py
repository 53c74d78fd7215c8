"""Model dimensions the cost model needs, from a HF config.json or by hand."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelDims:
    """A Llama-style decoder-only transformer's shape.

    Attributes:
        hidden: Hidden size ``h``.
        layers: Number of decoder layers.
        heads: Query heads.
        kv_heads: Key/value heads (``heads`` without GQA).
        ffn: MLP intermediate size (gated MLP: gate, up and down projections).
        vocab: Vocabulary size (embedding and replicated ``lm_head``).
        head_dim: Per-head size; ``hidden // heads`` when the config has none.
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    head_dim: int

    @classmethod
    def make(cls, hidden: int, layers: int, heads: int, ffn: int | None = None,
             vocab: int = 32000, kv_heads: int | None = None,
             head_dim: int | None = None) -> ModelDims:
        """Fill in the usual defaults (``ffn = 4h``, no GQA, ``head_dim = h/heads``).

        Raises:
            ValueError: a size is not positive or ``hidden`` is not divisible by ``heads``.
        """
        for name, value in (("hidden", hidden), ("layers", layers), ("heads", heads)):
            if value < 1:
                raise ValueError(f"model dimension {name} must be >= 1, got {value}")
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"hidden={hidden} is not divisible by heads={heads}; "
                                 "pass head_dim explicitly")
            head_dim = hidden // heads
        return cls(hidden, layers, heads, kv_heads or heads, ffn or 4 * hidden, vocab, head_dim)

    @property
    def q_dim(self) -> int:
        """Width of the query projection output (``heads * head_dim``)."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of one key or value projection output (``kv_heads * head_dim``)."""
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Matmul weights of one decoder layer (q, k, v, o, gate, up, down)."""
        attn = self.hidden * (2 * self.q_dim + 2 * self.kv_dim)
        return attn + 3 * self.hidden * self.ffn

    def as_dict(self) -> dict[str, Any]:
        """The dimensions as plain data."""
        return asdict(self)


def read_config(path: str | Path) -> dict[str, Any]:
    """Read a HF ``config.json`` (or the one inside a model directory).

    Raises:
        ValueError: no such file/directory, no config.json in it, or not valid JSON.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        hint = ""
        if not Path(path).exists() and str(path).count("/") == 1 and not str(path).startswith("."):
            hint = (f" ({path!r} looks like a Hub id: nothing is downloaded; fetch it first, e.g. "
                    f"`huggingface-cli download {path} --local-dir DIR`, and pass DIR)")
        raise ValueError(f"cannot read model config: {p} does not exist; pass a HuggingFace "
                         f"model directory (containing config.json) or a config.json file{hint}")
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read model config {p}: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"model config {p} is not a JSON object")
    return data


def dims_from_config(config: dict[str, Any], source: str = "config") -> ModelDims:
    """Build :class:`ModelDims` from a HF config dict (Llama/Mistral/Qwen names).

    Raises:
        ValueError: a required key is missing; the message names it.
    """
    def need(*keys: str) -> int:
        for key in keys:
            if key in config and config[key] is not None:
                return int(config[key])
        raise ValueError(f"{source}: missing {' or '.join(keys)}; pass --hidden/--layers/"
                         "--heads/--ffn/--vocab instead")

    hidden = need("hidden_size", "n_embd", "d_model")
    heads = need("num_attention_heads", "n_head")
    return ModelDims.make(
        hidden=hidden, layers=need("num_hidden_layers", "n_layer"), heads=heads,
        ffn=need("intermediate_size", "n_inner") if any(
            config.get(k) for k in ("intermediate_size", "n_inner")) else None,
        vocab=need("vocab_size"), kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim"))
