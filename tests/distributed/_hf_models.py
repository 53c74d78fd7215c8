"""Tiny random-weight HuggingFace models built from configs (no downloads).

Sizes are chosen so tp 2 and 4 divide every split dimension: 8 query heads,
2 or 4 KV heads (Llama/Mistral/Qwen2 use GQA with 2 so tp=4 replicates KV
heads), vocab 128.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from torchtp.plans.state_space import FUSED_KERNELS

VOCAB = 128
# With a fused Mamba kernel's package importable (transformers >= 5.25 requires `kernels`)
# torchtp keeps Mamba-style mixers whole, with the reason in describe_plan(): tests of
# their split need the torch path (test_fused_kernel_keeps_mixers_whole tests the other).
NEEDS_MAMBA_TORCH_PATH = pytest.mark.skipif(
    any(importlib.util.find_spec(k) is not None for k in FUSED_KERNELS),
    reason=f"one of {FUSED_KERNELS} is importable: torchtp keeps Mamba mixers whole")


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
    configs.update(_more_configs(tf))
    configs.update(_uneven_configs(tf))
    config = configs[arch]()
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    if arch in SEQ2SEQ:
        return tf.AutoModelForSeq2SeqLM.from_config(config).eval()
    if arch in MASKED:
        return tf.AutoModelForMaskedLM.from_config(config).eval()
    return tf.AutoModelForCausalLM.from_config(config).eval()


def _more_configs(tf: object) -> dict:
    """Architectures beyond the core list (checked once at tp=4 by test_hf_more_archs)."""
    c = _common()
    gpt = {"vocab_size": VOCAB, "n_embd": 64, "n_layer": 2, "n_head": 8, "n_positions": 64}
    return {
        "gemma2": lambda: tf.Gemma2Config(**c, num_key_value_heads=4, head_dim=16),
        "starcoder2": lambda: tf.Starcoder2Config(**c, num_key_value_heads=4),
        "olmo": lambda: tf.OlmoConfig(**c, num_key_value_heads=4),
        "olmo2": lambda: tf.Olmo2Config(**c, num_key_value_heads=4),
        # q/k norms over all heads, 2 KV heads: replicated on 2 ranks each at tp 4.
        "olmo2-gqa": lambda: tf.Olmo2Config(**c, num_key_value_heads=2),
        "granite": lambda: tf.GraniteConfig(**c, num_key_value_heads=4),
        "cohere": lambda: tf.CohereConfig(**c, num_key_value_heads=4),
        "phi": lambda: tf.PhiConfig(**c),
        "stablelm": lambda: tf.StableLmConfig(**c, num_key_value_heads=4),
        "mistral-mqa": lambda: tf.MistralConfig(**c, num_key_value_heads=1),
        "llama-bias": lambda: tf.LlamaConfig(**c, num_key_value_heads=2, attention_bias=True,
                                             mlp_bias=True),
        "falcon": lambda: tf.FalconConfig(vocab_size=VOCAB, hidden_size=64,
                                          num_hidden_layers=2, num_attention_heads=8),
        "falcon-new": lambda: tf.FalconConfig(vocab_size=VOCAB, hidden_size=64,
                                              num_hidden_layers=2, num_attention_heads=8,
                                              new_decoder_architecture=True, num_kv_heads=4),
        "gptj": lambda: tf.GPTJConfig(**gpt, rotary_dim=4),
        "codegen": lambda: tf.CodeGenConfig(**gpt, rotary_dim=4),
        "bloom": lambda: tf.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=8),
        "mpt": lambda: tf.MptConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=8,
                                    max_seq_len=64),
        "roberta": lambda: tf.RobertaConfig(**c),
        "distilbert": lambda: tf.DistilBertConfig(vocab_size=VOCAB, dim=64, hidden_dim=128,
                                                  n_layers=2, n_heads=8),
        "electra": lambda: tf.ElectraConfig(**c, embedding_size=64),
        "t5": lambda: tf.T5Config(vocab_size=VOCAB, d_model=64, d_kv=8, d_ff=128, num_layers=2,
                                  num_heads=8, decoder_start_token_id=0),
        # Qwen3 with an HF plan that leaves its per-head_dim q_norm/k_norm plainly
        # replicated, as transformers 5.25's Param2MoE plan does with its own.
        "qwen3-bare-norms": lambda: _without_norm_rules(
            tf.Qwen3Config(**c, num_key_value_heads=4, head_dim=8)),
        # Llama 4: experts transformers does not decorate, (E, H, 2I) and (E, I, H), called
        # with every expert's rows already routed; a shared expert; q/k norms; a no-RoPE
        # layer (the second), layers alternating dense MLP and MoE.
        "llama4": lambda: tf.Llama4TextConfig(
            **c, num_key_value_heads=4, head_dim=8, intermediate_size_mlp=128,
            num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
            no_rope_layers=[1, 0], attention_chunk_size=32),
        # xIELU activation between up_proj and down_proj, with learnable scalars read
        # inside the MLP's split region: their gradients need summing too.
        "apertus": lambda: tf.ApertusConfig(**c, num_key_value_heads=4),
        # Attention sinks (one learnable value per head) its HF plan cuts with the heads
        # ('local_params'); new in transformers 5.24.
        "granite_swa": lambda: tf.GraniteSWAConfig(**c, num_key_value_heads=4),
        "bart": lambda: tf.BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2,
                                      decoder_layers=2, encoder_attention_heads=8,
                                      decoder_attention_heads=8, encoder_ffn_dim=128,
                                      decoder_ffn_dim=128, max_position_embeddings=64),
        # An encoder-decoder whose dummy inputs hold no decoder ids and which does not
        # shift input_ids itself: the probe must supply decoder_input_ids.
        "pegasus": lambda: tf.PegasusConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2,
                                            decoder_layers=2, encoder_attention_heads=8,
                                            decoder_attention_heads=8, encoder_ffn_dim=128,
                                            decoder_ffn_dim=128, max_position_embeddings=64,
                                            bos_token_id=1),  # 5.3's padding check reads it
    }


def _without_norm_rules(config: object) -> object:
    """``config`` with the norm entries taken out of its HF TP plan."""
    plan = dict(config.base_model_tp_plan)  # type: ignore[attr-defined]
    config.base_model_tp_plan = {k: v for k, v in plan.items() if "norm" not in k}
    return config


def _uneven_configs(tf: object) -> dict:
    """Sizes that divide by neither 3 nor 4: vocab 97, hidden 70/55, intermediate 98.

    Llama: 10 query heads in 2 KV groups (tp 3: KV heads replicated, query heads 3/2/5;
    tp 4: 3/2/3/2); Qwen2-0.5B's 14 heads / 2 KV heads; a tied Llama with 7 heads
    (3/2/2, 2/2/2/1) and its embedding + LM head split by vocabulary; GPT-2: Conv1D,
    packed q|k|v, 5 heads (2/2/1, 2/1/1/1).
    """
    c = {"vocab_size": 97, "hidden_size": 70, "intermediate_size": 98, "num_hidden_layers": 2,
         "max_position_embeddings": 64}
    return {
        "llama-uneven": lambda: tf.LlamaConfig(**c, num_attention_heads=10, num_key_value_heads=2,
                                               head_dim=8),
        "qwen2-uneven": lambda: tf.Qwen2Config(**c, num_attention_heads=14, num_key_value_heads=2,
                                               head_dim=6),
        # Multi-head latent attention (dense layers only: the MoE layers are checked in
        # float64 by test_moe), query LoRA (V3) and a plain q_proj (V2); 10 heads.
        "deepseek_v3-uneven": lambda: tf.DeepseekV3Config(
            **c, num_attention_heads=10, num_key_value_heads=10, q_lora_rank=24,
            kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6,
            first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=24, n_group=1, topk_group=1, rope_scaling=None),
        "deepseek_v2-uneven": lambda: tf.DeepseekV2Config(
            **c, num_attention_heads=10, num_key_value_heads=10, q_lora_rank=None,
            kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6,
            first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=24, rope_scaling=None),
        "olmo2-uneven": lambda: tf.Olmo2Config(**c, num_attention_heads=10,
                                               num_key_value_heads=2, head_dim=8),
        "llama-tied-uneven": lambda: tf.LlamaConfig(**c, num_attention_heads=7,
                                                    num_key_value_heads=7,
                                                    tie_word_embeddings=True),
        "gpt2-uneven": lambda: tf.GPT2Config(vocab_size=97, n_embd=55, n_layer=2, n_head=5,
                                             n_inner=98, n_positions=64, bos_token_id=0,
                                             eos_token_id=1),
        **_state_space_configs(tf),
    }


def _state_space_configs(tf: object) -> dict:
    """State-space mixers (tests/distributed/test_hf_new_families.py).

    Mamba-2: 16 heads in 2 groups (tp 4: each group on two ranks) and 10 heads in one group
    (released checkpoints' n_groups=1: every rank shares the group's B/C and the gated
    norm's statistic; tp 3: 4/3/3 heads). Falcon-H1 with its gated norm (gate after the
    norm, distinct multipliers in its mup_vector) and without one (the gate alone). Mamba-1
    (Mamba, Jamba), the gated delta-net (Qwen3-Next) and the Mamba-2 mixers of Bamba,
    NemotronH and GraniteMoeHybrid.
    """
    mamba = {"num_hidden_layers": 2, "state_size": 8, "conv_kernel": 4, "chunk_size": 4,
             "expand": 2, "head_dim": 8}
    falcon = {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
              "mamba_d_head": 8, "mamba_d_state": 8, "mamba_chunk_size": 4,
              "max_position_embeddings": 64}
    next_common = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8,
                   "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 128,
                   "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                   "shared_expert_intermediate_size": 32, "linear_key_head_dim": 8,
                   "linear_value_head_dim": 8, "max_position_embeddings": 64,
                   "layer_types": ["linear_attention", "full_attention"]}
    hybrid = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 128}
    return {
        "mamba2": lambda: tf.Mamba2Config(**mamba, vocab_size=VOCAB, hidden_size=64,
                                          num_heads=16, n_groups=2),
        "mamba2-uneven": lambda: tf.Mamba2Config(**mamba, vocab_size=97, hidden_size=40,
                                                 num_heads=10, n_groups=1),
        "falcon_h1": lambda: tf.FalconH1Config(**falcon, vocab_size=VOCAB, hidden_size=64,
                                               intermediate_size=128, mamba_n_heads=16,
                                               mamba_n_groups=2, mamba_d_ssm=128,
                                               mamba_rms_norm=True,
                                               ssm_multipliers=[0.5, 1.5, 2.0, 0.75, 1.25]),
        "mamba-uneven": lambda: tf.MambaConfig(vocab_size=97, hidden_size=40, num_hidden_layers=2,
                                        state_size=8, conv_kernel=4, expand=2,
                                        time_step_rank=6),
        # Mamba-1 mixers with norms on dt/B/C, attention every other layer, MoE on layer 1.
        "jamba": lambda: tf.JambaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=8,
                                        num_key_value_heads=2, num_experts=4,
                                        num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4,
                                        mamba_expand=2, attn_layer_period=2, attn_layer_offset=1,
                                        expert_layer_period=2, expert_layer_offset=1,
                                        use_mamba_kernels=False),
        # Gated delta-net beside gated attention and MoE: 4 key heads with 2 value heads each,
        # and 2 key heads with 3 each (tp 3 and 4: a key head replicated on two ranks).
        "qwen3_next": lambda: tf.Qwen3NextConfig(**next_common, vocab_size=VOCAB,
                                                 linear_num_key_heads=4,
                                                 linear_num_value_heads=8),
        "qwen3_next-uneven": lambda: tf.Qwen3NextConfig(**next_common, vocab_size=97,
                                                        linear_num_key_heads=2,
                                                        linear_num_value_heads=6),
        # Qwen3.5: the same gated delta-net, which its HF plan computes split but gathers
        # after every projection (colwise_gather_output), and a dense MLP.
        "qwen3_5_text": lambda: tf.Qwen3_5TextConfig(**next_common, vocab_size=VOCAB,
                                                     linear_num_key_heads=4,
                                                     linear_num_value_heads=8),
        # OLMo-hybrid: OLMo 2's norms after each block in its attention layers, a norm
        # before each in its gated delta-net layers.
        "olmo_hybrid": lambda: tf.OlmoHybridConfig(**next_common, vocab_size=VOCAB,
                                                   linear_num_key_heads=4,
                                                   linear_num_value_heads=8, pad_token_id=0,
                                                   bos_token_id=1, eos_token_id=2),
        # Mamba-2 mixers in other hybrids: Bamba (attention on layer 1), NemotronH (its
        # own pattern of mixer, attention and MLP layers), GraniteMoeHybrid (mixers + MoE).
        "bamba": lambda: tf.BambaConfig(**hybrid, mamba_n_heads=16, mamba_d_head=8,
                                        mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=4,
                                        attn_layer_indices=[1]),
        # transformers before 5.24 names the layer kinds "mamba" and "attention" (and
        # NemotronH has no plain MLP layer kind there).
        "nemotron_h": lambda: _layer_kinds(
            tf.NemotronHConfig, "layers_block_type",
            ["linear_attention", "mlp", "full_attention", "mlp"], ["mamba", "attention"] * 2,
            **{**hybrid, "num_hidden_layers": 4}, mamba_num_heads=16, mamba_head_dim=8,
            n_groups=2, ssm_state_size=8, chunk_size=4),
        "granitemoehybrid": lambda: _layer_kinds(
            tf.GraniteMoeHybridConfig, "layer_types", ["linear_attention", "full_attention"],
            ["mamba", "attention"], **hybrid, mamba_n_heads=16, mamba_d_head=8,
            mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=4, num_local_experts=4,
            num_experts_per_tok=2, shared_intermediate_size=64),
        "falcon_h1-uneven": lambda: tf.FalconH1Config(**falcon, vocab_size=97, hidden_size=40,
                                                      intermediate_size=98, mamba_n_heads=10,
                                                      mamba_n_groups=1, mamba_d_ssm=80),
    }


def _layer_kinds(config_class: type, field: str, kinds: list[str], older: list[str],
                 **sizes: object) -> object:
    """``config_class(**sizes)`` with its layer kinds under today's names, or the names of
    the transformers releases before 5.24 (``older``) where those are refused."""
    try:
        return config_class(**sizes, **{field: kinds})
    except ValueError:
        return config_class(**sizes, **{field: older})


UNEVEN_VOCAB = 97


def vocab_of(arch: str) -> int:
    """The vocabulary size of ``arch`` (input ids must stay below it)."""
    return UNEVEN_VOCAB if arch.endswith("-uneven") else VOCAB


SEQ2SEQ = {"t5", "bart", "pegasus"}
MASKED = {"bert", "roberta", "distilbert", "electra"}


GENERATES = {"granite_swa", "llama4", "llama", "llama-tied", "mistral", "qwen2", "qwen3", "phi3",
             "gpt_neox", "gpt2", "opt",
             "gemma", "gpt_bigcode", "gemma2", "starcoder2", "olmo", "olmo2", "granite", "cohere",
             "phi", "stablelm", "mistral-mqa", "llama-bias", "falcon", "falcon-new", "gptj",
             "codegen", "bloom", "mpt", "t5", "bart", "pegasus", "llama-uneven", "qwen2-uneven",
             "llama-tied-uneven", "gpt2-uneven", "olmo2-gqa", "olmo2-uneven",
             "deepseek_v3-uneven", "deepseek_v2-uneven", "mamba2", "mamba2-uneven", "falcon_h1",
             "falcon_h1-uneven", "mamba-uneven", "jamba", "qwen3_next", "qwen3_next-uneven", "bamba",
             "nemotron_h", "granitemoehybrid"}
