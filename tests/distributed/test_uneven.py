"""Any size shards: sizes that do not divide by tp split balanced, exactly.

Plain layers against nn.Linear / nn.Embedding, HF models with vocab 97,
intermediate 98 and 5-14 heads at tp 3 and 4 (logits, every gradient, SGD
steps, generate), and checkpoint round trips between uneven tp sizes.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

import torchtp
from torchtp.checkpoint import reshard
from torchtp.core.layouts import group_share, shard_range, shard_sizes, valid_sizes

from ._ckpt_checks import assert_exact
from ._ckpt_checks import check_archs as check_checkpoints
from ._hf_checks import check_archs
from ._hf_models import build
from ._uneven_checks import check_layers
from .test_checkpoint import _same_state
from .test_hf_models import EXPECTED_COLLECTIVES

EVEN_COUNTS = {  # one collective per direction, as for sizes that divide
    "RowParallelLinear True": {"fwd all_gather": 1, "bwd all_reduce": 1},
    "RowParallelLinear False": {"bwd all_reduce": 1},
    "ColumnParallelLinear True": {"fwd all_reduce": 1},
    "ColumnParallelLinear False": {"fwd all_reduce": 1, "bwd all_gather": 1},
}


def test_split_rule_is_balanced_and_matches_tensor_split():
    for size in range(1, 30):
        for parts in range(1, size + 1):
            sizes = shard_sizes(size, parts)
            assert max(sizes) - min(sizes) <= 1 and sum(sizes) == size
            want = [len(c) for c in torch.arange(size).tensor_split(parts)]
            assert sizes == want
            assert [shard_range(size, parts, r)[1] for r in range(parts)] == want
    assert valid_sizes(10, 4) == [1, 2, 3, 4]
    # Qwen2-0.5B's 14 query heads in 2 KV groups at tp 4: KV heads replicated on 2 ranks each.
    assert [group_share(2, 7, 4, r) for r in range(4)] == [
        ((0, 4), (0, 1)), ((4, 3), (0, 1)), ((7, 4), (1, 1)), ((11, 3), (1, 1))]


@pytest.mark.parametrize("world_size", [3, pytest.param(4, marks=pytest.mark.slow)])
def test_plain_layers_split_unevenly_match_torch(ranks, world_size):
    results = ranks(check_layers, world_size, timeout=300)
    for got in results:
        assert got["counts"] == EVEN_COUNTS
        assert got["plan"] == ["colwise", "rowwise", "colwise_gather_output"]


def test_hf_models_at_tp_3(ranks):
    # Vocab 97 (lm_head gathered unevenly), intermediate 98, 10 heads / 2 KV heads
    # (more ranks than KV heads: replicated 2/1), GPT-2's packed Conv1D with 5 heads,
    # a tied embedding + LM head split by vocabulary.
    # plan="auto-memory": the HF plans as written (by cost the small vocabularies stay whole).
    archs = ["llama-uneven", "gpt2-uneven", "llama-tied-uneven"]
    results = ranks(check_archs, 3, archs, 2, False, "auto-memory", timeout=400,
                    gloo_timeout=60)
    for arch in archs:
        got = results[0][arch]
        assert got["generated"] == 6, arch
        assert got["notes"] == [], arch
    # The same collectives as the even models at tp 2 and 4 (test_hf_models): two
    # all-reduces per layer, one for the vocab-split embedding, one LM-head all-gather.
    for arch, even in (("llama-uneven", "llama"), ("llama-tied-uneven", "llama"),
                       ("gpt2-uneven", "gpt2")):
        assert results[0][arch]["collectives"] == EXPECTED_COLLECTIVES[even], arch


@pytest.mark.slow
def test_qwen2_05b_heads_at_tp_4(ranks):
    results = ranks(check_archs, 4, ["qwen2-uneven"], 2, False, "auto-memory", timeout=400,
                    gloo_timeout=60)
    assert results[0]["qwen2-uneven"]["collectives"] == EXPECTED_COLLECTIVES["qwen2"]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 4])
def test_hf_uneven_matrix(ranks, world_size):
    archs = ["llama-uneven", "qwen2-uneven", "llama-tied-uneven", "gpt2-uneven"]
    results = ranks(check_archs, world_size, archs, 2, timeout=600, gloo_timeout=60)
    assert all(results[0][a]["generated"] == 6 for a in archs)


@pytest.mark.parametrize("archs", [
    # GPT-2: Conv1D (transposed) and packed q|k|v, 5 heads (2/2/1 -> 2/1/1/1).
    ["gpt2-uneven"],
    pytest.param(["llama-uneven", "llama-tied-uneven"], marks=pytest.mark.slow),
])
def test_checkpoints_round_trip_between_uneven_tp_sizes(ranks, tmp_path, archs):
    dirs = {a: str(tmp_path / "hf-in" / a) for a in archs}
    for arch in archs:
        build(arch).save_pretrained(dirs[arch])
    out3, out4 = str(tmp_path / "tp3"), str(tmp_path / "tp4")
    ranks(check_checkpoints, 3, dirs, None, out3, timeout=400, gloo_timeout=60)
    sharded3 = {a: os.path.join(out3, "sharded", a) for a in archs}
    ranks(check_checkpoints, 4, dirs, sharded3, out4, timeout=400, gloo_timeout=60)
    for arch in archs:
        for out in (out3, out4):
            _same_state(os.path.join(out, "hf", arch), arch)  # save_pretrained, consolidated
        # Offline 3 -> 4 writes what save_sharded wrote at tp 4; 4 -> 1 in this process.
        dst = str(tmp_path / f"r4-{arch}")
        reshard(sharded3[arch], dst, 4)
        for r in range(4):
            name = f"rank-{r:05d}-of-00004.safetensors"
            got = load_file(os.path.join(dst, name))
            want = load_file(os.path.join(out4, "sharded", arch, name))
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        one = torchtp.DistributedModelWrapper.from_pretrained(dst, progress=False)
        assert_exact(one, build(arch))
