"""torch.compile(fullgraph=True) on wrapped HF models: no graph breaks, eager's numbers.

Each rank compiles the wrapped model with ``aot_eager`` (traces forward and
backward like inductor, without C++ builds), counts graph breaks with
``torch._dynamo.explain`` and compares logits and every gradient with the
unsharded model run eagerly.
"""

from __future__ import annotations

import pytest
import torch

import torchtp

from ._hf_checks import GRADS, LOGITS, compare_params, inputs, loss_of
from ._hf_models import build
from ._sp_checks import LOSS, batch


def _compile_archs(rank: int, world_size: int, archs: list[str]) -> dict[str, int]:
    breaks = {}
    for arch in archs:
        torch._dynamo.reset()
        ref, wrapped = build(arch), torchtp.DistributedModelWrapper(build(arch))
        batch = inputs(arch)
        explained = torch._dynamo.explain(wrapped)(**batch)
        breaks[arch] = explained.graph_break_count
        compiled = torch.compile(wrapped, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(**batch).logits, ref(**batch).logits, **LOGITS)
        loss_of(compiled, batch).backward()
        loss_of(ref, batch).backward()
        compare_params(wrapped, ref, grads=True)
        # The config copies keep the attention switch live: a later switch reaches
        # the attention modules (and recompiles), with unchanged numbers.
        wrapped.base_model.set_attn_implementation("sdpa")
        ref.set_attn_implementation("sdpa")
        attn = next(m for n, m in wrapped.named_modules() if n.endswith(("attn", "attention")))
        assert attn.config._attn_implementation == "sdpa", arch
        with torch.no_grad():
            torch.testing.assert_close(compiled(**batch).logits, ref(**batch).logits, **GRADS)
    return breaks


def test_hf_fullgraph_compile_llama_and_a_parallel_residual_model(ranks):
    # GPT-NeoX: both branches' partial sums reduced once per layer (reduce_residual's hooks).
    archs = ["llama", "gpt_neox"]
    assert ranks(_compile_archs, 2, archs, timeout=400) == [dict.fromkeys(archs, 0)] * 2


@pytest.mark.slow
def test_hf_fullgraph_compile_more_archs(ranks):
    archs = ["gpt2", "qwen2", "mistral", "phi3", "gemma", "qwen3"]
    assert ranks(_compile_archs, 2, archs, timeout=600) == [dict.fromkeys(archs, 0)] * 2


def _compile_sequence_parallel(rank: int, world_size: int) -> int:
    """Sequence + loss parallelism compiled (graph breaks allowed: the label check reads
    a value): loss and every gradient equal the unsharded model's, run eagerly. The
    compiled projections save what the compiled graph saves (no Python re-gather)."""
    torch._dynamo.reset()
    ref = build("llama")
    wrapped = torchtp.DistributedModelWrapper(build("llama"), sequence_parallel=True,
                                              loss_parallel=True)
    data = batch(9, vocab=ref.config.vocab_size)  # 9 tokens: the last shard is padded
    compiled = torch.compile(wrapped, backend="aot_eager")
    for _ in range(2):  # the second call runs the cached graphs
        wrapped.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        got, want = compiled(**data).loss, ref(**data).loss
        torch.testing.assert_close(got, want, **LOSS)
        got.backward()
        want.backward()
        checked = compare_params(wrapped, ref, grads=True)
    return checked


def test_compiled_sequence_and_loss_parallelism_match_one_process(ranks):
    assert all(n > 0 for n in ranks(_compile_sequence_parallel, 2, timeout=400))
