"""Signal configs without processes: registry, YAML, TORCHTP_CONFIG, scopes, backward rules."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torchtp import signal
from torchtp.signal import ShardConfig, SignalConfig

DOC_YAML = textwrap.dedent("""\
    # config.yaml (the document's quick example)
    forward_layer1:
      shard:
        axis: 0                  # Shard batch dimension
        workers: [0, 1, 2, 3]    # Use workers 0-3
      backward: backward_layer1  # Different config for gradients

    backward_layer1:
      shard:
        axis: 0
        workers: [0, 1, 2, 3]

    hot_path:
      shard:
        axis: 0
        workers: [0, 1, 2, 3]
      compile: true              # Enable torch.compile for this signal
    """)


@pytest.fixture(autouse=True)
def _clean_registry():
    before = signal.list_configs()
    yield
    for name in signal.list_configs():
        if name not in before:
            signal.unregister_config(name)


def test_load_the_documents_yaml(tmp_path: Path):
    path = tmp_path / "config.yaml"
    path.write_text(DOC_YAML)
    loaded = signal.load_config(path)
    assert set(loaded) == {"forward_layer1", "backward_layer1", "hot_path"}
    fwd = signal.get_config("forward_layer1")
    assert fwd == SignalConfig(shard=ShardConfig(axis=0, workers=[0, 1, 2, 3]),
                               backward_signal="backward_layer1", compile=False)
    assert signal.get_config("hot_path").compile is True
    assert fwd.source == f"{path}: forward_layer1"


def test_python_api_and_mixing_with_yaml(tmp_path: Path):
    (tmp_path / "base.yaml").write_text("base:\n  shard:\n    axis: 1\n    workers: [0]\n")
    signal.load_config(tmp_path / "base.yaml")
    signal.register_config("dynamic_layer", SignalConfig(shard=ShardConfig(axis=0, workers=[0])))
    assert signal.get_config("base").shard == ShardConfig(1, [0])
    assert signal.get_config("dynamic_layer").shard.workers == (0,)


@pytest.mark.parametrize(("text", "pattern"), [
    ("a: [unclosed", r"bad.yaml: not valid YAML"),
    ("- a\n- b\n", r"bad.yaml: the top level must map signal names to configs, got list"),
    ("a:\n  shrad: {axis: 0}\n", r"bad.yaml: a.shrad: unknown key; expected one of shard"),
    ("a:\n  shard: {axis: -1}\n", r"bad.yaml: a.shard.axis: expected an int >= 0, got -1"),
    ("a:\n  shard: {workers: abc}\n", r"bad.yaml: a.shard.workers: expected a non-empty list "
                                      r"of distinct ranks >= 0, got 'abc'"),
    ("a:\n  shard: {workers: [0, 0]}\n", r"a.shard.workers: .*got \[0, 0\]"),
    ("a:\n  compile: maybe\n", r"bad.yaml: a.compile: expected true or false, got 'maybe'"),
    ("a:\n  backward: nowhere\n", r"bad.yaml: a.backward: unknown signal 'nowhere'"),
    ("a: 3\n", r"bad.yaml: a: expected a mapping with keys shard/backward/compile, got 3"),
])
def test_malformed_yaml_names_file_and_key(tmp_path: Path, text: str, pattern: str):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=pattern):
        signal.load_config(path)
    assert "a" not in signal.list_configs()  # all or nothing


def test_missing_file_and_bad_python_configs(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"signal config file .*nope.yaml' does not exist"):
        signal.load_config(tmp_path / "nope.yaml")
    with pytest.raises(ValueError, match=r"ShardConfig.workers=\[\] must be non-empty"):
        ShardConfig(workers=[])
    with pytest.raises(ValueError, match=r"ShardConfig.axis=-1 must be an int >= 0"):
        ShardConfig(axis=-1)
    with pytest.raises(TypeError, match=r"register_config\('x', ...\) needs a SignalConfig"):
        signal.register_config("x", {"shard": {}})  # type: ignore[arg-type]
    with pytest.raises(KeyError, match=r"unknown signal 'missing'; known signals"):
        signal.get_config("missing")


def _import_with_env(path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCHTP_CONFIG=str(path))
    code = "import torchtp.signal as s; print(sorted(s.list_configs()))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def test_torchtp_config_env_var_is_read_at_import(tmp_path: Path):
    good = tmp_path / "config.yaml"
    good.write_text(DOC_YAML)
    done = _import_with_env(good)
    assert done.returncode == 0, done.stderr
    assert "['backward_layer1', 'forward_layer1', 'hot_path']" in done.stdout
    bad = tmp_path / "broken.yaml"
    bad.write_text("x:\n  shard: {axis: one}\n")
    done = _import_with_env(bad)
    assert done.returncode != 0
    assert "TORCHTP_CONFIG=" in done.stderr and "broken.yaml: x.shard.axis" in done.stderr


def test_scopes_outside_processes_return_plain_tensors():
    signal.register_config("one", SignalConfig(shard=ShardConfig(axis=0, workers=[0])))
    assert signal.current() is None
    assert type(signal.randn(4, 2)) is torch.Tensor
    with signal.context("one") as cfg:
        assert cfg.shard.workers == (0,) and signal.current() == "one"
        x = signal.zeros(4, 2)
        assert type(x) is torch.Tensor and not x.any()
    signal.enter("one")
    assert signal.ones((2, 3)).sum() == 6
    signal.exit("one")
    assert signal.current() is None


def test_scope_errors():
    signal.register_config("far", SignalConfig(shard=ShardConfig(workers=[0, 5])))
    with pytest.raises(ValueError, match=r"signal 'far' \(python.shard.workers\): workers \[5\] "
                                         r"are outside the world of 1 rank\(s\)"):
        signal.enter("far")
    with pytest.raises(RuntimeError, match=r"signal.exit\('x'\) without a matching signal.enter"):
        signal.exit("x")
    signal.register_config("a", SignalConfig(shard=ShardConfig(workers=[0])))
    signal.register_config("b", SignalConfig(shard=ShardConfig(workers=[0])))
    with signal.context("a"):
        signal.enter("b")
        with pytest.raises(RuntimeError, match=r"exit\('a'\) but the innermost signal is 'b'"):
            signal.exit("a")
        signal.exit("b")
    with pytest.raises(RuntimeError, match=r"needs name=... outside a signal context"):
        signal.tensor(torch.zeros(2))
    signal.register_config("axis3", SignalConfig(shard=ShardConfig(axis=3, workers=[0])))
    with pytest.raises(ValueError, match=r"signal 'axis3' \(python.shard.axis\) shards axis 3, "
                                         r"but the tensor has 2 dim\(s\)"):
        signal.tensor(torch.zeros(2, 2), "axis3")


def test_backward_signal_decision():
    signal.register_config("fwd", SignalConfig(shard=ShardConfig(0, [0]), backward_signal="bwd"))
    signal.register_config("bwd", SignalConfig(shard=ShardConfig(0, [0])))
    with signal.context("fwd"):  # same workers: backward runs where the forward ran
        pass
    signal.register_config("other_axis", SignalConfig(shard=ShardConfig(1, [0])))
    with pytest.raises(NotImplementedError, match=r"signal 'fwd' shards axis 0 but its backward "
                                                  r"signal 'other_axis' shards axis 1"), \
            signal.context("fwd", backward="other_axis"):
        pass
    assert signal.current() is None


def test_backward_workers_outside_the_world():
    signal.register_config("stage_1", SignalConfig(shard=ShardConfig(0, [0]),
                                                   backward_signal="stage_1_backward"))
    signal.register_config("stage_1_backward", SignalConfig(shard=ShardConfig(0, [0, 1])))
    with pytest.raises(ValueError, match=r"workers \[1\] are outside the world"):
        signal.enter("stage_1")


def test_compile_flag_applies_torch_compile():
    signal.register_config("hot", SignalConfig(shard=ShardConfig(0, [0]), compile=True))
    signal.register_config("cold", SignalConfig(shard=ShardConfig(0, [0])))
    model = torch.nn.Linear(4, 2)
    x = torch.randn(3, 4)
    compiled = signal.parallelize(model, "hot", compile_kwargs={"backend": "eager"})
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    assert torch.allclose(compiled(x), model(x))
    with signal.context("cold"):
        assert signal.parallelize(model) is model
