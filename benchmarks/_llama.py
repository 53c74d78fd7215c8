"""The small Llama-architecture model every benchmark uses (random weights, built locally)."""

from __future__ import annotations

from typing import Any

import torch

# hidden 512, 4 layers, 8 heads (8 KV heads), ffn 1408: divisible by tp 1, 2, 4, 8.
SMALL = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 8, "intermediate_size": 1408, "vocab_size": 2048,
         "max_position_embeddings": 1024}

HF_PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


def llama_config(**overrides: Any) -> Any:
    """A ``LlamaConfig`` for :data:`SMALL` (sdpa attention for every variant)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{**SMALL, **overrides})
    cfg._attn_implementation = "sdpa"
    return cfg


def build_llama(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """Identical random weights on every rank (same seed)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(**overrides)).eval()
