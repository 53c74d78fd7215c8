"""The torchtp command line, run in-process through ``main(argv)``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from torch import nn

from torchtp.cli import SUBCOMMANDS, main
from torchtp.hf.compat import LAZY_STATE_CACHES

from ._hf_models import NEEDS_MAMBA_TORCH_PATH
from .test_moe import _sentinel


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama config.json only (no weights): 2 layers, 8 heads, 4 KV heads."""
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                             num_key_value_heads=4, intermediate_size=176,
                             vocab_size=128).to_json_file(str(path))
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved random-weight Llama (the demo's builder, scaled down)."""
    from torchtp.cli.demo import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("model"), hidden=64, layers=2)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_every_subcommand_with_examples(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    for name in SUBCOMMANDS:
        assert name in out
    assert "examples:" in out
    for name in SUBCOMMANDS:
        code, out, _ = run_cli(capsys, name, "--help")
        assert code == 0 and "examples:" in out and f"torchtp {name}" in out


def test_plan_table_memory_and_collectives(capsys, tiny_config):
    code, out, _ = run_cli(capsys, "plan", str(tiny_config), "--tp", "2")
    assert code == 0, out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.startswith(("model", "lm"))}
    assert rows["model.layers.*.self_attn.q_proj"] == ["colwise", "2", "64x64", "32x64"]
    assert rows["model.layers.*.mlp.down_proj"] == ["rowwise", "2", "64x176", "64x88"]
    # The HF plan's vocabulary splits of lm_head and embed_tokens (vocabulary 128) do not
    # pay: kept whole by cost, which the table says; 2 all-reduces per decoder layer.
    assert rows["lm_head"] == ["replicate", "1", "128x64", "128x64"]
    assert "collectives per forward: 4 x all_reduce" in out
    assert "plan chosen by cost (cpu-gloo profile;" in out
    assert "note: 'lm_head' kept replicated: splitting it alone saves 16.0 KiB" in out
    assert "valid tp sizes for this model: [1, 2, 3, 4, 5, 6, 7, 8]" in out  # 8 query heads
    assert "no blockers: tp=2 works" in out


def test_plan_json_counts_bytes_per_rank(capsys, tiny_config):
    code, out, _ = run_cli(capsys, "plan", str(tiny_config), "--tp", "4", "--json")
    report = json.loads(out)
    assert code == 0 and report["blockers"] == []
    assert report["collectives_per_forward"] == {"all_reduce": 4}
    # the decoder layers are split by 4; the RMSNorm weights (2 per layer + the final
    # one), the embedding and lm_head (kept whole by cost) are not
    split = 2 * (64 * 64 * 2 + 32 * 64 * 2 + 176 * 64 * 3) * 4
    norms = ((2 * 2 + 1) * 64 + 2 * 128 * 64) * 4
    assert report["param_bytes_unsharded"] == split + norms
    assert report["param_bytes_per_rank"] == split // 4 + norms
    down = [r for r in report["layers"] if r["module"] == "model.layers.1.mlp.down_proj"]
    assert down == [{"module": "model.layers.1.mlp.down_proj", "style": "rowwise",
                     "full": [64, 176], "local": [64, 44], "local_per_rank": [[64, 44]] * 4}]
    assert report["param_bytes_by_rank"] == [split // 4 + norms] * 4


def test_plan_shows_per_rank_sizes_when_tp_does_not_divide(capsys, tiny_config):
    code, out, _ = run_cli(capsys, "plan", str(tiny_config), "--tp", "3")
    assert code == 0, out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.startswith(("model", "lm"))}
    # 8 query heads in 4 KV groups of 2: whole groups 2/1/1 -> 4/2/2 heads of 8 rows.
    assert rows["model.layers.*.self_attn.q_proj"] == ["colwise", "2", "64x64",
                                                       "32x64/16x64/16x64"]
    assert rows["model.layers.*.self_attn.o_proj"] == ["rowwise", "2", "64x64",
                                                       "64x32/64x16/64x16"]
    assert rows["model.layers.*.mlp.down_proj"] == ["rowwise", "2", "64x176",
                                                    "64x59/64x59/64x58"]
    assert rows["lm_head"] == ["replicate", "1", "128x64", "128x64"]  # kept whole by cost
    assert "no blockers: tp=3 works" in out
    code, out, _ = run_cli(capsys, "plan", str(tiny_config), "--tp", "3", "--plan",
                           "auto-memory")
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.startswith(("model", "lm"))}
    assert rows["lm_head"] == ["colwise_gather_output", "1", "128x64", "43x64/43x64/42x64"]
    code, out, _ = run_cli(capsys, "plan", str(tiny_config), "--tp", "9", "--json")
    report = json.loads(out)
    assert code == 1 and report["valid_tp_sizes"] == list(range(1, 9))
    assert any("num_attention_heads (query heads)=8 cannot give each of world_size=9 ranks"
               in b for b in report["blockers"])


@pytest.mark.parametrize("argv, message", [
    (["plan", "/no/such/model", "--tp", "2"], "cannot read model config: /no/such/model does not exist"),
    (["plan", "{cfg}", "--tp", "0"], "expected a positive integer, got 0"),
    (["plan", "{cfg}", "--tp", "two"], "expected a positive integer, got 'two'"),
    (["plan", "{cfg}", "--tp", "2", "--dtype", "int3"], "unknown dtype 'int3'"),
    (["plan", "{bad}", "--tp", "2"], "cannot read model config"),
    (["estimate", "--hidden", "64"], "missing --layers, --heads"),
    (["estimate", "--hidden", "64", "--layers", "2", "--heads", "4", "--hardware", "tpu"],
     "unknown hardware preset 'tpu'"),
    (["verify", "/no/such/model", "--tp", "2"], "does not exist"),
    (["bench", "{bad}", "--tp", "2"], "cannot read model config"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["plan", "meta-llama/Llama-3.2-1B", "--tp", "2"], "looks like a Hub id: nothing is downloaded"),
    (["plan", "{cfg}", "--tp", "2", "--plan", "nofile.yaml"],
     "expected auto, auto-memory, builtin or a plan file"),
    (["verify", "{cfg}", "--tp", "9"], "tp=9 cannot split"),
    (["bench", "{cfg}", "--tp", "9"], "valid tp sizes: [1, 2, 3, 4, 5, 6, 7, 8]"),
])
def test_bad_arguments_give_a_message_and_status_2(capsys, tiny_config, tmp_path, argv, message):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    argv = [a.format(cfg=tiny_config, bad=bad) for a in argv]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err + out


def test_plan_other_architectures_from_config_only(capsys, tmp_path):
    cfg = transformers.Qwen2Config(hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, vocab_size=256)
    cfg.to_json_file(str(tmp_path / "config.json"))
    code, out, _ = run_cli(capsys, "plan", str(tmp_path), "--tp", "4", "--json")
    report = json.loads(out)
    assert code == 0 and report["model_type"] == "qwen2"
    assert report["collectives_per_forward"] == {"all_reduce": 2 * 3}  # embedding kept whole
    assert 4 in report["valid_tp_sizes"]  # 2 KV heads replicated over 4 ranks


@NEEDS_MAMBA_TORCH_PATH
def test_plan_a_mamba2_config_splits_its_mixers(capsys, tmp_path):
    # Its config.json stores time_step_limit's infinity as {"__float__": "Infinity"}: read
    # by transformers' own reader. On the meta device the mixers are probed on a CPU copy.
    cfg = transformers.Mamba2Config(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                    num_heads=8, head_dim=8, expand=2, n_groups=1,
                                    state_size=8, conv_kernel=4, chunk_size=4)
    cfg.save_pretrained(str(tmp_path))
    code, out, _ = run_cli(capsys, "plan", str(tmp_path), "--tp", "2", "--json")
    report = json.loads(out)
    assert code == 0 and report["model_type"] == "mamba2"
    # out_proj and the gated norm (one group shared by both ranks) in each of 2 layers; the
    # mixers stay whole before transformers 5.5 (its cache holds their states whole).
    split = Version(transformers.__version__) >= Version(LAZY_STATE_CACHES)
    assert report["collectives_per_forward"] == ({"all_reduce": 2 * 2} if split else {})


def test_plan_builtin_phi3_avoids_per_layer_all_gathers(capsys, tmp_path):
    cfg = transformers.Phi3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=4, intermediate_size=128, vocab_size=256,
                                  pad_token_id=0)
    cfg.to_json_file(str(tmp_path / "config.json"))
    counts = {}
    for choice in ("auto", "builtin"):
        code, out, _ = run_cli(capsys, "plan", str(tmp_path), "--tp", "2", "--plan", choice, "--json")
        assert code == 0
        counts[choice] = json.loads(out)["collectives_per_forward"]
    assert counts["builtin"] == {"all_reduce": 2 * 2 + 1, "all_gather": 1}  # lm_head only
    # By cost: the built-in part-wise split wins over HF's own plan, which gathers qkv and
    # gate_up outputs; the small embedding and lm_head stay whole.
    assert counts["auto"] == {"all_reduce": 2 * 2}


def test_estimate_table_and_json(capsys, tiny_config):
    code, out, _ = run_cli(capsys, "estimate", "--hidden", "4096", "--layers", "32", "--heads", "32",
                           "--ffn", "11008", "--tp", "2,4", "--hardware", "a100-nvlink")
    assert code == 0
    assert "hardware: a100-nvlink\nsource: NVIDIA A100" in out and "speedup" in out
    code, out, _ = run_cli(capsys, "estimate", "--model", str(tiny_config), "--tp", "2",
                           "--hardware", "cpu-gloo", "--json")
    data = json.loads(out)
    assert code == 0 and data["model"]["hidden"] == 64
    assert [(e["phase"], e["tp"]) for e in data["estimates"]] == [
        ("prefill", 1), ("prefill", 2), ("decode", 1), ("decode", 2)]
    assert data["estimates"][0]["speedup"] == 1.0


def test_verify_tp2_forward_and_backward_end_to_end(capsys, tiny_model):
    code, out, err = run_cli(capsys, "verify", str(tiny_model), "--tp", "2", "--grad", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["passed"] and report["max_rel_error"] < 1e-4
    _, planned, _ = run_cli(capsys, "plan", str(tiny_model), "--tp", "2", "--json")
    for rank in report["ranks"]:
        # what `plan` predicts is what the sharded forward issued
        assert rank["collectives_per_forward"] == json.loads(planned)["collectives_per_forward"]
        assert rank["grad_error"][1] < 1e-4 and rank["peak_rss_bytes"] > 0


def test_bench_reports_latency_and_memory(capsys, tiny_model):
    code, out, _ = run_cli(capsys, "bench", str(tiny_model), "--tp", "2", "--reps", "2",
                           "--new-tokens", "2", "--seq", "8", "--json")
    report = json.loads(out)
    assert code == 0 and report["tp"] == 2
    assert report["prefill_ms"] > 0 and report["decode_tokens_per_s"] > 0
    assert len(report["peak_rss_bytes_per_rank"]) == 2


def test_python_dash_m_runs_the_same_cli(tiny_config):
    proc = subprocess.run([sys.executable, "-m", "torchtp", "plan", "/no/such/dir", "--tp", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "torchtp plan: error:" in proc.stderr and "Traceback" not in proc.stderr


def test_reshard_and_consolidate_through_the_torchtp_command(tmp_path):
    # HF directory -> torchtp checkpoint for tp=2 -> consolidated HF directory,
    # all offline; plain transformers loads the result with identical weights.
    import transformers

    from ._hf_models import build

    model = build("llama")
    model.save_pretrained(tmp_path / "hf")
    assert main(["reshard", str(tmp_path / "hf"), str(tmp_path / "tp2"), "--tp", "2"]) == 0
    assert main(["consolidate", str(tmp_path / "tp2"), str(tmp_path / "back")]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    for (name, p), (_, q) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
    assert main(["reshard", str(tmp_path / "missing"), str(tmp_path / "x"), "--tp", "2"]) == 2


def test_plan_places_experts_as_the_wrapper_would(capsys, tmp_path):
    cfg = transformers.MixtralConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=48, num_local_experts=4,
                                     num_experts_per_tok=2)
    cfg.to_json_file(str(tmp_path / "config.json"))
    if not _sentinel():  # transformers before 5.24: whole experts refused, naming the fix
        code, out, _ = run_cli(capsys, "plan", str(tmp_path), "--tp", "2", "--expert-parallel",
                               "true")
        assert code == 1 and "no expert-parallel sentinel" in out, out
        return
    code, out, _ = run_cli(capsys, "plan", str(tmp_path), "--tp", "4", "--expert-parallel", "2",
                           "--json")
    report = json.loads(out)
    experts = [r for r in report["layers"] if r["module"] == "model.layers.0.mlp.experts"]
    # ep 2 x tp 2: every rank holds 2 of the 4 experts and half of each one's 48 features.
    assert code == 0 and experts == [{
        "module": "model.layers.0.mlp.experts", "style": "ep_dispatch_experts",
        "full": [4, 96, 32], "local": [2, 48, 32], "local_per_rank": [[2, 48, 32]] * 4}]
    assert report["valid_tp_sizes"] == [2, 4]  # multiples of expert_parallel=2, <= 4 heads
    code, out, _ = run_cli(capsys, "plan", str(tmp_path), "--tp", "2", "--expert-parallel",
                           "true", "--expert-dispatch", "all_to_all")
    assert code == 0 and "4x96x32      2x96x32" in out
    # embed_tokens and lm_head (vocabulary 96) kept whole by cost: per MoE layer one
    # all-reduce (attention), a route-hash all-gather and 2 all-to-alls + 1 all-gather.
    assert "collectives per forward: 2 x all_reduce, 4 x all_gather, 4 x all_to_all" in out
    code, out, _ = run_cli(capsys, "plan", str(tmp_path), "--tp", "4", "--expert-parallel",
                           "3")
    assert code == 1 and "expert_parallel=3 does not divide the tensor-parallel size" in out
    # verify runs the same options on real ranks: whole experts through all-to-all dispatch.
    code, out, _ = run_cli(capsys, "verify", str(tmp_path), "--tp", "2", "--grad",
                           "--expert-parallel", "true", "--expert-dispatch", "all_to_all", "--json")
    report = json.loads(out)
    assert code == 0 and report["passed"], report
    assert report["ranks"][0]["collectives_per_forward"]["all_to_all"] == 4  # 2 per MoE layer


def test_verify_reports_the_largest_relative_gradient_error_and_missing_gradients():
    from torchtp.cli.verify import _grad_error

    torch.manual_seed(0)
    ref, got = nn.Linear(4, 4), nn.Linear(4, 4)
    got.load_state_dict(ref.state_dict())
    ref.weight.grad, ref.bias.grad = 1000 * torch.randn(4, 4), 1e-3 * torch.randn(4)
    got.weight.grad = ref.weight.grad + 1e-3  # rounding-sized on a large gradient: 1e-6 relative
    got.bias.grad = 1.5 * ref.bias.grad  # half wrong on a small one
    assert _grad_error(got, ref)[1] == pytest.approx(0.5)
    got.bias.grad = None  # a gradient that never arrived
    assert _grad_error(got, ref) == (math.inf, math.inf)
    # A tied weight is one gradient under two names: found under either, not missing
    tied_ref = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    tied_ref[1].weight = tied_ref[0].weight
    tied_ref[0].weight.grad = torch.ones(5, 4)
    tied_got = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    tied_got[0].weight.grad, tied_got[1].weight.grad = torch.ones(5, 4), torch.ones(5, 4)
    assert _grad_error(tied_got, tied_ref) == (0.0, 0.0)
