"""Tiny random-weight HuggingFace models built from configs (no downloads).

Sizes are chosen so tp 2 and 4 divide every split dimension: 8 query heads,
2 or 4 KV heads (Llama/Mistral/Qwen2 use GQA with 2 so tp=4 replicates KV
heads), vocab 128.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 128


def _common() -> dict:
    return {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 8, "max_position_embeddings": 64}


def build(arch: str, seed: int = 0, **overrides: object) -> nn.Module:
    """A tiny ``arch`` model (in eval mode, fp32) built under ``seed``."""
    import transformers as tf

    configs = {
        "llama": lambda: tf.LlamaConfig(**_common(), num_key_value_heads=2),
        "llama-tied": lambda: tf.LlamaConfig(**_common(), num_key_value_heads=4,
                                             tie_word_embeddings=True),
        "mistral": lambda: tf.MistralConfig(**_common(), num_key_value_heads=2, sliding_window=32),
        "qwen2": lambda: tf.Qwen2Config(**_common(), num_key_value_heads=2),
        "qwen3": lambda: tf.Qwen3Config(**_common(), num_key_value_heads=4, head_dim=8),
        "phi3": lambda: tf.Phi3Config(**_common(), num_key_value_heads=4, pad_token_id=0),
        "gpt_neox": lambda: tf.GPTNeoXConfig(**_common(), rotary_pct=0.5),
        "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=8,
                                      n_positions=64, bos_token_id=0, eos_token_id=1),
        "bert": lambda: tf.BertConfig(**_common()),
        # Gemma: an nn.Embedding subclass that scales its lookup; head_dim != hidden/heads.
        "gemma": lambda: tf.GemmaConfig(**_common(), num_key_value_heads=4, head_dim=16),
        # GPT-BigCode: multi-query attention, one KV head replicated on every rank.
        "gpt_bigcode": lambda: tf.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=64, n_layer=2,
                                                   n_head=8, n_positions=64, bos_token_id=0,
                                                   eos_token_id=1),
        "opt": lambda: tf.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128,
                                    num_hidden_layers=2, num_attention_heads=8,
                                    max_position_embeddings=64, word_embed_proj_dim=64,
                                    bos_token_id=0, eos_token_id=1, pad_token_id=2),
    }
    config = configs[arch]()
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    cls = tf.BertForMaskedLM if arch == "bert" else tf.AutoModelForCausalLM
    model = cls(config) if arch == "bert" else cls.from_config(config)
    return model.eval()


GENERATES = {"llama", "llama-tied", "mistral", "qwen2", "qwen3", "phi3", "gpt_neox", "gpt2", "opt",
             "gemma", "gpt_bigcode"}
