"""A tensor-parallel Llama forward issues the minimum number of collectives.

Two all-reduces per decoder layer (after ``o_proj`` and after ``down_proj``)
and nothing else with ``lm_head`` replicated; one extra all-gather when
``lm_head`` is ``colwise_gather_output``; and one all-reduce more with the
model's own HF plan (``plan=None``), whose vocab-parallel embedding sums its
partial lookups. Counted with torchtp.count_collectives.
"""

from __future__ import annotations

import pytest
import torch
import transformers

LAYERS = 3
PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                                   num_key_value_heads=4, intermediate_size=64, vocab_size=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def _count(rank: int, world_size: int) -> list[dict[str, int]]:
    import torchtp

    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    counts = []
    for plan in (PLAN, {**PLAN, "lm_head": "colwise_gather_output"}, None):
        ref = _llama()
        model = torchtp.DistributedModelWrapper(_llama(), plan=plan)
        with torch.no_grad(), torchtp.count_collectives() as prefill:
            out = model(ids, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        with torch.no_grad(), torchtp.count_collectives() as decode:
            model(token, past_key_values=out.past_key_values, use_cache=True)
        torch.testing.assert_close(out.logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
        counts += [dict(prefill.counts), dict(decode.counts)]
    return counts


@pytest.mark.parametrize("world_size", [2])
def test_llama_forward_needs_two_all_reduces_per_layer(ranks, world_size):
    for counts in ranks(_count, world_size, timeout=180):
        minimum = {"all_reduce": 2 * LAYERS}
        assert counts[0] == minimum and counts[1] == minimum  # prefill, decode
        with_head = {"all_reduce": 2 * LAYERS, "all_gather": 1}
        assert counts[2] == with_head and counts[3] == with_head
        # The model's own HF plan also splits the embedding by vocab: one all-reduce more.
        own = {"all_reduce": 2 * LAYERS + 1, "all_gather": 1}
        assert counts[4] == own and counts[5] == own
