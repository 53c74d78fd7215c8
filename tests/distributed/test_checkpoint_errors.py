"""Bad checkpoints and bad saves: the same clear error on every rank, nothing half-written."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

import torchtp
from torchtp.checkpoint import reshard

from ._ckpt_checks import check_errors
from ._hf_models import build


def _copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: str, **changes: object) -> None:
    with open(path) as f:
        data = json.load(f)
    data.update(changes)
    with open(path, "w") as f:
        json.dump(data, f)


def _make_cases(root: str) -> tuple[dict[str, str], str]:
    good = os.path.join(root, "llama")
    build("llama").save_pretrained(good)
    weights = os.path.join(good, "model.safetensors")
    cases = {}
    cases["missing_tensor"] = _copy(good, os.path.join(root, "missing_tensor"))
    tensors = load_file(weights)
    del tensors["model.norm.weight"]
    save_file(tensors, os.path.join(cases["missing_tensor"], "model.safetensors"))
    cases["shape"] = _copy(good, os.path.join(root, "shape"))
    _edit_json(os.path.join(cases["shape"], "config.json"), intermediate_size=96)
    cases["truncated"] = _copy(good, os.path.join(root, "truncated"))
    with open(os.path.join(cases["truncated"], "model.safetensors"), "r+b") as f:
        f.truncate(os.path.getsize(weights) - 100)
    cases["corrupt"] = _copy(good, os.path.join(root, "corrupt"))
    with open(os.path.join(cases["corrupt"], "model.safetensors"), "r+b") as f:
        f.seek(8)
        f.write(b"\xff" * 32)
    cases["missing_index"] = os.path.join(root, "missing_index")
    build("llama").save_pretrained(cases["missing_index"], max_shard_size="40KB")
    index = os.path.join(cases["missing_index"], "model.safetensors.index.json")
    with open(index) as f:
        data = json.load(f)
    del data["weight_map"]["model.norm.weight"]
    _edit_json(index, weight_map=data["weight_map"])
    sharded = os.path.join(root, "sharded")
    torchtp.DistributedModelWrapper(build("llama")).save_sharded(sharded)
    cases["other_model"] = _copy(sharded, os.path.join(root, "other_model"))
    _edit_json(os.path.join(cases["other_model"], "torchtp_checkpoint.json"), model_type="gpt2")
    cases["mixed_files"] = _copy(sharded, os.path.join(root, "mixed_files"))
    other = os.path.join(root, "qwen3-sharded")
    torchtp.DistributedModelWrapper(build("qwen3")).save_sharded(other)
    shutil.copy(os.path.join(other, "torchtp_checkpoint.json"), cases["mixed_files"])
    # Any size splits now (balanced shares), so only what is structurally
    # impossible is blocked: one attention head cannot be split over two ranks.
    one = os.path.join(root, "one_head")
    build("llama", hidden_size=16, num_attention_heads=1, num_key_value_heads=1, vocab_size=96,
          intermediate_size=96, head_dim=16).save_pretrained(one)
    cases["tp_blocked"] = os.path.join(root, "tp_blocked")
    reshard(one, cases["tp_blocked"], 1)
    # Rank files copied between checkpoints: same names and shapes, another owner.
    cases["foreign_file"] = _copy(sharded, os.path.join(root, "foreign_file"))
    seed1 = os.path.join(root, "seed1")
    torchtp.DistributedModelWrapper(build("llama", seed=1)).save_sharded(seed1)
    shutil.copy(os.path.join(seed1, "rank-00000-of-00001.safetensors"), cases["foreign_file"])
    cases["wrong_rank_file"] = os.path.join(root, "wrong_rank_file")
    reshard(good, cases["wrong_rank_file"], 2)
    shutil.copy(os.path.join(cases["wrong_rank_file"], "rank-00000-of-00002.safetensors"),
                os.path.join(cases["wrong_rank_file"], "rank-00001-of-00002.safetensors"))
    cases["no_config"] = _copy(good, os.path.join(root, "no_config"))
    os.remove(os.path.join(cases["no_config"], "config.json"))
    return cases, good


def test_bad_checkpoints_raise_on_every_rank(ranks, tmp_path):
    cases, good = _make_cases(str(tmp_path / "cases"))
    msgs = ranks(check_errors, 2, cases, good, str(tmp_path / "out"), timeout=300,
                 gloo_timeout=60)
    assert msgs[0] == msgs[1]  # the same verdict on every rank
    assert "num_attention_heads" in msgs[0]["tp_blocked"] or "heads" in msgs[0]["tp_blocked"]
    assert "model.safetensors" in msgs[0]["truncated"]


def test_offline_errors(tmp_path):
    cases, good = _make_cases(str(tmp_path / "cases"))
    with pytest.raises(ValueError, match="saved at tp=1\\) cannot be resharded to tp=2"):
        reshard(cases["tp_blocked"], str(tmp_path / "r2"), 2)
    with pytest.raises(ValueError, match="is not a directory"):
        reshard(good, os.path.join(good, "config.json"), 2)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        reshard(cases["truncated"], str(tmp_path / "r"), 2)
    assert not os.path.exists(str(tmp_path / "r2")) and not os.path.exists(str(tmp_path / "r"))
    with pytest.raises(ValueError, match=r"rank-00000-of-00001\.safetensors comes from another "
                       r"model or save \(model fingerprint [0-9a-f]{16}, the checkpoint"):
        reshard(cases["foreign_file"], str(tmp_path / "r"), 2)
    with pytest.raises(ValueError, match=r"rank-00001-of-00002\.safetensors holds TP rank 0's "
                       r"shards of a tp 2 save, but the checkpoint lists it as rank 1's of tp 2"):
        reshard(cases["wrong_rank_file"], str(tmp_path / "r"), 1)


def test_bad_max_shard_size_is_named_and_leaves_nothing(tmp_path):
    w = torchtp.DistributedModelWrapper(build("llama"))
    out = str(tmp_path / "hf")
    with pytest.raises(ValueError, match="max_shard_size='5 gigs' is not a size"):
        w.save_pretrained(out, max_shard_size="5 gigs")
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp-torchtp")


def _different_checkpoints(rank: int, world_size: int, paths: list[str]) -> str:
    import torchtp

    try:
        torchtp.DistributedModelWrapper.from_pretrained(paths[rank], progress=False)
    except torchtp.RankMismatchError as err:
        return str(err)
    return "loaded"


def test_ranks_given_different_checkpoints_raise_on_every_rank(ranks, tmp_path):
    from ._hf_models import build

    paths = []
    for i, arch in enumerate(("llama", "mistral")):
        build(arch).save_pretrained(tmp_path / str(i))
        paths.append(str(tmp_path / str(i)))
    for msg in ranks(_different_checkpoints, 2, paths):
        assert "model config (sha256) must match across all ranks" in msg


# The ranks' bound on waiting for each other: a subset-of-ranks save must raise
# within it (min(60 s, TP_TIMEOUT)), not after the old fixed 120 s.
FAST = {"TP_TIMEOUT": "5"}
BOUND_S = 15  # TP_TIMEOUT plus process start and polling on a busy 2-core machine


def _timed(fn, *args, **kwargs):
    """``(exception type name, message, seconds)`` of ``fn(...)``, or ``(None, "ok", s)``."""
    import time

    start = time.monotonic()
    try:
        fn(*args, **kwargs)
    except Exception as err:  # the test asserts the type and message
        return type(err).__name__, str(err), time.monotonic() - start
    return None, "ok", time.monotonic() - start


def _shard_files(rank: int, world_size: int, tmp: str) -> dict:
    """Per-rank torch.save'd state dicts given to the wrong rank, or from another model."""
    import torch
    import torch.distributed as dist

    from ._models import mlp

    def save(seed: int, name: str) -> torch.nn.Module:
        wrapped = torchtp.DistributedModelWrapper(mlp(hidden=16, ffn=32, seed=seed))
        torch.save(wrapped.state_dict(), os.path.join(tmp, f"{name}.rank{rank}.pt"))
        return wrapped

    wrapped, _ = save(0, "mine"), save(1, "other")
    dist.barrier()  # every rank's files are written

    def load(name: str, file_rank: int = rank, strict: bool = True) -> object:
        sd = torch.load(os.path.join(tmp, f"{name}.rank{file_rank}.pt"))
        return wrapped.load_state_dict(sd, strict=strict)

    seen = {"wrong_rank": _timed(load, "mine", 0),  # rank 1 loads rank 0's file
            "other_model": _timed(load, "other" if rank == 1 else "mine")}
    x = torch.randn(4, 16)
    for name, seed in (("other", 1), ("mine", 0)):  # the same source on every rank: loads
        seen[f"all_{name}"] = _timed(load, name)
        with torch.no_grad():  # fp32 sums in another order: default tolerances
            torch.testing.assert_close(wrapped(x), mlp(hidden=16, ffn=32, seed=seed)(x))
    # A plain dict (no record: safetensors, a filtered copy) with strict=False still loads.
    plain = dict(torch.load(os.path.join(tmp, f"mine.rank{rank}.pt")))
    del plain["2.bias"]
    seen["plain_partial"] = _timed(wrapped.load_state_dict, plain, strict=False)
    return seen


def test_shard_files_know_whose_they_are(ranks, tmp_path):
    results = ranks(_shard_files, 2, str(tmp_path), env=FAST, timeout=120)
    for seen in results:
        kind, msg, took = seen["wrong_rank"]
        assert kind == "ValueError" and took < BOUND_S, seen
        assert "TP rank 1 (tp 2) was given the state dict that TP rank 0 saved at tp 2" in msg
        kind, msg, took = seen["other_model"]
        assert kind == "RankMismatchError" and took < BOUND_S, seen
        assert "replicated parameter '2.bias' after loading" in msg
        assert "different models or saves" in msg
        for case in ("all_other", "all_mine", "plain_partial"):
            assert seen[case][0] is None, (case, seen[case])


def _subset_save(rank: int, world_size: int, tmp: str, what: str) -> dict:
    """One rank saves alone while the other keeps working (forwards) or has exited."""
    import time

    import torch
    from peft import LoraConfig, get_peft_model

    from ._hf_checks import inputs
    from ._hf_models import build

    wrapped = torchtp.DistributedModelWrapper(build("llama"))
    model = wrapped
    if what == "peft":
        model = get_peft_model(wrapped.base_model, LoraConfig(r=4, target_modules=["q_proj"]))
    batch = inputs("llama")
    with torch.no_grad():
        # Shapes agreed in the same context of previous collectives (health.before):
        # the next forward goes straight into its all-reduces.
        for _ in range(4):
            model(**batch)
    out = os.path.join(tmp, what)
    save = {"save_sharded": wrapped.save_sharded, "peft": model.save_pretrained,
            "save_pretrained_rank1": wrapped.save_pretrained}[what]
    seen: dict = {}
    if what == "save_pretrained_rank1":  # rank 0 ends its program first
        if rank == 0:
            seen["shutdown"] = _timed(torchtp.shutdown_tensor_parallel)
        else:
            time.sleep(1.0)
            seen["save"] = _timed(save, out)
            seen["shutdown"] = _timed(torchtp.shutdown_tensor_parallel)
        return seen
    if rank == 0:
        seen["save"] = _timed(save, out)
    else:  # blocked in its all-reduce until rank 0 joins it, exits or dies
        with torch.no_grad():
            seen["forward"] = _timed(model, **batch)
    # Rank 0 ends its program: rank 1 learns it; nobody's exit waits another TP_TIMEOUT.
    seen["shutdown"] = _timed(torchtp.shutdown_tensor_parallel)
    seen["exists"] = os.path.exists(out)
    return seen


@pytest.mark.parametrize("what", ["save_sharded", "peft"])
def test_save_on_rank_0_only_fails_fast_on_every_rank(ranks, tmp_path, what):
    saver, worker = ranks(_subset_save, 2, str(tmp_path), what, env=FAST, timeout=90)
    kind, msg, took = saver["save"]
    assert kind == "RuntimeError" and took < BOUND_S, saver
    assert "must call it, but ranks [1] did not arrive within 5 s" in msg
    # Rank 1 was blocked in its forward's all-reduce: told when rank 0's program ended.
    kind, msg, took = worker["forward"]
    assert kind == "InconsistentGroupError" and took < BOUND_S, worker
    assert "rank 0 reached the end of its program" in msg
    # Not a second TP_TIMEOUT: at most 2 s (AFTER_MISSED_S) after the failed save.
    assert saver["shutdown"][0] is None and saver["shutdown"][2] < 3.5, saver
    assert worker["shutdown"][0] is None and worker["shutdown"][2] < 1.0, worker
    assert not saver["exists"] and not worker["exists"]


def test_save_on_rank_1_only_after_rank_0_exited_fails_at_once(ranks, tmp_path):
    exited, saver = ranks(_subset_save, 2, str(tmp_path), "save_pretrained_rank1", env=FAST,
                          timeout=90)
    kind, msg, took = saver["save"]
    assert kind == "RuntimeError" and took < 3.0, saver  # not the 5 s bound: rank 0 is gone
    assert "ranks [0] will never arrive (rank 0 reached the end of its program)" in msg
    # Both exits meet once rank 1 gives up (~1 s), not after TP_TIMEOUT (5 s).
    for seen in (exited, saver):
        assert seen["shutdown"][0] is None and seen["shutdown"][2] < 3.0, seen


def test_load_training_state_into_an_unwrapped_model_is_a_type_error(tmp_path):
    from torch import nn

    from torchtp.checkpoint.dcp import load_training_state

    with pytest.raises(TypeError, match="load_training_state needs the DistributedModelWrapper "
                       r"\(or a DDP around it\), got Linear"):
        load_training_state(str(tmp_path), nn.Linear(2, 2))
