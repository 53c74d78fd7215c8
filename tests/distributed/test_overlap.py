"""Communication overlapped with computation: exact, and really overlapped.

Rank-side checks in ``_overlap_checks.py``. Three launches in all: the layer
checks and traces (tp 2, 3, 4 as subgroups of one 4-process run), and a tiny
HF Llama at tp 2 and tp 4. The symmetric-memory fused ops need CUDA and
NCCL: here only their gate and the exact fallback run (see docs/performance.md).
"""

from __future__ import annotations

import pytest
import torch

from torchtp.comm import overlap
from torchtp.comm.chunked import pieces
from torchtp.core import torch_compat

from ._overlap_checks import check_all_layers, check_hf

SEQ = 9  # shards of 5, 3, 3 tokens at tp 2, 3, 4 (padded), pieces uneven at 2 and 4 chunks


@pytest.fixture(scope="module")
def layer_results(tmp_path_factory):
    from .harness import run_ranks

    return run_ranks(check_all_layers, 4, SEQ, tmp_path=tmp_path_factory.mktemp("overlap"),
                     timeout=240, gloo_timeout=60)


def test_overlap_on_equals_off_at_tp_2_3_4(layer_results):
    for rank, result in enumerate(layer_results):
        checked = result["layers"]
        tps = (2, 3, 4) if rank < 2 else range(rank + 1, 5)
        for tp in tps:
            # Every mode against the unsharded block, every overlapped mode against its
            # plain one: output, input gradient and the 8 parameter gradients.
            assert sum(v for k, v in checked.items() if k.startswith(f"tp{tp} ")
                       and "bitwise" not in k) == 12 * 10, (rank, tp, checked)
            # Without sequence parallelism the overlapped backward runs the same products
            # and the same all-reduce: bitwise equal.
            assert checked[f"tp{tp} grad_reduce bitwise"] == 1
        assert result["unused sibling, retained graph"] == 10


def test_each_overlapped_collective_is_issued_before_its_compute_and_waited_before_read(
        layer_results):
    for result in layer_results:
        traces = result["traces"]
        # Gloo on CPU: the fused ops are refused and TP_DEBUG says so, once per path.
        assert traces["sequence"].pop("TP_DEBUG") == [
            f"overlap: {what} runs the exact chunked fallback, not PyTorch's fused "
            "symmetric-memory op: the tensors are on cpu, the fused ops need CUDA"
            for what in ("all-gather + matmul", "matmul + reduce-scatter")]
        assert traces["grad_reduce"].pop("TP_DEBUG") == []
        for label, by_op in traces.items():
            for op, found in by_op.items():
                for entry in found:
                    assert not entry["read early"], (label, op, entry)
                    assert entry["read after"], (label, op, entry)
        # The input-gradient all-reduce runs beside the weight (mm) and bias (sum) gradients.
        assert [e["products"] for e in traces["grad_reduce"]["all_reduce"]] == [["mm", "sum"]]
        seq = traces["sequence"]
        # Forward: piece 1's all-gather beside piece 0's q/k/v products (addmm: with bias);
        # backward: the output projection's gradient pieces (piece 1 beside piece 0's input
        # gradient, mm), and the re-gather of the block input beside the input gradient.
        assert [e["products"] for e in seq["all_gather"]] == [[], ["addmm"], [], ["mm"], ["mm"]]
        # Forward: piece 0's reduce-scatter beside piece 1's product; backward: the block
        # input gradient's reduce-scatter beside the last projection's weight and bias grads.
        assert [e["products"] for e in seq["reduce_scatter"]] == [["mm"], [], ["mm", "sum"]]
        assert seq["all_reduce"] == []


@pytest.mark.parametrize("world_size", [2, 4])
def test_hf_llama_overlap_on_equals_off(ranks, world_size):
    for result in ranks(check_hf, world_size, SEQ, timeout=240, gloo_timeout=60):
        assert all(v == 21 for k, v in result.items() if "grads" in k), result
        plain, overlapped = result["sp=False collectives"]
        assert plain == overlapped  # the same all-reduces, only started earlier
        assert result["sp=False bitwise"]
        plain, overlapped = result["sp=True collectives"]
        # One all-gather/reduce-scatter per piece (2) where the chunked path runs: the
        # blocks' input gathers and output reduce-scatters, the output gradient gathers.
        layers = 2 * 2  # attention and MLP blocks of the 2 decoder layers
        assert overlapped["all_gather"] == plain["all_gather"] + 2 * layers
        assert overlapped["reduce_scatter"] == plain["reduce_scatter"] + layers
        assert overlapped["all_reduce"] == plain["all_reduce"]


def test_pieces_cover_the_shard_with_a_shorter_last_one():
    assert pieces(5, 2) == [(0, 3), (3, 5)]
    assert pieces(5, 4) == [(0, 2), (2, 4), (4, 5)]
    assert pieces(2, 4) == [(0, 1), (1, 2)]
    assert pieces(6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert pieces(0, 2) == [(0, 0)]


def test_switch_precedence_and_env_parsing(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(overlap.ENV, raising=False)
    overlap.reset()
    for kind in overlap.KINDS:
        assert overlap.enabled(kind, None, cpu) is overlap.AUTO[(kind, "cpu")]
        assert overlap.enabled(kind, None, cuda) is overlap.AUTO[(kind, "cuda")]
        assert overlap.enabled(kind, True, cpu) and not overlap.enabled(kind, False, cuda)
    for raw, on in [("1", set(overlap.KINDS)), ("off", set()), ("sequence", {"sequence"}),
                    (" grad_reduce , sequence ", set(overlap.KINDS))]:
        monkeypatch.setenv(overlap.ENV, raw)
        overlap.reset()
        assert {k for k in overlap.KINDS if overlap.enabled(k, None, cpu)} == on
        assert overlap.enabled("sequence", False, cpu) is False  # the layer's choice wins
    monkeypatch.setenv(overlap.ENV, "fast")
    overlap.reset()
    with pytest.raises(ValueError, match=r"TP_OVERLAP='fast'.*grad_reduce"):
        overlap.enabled("sequence", None, cpu)
    monkeypatch.setenv(overlap.CHUNKS_ENV, "0")
    with pytest.raises(ValueError, match="TP_OVERLAP_CHUNKS='0' must be an integer >= 1"):
        overlap.chunks()
    overlap.reset()


def test_symmetric_memory_gate_says_why_it_falls_back():
    gate = torch_compat.symm_mem_gate
    assert gate("cuda", "nccl", (2, 13), False, True) is None
    assert "on cpu" in gate("cpu", "gloo", (2, 13), False, True)
    assert "backend is gloo" in gate("cuda", "gloo", (2, 13), False, True)
    assert "predates" in gate("cuda", "nccl", (2, 5), False, True)
    assert "autocast" in gate("cuda", "nccl", (2, 13), True, True)
    assert "did not register" in gate("cuda", "nccl", (2, 13), False, False)
    # On this CPU build the real gate refuses before importing anything.
    assert "need CUDA" in torch_compat.symm_mem_unavailable(torch.ones(1), None)
