"""The cost model's formulas against hand-computed values."""

from __future__ import annotations

import dataclasses
import json

import pytest

from torchtp.costmodel import (
    PRESETS,
    ModelDims,
    allreduce_time,
    dims_from_config,
    estimate,
    gemm_time,
    get_hardware,
    read_config,
    ring_steps,
    slowdown,
    sweep,
)

# 1 ms per step, 1 GB/s, 1 GFLOP/s, effectively infinite memory bandwidth.
TOY = dataclasses.replace(
    PRESETS["cpu-gloo"], name="toy", peak_flops=1e9, gemm_efficiency=1.0, mem_bandwidth=1e15,
    mem_efficiency=1.0, bus_bandwidth=1e9, latency=1e-3, steps="ring", layer_overhead=0.0,
    shared_cores=None, dtype_bytes=4, effective_cores=None, oversubscribed_latency=None)
DIMS = ModelDims.make(hidden=64, layers=2, heads=4, ffn=128, vocab=100)


def test_ring_and_tree_steps():
    assert [ring_steps(n) for n in (1, 2, 4, 8)] == [0, 2, 6, 14]
    assert [ring_steps(n, "tree") for n in (1, 2, 4, 8)] == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="unknown all-reduce step model 'star'"):
        ring_steps(2, "star")


def test_allreduce_time_is_latency_times_steps_plus_ring_volume():
    assert allreduce_time(1e6, 1, TOY) == 0.0
    # 2 steps * 1 ms + 2*(1/2) * 1 MB / 1 GB/s = 2 ms + 1 ms
    assert allreduce_time(1e6, 2, TOY) == pytest.approx(3e-3)
    # 6 steps * 1 ms + 2*(3/4) * 4 MB / 1 GB/s = 6 ms + 6 ms
    assert allreduce_time(4e6, 4, TOY) == pytest.approx(12e-3)


def test_gemm_time_is_the_roofline_maximum():
    hw = dataclasses.replace(TOY, mem_bandwidth=1e6)
    assert gemm_time(2e9, 1e3, hw) == pytest.approx(2.0)  # FLOP-bound
    assert gemm_time(1e3, 3e6, hw) == pytest.approx(3.0)  # memory-bound


def test_slowdown_when_ranks_share_cores():
    hw = dataclasses.replace(TOY, shared_cores=2)
    assert [slowdown(n, hw) for n in (1, 2, 4)] == [1.0, 1.0, 2.0]
    assert slowdown(8, TOY) == 1.0
    busy = dataclasses.replace(hw, effective_cores=1.5)  # other jobs take half a core
    assert slowdown(3, busy) == pytest.approx(2.0)


def test_oversubscribed_ranks_pay_the_scheduler_latency_per_step():
    hw = dataclasses.replace(TOY, shared_cores=2, oversubscribed_latency=5e-3)
    assert allreduce_time(0, 2, hw) == pytest.approx(2 * 1e-3)  # one core per rank
    assert allreduce_time(0, 4, hw) == pytest.approx(6 * 5e-3)  # 4 ranks on 2 cores


def test_layer_params_and_decode_estimate_by_hand():
    assert DIMS.layer_params == 64 * (2 * 64 + 2 * 64) + 3 * 64 * 128 == 40960
    e = estimate(DIMS, TOY, tp=2, batch=1, seq=10, phase="decode")
    # matmuls 2*1*40960/2 + attention 4*1*10*64/2 FLOPs at 1 GFLOP/s
    assert e.compute_per_layer == pytest.approx((40960 + 1280) / 1e9)
    assert e.allreduce_bytes == 64 * 4
    # two all-reduces of 256 B: 2 * (2 ms + 256 B / 1 GB/s)
    assert e.comm_per_layer == pytest.approx(2 * (2e-3 + 256 / 1e9))
    assert e.head == pytest.approx(2 * 64 * 100 / 1e9)
    assert e.total == pytest.approx(2 * (e.compute_per_layer + e.comm_per_layer) + e.head)
    base = estimate(DIMS, TOY, tp=1, batch=1, seq=10, phase="decode")
    assert base.comm_per_layer == 0.0 and base.speedup == pytest.approx(1.0)
    assert e.speedup == pytest.approx(base.total / e.total)
    assert e.speedup < 0.1  # 1 ms latency swamps a 40 us layer: tp does not pay off
    assert e.weight_bytes_per_rank == (2 * 40960 + 2 * 100 * 64) * 4 / 2


def test_prefill_moves_batch_times_seq_tokens():
    e = estimate(DIMS, TOY, tp=4, batch=2, seq=8, phase="prefill")
    assert e.allreduce_bytes == 2 * 8 * 64 * 4
    assert e.tokens_per_s == pytest.approx(16 / e.total)
    assert [x.phase for x in sweep(DIMS, TOY, [1, 2])] == ["prefill", "prefill", "decode", "decode"]


def test_a100_preset_reproduces_gpt_fast_scaling():
    # gpt-fast, Llama-2-7B, batch 1, bf16, A100 (ANCHORS.md): tokens/s at tp 1/2/4/8.
    llama7b = ModelDims.make(hidden=4096, layers=32, heads=32, ffn=11008, vocab=32000)
    published = {1: 104.9, 2: 168.8, 4: 254.0, 8: 328.4}
    for tp, tokens in published.items():
        got = estimate(llama7b, get_hardware("a100-nvlink"), tp, seq=128, phase="decode")
        assert got.tokens_per_s == pytest.approx(tokens, rel=0.10)


def test_presets_state_their_sources():
    for name, hw in PRESETS.items():
        assert hw.name == name and len(hw.source) > 40
    with pytest.raises(ValueError, match="unknown hardware preset 'tpu'; valid presets: a100-nvlink"):
        get_hardware("tpu")


def test_dims_from_hf_config(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16,
           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192,
           "vocab_size": 128256, "head_dim": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    dims = dims_from_config(read_config(tmp_path))
    assert (dims.hidden, dims.layers, dims.heads, dims.kv_heads, dims.ffn, dims.vocab,
            dims.head_dim) == (2048, 16, 32, 8, 8192, 128256, 64)
    assert dims.kv_dim == 512
    with pytest.raises(ValueError, match="missing num_hidden_layers or n_layer"):
        dims_from_config({"hidden_size": 8, "num_attention_heads": 2}, source="x")
    with pytest.raises(ValueError, match="does not exist; pass a HuggingFace model directory"):
        read_config(tmp_path / "nope")
    with pytest.raises(ValueError, match="hidden=10 is not divisible by heads=4"):
        ModelDims.make(hidden=10, layers=1, heads=4)


def test_estimate_rejects_bad_sizes():
    with pytest.raises(ValueError, match="tp must be >= 1, got 0"):
        estimate(DIMS, TOY, tp=0)
    with pytest.raises(ValueError, match="unknown phase 'train'"):
        estimate(DIMS, TOY, tp=1, phase="train")
