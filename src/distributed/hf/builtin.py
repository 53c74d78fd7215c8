"""torchtp's own plans for popular architectures that ship no HF plan.

Keys are ``config.model_type``; patterns are relative to the base model and
are prefixed with its attribute name (``transformer.``, ``bert.``...) when a
head model is wrapped. Every attention block gets one all-reduce and every
MLP one; tied embeddings stay replicated.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_BERT = {
    "encoder.layer.*.attention.self.query": "colwise",
    "encoder.layer.*.attention.self.key": "colwise",
    "encoder.layer.*.attention.self.value": "colwise",
    "encoder.layer.*.attention.output.dense": "rowwise",
    "encoder.layer.*.intermediate.dense": "colwise",
    "encoder.layer.*.output.dense": "rowwise",
}

def _t5_stack(stack: str, attention: tuple[str, ...], mlp: str) -> dict[str, str]:
    """One T5 stack: each attention's q/k/v by whole heads, o rowwise; the relative position
    table whole on every rank, its gradient summed (each rank's heads read their columns);
    the feed-forward (plain ``wi`` or gated ``wi_0``/``wi_1``) as a pair."""
    plan = {}
    for layer, name in enumerate(attention):
        lead = f"{stack}.block.*.layer.{layer}.{name}"
        plan.update({f"{lead}.q": "colwise", f"{lead}.k": "colwise", f"{lead}.v": "colwise",
                     f"{lead}.o": "rowwise"})
    plan[f"{stack}.block.*.layer.0.SelfAttention.relative_attention_bias"] = \
        "replicated_with_grad_allreduce"
    ffn = f"{stack}.block.*.layer.{mlp}.DenseReluDense"
    plan.update({f"{ffn}.wi": "colwise", f"{ffn}.wi_0": "colwise", f"{ffn}.wi_1": "colwise",
                 f"{ffn}.wo": "rowwise"})
    return plan


# T5 (and mT5, UMT5): encoder self-attention, decoder self- and cross-attention.
_T5 = {**_t5_stack("encoder", ("SelfAttention",), "1"),
       **_t5_stack("decoder", ("SelfAttention", "EncDecAttention"), "2")}

BUILTIN_PLANS: dict[str, dict[str, str]] = {
    "t5": _T5,
    "mt5": _T5,
    "umt5": _T5,
    # GPT-2: c_attn is a Conv1D with q|k|v stacked along out_features.
    "gpt2": {
        "h.*.attn.c_attn": "packed_colwise",
        "h.*.attn.c_proj": "rowwise",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    },
    "bert": _BERT,
    "roberta": _BERT,
    "xlm-roberta": _BERT,
    "electra": _BERT,
    # GPT-BigCode (StarCoder): multi-query attention, c_attn stacks q (all heads)
    # | k | v (one head each); the single KV head is replicated on every rank.
    "gpt_bigcode": {
        "h.*.attn.c_attn": "packed_colwise",
        "h.*.attn.c_proj": "rowwise",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    },
    "opt": {
        "decoder.layers.*.self_attn.q_proj": "colwise",
        "decoder.layers.*.self_attn.k_proj": "colwise",
        "decoder.layers.*.self_attn.v_proj": "colwise",
        "decoder.layers.*.self_attn.out_proj": "rowwise",
        "decoder.layers.*.fc1": "colwise",
        "decoder.layers.*.fc2": "rowwise",
    },
    # Falcon's fused query_key_value layout differs between its variants, so the
    # attention input stays whole (gathered) and only the output is split. The
    # automatic plan splits it by whole heads or KV groups (confirmed by its probe)
    # and wins by cost.
    "falcon": {
        "h.*.self_attention.query_key_value": "colwise_gather_output",
        "h.*.self_attention.dense": "rowwise_split_input",
        "h.*.mlp.dense_h_to_4h": "colwise",
        "h.*.mlp.dense_4h_to_h": "rowwise",
    },
    # Phi-3's HF plan gathers its fused qkv_proj / gate_up_proj outputs (two
    # all-gathers per layer). Splitting the packed parts keeps heads local:
    # two all-reduces per layer. The cost model picks it over HF's plan (same
    # memory, less communication); plan="builtin" selects it as written.
    "phi3": {
        "embed_tokens": "embedding_rowwise",
        "layers.*.self_attn.qkv_proj": "packed_colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_up_proj": "packed_colwise",
        "layers.*.mlp.down_proj": "rowwise",
    },
    # Jamba's HF plan names only its experts: the built-in one adds its attention (every
    # attn_layer_period-th layer) and dense MLPs; its Mamba mixers are added as for every
    # model (plans/state_space), the attention split verified by the head probe.
    "jamba": {
        "embed_tokens": "embedding_rowwise",
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.feed_forward.gate_proj": "colwise",
        "layers.*.feed_forward.up_proj": "colwise",
        "layers.*.feed_forward.down_proj": "rowwise",
        "layers.*.feed_forward.experts.gate_up_proj": "packed_colwise",
        "layers.*.feed_forward.experts.down_proj": "rowwise",
        "layers.*.feed_forward.experts": "moe_tp_experts",
    },
    # As transformers ships it from 5.24, so every supported release splits GPT-J alike.
    "gptj": {
        "wte": "embedding_rowwise",
        "h.*.attn.q_proj": "colwise",
        "h.*.attn.k_proj": "colwise",
        "h.*.attn.v_proj": "colwise",
        "h.*.attn.out_proj": "rowwise",
        "h.*.mlp.fc_in": "colwise",
        "h.*.mlp.fc_out": "rowwise",
    },
}


# Head-model outputs that the built-in plans split (their input is replicated).
_HEADS = {"phi3": {"lm_head": "colwise_gather_output"},
          "gptj": {"lm_head": "colwise_gather_output"},
          "jamba": {"lm_head": "colwise_gather_output"}}


# Models whose attention normalises q and k over all heads (OLMo-2 and its kin): their HF
# plans gather q/k/v ("we need to replicate here due to the added norm on q and k"). The
# built-in plan is that plan with whole heads kept local instead: q/k/v split by heads,
# the norms split with them (their mean of squares summed over the ranks, decision 152).
HEAD_NORM_TYPES = frozenset({"olmo2", "olmo3", "olmoe", "flex_olmo", "minimax_m2",
                             "olmo_hybrid"})
_LOCAL_HEADS = {"colwise_gather_output": "colwise", "rowwise_split_input": "rowwise"}


def heads_kept_local(hf_rules: dict[str, str]) -> dict[str, str]:
    """``hf_rules`` with its attention's gathered q/k/v and split-input o made local."""
    attention = (".self_attn.q_proj", ".self_attn.k_proj", ".self_attn.v_proj",
                 ".self_attn.o_proj")
    return {k: _LOCAL_HEADS.get(v, v) if k.endswith(attention) else v
            for k, v in hf_rules.items()}


# Multi-head latent attention (DeepSeek-V2/V3 and the models built on it): the latent
# down-projections (q_a_proj, kv_a_proj_with_mqa) and their norms stay whole on every
# rank (small, and read by every head); the up-projections split by whole heads, each
# head's nope/rope (q) or nope/value (kv) features together; o_proj by the same heads.
_LATENT_ATTENTION = {"q_proj": "colwise", "q_b_proj": "colwise", "kv_b_proj": "colwise",
                     "o_proj": "rowwise"}


def latent_attention_plan(names: Iterable[str],
                          hf_rules: dict[str, str] | None) -> dict[str, str] | None:
    """The model's HF plan (if any) with every latent attention split by heads, or ``None``
    when no module is a latent attention's ``kv_b_proj``. ``kv_a_proj_with_mqa`` gets its
    style (``mla_kv_a_proj``) when the heads are split (:mod:`torchtp.plans.head_split`)."""
    attentions = {re.sub(r"\.\d+(?=\.|$)", ".*", n.rpartition(".")[0])
                  for n in names if n.endswith(".kv_b_proj")}
    if not attentions:
        return None
    rules = dict(hf_rules or {})
    for attention in sorted(attentions):
        rules.update({f"{attention}.{leaf}": style for leaf, style in _LATENT_ATTENTION.items()})
    return rules


def builtin_plan(model_type: str, prefix: str) -> dict[str, str] | None:
    """The built-in plan for ``model_type`` with names under ``prefix``, if any."""
    plan = BUILTIN_PLANS.get(model_type)
    if plan is None:
        return None
    lead = f"{prefix}." if prefix else ""
    full = {lead + k: v for k, v in plan.items()}
    if prefix:
        full.update(_HEADS.get(model_type, {}))
    return full
