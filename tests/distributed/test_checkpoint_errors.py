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
