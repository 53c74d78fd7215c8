"""Rank functions for test_training.py: TP x DP training against one process.

Every rank also trains the unsharded model on the global batch itself (same
seed), so the reference never comes from the shard under test.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import torchtp

from ._hf_models import VOCAB, build

STEPS = 3
MAX_NORM = 0.5  # below the first steps' norms (~2-4), so clipping is active
# fp32 with a different summation order (all-reduced partial matmuls, DDP/FSDP
# averaging, the norm's sum over ranks): a few ulps per op, amplified by 3 Adam steps.
TOL = {"rtol": 2e-4, "atol": 2e-5}


def _batch(n: int = 4, length: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (n, length), generator=g)


def _train(model: nn.Module, ids: torch.Tensor, clip: Callable[..., torch.Tensor],
           params: Callable[[], Any]) -> tuple[list[float], list[float]]:
    """STEPS of forward + backward + clip + AdamW; (losses, pre-clip norms)."""
    opt = torch.optim.AdamW(params(), lr=1e-2)
    losses, norms = [], []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(clip(params(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, norms


def _reference(arch: str) -> tuple[nn.Module, list[float], list[float]]:
    ref = build(arch, seed=0).train()
    ids = _batch()
    losses, norms = _train(ref, ids, torch.nn.utils.clip_grad_norm_, ref.parameters)
    return ref, losses, norms


def _global_loss(losses: list[float], group: Any) -> list[float]:
    """Mean over the DP ranks of each step's slice loss (= the global-batch loss)."""
    t = torch.tensor(losses)
    torch.distributed.all_reduce(t, group=group)
    return (t / torch.distributed.get_world_size(group)).tolist()


def _raises(fn: Callable[[], Any], match: str) -> str:
    with pytest.raises(ValueError, match=match) as info:
        fn()
    return str(info.value)


def _misuse(tmp: str) -> list[str]:
    """DDP over the world (TP peers + DP peers), FSDP2 over TP peers, a model sharded
    before the wrap (``tmp``: a directory for transformers' ``from_pretrained``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = _batch()[:1]
    msgs = [_raises(lambda: DDP(torchtp.DistributedModelWrapper(build("llama"))),
                    r"DistributedDataParallel over ranks \[0, 1, 2, 3\] mixes tensor-parallel "
                    r"peers .* process_group=.*dp_group")]
    msgs.append(_raises(lambda: DDP(_Outer(torchtp.DistributedModelWrapper(build("llama")))),
                        r"DistributedDataParallel over ranks \[0, 1, 2, 3\] mixes tensor-parallel "
                        r"peers \[\d, \d\] \(which hold different shards of _Outer, e\.g\. "
                        r"'inner\.base_model\.model\.layers\.0\.self_attn\.q_proj\.weight' of full shape "
                        r"\[\d+, \d+\] split along dim \d \((rows|columns)\) over tp=2\)"))
    world = init_device_mesh("cpu", (4,))
    sharded = fully_shard(torchtp.DistributedModelWrapper(build("llama")), mesh=world)
    msgs.append(_raises(lambda: sharded(input_ids=ids),
                        r"FSDP's mesh \[0, 1, 2, 3\] contains tensor-parallel peers"))
    # Sharded after a forward: the wrapper noticed FSDP2's new parameter objects
    used = torchtp.DistributedModelWrapper(build("llama"))
    used(input_ids=ids)
    used = fully_shard(used, mesh=world)
    msgs.append(_raises(lambda: used(input_ids=ids),
                        r"FSDP's mesh \[0, 1, 2, 3\] contains tensor-parallel peers"))
    # The module holding the first parameter replaced after a forward (as
    # resize_token_embeddings does), then sharded: the old module's slot still holds the
    # old parameter, the registration tells the wrapper to look again.
    swapped = torchtp.DistributedModelWrapper(build("llama"))
    swapped(input_ids=ids)
    inner = swapped.base_model.model
    inner.embed_tokens = copy.deepcopy(inner.embed_tokens)
    swapped = fully_shard(swapped, mesh=world)
    msgs.append(_raises(lambda: swapped(input_ids=ids),
                        r"FSDP's mesh \[0, 1, 2, 3\] contains tensor-parallel peers"))
    # Sharded before the wrap (FSDP2, PyTorch's TP; transformers' tp_plan leaves DTensors
    # too): refused before any fingerprint or cut, on every rank
    msgs.append(_raises(lambda: torchtp.DistributedModelWrapper(fully_shard(build("llama"),
                                                                            mesh=world)),
                        r"model is already sharded: parameter 'model\.embed_tokens\.weight' is "
                        r"a DTensor \(Shard\(dim=0\) over a mesh of 4 ranks\).*wrap the "
                        r"unsharded model .* fully_shard\(module, mesh=cfg\.mesh\['dp'\]\) "
                        r"after the wrap"))
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    mlp = parallelize_module(nn.Sequential(nn.Linear(8, 8)), world, {"0": RowwiseParallel()})
    msgs.append(_raises(lambda: torchtp.DistributedModelWrapper(mlp),
                        r"parameter '0\.weight' is a DTensor \(Shard\(dim=1\) over a mesh"))
    from transformers import AutoModelForCausalLM

    saved = f"{tmp}-hf"
    if torch.distributed.get_rank() == 0:
        build("llama-tied").save_pretrained(saved)  # 8 query and 4 KV heads: tp 4 fits
    torch.distributed.barrier()
    hf_tp = AutoModelForCausalLM.from_pretrained(saved, tp_plan="auto")
    msgs.append(_raises(lambda: torchtp.DistributedModelWrapper(hf_tp),
                        r"model is already sharded: 'LlamaForCausalLM' was loaded with "
                        r"transformers' own tensor parallelism \(from_pretrained\(\.\.\., "
                        r"tp_plan=\.\.\.\) over 4 ranks\).*DistributedModelWrapper\."
                        r"from_pretrained\(path\)"))
    return msgs


def dp_tp_ddp_fsdp(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """dp 2 x tp 2: mesh attributes, DDP (MQA: KV heads replicated in each TP group), FSDP2."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    with pytest.raises(ValueError, match=r"tp_size=3 must divide the world size 4; "
                       r"valid tp_size values: \[1, 2, 4\]"):
        torchtp.init_tensor_parallel(tp_size=3)
    cfg = torchtp.init_tensor_parallel(tp_size=2)
    assert torchtp.init_tensor_parallel(tp_size=2) is cfg  # idempotent: the same mesh
    # init_parallel names the same mesh: dp takes what tp leaves and the other way round.
    assert torchtp.init_parallel(tp=2) is cfg and torchtp.init_parallel(dp=2) is cfg
    with pytest.raises(ValueError, match=r"init_parallel: dp=3 must divide the world size 4; "
                       r"valid dp values: \[1, 2, 4\]"):
        torchtp.init_parallel(tp=2, dp=3)
    with pytest.raises(ValueError, match=r"dp=1, tp=2: the product of the mesh sizes must "
                       r"equal the world size 4"):
        torchtp.init_parallel(tp=2, dp=1)
    from torchtp.comm.runtime import resolve_group

    assert resolve_group() is cfg.group and resolve_group(dim="tp") is cfg.group
    assert resolve_group(dim="dp") is cfg.dp_group
    out: dict[str, Any] = {"cfg": (cfg.world_size, cfg.rank, cfg.dp_size, cfg.dp_rank,
                                   cfg.world_size, cfg.rank, cfg.mesh.mesh_dim_names,
                                   torch.distributed.get_process_group_ranks(cfg.group),
                                   torch.distributed.get_process_group_ranks(cfg.dp_group))}
    mine = _batch()[cfg.dp_rank * 2:(cfg.dp_rank + 1) * 2]  # this DP rank's slice
    out["misuse"] = _misuse(tmp)
    for arch, kind in (("mistral-mqa", "ddp"), ("llama", "fsdp")):
        ref, ref_losses, ref_norms = _reference(arch)
        wrapped = torchtp.DistributedModelWrapper(build(arch, seed=0).train())
        if kind == "ddp":
            model: nn.Module = DDP(wrapped, process_group=cfg.dp_group)
        else:
            for layer in wrapped.model.layers:
                fully_shard(layer, mesh=cfg.mesh["dp"])
            model = fully_shard(wrapped, mesh=cfg.mesh["dp"])
            assert all(type(p).__name__ == "DTensor" for p in model.parameters())
        losses, norms = _train(model, mine, torchtp.clip_grad_norm_, model.parameters)
        if kind == "ddp":  # a DCP round trip of a dp x tp job (DP replicas deduplicated)
            from torchtp.checkpoint.dcp import load_training_state, save_training_state

            save_training_state(tmp, model)
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            load_training_state(tmp, model)
        torch.testing.assert_close(norms, ref_norms, **TOL)
        torch.testing.assert_close(_global_loss(losses, cfg.dp_group), ref_losses, **TOL)
        with torch.no_grad():
            full = _batch()
            got = (model.module if kind == "ddp" else model)(input_ids=full).logits
            torch.testing.assert_close(got, ref(input_ids=full).logits, **TOL)
        out[kind] = norms
    return out


def tp_only(rank: int, world_size: int) -> list[float]:
    """World = TP group: grad_norm vs torch; DDP around the wrapper or any other module trains
    exactly."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torchtp.init_tensor_parallel()
    got = _clip_matches_torch()
    ref, ref_losses, ref_norms = _reference("mistral-mqa")
    wrapped = torchtp.DistributedModelWrapper(build("mistral-mqa", seed=0).train())
    model = DDP(wrapped)
    assert "base_model.model.layers.0.self_attn.q_proj.weight" in model.parameters_to_ignore
    losses, norms = _train(model, _batch(), torchtp.clip_grad_norm_, model.parameters)
    torch.testing.assert_close(losses, ref_losses, **TOL)
    torch.testing.assert_close(norms, ref_norms, **TOL)
    with torch.no_grad():
        torch.testing.assert_close(model.module(input_ids=_batch()).logits,
                                   ref(input_ids=_batch()).logits, **TOL)
    _ddp_placements(ref, ref_losses, ref_norms)
    return got + norms


class _Outer(nn.Module):
    """A user's module holding the tensor-parallel model (keyword arguments passed on)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, **kwargs: Any) -> Any:
        return self.inner(**kwargs)


def _ddp_placements(ref: nn.Module, ref_losses: list[float], ref_norms: list[float]) -> None:
    """DDP over the TP group around base_model, an outer module (after a training forward
    ran, and for evaluation only) and a PEFT model: each as the unsharded model."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    def fresh() -> torchtp.DistributedModelWrapper:
        return torchtp.DistributedModelWrapper(build("mistral-mqa", seed=0).train())

    base = DDP(fresh().base_model)
    assert "model.layers.0.self_attn.q_proj.weight" in base.parameters_to_ignore
    warm = fresh()
    warm(input_ids=_batch())  # a training forward before DDP exists
    for model in (base, DDP(_Outer(warm))):
        losses, norms = _train(model, _batch(), torchtp.clip_grad_norm_, model.parameters)
        torch.testing.assert_close(losses, ref_losses, **TOL)
        torch.testing.assert_close(norms, ref_norms, **TOL)
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=_batch()).logits,
                                       ref(input_ids=_batch()).logits, **TOL)
    evaluating = DDP(_Outer(fresh().eval()))  # evaluation only: the broadcast alone would harm
    with torch.no_grad():
        torch.testing.assert_close(evaluating(input_ids=_batch()).logits,
                                   build("mistral-mqa", seed=0)(input_ids=_batch()).logits, **TOL)
    _ddp_peft()
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    hand = DDP(nn.Sequential(torchtp.RowParallelLinear.from_linear(full[0]), nn.ReLU(),
                             torchtp.ColumnParallelLinear.from_linear(full[2])))  # no wrapper
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(hand(x), full(x), **TOL)
    early = DDP(build("mistral-mqa", seed=0).train())  # before the model is sharded
    with pytest.raises(ValueError, match=r"model is a DistributedDataParallel: wrap the model "
                       r"first, then build DDP around the DistributedModelWrapper"):
        torchtp.DistributedModelWrapper(early)
    torchtp.DistributedModelWrapper(early.module)
    for _ in range(2):  # at every forward, not only the first
        with pytest.raises(ValueError, match=r"DistributedDataParallel around MistralForCausalLM "
                           r"was built before MistralForCausalLM was made tensor-parallel .*: "
                           r"its reducer does not hold 'model\.layers\.0\.self_attn\.q_proj\.weight', so DDP "
                           r"would never average it\. Build DDP after "
                           r"DistributedModelWrapper\(model\)"):
            early(input_ids=_batch())


def _ddp_peft() -> None:
    """DDP(get_peft_model(wrapped.base_model)): three LoRA steps as unsharded LoRA."""
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel as DDP

    def lora(model: nn.Module) -> nn.Module:
        torch.manual_seed(5)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                            init_lora_weights="gaussian")
        return get_peft_model(model, config)

    ref = lora(build("mistral-mqa", seed=0).train())
    tp = DDP(lora(torchtp.DistributedModelWrapper(build("mistral-mqa", seed=0).train())
                  .base_model))
    got = []
    for model, clip in ((ref, torch.nn.utils.clip_grad_norm_), (tp, torchtp.clip_grad_norm_)):
        adapters = [p for p in model.parameters() if p.requires_grad]
        got.append(_train(model, _batch(), clip, lambda ps=adapters: ps))
    torch.testing.assert_close(got[1], got[0], **TOL)
    with torch.no_grad():
        torch.testing.assert_close(tp(input_ids=_batch()).logits,
                                   ref(input_ids=_batch()).logits, **TOL)


def _clip_matches_torch() -> list[float]:
    """grad_norm for p = 2, 1, inf (MQA: replicated KV segments) vs the unsharded model."""
    ref = build("mistral-mqa", seed=0)
    wrapped = torchtp.DistributedModelWrapper(copy.deepcopy(ref))
    for m in (ref, wrapped):
        m(input_ids=_batch(), labels=_batch()).loss.backward()
    got = []
    for p in (2.0, 1.0, float("inf")):
        want = torch.nn.utils.get_total_norm([q.grad for q in ref.parameters()], p)
        mine = torchtp.grad_norm(wrapped.parameters(), p)
        torch.testing.assert_close(mine, want, rtol=1e-5, atol=0)
        got.append(float(mine))
    _torch_clip_is_routed(ref, wrapped)
    return got


def _torch_clip_is_routed(ref: nn.Module, wrapped: torchtp.DistributedModelWrapper) -> None:
    """``torch.nn.utils.clip_grad_norm_`` on a wrapped model's parameters clips as on the
    unsharded model, with ``max_norm`` where it matters most: above every rank's own
    shards' norm, below the whole model's (unrouted, no rank would clip, silently)."""
    shards = torch.nn.utils.get_total_norm([q.grad for q in wrapped.parameters()])
    torch.distributed.all_reduce(shards, torch.distributed.ReduceOp.MAX)
    whole = torchtp.grad_norm(wrapped.parameters())
    assert shards < whole
    max_norm = float(shards + whole) / 2
    norm = torch.nn.utils.clip_grad_norm_(wrapped.parameters(), max_norm)
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm),
                               rtol=1e-5, atol=0)
    for name, q in ref.named_parameters():  # a replicated parameter's gradient, clipped
        if name.endswith("norm.weight"):
            torch.testing.assert_close(wrapped.base_model.get_parameter(name).grad, q.grad, rtol=1e-5,
                                       atol=1e-8)


def agreement(rank: int, world_size: int, tmp: str) -> list[str]:
    """Different seeds, different batches, a stale checkpoint copy: RankMismatchError everywhere."""
    import os

    from safetensors.torch import save_file

    from ._models import mlp

    torchtp.init_tensor_parallel()
    msgs = []
    with pytest.raises(torchtp.RankMismatchError, match=r"weights of '0.weight' .*different seeds"):
        torchtp.DistributedModelWrapper(mlp(seed=rank))
    wrapped = torchtp.DistributedModelWrapper(mlp())
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(rank))
    wrapped.eval()
    with pytest.raises(torchtp.RankMismatchError, match=r"argument 0 differs on TP ranks \[1\]"):
        wrapped(x)  # eval forwards are checked too
    os.environ["TP_CHECK_INPUTS"] = "0"
    torchtp.configure_from_env()  # read once, as at import
    wrapped(x)  # turned off: not checked
    del os.environ["TP_CHECK_INPUTS"]
    torchtp.configure_from_env()
    wrapped.train()
    with pytest.raises(torchtp.RankMismatchError, match=r"data sampler") as info:
        wrapped(x)
    msgs.append(str(info.value))
    wrapped(torch.ones(2, 16))  # the same batch everywhere: fine
    with pytest.raises(torchtp.RankMismatchError, match=r"data sampler"):
        wrapped(x)  # and checked again on every forward
    # One copy of the files per "node", same config, rank 1's copy is stale.
    model = build("llama")
    if rank == 1:
        with torch.no_grad():
            model.model.layers[1].mlp.up_proj.weight.mul_(2)
    # HF's save_pretrained writes on the main process only: write the files directly.
    model.config.save_pretrained(f"{tmp}/node{rank}")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              f"{tmp}/node{rank}/model.safetensors")
    torch.distributed.barrier()
    with pytest.raises(torchtp.RankMismatchError,
                       match=r"checkpoint tensor 'model.layers.1.mlp.up_proj.weight' .*stale"):
        torchtp.DistributedModelWrapper.from_pretrained(f"{tmp}/node{rank}")
    return msgs


def _same_on_every_rank(t: torch.Tensor) -> bool:
    everyone = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(everyone, t.detach().contiguous())
    return all(torch.equal(e, everyone[0]) for e in everyone)


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _lora_on_pairs(model: nn.Module) -> nn.Module:
    """LoRA (with its own dropout) on both layers of deep_mlp's pairs: on the weight-row-split
    ("colwise") ones its dropout reads the replicated input, the second after a split region
    opened (0.5.0 after 0.0's); on the weight-column-split ("rowwise") ones the LoRA forward
    computes the partial sum itself instead of calling the layer."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(5)
    model = get_peft_model(model, LoraConfig(r=2, target_modules=r".*0\.(0|3|5\.0|5\.2)",
                                             lora_dropout=0.3, init_lora_weights="gaussian"))
    with torch.no_grad():  # B starts at zero: A's gradient would be zero, whatever the masks
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    return model


# Replicated parameters of the models below: norms, the unpaired head, LoRA's B on the
# weight-column-split layers and LoRA's A on the weight-row-split ones.
_REPLICATED = re.compile(r"ln|norm|4\.weight$|0\.(3|5\.2)\.lora_B|0\.(0|5\.0)\.lora_A")


def _rng_cases() -> Iterator[tuple[torchtp.DistributedModelWrapper, nn.Module, Any]]:
    """(wrapped model, what the training loop calls, inputs) for :func:`rng_streams`."""
    from ._models import deep_mlp

    for model, inputs in ((build("gpt2", resid_pdrop=0.3, attn_pdrop=0.3, embd_pdrop=0.3),
                           {"input_ids": _batch()}),
                          (nn.Sequential(deep_mlp(), nn.Dropout(0.5)), (torch.randn(4, 16),)),
                          (_lora_on_pairs(nn.Sequential(deep_mlp(), nn.Dropout(0.5))),
                           (torch.randn(4, 16),))):
        wrapped = torchtp.DistributedModelWrapper(model.train())
        yield wrapped, wrapped, inputs
    # docs/integrations.md's way: wrapped in eval mode, LoRA added after the wrap, and the
    # PEFT model trained and called itself, never the wrapper: the forward door's hooks
    # switch the streams however the model is called.
    wrapped = torchtp.DistributedModelWrapper(nn.Sequential(deep_mlp(), nn.Dropout(0.5)).eval())
    yield wrapped, _lora_on_pairs(wrapped.base_model).train(), (torch.randn(4, 16),)


def rng_streams(rank: int, world_size: int) -> list[bool]:
    """Dropout everywhere (GPT-2: embedding, attention probs, residual), different RNG states;
    a replicated dropout after LoRA'd weight-column-split layers; the same called through a
    PEFT model made after the wrap."""
    from torchtp.layers import rng

    torchtp.init_tensor_parallel()
    results = []
    for wrapped, model, inputs in _rng_cases():
        torch.manual_seed(100 + rank)  # every rank's own RNG state differs from here on
        before = torch.get_rng_state()
        args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
        shared = rng.TRACKER.shared
        assert shared is not None
        masks: list[torch.Tensor] = []
        inner = [m for n, m in wrapped.named_modules() if n.endswith("0.2")]  # deep_mlp's pair
        hooks = [m.register_forward_hook(lambda _m, _i, o, seen=masks: seen.append(o == 0))
                 for m in inner]
        out = _logits(model(*args, **kwargs))
        for hook in hooks:
            hook.remove()
        assert torch.equal(torch.get_rng_state(), before)  # the user's stream is untouched
        assert rng.TRACKER.shared is not None  # the shared stream moved on
        assert not torch.equal(rng.TRACKER.shared[0], shared[0])
        # The dropout inside the pair's split region (a (4, 16) shard on each rank) drew
        # from the rank's local stream: the masks differ across ranks (from the shared
        # stream they would be equal).
        assert len(masks) == len(inner) and all(not _same_on_every_rank(m) for m in masks)
        out.square().mean().backward()
        # LoRA: only the adapters train; B of a weight-column-split layer is replicated
        replicated = [p.grad for n, p in wrapped.named_parameters() if p.grad is not None
                      and _REPLICATED.search(n)]
        assert replicated
        assert sum("lora" in n for n, p in wrapped.named_parameters()
                   if p.grad is not None and _REPLICATED.search(n)) in (0, 4)
        results.append(_same_on_every_rank(out) and all(map(_same_on_every_rank, replicated)))
        torchtp.manual_seed(7)
        first = _logits(model(*args, **kwargs))
        later = _logits(model(*args, **kwargs))
        torchtp.manual_seed(7)
        again = _logits(model(*args, **kwargs))
        results.append(torch.equal(first, again) and not torch.equal(first, later))
    return results


def _steps(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        loss = model(input_ids=_batch(), labels=_batch()).loss
        loss.backward()
        torchtp.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def resume(rank: int, world_size: int, tmp: str) -> list[float]:
    """Save after 2 steps, resume in a fresh model/optimizer (tp 2 and tp 1): same losses."""
    from torchtp.checkpoint.dcp import load_training_state, save_training_state

    torchtp.init_tensor_parallel()
    # mistral-mqa at tp 2: KV heads replicated (saved gathered), the rest Shard(dim).
    model = torchtp.DistributedModelWrapper(build("mistral-mqa").train())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _steps(model, opt, 2)
    save_training_state(tmp, model, opt, step=2, extra={"note": "x"})
    uninterrupted = _steps(model, opt, 2)
    fresh = torchtp.DistributedModelWrapper(build("mistral-mqa", seed=5).train())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    assert load_training_state(tmp, fresh, fresh_opt) == (2, {"note": "x"})
    assert fresh_opt.param_groups[0]["lr"] == 1e-2
    assert _steps(fresh, fresh_opt, 2) == uninterrupted  # bit-identical at the same tp
    # tp 2 -> 1: every rank loads the whole model into its own 1-rank TP group.
    single, _ = torch.distributed.new_subgroups_by_enumeration([[0], [1]])
    one = torchtp.DistributedModelWrapper(build("mistral-mqa", seed=5).train(), group=single)
    one_opt = torch.optim.AdamW(one.parameters(), lr=1e-3)
    assert load_training_state(tmp, one, one_opt)[0] == 2
    resharded = _steps(one, one_opt, 2)
    torch.testing.assert_close(resharded, uninterrupted, **TOL)
    _resume_square_conv1d(f"{tmp}-conv1d", single)
    return uninterrupted


class _SquareConv1D(nn.Module):
    """GPT-2's square ``Conv1D`` pair (weights ``(in, out)``, transposed in torchtp's split
    layers) and a branch first used after the save (no optimizer state when saved)."""

    def __init__(self, seed: int, branch: bool = True) -> None:
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Sequential(Conv1D(8, 8), nn.ReLU(), Conv1D(8, 8))
        self.b = nn.Linear(8, 8) if branch else None
        for p in self.parameters():  # Conv1D starts its biases at 0: every value counts here
            nn.init.normal_(p)
        self.double()
        self.use_b = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return y + self.b(x) if self.use_b and self.b is not None else y


def _conv1d_steps(model: nn.Module, opt: torch.optim.Optimizer, use_b: bool) -> torch.Tensor:
    """One AdamW step (branch ``b`` used or not); the outputs after it, on a fixed batch."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    inner = model.base_model if isinstance(model, torchtp.DistributedModelWrapper) else model
    inner.use_b = use_b
    (model(x) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        return model(x)


def _resume_square_conv1d(tmp: str, single: Any) -> None:
    """Training state across tp 2 -> 1 -> 2 of square Conv1D weights (each loaded the
    wrong way round would still fit), with parameters that had no optimizer state when
    saved: the outputs equal one process's uninterrupted run. Float64: only the
    summation order differs."""
    from torchtp.checkpoint.dcp import load_training_state, save_training_state

    plan = {"a.0": "colwise", "a.2": "rowwise"}
    ref = _SquareConv1D(0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-1)
    want = [_conv1d_steps(ref, ref_opt, use_b) for use_b in (False, False, True)]
    model = torchtp.DistributedModelWrapper(_SquareConv1D(0), plan=plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-1)
    torch.testing.assert_close(_conv1d_steps(model, opt, False), want[0], rtol=1e-12, atol=0)
    save_training_state(f"{tmp}/tp2", model, opt, step=1)
    one = torchtp.DistributedModelWrapper(_SquareConv1D(5), plan=plan, group=single)
    one_opt = torch.optim.AdamW(one.parameters(), lr=1e-3)
    load_training_state(f"{tmp}/tp2", one, one_opt)
    assert not any(p in one_opt.state for p in one.base_model.b.parameters())  # as saved
    torch.testing.assert_close(_conv1d_steps(one, one_opt, False), want[1], rtol=1e-12, atol=0)
    save_training_state(f"{tmp}/tp1", one, one_opt, step=2)
    two = torchtp.DistributedModelWrapper(_SquareConv1D(5), plan=plan)
    two_opt = torch.optim.AdamW(two.parameters(), lr=1e-3)
    load_training_state(f"{tmp}/tp1", two, two_opt)
    torch.testing.assert_close(_conv1d_steps(two, two_opt, True), want[2], rtol=1e-12, atol=0)
    # A checkpoint without the orientation mark (torchtp before 2026-12-08 saved split Conv1D
    # weights transposed) is refused for a model holding Conv1D weights
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"a.0.weight": torch.zeros(8, 8, dtype=torch.float64)}},
             checkpoint_id=f"{tmp}/unmarked")
    with pytest.raises(ValueError, match=r"this checkpoint was written by a torchtp that saved "
                       r"split Conv1D weights \(GPT-2 style\) transposed"):
        load_training_state(f"{tmp}/unmarked", two, two_opt)
    smaller = torchtp.DistributedModelWrapper(_SquareConv1D(5, branch=False), plan=plan)
    with pytest.raises(ValueError, match=r"the checkpoint holds tensors this model does not "
                       r"have: b\.bias, b\.weight; it was saved from another model"):
        load_training_state(f"{tmp}/tp1", smaller)


def clip_over_own_groups(rank: int, world_size: int) -> list[float]:
    """Two TP pairs wrapped with group= of their own (no init_parallel), each fed its own
    batch: torch's routed clip and torchtp's clip each pair by its own model's norm, as one
    process on that pair's batch (float64: only the summation order differs)."""
    pairs, _ = torch.distributed.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).double()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 + rank // 2),
                    dtype=torch.float64)
    ref = copy.deepcopy(full)
    (ref(x) ** 2).mean().backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)  # one process: torch's own
    norms = []
    # torch's looked up at the call, as accelerate and Lightning do: the wrap routes the name
    for clip in (lambda *a: torch.nn.utils.clip_grad_norm_(*a), torchtp.clip_grad_norm_):
        wrapped = torchtp.DistributedModelWrapper(copy.deepcopy(full), group=pairs)
        (wrapped(x) ** 2).mean().backward()
        norm = clip(wrapped.parameters(), 0.01)
        torch.testing.assert_close(norm, want, rtol=1e-12, atol=0)
        torch.testing.assert_close(wrapped.base_model[2].bias.grad, ref[2].bias.grad,
                                   rtol=1e-12, atol=0)  # replicated: clipped by one factor
        norms.append(float(norm))
    return norms
