"""The shape of a decoder-only model, as the layout planner sees it.

:class:`Arch` holds what memory and time depend on: widths, heads, layers,
vocabulary, the MLP kind, experts and latent attention. It is read from a
HuggingFace config (:func:`arch_from_config`: the Llama, Mistral, Qwen2/3,
Qwen3-MoE, Mixtral, DeepSeek-V2/V3 and GPT-2 names) or written by hand for
a published model that has no config here (:mod:`torchtp.planner.published`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

_GATED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v2",
          "deepseek_v3", "olmo2", "phi3")


@dataclass(frozen=True)
class Latent:
    """Multi-head latent attention (DeepSeek-V2/V3): low-rank queries, keys and values.

    Attributes:
        q_rank: Query down-projection rank (``q_lora_rank``; 0: a plain ``q_proj``).
        kv_rank: Key/value latent rank (``kv_lora_rank``).
        rope_dim: Per-head rotary part of queries and keys (``qk_rope_head_dim``).
        nope_dim: Per-head non-rotary part (``qk_nope_head_dim``).
        v_dim: Per-head value width (``v_head_dim``).
    """

    q_rank: int
    kv_rank: int
    rope_dim: int
    nope_dim: int
    v_dim: int


@dataclass(frozen=True)
class Experts:
    """A mixture of experts in every layer after the first ``dense_layers``.

    Attributes:
        count: Routed experts per MoE layer.
        top_k: Experts each token is sent to.
        ffn: Intermediate size of one routed expert.
        shared_ffn: Intermediate size of the shared experts together (0: none).
        dense_layers: Leading layers with a dense MLP instead (DeepSeek's ``first_k_dense_replace``).
        router_bias: The router has a per-expert score bias (DeepSeek-V3).
    """

    count: int
    top_k: int
    ffn: int
    shared_ffn: int = 0
    dense_layers: int = 0
    router_bias: bool = False


@dataclass(frozen=True)
class Arch:
    """A decoder-only transformer's shape.

    Attributes:
        name: What it is called in tables.
        hidden: Model width ``h``.
        layers: Decoder layers.
        heads: Query heads.
        kv_heads: Key/value heads (GQA when fewer than ``heads``).
        head_dim: Per-head width of queries and keys.
        ffn: Dense MLP intermediate size.
        vocab: Vocabulary size.
        mlp: ``"gated"`` (SiLU gate, up, down: Llama) or ``"plain"`` (GELU up,
            down: GPT-2 and Megatron's GPT).
        norm: ``"rms"`` (no bias) or ``"layer"`` (weight and bias).
        bias: Linear layers have biases (``"qkv"``: only q/k/v, as Qwen2;
            ``"all"``: every linear, as GPT-2; ``""``: none).
        tied: The LM head is the input embedding.
        positions: Rows of a learned position table (GPT-2); 0: rotary.
        qk_norm: Per-head RMSNorms on queries and keys (Qwen3, OLMo-2).
        experts: The mixture of experts, or ``None`` for a dense model.
        latent: Latent attention, or ``None``.
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    mlp: str = "gated"
    norm: str = "rms"
    bias: str = ""
    tied: bool = False
    positions: int = 0
    qk_norm: bool = False
    experts: Experts | None = None
    latent: Latent | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def q_dim(self) -> int:
        """Width of all query heads (``heads * head_dim``; latent: nope + rope per head)."""
        if self.latent is not None:
            return self.heads * (self.latent.nope_dim + self.latent.rope_dim)
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key heads (one of keys or values; latent: values' width)."""
        if self.latent is not None:
            return self.heads * self.latent.v_dim
        return self.kv_heads * self.head_dim

    @property
    def v_dim(self) -> int:
        """Width of all value heads (the attention output's width)."""
        return self.heads * self.latent.v_dim if self.latent is not None else self.q_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has experts."""
        return self.experts is not None and layer >= self.experts.dense_layers

    @property
    def moe_layers(self) -> int:
        """How many layers have experts."""
        return sum(self.is_moe_layer(i) for i in range(self.layers))

    def as_dict(self) -> dict[str, Any]:
        """The shape as plain data."""
        out = asdict(self)
        out.pop("extra")
        return out


def _get(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def _need(config: dict[str, Any], source: str, *keys: str) -> int:
    value = _get(config, *keys)
    if value is None:
        raise ValueError(f"{source}: the config has no {' or '.join(keys)}; the layout planner "
                         "needs it (give the shape by hand with torchtp.planner.Arch)")
    return int(value)


def arch_from_config(config: Any, source: str = "config") -> Arch:
    """The :class:`Arch` of a HuggingFace config (a ``PretrainedConfig`` or its dict).

    Raises:
        ValueError: a size the planner needs is missing, naming it.
    """
    data: dict[str, Any] = config if isinstance(config, dict) else config.to_dict()
    kind = str(data.get("model_type", ""))
    hidden = _need(data, source, "hidden_size", "n_embd", "d_model")
    heads = _need(data, source, "num_attention_heads", "n_head")
    gated = kind in _GATED or kind not in ("gpt2", "gpt_neo", "gptj")
    ffn = int(_get(data, "intermediate_size", "n_inner", default=0) or 4 * hidden)
    experts = _experts(data)
    latent = _latent(data)
    return Arch(
        name=str(_get(data, "_name_or_path", default="") or kind or "model"),
        hidden=hidden, layers=_need(data, source, "num_hidden_layers", "n_layer"), heads=heads,
        kv_heads=int(_get(data, "num_key_value_heads", default=heads)),
        head_dim=int(_get(data, "head_dim", default=hidden // heads)),
        ffn=ffn, vocab=_need(data, source, "vocab_size"),
        mlp="gated" if gated else "plain", norm="rms" if gated else "layer",
        bias="all" if not gated else ("qkv" if kind == "qwen2" or data.get("attention_bias")
                                      else ""),
        tied=bool(data.get("tie_word_embeddings", not gated)),
        positions=int(data.get("n_positions", 0)) if not gated else 0,
        qk_norm=kind in ("qwen3", "qwen3_moe", "olmo2"), experts=experts, latent=latent,
        extra={"model_type": kind})


def _experts(data: dict[str, Any]) -> Experts | None:
    count = _get(data, "num_local_experts", "num_experts", "n_routed_experts")
    if not count:
        return None
    shared = int(_get(data, "n_shared_experts", default=0) or 0)
    expert_ffn = int(_get(data, "moe_intermediate_size", "intermediate_size"))
    return Experts(count=int(count), top_k=int(_get(data, "num_experts_per_tok", "top_k")),
                   ffn=expert_ffn, shared_ffn=shared * expert_ffn,
                   dense_layers=int(_get(data, "first_k_dense_replace", default=0) or 0),
                   router_bias=data.get("model_type") == "deepseek_v3")


def _latent(data: dict[str, Any]) -> Latent | None:
    if not data.get("kv_lora_rank"):
        return None
    return Latent(q_rank=int(data.get("q_lora_rank") or 0), kv_rank=int(data["kv_lora_rank"]),
                  rope_dim=int(data["qk_rope_head_dim"]), nope_dim=int(data["qk_nope_head_dim"]),
                  v_dim=int(data["v_head_dim"]))
