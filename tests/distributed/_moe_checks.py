"""Rank functions for the mixture-of-experts tests (tensor parallelism inside experts).

Every model is built twice from the same seed in float64: the reference runs
in one process, unsharded; the other is wrapped. float64 so that a
reduction-order difference cannot flip a router's top-k choice; the test also
asserts that both runs routed every token to the same experts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import torchtp

from ._hf_checks import compare_params, expected_local

VOCAB = 96
# float64 end to end: sums in another order differ by ~1e-15 relative.
TOL = {"rtol": 1e-9, "atol": 1e-11}


def build_moe(arch: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A tiny random ``arch`` MoE causal LM in float64 (eval mode)."""
    import transformers as tf

    common = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64}
    configs = {
        "mixtral": lambda: tf.MixtralConfig(**common, intermediate_size=48, num_local_experts=4,
                                            num_experts_per_tok=2),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**common, head_dim=8, moe_intermediate_size=24,
                                               num_experts=4, num_experts_per_tok=2,
                                               intermediate_size=48, norm_topk_prob=True),
        "olmoe": lambda: tf.OlmoeConfig(**common, intermediate_size=48, num_experts=4,
                                        num_experts_per_tok=2),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**common, moe_intermediate_size=24, num_experts=4,
                                               num_experts_per_tok=2, intermediate_size=48,
                                               shared_expert_intermediate_size=40),
        # Shared experts beside the routed ones, sigmoid group-limited routing, MLA attention.
        "deepseek_v3": lambda: tf.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4}, intermediate_size=48,
            moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=2, topk_group=1,
            rope_scaling=None),
        # Biases inside every expert, transposed and interleaved gate/up (whole experts only).
        "gpt_oss": lambda: tf.GptOssConfig(**common, intermediate_size=24, head_dim=8,
                                           num_local_experts=4, num_experts_per_tok=2),
        # New in transformers 5.25. Param2MoE: q_norm/k_norm its plan leaves plainly
        # replicated; MiniCPM5-MoE: a gated q projection, k/v "unit_colwise";
        # Kolibri-1.1: no plan, sliding and indexed attention, q/k norms.
        "param2moe": lambda: tf.Param2MoeConfig(
            **common, head_dim=8, intermediate_size=48, moe_intermediate_size=24,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=0, n_group=1, topk_group=1),
        "minicpm5_moe": lambda: tf.MiniCPM5MoeConfig(
            **common, head_dim=8, intermediate_size=48, moe_intermediate_size=24,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            mlp_layer_types=["sparse", "sparse"]),
        "kolibri1_1": lambda: tf.Kolibri1_1Config(
            **common, head_dim=16, moe_intermediate_size=24, num_local_experts=4,
            num_experts_per_tok=2, shared_expert_intermediate_size=40,
            layer_types=["sliding_attention", "indexed_attention"], sliding_window=8,
            index_layers=[1], kv_source_layers=[0, 1], index_num_heads=1, index_topk=8,
            index_pool_size=64, index_compression=4, index_num_local_tokens=4,
            index_num_sink_tokens=2, mlp_only_layers=[], mlp_only_intermediate_size=48),
    }
    config = configs[arch]()
    config._attn_implementation = "eager"
    # transformers' default (grouped_mm) has no float64 kernel on CPU; the loop over
    # experts ("eager") computes the same sums. test_moe also runs grouped_mm in fp32.
    config._experts_implementation = "eager"
    config.output_router_logits = True  # the loss includes the router's auxiliary loss
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    # GPT-OSS initialises its experts' biases to zeros: drawn here, so that a bias cut
    # with the wrong features, or added on more than one rank, changes the results.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name and name.endswith("_bias"):
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(seed + 1))
    return model


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "labels": ids}


def _routes(model: nn.Module, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Every MoE layer's top-k expert choice per token, as its experts module receives it."""
    seen: list[torch.Tensor] = []
    handles = [m.register_forward_pre_hook(lambda _m, args: seen.append(args[1].sort(-1).values))
               for n, m in model.named_modules() if n.endswith("mlp.experts")]
    try:
        model(**batch)
    finally:
        for h in handles:
            h.remove()
    assert seen, "no experts module ran"
    return seen


ARCHS = ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "deepseek_v3"]


# Routers compute in float32 (softmax of .float() logits): once the ranks' float64 partial
# sums round a router input differently in float32 (tp 3 sums three partials), everything
# upstream of a router gets float32-level gradient differences, ~1e-6 relative.
ROUTER_TOL = {"rtol": 1e-5, "atol": 1e-7}
# OLMoE normalises q and k over all heads in float32 (its RMSNorm casts up, whatever the
# model's dtype): split by heads, the sum of squares adds the ranks' partial sums in another
# order, ~1e-7 relative, so everything after the first attention agrees to float32 level.
FLOAT32_NORMS = {"olmoe"}
# Their steps are checked with SGD, not AdamW: Adam divides every gradient by its own
# magnitude, so on a gradient near zero float32-level noise (1e-9 absolute) becomes a step
# difference of 1e-5 and more (seen), which says nothing about the split.


def check_moe(rank: int, world_size: int, archs: list[str], expert_parallel: bool | int = False,
              grad_tol: dict[str, float] | None = None, dispatch: str = "auto",
              sequence_parallel: bool = False) -> dict[str, dict[str, Any]]:
    """:func:`check_one` for each architecture, in one set of processes."""
    return {arch: check_one(arch, expert_parallel, grad_tol or TOL, dispatch, sequence_parallel)
            for arch in archs}


def _starve(model: nn.Module) -> None:
    """Route every token to experts 0 and 1 in every layer: the others receive none."""
    def first_two(_m: nn.Module, _a: Any, out: Any) -> Any:
        logits, scores, indices = out
        return logits, scores, torch.tensor([0, 1]).expand_as(indices)

    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            module.register_forward_hook(first_two)


def check_one(arch: str, expert_parallel: bool | int = False,
              grad_tol: dict[str, float] = TOL, dispatch: str = "auto",
              sequence_parallel: bool = False) -> dict[str, Any]:
    """Logits, loss (with the aux loss), routes, every gradient and the whole model's
    gradient norm (``torchtp.clip_grad_norm_``) equal one process's.

    ``mixtral-e3``: 3 experts (uneven over 2 ranks); ``mixtral-starved``: every token
    goes to experts 0 and 1, so rank 1's experts (expert parallel) get no token.
    """
    overrides = {"num_local_experts": 3} if arch == "mixtral-e3" else {}
    tol = ROUTER_TOL if arch in FLOAT32_NORMS else TOL
    grad_tol = ROUTER_TOL if arch in FLOAT32_NORMS else grad_tol
    starved = arch == "mixtral-starved"
    arch = arch.removesuffix("-e3").removesuffix("-starved")
    ref = build_moe(arch, **overrides).train()
    wrapped = torchtp.DistributedModelWrapper(build_moe(arch, **overrides).train(),
                                              expert_parallel=expert_parallel,
                                              expert_dispatch=dispatch,
                                              sequence_parallel=sequence_parallel)
    if starved:
        _starve(ref)
        _starve(wrapped.base_model)
    batch = _batch()
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in
                   zip(_routes(ref, batch), _routes(wrapped, batch), strict=True))
    want, got = ref(**batch), wrapped(**batch)
    torch.testing.assert_close(got.logits, want.logits, **tol)
    if want.get("aux_loss") is not None:  # DeepSeek-V3 and GPT-OSS have none
        torch.testing.assert_close(got.aux_loss, want.aux_loss, **tol)
    torch.testing.assert_close(got.loss, want.loss, **tol)
    want.loss.backward()
    got.loss.backward()
    ref_params, checked = dict(ref.named_parameters()), []
    for name, p in wrapped.base_model.named_parameters():
        module_name, _, pname = name.rpartition(".")
        module = wrapped.base_model.get_submodule(module_name)
        assert p.grad is not None, f"{name} got no gradient"
        full = ref_params[name].grad
        torch.testing.assert_close(p.grad, expected_local(module, pname, full), **grad_tol,
                                   msg=lambda m, n=name: f"{n}: {m}")
        if not torchtp.layouts_of(module):  # replicated: bit-identical on every rank
            first = p.grad.clone()
            dist.broadcast(first, src=0)
            assert torch.equal(first, p.grad), f"replicated {name}'s gradient differs across ranks"
        checked.append(name)
    # The whole model's norm from the ranks' shards (each expert block counted once).
    norm = torchtp.clip_grad_norm_(wrapped, max_norm=1e9)
    torch.testing.assert_close(norm, torch.nn.utils.get_total_norm(
        [p.grad for p in ref.parameters()]).to(norm.dtype), rtol=1e-6, atol=0)  # float32 sum
    # One AdamW step each (torchtp's optimizer-step check runs on the wrapped one): the
    # next forward still matches, and every replicated parameter is equal on every rank.
    optimizer = torch.optim.SGD if arch in FLOAT32_NORMS else torch.optim.AdamW
    for model in (ref, wrapped):  # a second step: the AdamW states must match too
        opt = optimizer(model.parameters(), lr=1e-2)
        opt.step()
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    torch.testing.assert_close(wrapped(**batch).logits, ref(**batch).logits, **grad_tol)
    for name, p in wrapped.base_model.named_parameters():
        torch.testing.assert_close(p, expected_local(
            wrapped.base_model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2],
            ref_params[name].detach()), **grad_tol,
            msg=lambda m, n=name: f"{n} after 2 steps: {m}")
    experts = wrapped.base_model.model.layers[0].mlp.experts
    return {"checked": len(checked), "experts": type(experts).__name__,
            "local": tuple(experts.gate_up_proj.shape), "describe": wrapped.describe_plan(),
            "router_grads": [n for n in checked
                             if n.endswith(("mlp.gate.weight", "mlp.router.weight"))],
            "expert_grad_norm": float(experts.gate_up_proj.grad.abs().sum())}


def check_grouped_mm(rank: int, world_size: int, whole: bool) -> None:
    """float32 at tp 2 with transformers' default experts kernel (grouped_mm), and, with
    ``whole``, whole experts per rank under grouped_mm and under an eager configuration
    (which then runs transformers' grouped_mm function), and all-to-all dispatch with
    float32 and bfloat16 token states."""
    cases = [("grouped_mm", False)] + ([("grouped_mm", True), ("eager", True)] if whole else [])
    batch = _batch()
    for implementation, expert_parallel in cases:
        ref = build_moe("mixtral").float()
        ref.config._experts_implementation = implementation
        model = build_moe("mixtral").float()
        model.config._experts_implementation = implementation
        wrapped = torchtp.DistributedModelWrapper(model, expert_parallel=expert_parallel)
        with torch.no_grad():
            assert all(torch.equal(a, b) for a, b in
                       zip(_routes(ref, batch), _routes(wrapped, batch), strict=True))
            # float32: the all-reduce sums the ranks' partial outputs in another order.
            torch.testing.assert_close(wrapped(**batch).logits, ref(**batch).logits,
                                       rtol=1e-5, atol=1e-5)
    if whole:
        for dtype in (torch.float32, torch.bfloat16):
            _dispatch_in_dtype(dtype)


def check_grouped_mm_uneven(rank: int, world_size: int) -> list[tuple[int, ...]]:
    """Under grouped_mm with 32 expert features at tp 3 (float32: 12/12/8; bfloat16: 16/8/8;
    never 11/11/10): routes, logits, loss and every gradient equal one process's. Returns
    the local ``down_proj`` shape per dtype."""
    batch = _batch()
    shapes = []
    # float32: the all-reduce sums three partial outputs in another order (~1e-7 relative);
    # gradients of O(1e-3..1) after two layers: rtol 1e-4 as GRADS. bfloat16 (8 bits of
    # mantissa): one rounding of each partial sum, ~1e-2 relative on logits of O(1).
    for dtype, tol in ((torch.float32, {"rtol": 1e-4, "atol": 1e-5}),
                       (torch.bfloat16, {"rtol": 3e-2, "atol": 3e-2})):
        ref = build_moe("mixtral", intermediate_size=32).to(dtype).train()
        model = build_moe("mixtral", intermediate_size=32).to(dtype).train()
        for m in (ref, model):
            m.config._experts_implementation = "grouped_mm"
        wrapped = torchtp.DistributedModelWrapper(model)
        with torch.no_grad():
            assert all(torch.equal(a, b) for a, b in
                       zip(_routes(ref, batch), _routes(wrapped, batch), strict=True))
        want, got = ref(**batch), wrapped(**batch)
        torch.testing.assert_close(got.logits, want.logits, **tol)
        shapes.append(tuple(wrapped.base_model.model.layers[0].mlp.experts.down_proj.shape))
        if dtype != torch.float32:  # bfloat16 gradients: rounding, not layout, dominates
            continue
        want.loss.backward()
        got.loss.backward()
        compare_params(wrapped, ref, grads=True, tol=tol)
    return shapes


def _dispatch_in_dtype(dtype: torch.dtype) -> None:
    """All-to-all dispatch under grouped_mm with ``dtype`` token states and the router's
    float32 weights: the experts run in ``dtype`` and the output comes back in it, as
    transformers' kernel returns it, with its values (weighted sums in float32 in slot
    order, as the kernel sums them)."""
    ref = build_moe("mixtral").to(dtype)
    ref.config._experts_implementation = "grouped_mm"
    model = build_moe("mixtral").to(dtype)
    model.config._experts_implementation = "grouped_mm"
    wrapped = torchtp.DistributedModelWrapper(model, expert_parallel=True,
                                              expert_dispatch="all_to_all")
    x = torch.randn(13, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        _, weights, index = ref.model.layers[0].mlp.gate(x)  # float32 weights (N, 2)
        want = ref.model.layers[0].mlp.experts(x, index, weights)
        got = wrapped.base_model.model.layers[0].mlp.experts(x, index, weights)
    assert got.dtype == want.dtype == dtype, (got.dtype, want.dtype)
    # float32: each row's products are the kernel's, sums in the same order; bfloat16:
    # one rounding of the output (the GEMMs see groups of other sizes).
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else \
        {"rtol": 1.6e-2, "atol": 1e-2}
    torch.testing.assert_close(got, want, **tol)


def _reload(path: str, expert_parallel: bool | int, full: dict[str, torch.Tensor],
            saved: nn.Module, ids: torch.Tensor) -> tuple[nn.Module, float]:
    """``from_pretrained(path, expert_parallel=...)``: every parameter is this rank's cut of
    ``full``, bit for bit; returns the model and its largest logit difference to ``saved``."""
    again = torchtp.DistributedModelWrapper.from_pretrained(
        path, progress=False, expert_parallel=expert_parallel)
    for name, p in again.base_model.named_parameters():
        module = again.base_model.get_submodule(name.rpartition(".")[0])
        assert torch.equal(p, expected_local(module, name.rpartition(".")[2], full[name])), \
            (path, expert_parallel, name)
    with torch.no_grad():
        diff = float((again(input_ids=ids).logits - saved(input_ids=ids).logits).abs().max())
    return again, diff


def check_checkpoints(rank: int, world_size: int, out: str, whole: bool,
                      arch: str = "mixtral") -> float:
    """tp 2 saves (sharded and consolidated HF); both reload at tp 2 equal, and the sharded
    one, with ``whole``, into whole experts per rank (and their save back into split experts).

    Returns the largest logit difference after reloading: the reloaded config runs
    transformers' default experts implementation, which may sum in another order.
    """
    import os

    model = build_moe(arch).float()  # float32: transformers' default grouped_mm
    wrapped = torchtp.DistributedModelWrapper(model)
    wrapped.save_sharded(os.path.join(out, "sharded"))
    wrapped.save_pretrained(os.path.join(out, "hf"))
    full = {n: p.detach() for n, p in build_moe(arch).float().named_parameters()}
    ids = _batch()["input_ids"]
    # The consolidated HF directory too: from_pretrained reads this rank's cut of it
    loads = [(os.path.join(out, "sharded"), False), (os.path.join(out, "hf"), False)]
    if whole:  # split -> whole experts, saved again, -> split
        loads += [(os.path.join(out, "sharded"), True), (os.path.join(out, "whole"), False)]
    worst = 0.0
    for path, expert_parallel in loads:
        again, diff = _reload(path, expert_parallel, full, wrapped, ids)
        worst = max(worst, diff)
        if expert_parallel:
            again.save_sharded(os.path.join(out, "whole"))
    return worst


def check_ep_checkpoints(rank: int, world_size: int, out: str) -> float:
    """ep 2 x tp 2 (``expert_parallel=2`` at 4 ranks) saves sharded and HF; the sharded save
    reloads at ep 2 x tp 2, at ep 4 (whole experts) and at tp 4 (every expert split), each
    shard bit for bit, and ep 4's own save reloads at ep 2 x tp 2.

    Returns the largest logit difference between a reload and the saved model (float32,
    the reloads' experts implementation may sum in another order).
    """
    import os

    wrapped = torchtp.DistributedModelWrapper(build_moe("mixtral").float(), expert_parallel=2)
    block = wrapped.base_model.model.layers[0].mlp.experts.gate_up_proj
    full = {n: p.detach() for n, p in build_moe("mixtral").float().named_parameters()}
    # Independently of the layout code: experts 2r'..2r'+1 (r' = rank // 2), of each the
    # gate rows and up rows of feature half rank % 2 (Mixtral: [gate; up], I = 48).
    first, half = 2 * (rank // 2), 24 * (rank % 2)
    gate_up = full["model.layers.0.mlp.experts.gate_up_proj"][first:first + 2]
    assert torch.equal(block, torch.cat([gate_up[:, half:half + 24],
                                         gate_up[:, 48 + half:48 + half + 24]], 1))
    wrapped.save_sharded(os.path.join(out, "ep2tp2"))
    wrapped.save_pretrained(os.path.join(out, "hf"))
    ids = _batch()["input_ids"]
    worst = 0.0
    for path, expert_parallel in [("ep2tp2", 2), ("ep2tp2", True), ("ep2tp2", False),
                                  ("ep4", 2)]:
        again, diff = _reload(os.path.join(out, path), expert_parallel, full, wrapped, ids)
        worst = max(worst, diff)
        if expert_parallel is True:
            again.save_sharded(os.path.join(out, "ep4"))
    return worst


def check_generate(rank: int, world_size: int, splits: list[bool | str]) -> list[list[int]]:
    """Greedy and seeded-sampling ``generate`` (KV cache) equal one process's, for each
    ``expert_parallel`` value in ``splits`` (a dispatch name: whole experts with that
    ``expert_dispatch``; decode steps give some ranks no token to route)."""
    # No router logits: transformers 5.3's generate cannot compute their aux loss.
    ref = build_moe("mixtral", output_router_logits=False)
    ids = _batch()["input_ids"][:1, :5]
    out = []
    for split in splits:
        expert_parallel, dispatch = (True, split) if isinstance(split, str) else (split, "auto")
        wrapped = torchtp.DistributedModelWrapper(build_moe("mixtral", output_router_logits=False),
                                                  expert_parallel=expert_parallel,
                                                  expert_dispatch=dispatch)
        for sample in (False, True):
            kw = {"max_new_tokens": 6, "do_sample": sample, "use_cache": True, "pad_token_id": 0}
            torch.manual_seed(3)
            want = ref.generate(ids, **kw)
            torch.manual_seed(3)
            got = wrapped.generate(ids, **kw)
            assert torch.equal(got, want), (split, sample, got, want)
            out.append(got[0].tolist())
    return out


def check_route_mismatch(rank: int, world_size: int, expert_parallel: bool,
                         dispatch: str = "auto") -> tuple[str, float]:
    """Rank 1's router differs after wrapping: the forward raises on every rank, naming it."""
    import time

    from torchtp.core.errors import RankMismatchError

    wrapped = torchtp.DistributedModelWrapper(build_moe("mixtral"),
                                              expert_parallel=expert_parallel,
                                              expert_dispatch=dispatch)
    if rank == 1:
        with torch.no_grad():
            wrapped.base_model.model.layers[0].mlp.gate.weight.neg_()
    start = time.monotonic()
    try:
        with torch.no_grad():
            wrapped(**_batch())
    except RankMismatchError as err:
        return str(err), time.monotonic() - start
    raise AssertionError("different routes were not detected")


def mark_hub_kernel(model: nn.Module) -> list[nn.Module]:
    """Give GPT-OSS's MoE blocks the class attribute transformers' hub-kernel decorator
    sets where the kernels package is installed (``use_kernel_forward_from_hub(
    "MegaBlocksMoeMLP")``, transformers 5.24); returns the blocks."""
    blocks = [layer.mlp for layer in model.model.layers]
    marked = type("KernelGptOssMLP", (type(blocks[0]),), {"kernel_layer_name": "MegaBlocksMoeMLP"})
    for block in blocks:
        block.__class__ = marked
    return blocks


def kernelize(blocks: list[nn.Module]) -> None:
    """What ``kernels.kernelize`` does to each block on CUDA: bind the kernel layer's forward
    to the instance (here a stand-in that reads the experts' parameters itself, as
    MegaBlocks does, and sums nothing across ranks)."""
    from types import MethodType

    def kernel_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states @ self.experts.gate_up_proj[0][:, :hidden_states.shape[-1]]

    for block in blocks:
        block.forward = MethodType(kernel_forward, block)


def check_hub_kernels(rank: int, world_size: int) -> list[tuple[str, float]]:
    """GPT-OSS at tp 2 with its MoE blocks marked for a hub kernel. Kernelized before the
    wrap: the first forward raises on every rank before any collective. Not kernelized:
    exact; then kernelized, as ``model.train()`` does under ``use_kernels=True``: the next
    forward raises the same way; with the kernel removed again (its fallback) it runs
    exact. Returns each refusal's message and seconds."""
    import time

    def refused(wrapped: nn.Module) -> tuple[str, float]:
        start = time.monotonic()
        try:
            wrapped(**batch)
        except RuntimeError as err:
            return str(err), time.monotonic() - start
        raise AssertionError("a hub kernel in place of the split experts ran unnoticed")

    ref, batch = build_moe("gpt_oss"), _batch()
    model = build_moe("gpt_oss")
    kernelize(mark_hub_kernel(model))
    with torch.no_grad():
        got = [refused(torchtp.DistributedModelWrapper(model))]
        model = build_moe("gpt_oss")
        blocks = mark_hub_kernel(model)
        wrapped = torchtp.DistributedModelWrapper(model)
        torch.testing.assert_close(wrapped(**batch).logits, ref(**batch).logits, **TOL)
        kernelize(blocks)
        got.append(refused(wrapped))
        for block in blocks:  # kernels' fallback: the class's own forward again
            del block.__dict__["forward"]
        torch.testing.assert_close(wrapped(**batch).logits, ref(**batch).logits, **TOL)
    return got


def _adamw_steps(model: nn.Module, opt: torch.optim.Optimizer,
                 batch: dict[str, torch.Tensor], n: int = 2) -> list[float]:
    """``n`` training steps on ``batch`` (loss from its labels); the losses."""
    losses = []
    for _ in range(n):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def check_resume(rank: int, world_size: int, tmp: str, saved: bool | int,
                 resumed: list[bool | int]) -> None:
    """Two AdamW steps at ``expert_parallel=saved``, a DCP save (experts' optimizer state
    included), two more steps; a fresh model resumed from the save at each split of
    ``resumed`` takes the same two steps: bitwise the same losses at the same split."""
    from torchtp.checkpoint.dcp import load_training_state, save_training_state

    model = torchtp.DistributedModelWrapper(build_moe("mixtral").train(), expert_parallel=saved)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = _batch()
    _adamw_steps(model, opt, batch)
    save_training_state(tmp, model, opt, step=2)
    want = _adamw_steps(model, opt, batch)
    for expert_parallel in resumed:
        fresh = torchtp.DistributedModelWrapper(build_moe("mixtral", seed=5).train(),
                                                expert_parallel=expert_parallel)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        assert load_training_state(tmp, fresh, fresh_opt)[0] == 2
        got = _adamw_steps(fresh, fresh_opt, batch)
        if expert_parallel != saved:  # other cuts: the same sums in another order
            torch.testing.assert_close(got, want, **TOL)
        else:
            assert got == want


def check_dp_tp(rank: int, world_size: int, expert_parallel: bool | int = False,
                dispatch: str = "auto", tp: int = 2) -> dict[str, list[float]]:
    """dp 2 x tp ``tp``, DDP and FSDP2 over dp around split experts (or the experts placed
    by ``expert_parallel`` over the TP ranks, through ``dispatch``): two AdamW steps on each
    DP rank's half of the batch equal one process's on the whole batch.

    No router auxiliary loss here: it is a function of the batch's routing statistics,
    so its data-parallel average is not the whole batch's (in any framework).
    """
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg = torchtp.init_tensor_parallel(tp_size=tp)
    ids = torch.randint(3, VOCAB, (4, 9), generator=torch.Generator().manual_seed(7))
    ref = build_moe("mixtral", output_router_logits=False).train()
    want = _adamw_steps(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2),
                        {"input_ids": ids, "labels": ids})
    mine = ids[cfg.dp_rank * 2:(cfg.dp_rank + 1) * 2]
    out = {"want": want}
    for kind in ("ddp", "fsdp"):
        wrapped = torchtp.DistributedModelWrapper(
            build_moe("mixtral", output_router_logits=False).train(),
            expert_parallel=expert_parallel, expert_dispatch=dispatch)
        if kind == "ddp":
            model: nn.Module = DDP(wrapped, process_group=cfg.dp_group)
        else:
            model = fully_shard(wrapped, mesh=cfg.mesh["dp"])
        halves = torch.tensor(_adamw_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                           {"input_ids": mine, "labels": mine}),
                              dtype=torch.float64)
        dist.all_reduce(halves, group=cfg.dp_group)  # the whole batch's mean losses, x 2
        got = (halves / 2).tolist()
        # transformers computes the loss in float32 (logits.float()): the two halves' mean
        # and the whole batch's differ by float32 rounding, ~1e-7 relative.
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        out[kind] = got
    return out


def check_hub_layout(rank: int, world_size: int, out: str, arch: str,
                     splits: tuple[bool | int, ...]) -> dict[str, object]:
    """transformers' own ``save_pretrained`` (each expert its own tensors, as on the Hub)
    reloaded by ``from_pretrained`` into each split: every parameter is this rank's cut
    of the saved one, bit for bit; the files' expert keys and each split's logit difference."""
    import os

    from safetensors import safe_open

    model = build_moe(arch).float()
    full = {n: p.detach() for n, p in model.named_parameters()}
    if rank == 0:
        model.save_pretrained(out)
    dist.barrier()
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        keys = sorted(k for k in f.keys() if ".experts." in k and "layers.0." in k)  # noqa: SIM118
    ids = _batch()["input_ids"]
    return {"keys": keys, "diffs": [_reload(out, ep, full, model, ids)[1] for ep in splits]}


def check_mesh_ep(rank: int, world_size: int, sentinel: bool) -> dict[str, object]:
    """``init_parallel(tp=4, ep=...)``: a bad ``ep`` refused, ``ep=2`` the experts' default
    split (transformers' experts, a hand-written MoE), a dense model unaffected."""
    from ._hand_moe import HandMoEBlock

    try:
        torchtp.init_parallel(tp=world_size, ep=3)
        bad = ""
    except ValueError as err:
        bad = str(err)
    cfg = torchtp.init_parallel(tp=world_size, ep=2)
    out: dict[str, object] = {"bad": bad, "ep_size": cfg.ep_size}
    if sentinel:
        style = torchtp.DistributedModelWrapper(build_moe("mixtral")).resolved_plan.assignments[
            "model.layers.0.mlp.experts"]
        out["hf"] = (type(style).__name__, getattr(style, "ep", None))
    hand = torchtp.DistributedModelWrapper(HandMoEBlock())
    out["hand"] = hand.resolved_plan.assignments["moe.experts.0.up"].name
    dense = torchtp.DistributedModelWrapper(nn.Sequential(nn.Linear(8, 16), nn.ReLU(),
                                                          nn.Linear(16, 8)))
    out["dense"] = {n: s.name for n, s in dense.resolved_plan.assignments.items()}
    out["notes"] = [n for n in dense.resolved_plan.notes if "ep=" in n]
    return out
