"""DistributedModelWrapper on plain PyTorch models."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import torchtp
from torchtp import ColumnParallelLinear, DistributedModelWrapper, RowParallelLinear
from torchtp.checkpoint import consolidate, reshard

from ._hf_models import build
from ._models import deep_mlp, gather_param, mlp
from ._reference import seeded, tol


def _forward_backward_parity(rank: int, world_size: int, bias: bool,
                             dtype: torch.dtype) -> dict[str, int]:
    ref = mlp(bias=bias, dtype=dtype).to(dtype)
    wrapped = DistributedModelWrapper(mlp(bias=bias, dtype=dtype).to(dtype))
    x = seeded(3, 5, 16, seed=11, dtype=dtype)
    gy = seeded(3, 5, 16, seed=12, dtype=dtype)
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr = ref(xr)
    with torchtp.count_collectives() as fwd:
        ys = wrapped(xs)
    torch.testing.assert_close(ys, yr, **tol(dtype))
    (yr * gy).sum().backward()
    (ys * gy).sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad, **tol(dtype))
    ref_params = dict(ref.named_parameters())
    for name, p in wrapped.base_model.named_parameters():
        full = gather_param(wrapped.base_model, name, p.grad, world_size)
        torch.testing.assert_close(full, ref_params[name].grad, **tol(dtype), msg=name)
    return dict(fwd.counts)


@pytest.mark.parametrize("world_size", [2, 4])
def test_mlp_parity_one_all_reduce_per_pair(ranks, world_size):
    def cases():
        for bias in (True, False):
            for dtype in (torch.float32, torch.bfloat16):
                yield bias, dtype

    for bias, dtype in cases():
        counts = ranks(_forward_backward_parity, world_size, bias, dtype)
        assert counts == [{"all_reduce": 1}] * world_size, (bias, dtype)


def test_mlp_parity_world_size_one():
    assert _forward_backward_parity(0, 1, True, torch.float32) == {}


def _deep_parity(rank: int, world_size: int) -> tuple[list[str], dict[str, int]]:
    ref = deep_mlp().eval()
    wrapped = DistributedModelWrapper(deep_mlp().eval())
    x = seeded(4, 16, seed=3)
    with torchtp.count_collectives() as counter:
        out = wrapped(x)
    torch.testing.assert_close(out, ref(x), **tol(torch.float32))
    return wrapped.parallelized_layers, dict(counter.counts)


def test_auto_plan_pairs_through_elementwise_and_nested_sequentials(ranks):
    for layers, counts in ranks(_deep_parity, 2):
        assert layers == ["0", "3", "5.0", "5.2"]
        # two pairs -> two all-reduces; the small unpaired head (16 -> 8) stays whole: split
        # alone it would save 272 bytes per rank for an all-gather and an all-reduce.
        assert counts == {"all_reduce": 2}


def test_auto_plan_choices_are_recorded():
    wrapped = DistributedModelWrapper(deep_mlp(), world_size=2, rank=0)
    rules = wrapped.resolved_plan.rules
    assert rules == {"0": "colwise", "3": "rowwise", "5.0": "colwise", "5.2": "rowwise",
                     "6": "replicate"}
    assert "'6' kept replicated: splitting it alone saves 272 B of parameters per rank" in \
        wrapped.describe_plan()
    assert isinstance(wrapped.base_model[0], RowParallelLinear)
    assert isinstance(wrapped.base_model[3], ColumnParallelLinear)
    memory = DistributedModelWrapper(deep_mlp(), world_size=2, rank=0, plan="auto-memory")
    assert memory.resolved_plan.rules["6"] == "colwise_gather_output"
    assert "'6' has no partner Linear" in memory.describe_plan()


def test_unsplittable_layer_stays_replicated_and_says_why(caplog):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3))  # fewer rows and columns than ranks; 7 over 2 would split 4/3
    with caplog.at_level("INFO", logger="torchtp"):
        wrapped = DistributedModelWrapper(model, world_size=4, rank=1)
    assert wrapped.parallelized_layers == []
    assert ("kept replicated: neither out_features=3 nor in_features=2 gives each of "
            "world_size=4 ranks a share") in caplog.text


def test_tied_weights_stay_replicated():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    model[2].weight = model[0].weight
    wrapped = DistributedModelWrapper(model, world_size=2, rank=0)
    assert wrapped.parallelized_layers == []
    assert "weight is shared with another module" in wrapped.describe_plan()


def _explicit_plan(rank: int, world_size: int) -> list[str]:
    ref = mlp()
    plan = {"0": "colwise_gather_output", "2": "rowwise_split_input", "nothing.*": "colwise"}
    wrapped = DistributedModelWrapper(mlp(), plan=plan)
    x = seeded(2, 16, seed=5)
    torch.testing.assert_close(wrapped(x), ref(x), **tol(torch.float32))
    return wrapped.parallelized_layers


def test_explicit_plan_with_hf_vocabulary(ranks):
    assert ranks(_explicit_plan, 2) == [["0", "2"]] * 2


def test_plan_patterns_use_fnmatch(caplog):
    model = nn.Sequential(mlp(), mlp())
    with caplog.at_level("WARNING", logger="torchtp"):
        wrapped = DistributedModelWrapper(
            model, world_size=2, rank=0,
            plan={"*.0": "colwise", "*.2": "rowwise", "missing": "replicate"})
    assert wrapped.parallelized_layers == ["0.0", "0.2", "1.0", "1.2"]
    assert "rule 'missing' (style replicate) matches no module" in caplog.text


def test_wrapper_forwards_attributes_and_state_dict_holds_local_shards():
    model = mlp()
    model.custom_attribute = 42
    wrapped = DistributedModelWrapper(model, world_size=4, rank=3)
    assert wrapped.custom_attribute == 42
    assert wrapped.world_size == 4 and wrapped.rank == 3 and wrapped.base_model is model
    sd = wrapped.state_dict()
    assert set(sd) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert sd["0.weight"].shape == (16, 16) and sd["2.weight"].shape == (16, 16)
    assert sd["0.bias"].shape == (16,) and sd["2.bias"].shape == (16,)
    # Shards of another model (seed 1) load under the same names and shapes.
    other = DistributedModelWrapper(mlp(seed=1), world_size=4, rank=3).state_dict()
    before = {k: v.clone() for k, v in sd.items()}  # sd shares storage with the parameters
    result = wrapped.load_state_dict(other)
    assert not result.missing_keys and not result.unexpected_keys
    for name, tensor in wrapped.state_dict().items():
        assert torch.equal(tensor, other[name]), name
        assert not torch.equal(tensor, before[name]), name  # really replaced
    # An unsharded tensor (the full model's) loads as this rank's slice of it (rows 48-63)
    full = mlp(seed=2).state_dict()["0.weight"]  # (64, 16)
    wrapped.load_state_dict({**other, "0.weight": full})
    assert torch.equal(wrapped.base_model[0].weight, full[48:])
    with pytest.raises(RuntimeError, match=r"size mismatch for 0\.weight"):
        wrapped.load_state_dict({**other, "0.weight": torch.zeros(32, 16)})  # tp 2's shard


def _train(rank: int, world_size: int, steps: int) -> int:
    ref = deep_mlp()
    wrapped = DistributedModelWrapper(deep_mlp())
    # Dropout masks differ between sharded and unsharded models by design, so
    # this loop runs in eval mode; SGD updates are exact either way.
    ref.eval()
    wrapped.eval()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    ref_params = dict(ref.named_parameters())
    for step in range(steps):
        x, target = seeded(8, 16, seed=100 + step), seeded(8, 8, seed=200 + step)
        for model, optim in ((ref, opt_ref), (wrapped, opt)):
            optim.zero_grad()
            nn.functional.mse_loss(model(x), target).backward()
            optim.step()
        for name, p in wrapped.base_model.named_parameters():
            full = gather_param(wrapped.base_model, name, p, world_size)
            # SGD adds lr * grad to weights that matched: differences stay at
            # fp32 reassociation level (see _reference.FP32) after 5 steps.
            torch.testing.assert_close(full, ref_params[name].detach(), rtol=1e-5, atol=1e-6,
                                       msg=f"step {step}: {name}")
    return steps


@pytest.mark.parametrize("world_size", [2, 4])
def test_sgd_training_matches_single_process(ranks, world_size):
    assert ranks(_train, world_size, 5) == [5] * world_size


class _SharedModule(nn.Module):
    """One Linear object inside two Sequentials (a shared module, not just a tied weight)."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(8, 16)
        self.a = nn.Sequential(shared, nn.ReLU(), nn.Linear(16, 8))
        self.b = nn.Sequential(shared, nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(x)


class _TiedPartner(nn.Module):
    """A Sequential whose would-be rowwise partner shares its weight with another module."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                                 nn.Linear(16, 8))
        self.head = nn.Linear(16, 16)
        self.head.weight = self.seq[2].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq(x) + self.head(torch.ones(16)).sum()


def _shared_parity(rank: int, world_size: int) -> list[list[str]]:
    layers = []
    for cls in (_SharedModule, _TiedPartner):
        torch.manual_seed(0)
        ref = cls()
        torch.manual_seed(0)
        # plan="auto-memory": the lone Linears split and gathered, as cost would not.
        wrapped = DistributedModelWrapper(cls(), plan="auto-memory")
        x = seeded(3, 8, seed=5)
        torch.testing.assert_close(wrapped(x), ref(x))
        layers.append(wrapped.parallelized_layers)
    return layers


def test_auto_plan_replicates_shared_modules_and_never_pairs_them(ranks):
    # A shared Linear is kept whole, and so is the pairing around it: splitting its
    # neighbour alone would feed sharded activations into a replicated layer.
    got = ranks(_shared_parity, 2, timeout=120)
    assert got[0] == [["a.2", "b.2"], ["seq.0", "seq.4"]]


def test_tp1_training_with_dropout_equals_the_unwrapped_model():
    # One rank holds everything: no RNG streams, the caller's generator draws the masks.
    ref, wrapped = deep_mlp().train(), DistributedModelWrapper(deep_mlp().train())
    x = seeded(4, 16, seed=3)
    torch.manual_seed(7)
    want = ref(x)
    torch.manual_seed(7)
    got = wrapped(x)
    after = torch.rand(1)  # and the caller's generator moved on as the unwrapped run's did
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # same ops, same masks: bitwise
    torch.manual_seed(7)
    ref(x)
    assert torch.equal(torch.rand(1), after)


def test_tp1_keeps_the_model_as_it_was_and_plans_only_when_asked(tmp_path):
    # Decision 106: at tp 1 nothing is split, so no module is swapped and no Parameter
    # replaced (an optimizer built before or after the wrap holds the same objects).
    model = deep_mlp()
    modules, params = list(model.modules()), [id(p) for p in model.parameters()]
    wrapped = DistributedModelWrapper(model)
    assert wrapped.parallelized_layers == [] and wrapped.world_size == 1
    assert wrapped.__dict__["_resolved"] is None  # nothing planned yet
    assert [id(p) for p in wrapped.parameters()] == params
    assert "'6' has no partner Linear" in wrapped.describe_plan()  # the plan, resolved on demand
    assert wrapped.resolved_plan.rules["0"] == "colwise" and 2 in wrapped.valid_world_sizes
    assert list(model.modules()) == modules and [id(p) for p in model.parameters()] == params
    # A tp-1 save holds every tensor whole; resharded to tp 2 it is split as a tp-2 wrap
    # splits it, and consolidated back it is the model bit for bit.
    hf = build("llama")
    DistributedModelWrapper(hf).save_sharded(tmp_path / "tp1")
    reshard(tmp_path / "tp1", tmp_path / "tp2", 2)
    consolidate(tmp_path / "tp2", tmp_path / "hf")
    rank1 = load_file(tmp_path / "tp2" / "rank-00001-of-00002.safetensors")
    down = "model.layers.0.mlp.down_proj.weight"
    assert rank1[down].shape == (hf.config.hidden_size, hf.config.intermediate_size // 2)
    back = load_file(tmp_path / "hf" / "model.safetensors")
    for name, t in hf.state_dict().items():
        assert torch.equal(back[name], t), name


def test_tp1_checks_what_the_caller_gave_at_wrap_time(tmp_path):
    # A bad plan, plan file or option raises at a tp-1 wrap, as at any tp (not at a later save).
    with pytest.raises(ValueError, match=r"unknown plan style 'colwize' for '0'"):
        DistributedModelWrapper(mlp(), plan={"0": "colwize"})
    with pytest.raises(FileNotFoundError, match=r"plan file .*missing\.yaml does not exist"):
        DistributedModelWrapper(mlp(), plan=str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match=r"expert_parallel=True, but the model has no"):
        DistributedModelWrapper(mlp(), expert_parallel=True)
    # A valid explicit plan is resolved at the wrap and still changes nothing.
    model = mlp()
    params = [id(p) for p in model.parameters()]
    wrapped = DistributedModelWrapper(model, plan={"0": "colwise", "2": "rowwise"})
    assert wrapped.__dict__["_resolved"] is not None
    assert [id(p) for p in model.parameters()] == params and wrapped.parallelized_layers == []


def test_tp1_plan_resolved_after_peft_sees_the_base_layers():
    from peft import LoraConfig, get_peft_model

    wrapped = DistributedModelWrapper(build("llama"))
    get_peft_model(wrapped.base_model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert "q_proj" in wrapped.describe_plan()  # planned on the base Linears under the LoRA layers


def _wrap_on_a_subgroup_then_the_world(rank: int, world_size: int) -> list[float]:
    import torch.distributed as dist

    from torchtp.layers import rng

    pair = dist.new_group([0, 1])  # every rank creates it; only 0 and 1 wrap on it first
    if rank < 2:
        first = mlp()
        torch.manual_seed(rank)  # different generators: the sync must make them agree
        DistributedModelWrapper(first, group=pair)
    second = mlp()
    torch.manual_seed(10 + rank)
    DistributedModelWrapper(second, group=dist.group.WORLD)
    saved = torch.get_rng_state()
    assert rng.TRACKER.shared is not None
    torch.set_rng_state(rng.TRACKER.shared[0])
    draw = float(torch.rand(()))
    torch.set_rng_state(saved)
    return [draw]


def test_a_second_wrap_over_a_larger_group_does_not_hang_and_shares_one_stream(ranks):
    # Ranks 0 and 1 started their RNG streams in a first wrap; the second wrap's sync is a
    # collective on all four (it used to skip it on 0 and 1, leaving 2 and 3 waiting), and
    # 2 and 3 take the started ranks' shared stream.
    out = ranks(_wrap_on_a_subgroup_then_the_world, 4, timeout=120)
    assert len({tuple(o) for o in out}) == 1
