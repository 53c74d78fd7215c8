"""Rank functions of the context-parallel tests (run by tests/distributed/test_context_parallel.py).

The references are built on every rank from the full tensors of the same
seed, by formulas written out here (not torchtp's): plain softmax attention
over an explicit mask, and the unsharded HF model on the full batch.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch
import torch.distributed as dist

from torchtp.comm.ops import count_collectives
from torchtp.cp import MaskRule, SequenceLayout, SequenceMeta, context_attention, shard_sequence

# float64 throughout: the sharded and the one-process softmax sum the same terms
# in different orders, which float64 keeps at ~1e-15 relative; 1e-10 is far
# above that and far below any real error (a missing key shifts outputs by ~1e-2).
TOL = 1e-10


def reference_mask(meta: SequenceMeta, rule: MaskRule) -> torch.Tensor:
    """(B, 1, T, T) from the rules' definitions, one pair at a time."""
    b, t = meta.documents.shape
    ok = torch.zeros(b, 1, t, t, dtype=torch.bool)
    for n in range(b):
        for i in range(t):
            for j in range(t):
                keep = (not rule.causal or j <= i) and \
                    (rule.window is None or i - j < rule.window) and \
                    bool(meta.documents[n, i] == meta.documents[n, j]) and \
                    bool(meta.keys_valid[n, j])
                ok[n, 0, i, j] = keep
    return ok


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ok: torch.Tensor,
                        scale: float, sinks: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    # A query with no key at all: output 0 and log-sum-exp -inf (PyTorch's SDPA), no NaN.
    none = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(none, 0), -1).masked_fill(none, 0)
    lse = torch.logsumexp(s.masked_fill(none, 0), -1).masked_fill(none[..., 0], float("-inf"))
    if sinks is not None:
        p = p[..., :-1]
    return p @ v, lse


def _meta(kind: str, b: int, t: int) -> SequenceMeta:
    docs = torch.zeros(b, t, dtype=torch.long)
    valid = torch.ones(b, t, dtype=torch.bool)
    if kind in ("packed", "both"):
        docs[0, t // 3:] = 1
        docs[1, t // 2:] = 1
        docs[1, t - 2:] = 2
    if kind in ("padded", "both"):
        valid[0, t - 5:] = False
        valid[1, t - 1:] = False
    if kind == "left":  # left padding: the first queries of a row see no key at all
        valid[0, :3] = False
        valid[1, :1] = False
    return SequenceMeta(documents=docs, keys_valid=valid)


CASES = [  # (heads, kv heads, causal, window, mask kind, sinks, algorithm)
    (4, 4, True, None, "plain", False, "allgather"),
    (4, 4, False, None, "plain", False, "allgather"),
    (4, 2, True, None, "both", False, "allgather"),
    (4, 1, True, 3, "plain", True, "allgather"),
    (4, 4, True, None, "plain", False, "ulysses"),
    (4, 4, False, None, "padded", False, "ulysses"),
    (4, 2, True, 5, "packed", True, "ulysses"),
    (4, 1, True, None, "both", False, "ulysses"),  # KV heads repeated before the exchange
    (4, 2, True, None, "left", False, "allgather"),
    (4, 4, True, 4, "left", True, "ulysses"),
    (4, 4, True, None, "plain", False, "ring"),
    (4, 4, False, None, "padded", False, "ring"),
    (4, 2, True, None, "both", True, "ring"),
    (4, 1, True, 3, "packed", True, "ring"),  # MQA: cp exceeds the KV heads
    (4, 2, False, 5, "left", False, "ring"),
]


def _diff(a: torch.Tensor, r: torch.Tensor) -> float:
    """Largest |a - r|; -inf in both (queries with no key) counts as equal, NaN as infinite."""
    both = torch.isneginf(a) & torch.isneginf(r)
    return float(torch.nan_to_num((a - r).masked_fill(both, 0), nan=float("inf")).abs().max())


def attention_matches(rank: int, world: int) -> list[tuple[Any, ...]]:
    """Every case: sharded output, LSE, dQ, dK, dV against the one-process formulas."""
    group = dist.group.WORLD
    results = []
    for case in CASES:
        heads, kv, causal, window, kind, with_sinks, algorithm = case
        if algorithm == "ulysses" and heads % world:
            algorithm = "allgather"  # cp 3: Ulysses is refused (tested apart)
        torch.manual_seed(0)
        b, t, d = 2, 4 * world + 2 * world, 8  # T a multiple of 2 * cp
        q, k, v = (torch.randn(b, h, t, d, dtype=torch.float64) for h in (heads, kv, kv))
        sinks = torch.randn(heads, dtype=torch.float64) if with_sinks else None
        full_sinks = None if sinks is None else sinks.clone().requires_grad_()
        g_out, g_lse = torch.randn(b, heads, t, d, dtype=torch.float64), \
            torch.randn(b, heads, t, dtype=torch.float64)
        meta, rule = _meta(kind, b, t), MaskRule(causal=causal, window=window)
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        ref_out, ref_lse = reference_attention(*full, reference_mask(meta, rule), 0.3,
                                               full_sinks)
        ((ref_out * g_out).sum() + (ref_lse * g_lse).sum()).backward()
        layout = SequenceLayout(t, world)
        mine = [shard_sequence(x, layout, rank, dim=2).detach().requires_grad_() for x in (q, k, v)]
        my_sinks = None if sinks is None else sinks.clone().requires_grad_()
        with count_collectives() as counted:
            out, lse = context_attention(*mine, layout=layout, meta=meta, rule=rule,
                                         group=group, scale=0.3, algorithm=algorithm,
                                         sinks=my_sinks, with_lse=True)
            assert lse is not None
            ((out * shard_sequence(g_out, layout, rank, 2)).sum()
             + (lse * shard_sequence(g_lse, layout, rank, 2)).sum()).backward()
        errs = [_diff(a, shard_sequence(r, layout, rank, 2)) for a, r in (
            (out, ref_out), (lse, ref_lse), (mine[0].grad, full[0].grad),
            (mine[1].grad, full[1].grad), (mine[2].grad, full[2].grad))]
        if my_sinks is not None:  # each rank's queries' share, summed over cp (as grads.py does)
            assert my_sinks.grad is not None and full_sinks is not None
            summed = my_sinks.grad.clone()
            dist.all_reduce(summed)
            errs.append(_diff(summed, full_sinks.grad))
        assert max(errs) < TOL, (case, algorithm, errs)
        results.append((case, algorithm, dict(counted.counts)))
    return results


# ---- HuggingFace models -------------------------------------------------------------

# float64 models: logits and gradients of the split run sum the same terms as one
# process in another order (attention over gathered keys, gradients summed over
# cp), ~1e-13 relative; 1e-9 leaves room and still catches a lost token (~1e-2).
HF_TOL = 1e-9
NO_DROPOUT = {"gpt2": {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}}


def build_cp_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A tiny float64 causal LM of ``arch`` in training mode (no dropout anywhere)."""
    from ._hf_models import build
    from ._moe_checks import build_moe

    if arch in ("gpt_oss", "qwen3_moe"):
        extra = {"sliding_window": 4} if arch == "gpt_oss" else {}
        model = build_moe(arch, seed, output_router_logits=False, **extra)
    elif arch == "mistral":
        model = build(arch, seed, sliding_window=4)
    elif arch == "llama-gc":  # transformers' gradient checkpointing: layers recomputed
        model = build("llama", seed)
        model.gradient_checkpointing_enable()
    else:
        model = build(arch, seed, **NO_DROPOUT.get(arch, {}))
    return model.to(torch.float64).train()


def _hf_batch(kind: str, t: int = 13) -> dict[str, torch.Tensor]:
    """A full batch of 2 rows: ``t`` tokens (13 does not split: padded inside)."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 32, (2, t), generator=gen)  # inside every test vocabulary
    batch = {"input_ids": ids, "labels": ids.clone()}
    if kind == "padded":  # right padding, uneven over the rows (and so over the ranks)
        mask = torch.ones(2, t, dtype=torch.long)
        mask[0, t - 6:] = 0
        mask[1, t - 1:] = 0
        batch["attention_mask"] = mask
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    if kind in ("left", "holes"):  # left padding; or tokens masked inside the rows
        mask = torch.ones(2, t, dtype=torch.long)
        if kind == "left":
            mask[0, :4] = 0
            mask[1, :1] = 0
        else:
            mask[0, 4] = 0
            mask[1, 7:9] = 0
            batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        batch["attention_mask"] = mask
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    if kind in ("packed", "packed-masked"):  # row 0: documents of 5 and 8; row 1: 4, 4, 5
        pos = torch.cat([torch.arange(5), torch.arange(8)])
        pos1 = torch.cat([torch.arange(4), torch.arange(4), torch.arange(5)])
        batch["position_ids"] = torch.stack([pos, pos1])
        if kind == "packed-masked":  # with a mask, transformers ignores the packing
            batch["attention_mask"] = torch.ones(2, t, dtype=torch.long)
    return batch


def _documents(batch: dict[str, torch.Tensor]) -> list[list[tuple[int, int]]]:
    """Per row, ``(start, length)`` of each packed document."""
    pos = batch.get("position_ids")
    t = batch["input_ids"].shape[1]
    if pos is None:
        return [[(0, t)]] * batch["input_ids"].shape[0]
    out = []
    for row in pos.tolist():
        starts = [i for i, p in enumerate(row) if p == 0] + [t]
        out.append([(a, b - a) for a, b in itertools.pairwise(starts)])
    return out


def reference_step(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                   items: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One process: logits of the full batch and the token-mean loss (over ``items``
    tokens when given, as transformers' ``num_items_in_batch``). Packed documents
    without an attention mask run one by one (each document's own causal mask, which
    transformers builds for packed rows); with a mask the model sees the whole batch
    as it is (transformers ignores packing then)."""
    if "attention_mask" in batch:
        kw = {k: v for k, v in batch.items() if k != "labels"}
        logits = model(**kw, use_cache=False).logits
    else:
        logits = _doc_by_doc(model, batch)
    labels = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                             ignore_index=-100, reduction="sum")
    return logits, loss / (int((labels != -100).sum()) if items is None else items)


def _doc_by_doc(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    rows = []
    for n, docs in enumerate(_documents(batch)):
        parts = [model(input_ids=batch["input_ids"][n:n + 1, start:start + length]).logits
                 for start, length in docs]
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows)


def _compare(model_ref: torch.nn.Module, wrapped: Any, batch: dict[str, torch.Tensor],
             items: int | None) -> list[float]:
    """Logits at every position (padding too) and the loss; both backwards run."""
    ref_logits, ref_loss = reference_step(model_ref, batch, items)
    ref_loss.backward()
    extra = {} if items is None else {"num_items_in_batch": items}
    out = wrapped(**batch, **extra)
    out.loss.backward()
    logits = wrapped.unshard(out.logits, out.cp_batch).detach()
    return [float((logits - ref_logits.detach()).abs().max()),
            float((out.loss.detach() - ref_loss.detach()).abs())]


def hf_matches(rank: int, world: int, cases: list[tuple[str, str, str]]) -> dict[str, Any]:
    """Each ``(arch, batch kind, algorithm)``: logits, loss, every gradient and two SGD steps."""
    import torchtp
    from torchtp.cp import ContextParallel

    cfg = torchtp.init_parallel(cp=world)
    found: dict[str, Any] = {}
    for arch, kind, algorithm in cases:
        ref, model = build_cp_model(arch), build_cp_model(arch)
        if arch != "gpt_oss":  # eager attention's softmax runs in float32 (gpt-oss's does not)
            ref.set_attn_implementation("sdpa")
        wrapped = ContextParallel(model, algorithm=algorithm)
        batch = _hf_batch(kind.removesuffix("+items"))
        items = 40 if kind.endswith("+items") else None  # HF Trainer's num_items_in_batch
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        errs: list[float] = []
        for _step in range(2):
            grads = {n: p for n, p in model.named_parameters()}
            errs += _compare(ref, wrapped, batch, items)
            errs += [float((p.grad - dict(ref.named_parameters())[n].grad).abs().max())
                     for n, p in grads.items() if p.grad is not None]
            assert all(p.grad is not None for p in model.parameters()), arch
            opt_ref.step(), opt.step()
            opt_ref.zero_grad(), opt.zero_grad()
        assert max(errs) < HF_TOL, (arch, kind, algorithm, max(errs))
        found[f"{arch}/{kind}/{algorithm}"] = (max(errs), wrapped.describe())
    assert cfg.cp_size == world
    return found


def _raises(fn: Any) -> tuple[str, str, float]:
    """``(error type, message, seconds)`` of what ``fn()`` raised (it must raise)."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    raise AssertionError("did not raise")


def refusals(rank: int, world: int) -> dict[str, tuple[str, str, float]]:
    """Each bad input or setup: the error every rank raises, and how long it took."""
    import torchtp
    from torchtp.cp import ContextParallel

    torchtp.init_parallel(cp=world)
    got: dict[str, tuple[str, str, float]] = {}
    wrapped = ContextParallel(build_cp_model("llama"))
    batch = _hf_batch("plain")
    mine = {k: v + rank if k == "input_ids" else v for k, v in batch.items()}
    got["different batches"] = _raises(lambda: wrapped(**mine))
    got["inputs_embeds"] = _raises(lambda: wrapped(**batch, inputs_embeds=torch.zeros(2, 13, 64)))
    got["return_dict"] = _raises(lambda: wrapped(**batch, return_dict=False))
    got["logits_to_keep"] = _raises(lambda: wrapped(**batch, logits_to_keep=1))
    got["shift_labels"] = _raises(lambda: wrapped(**batch, shift_labels=batch["labels"]))
    # The router's auxiliary loss over one rank's tokens: refused per call, and set after the wrap
    moe = ContextParallel(build_cp_model("qwen3_moe"))
    got["router logits per call"] = _raises(lambda: moe(**batch, output_router_logits=True))
    moe.module.config.output_router_logits = True
    got["router logits set after"] = _raises(lambda: moe(**batch))
    moe.module.config.output_router_logits = False
    sinks = ContextParallel(build_cp_model("gpt_oss"))
    got["packed gpt_oss"] = _raises(lambda: sinks(**_hf_batch("packed")))
    got["generate"] = _raises(lambda: wrapped.generate(batch["input_ids"]))
    got["model called directly"] = _raises(lambda: wrapped.module(batch["input_ids"]))
    three_heads = build_cp_model("qwen2")  # 8 heads, 2 KV heads: Ulysses needs cp | 8
    if 8 % world:
        got["ulysses heads"] = _raises(lambda: ContextParallel(three_heads,
                                                               algorithm="ulysses")(**batch))
    got["unknown algorithm"] = _raises(lambda: ContextParallel(build_cp_model("llama"),
                                                               algorithm="zigzag"))
    got["unsupported family"] = _raises(lambda: ContextParallel(build_cp_model("gemma")))
    got["dropout"] = _raises(lambda: ContextParallel(build_cp_model(
        "gpt2").train().apply(_dropout))(**batch))
    # Still usable after every refusal: the group never went out of step.
    out = wrapped(**batch)
    got["after"] = ("ok", f"{float(out.loss):.12f}", 0.0)
    return got


def _dropout(module: torch.nn.Module) -> None:
    if hasattr(module, "attn_dropout"):
        module.attn_dropout.p = 0.1


def _train_two_steps(wrapped: Any, model: torch.nn.Module, ref: torch.nn.Module,
                     batch: dict[str, torch.Tensor], ref_batch: dict[str, torch.Tensor],
                     compare: Any, dp_group: Any = None) -> list[float]:
    """Two SGD steps of ``wrapped`` on ``batch`` and of ``ref`` on ``ref_batch``; each
    step's loss (averaged over ``dp_group``, as DDP averages gradients) and
    ``compare()`` (gradients, then weights after the step)."""
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    errs = []
    for _step in range(2):
        _, ref_loss = reference_step(ref, ref_batch)
        ref_loss.backward()
        loss = wrapped(**batch).loss
        loss.backward()
        seen = loss.detach().clone()
        if dp_group is not None:
            dist.all_reduce(seen, group=dp_group)
            seen /= dist.get_world_size(dp_group)
        errs += [float((seen - ref_loss.detach()).abs()), compare(True)]
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
        errs.append(compare(False))
    return errs


def _tp_compare(dmw: Any, ref: torch.nn.Module) -> Any:
    from ._hf_checks import compare_params

    tol = {"atol": HF_TOL, "rtol": HF_TOL}
    return lambda grads: float(compare_params(dmw, ref, grads, tol) and 0.0)


def cp_with_tp(rank: int, world: int) -> dict[str, Any]:
    """cp 2 x tp 2, with (all-gather attention) and without sequence parallelism (ring
    attention), and an MoE with its experts shared out over the TP ranks, against one process."""
    import torchtp
    from torchtp.cp import ContextParallel

    cfg = torchtp.init_parallel(cp=2, tp=2)
    found: dict[str, Any] = {}
    for sp in (False, True):
        ref, model = build_cp_model("llama"), build_cp_model("llama")
        ref.set_attn_implementation("sdpa")
        dmw = torchtp.DistributedModelWrapper(model, sequence_parallel=sp)
        wrapped = ContextParallel(dmw, algorithm="auto" if sp else "ring")
        batch = _hf_batch("padded")
        errs = _train_two_steps(wrapped, dmw, ref, batch, batch, _tp_compare(dmw, ref))
        assert max(errs) < HF_TOL, (sp, errs)
        found[f"sp={sp}"] = wrapped.describe()
    # Experts shared out over the TP ranks (ep 2), tokens split over cp.
    ref, model = build_cp_model("qwen3_moe"), build_cp_model("qwen3_moe")
    ref.set_attn_implementation("sdpa")
    try:
        dmw = torchtp.DistributedModelWrapper(model, expert_parallel=True)
    except ValueError as exc:  # transformers before 5.24 (make compat-smoke): refused, loudly
        assert "has no expert-parallel sentinel" in str(exc), exc
        found["ep"] = "refused by this transformers release"
    else:
        wrapped = ContextParallel(dmw)
        batch = _hf_batch("packed")
        errs = _train_two_steps(wrapped, dmw, ref, batch, batch, _tp_compare(dmw, ref))
        assert max(errs) < HF_TOL, ("ep", errs)
        found["ep"] = max(errs)
    found["ranks"] = (cfg.cp_rank, cfg.rank, dist.get_process_group_ranks(cfg.cp_group))
    found["masks"] = _dropout_masks()
    found["replayed"] = _dropout_replayed()
    return found


_SHARDS = ("attn.resid_dropout", "mlp.dropout")  # GPT-2's dropouts on token (and sequence) shards


def _dropout_gpt2(p: float = 0.5) -> torch.nn.Module:
    from ._hf_models import build

    return build("gpt2", 0, resid_pdrop=p, embd_pdrop=p, attn_pdrop=0.0).to(torch.float64).train()


def _same_mask(wrapped: Any, ends: tuple[str, ...]) -> list[list[bool]]:
    """One training forward of ``wrapped``; whether each pair of ranks (global ranks: tp
    peers 0-1 and 2-3, cp peers 0-2 and 1-3) drew the same masks in the dropouts whose
    names end in ``ends`` (every rank's shards have one shape: the padding is inside)."""
    masks: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: masks.append((out == 0).flatten()))
             for n, m in wrapped.named_modules() if n.endswith(ends)]
    wrapped(**_hf_batch("plain", t=16))
    for hook in hooks:
        hook.remove()
    mine = torch.cat(masks).to(torch.uint8)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [[torch.equal(a, b) for b in everyone] for a in everyone]


def _dropout_masks() -> dict[str, list[list[bool]]]:
    """The dropout masks of cp 2 x tp 2 GPT-2 (p=0.5, every rank seeded alike): plain
    context parallelism, and around a tensor-parallel wrapper with and without sequence
    parallelism, on the embedding's dropout and on the blocks'; and plain context
    parallelism built around the model in eval mode, the model trained afterwards."""
    import torchtp
    from torchtp.cp import ContextParallel

    found = {}
    for case in ("cp", "cp x tp", "cp x tp, sp", "cp, trained after"):
        torch.manual_seed(11)
        model = _dropout_gpt2()
        if case.startswith("cp x tp"):
            model = torchtp.DistributedModelWrapper(model, sequence_parallel=case.endswith("sp"))
        wrapped = ContextParallel(model.eval() if case.endswith("after") else model)
        model.train()  # through the model's own train(), not ContextParallel's
        found[f"{case}: embedding"] = _same_mask(wrapped, ("transformer.drop",))
        found[f"{case}: blocks"] = _same_mask(wrapped, _SHARDS)
    return found


def _dropout_replayed() -> dict[str, float]:
    """Activation checkpointing with dropout (p=0.3) replays the masks: the largest gradient
    difference to the same run without it (a checkpoint around the whole plain
    ContextParallel; HF's per decoder layer around cp x tp with sequence parallelism)."""
    from torch.utils.checkpoint import checkpoint

    import torchtp
    from torchtp.cp import ContextParallel

    def run(case: str, recompute: bool) -> dict[str, torch.Tensor]:
        model: Any = _dropout_gpt2(0.3)
        if case == "cp x tp, sp":
            if recompute:
                model.gradient_checkpointing_enable({"use_reentrant": False})
            model = torchtp.DistributedModelWrapper(model, sequence_parallel=True)
            torchtp.manual_seed(5)
        torch.manual_seed(5)
        wrapped = ContextParallel(model)
        batch = _hf_batch("plain", t=16)
        if case == "cp" and recompute:
            loss = checkpoint(lambda **b: wrapped(**b).loss, use_reentrant=False, **batch)
        else:
            loss = wrapped(**batch).loss
        loss.backward()
        return {n: q.grad for n, q in wrapped.named_parameters() if q.grad is not None}

    found = {}
    for case in ("cp", "cp x tp, sp"):
        plain, again = run(case, False), run(case, True)
        assert plain.keys() == again.keys() and plain
        found[case] = max(float((plain[n] - again[n]).abs().max()) for n in plain)
    return found


def _same_grads(model: torch.nn.Module, ref: torch.nn.Module) -> Any:
    def compare(grads: bool) -> float:
        ref_params = dict(ref.named_parameters())
        worst = 0.0
        for name, p in model.named_parameters():
            mine, full = (p.grad, ref_params[name].grad) if grads else (p, ref_params[name])
            if hasattr(mine, "full_tensor"):  # FSDP2's sharded DTensor
                mine = mine.full_tensor()
            worst = max(worst, float((mine.detach() - full.detach()).abs().max()))
        return worst
    return compare


def dp_with_cp(rank: int, world: int) -> dict[str, Any]:
    """dp 2 x cp 2 under DDP and under FSDP2: each replica half the batch, against one
    process on the whole batch; replica 0's rows are padded and replica 1's are not, so
    only a divisor over the global batch's tokens gives one process's token mean."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import torchtp
    from torchtp.cp import ContextParallel

    cfg = torchtp.init_parallel(dp=2, cp=2, tp=1)
    padded, plain = _hf_batch("padded"), _hf_batch("plain")
    plain["attention_mask"] = torch.ones_like(plain["input_ids"])
    full = {k: torch.cat([padded[k], plain[k].roll(1, dims=1)]) for k in padded}
    mine = {k: v[cfg.dp_rank * 2:(cfg.dp_rank + 1) * 2] for k, v in full.items()}
    found: dict[str, Any] = {}
    for kind in ("ddp", "fsdp2"):
        ref, model = build_cp_model("qwen2"), build_cp_model("qwen2")
        ref.set_attn_implementation("sdpa")
        wrapped: Any = ContextParallel(model)
        if kind == "ddp":
            wrapped = DDP(wrapped, process_group=cfg.dp_group)
        else:
            for layer in model.model.layers:
                fully_shard(layer, mesh=cfg.mesh["dp"])
            fully_shard(model, mesh=cfg.mesh["dp"])
        errs = _train_two_steps(wrapped, model, ref, mine, full, _same_grads(model, ref),
                                cfg.dp_group)
        assert max(errs) < HF_TOL, (kind, errs)
        found[kind] = max(errs)
    return found


def counts_roundtrip_compile(rank: int, world: int, save_dir: str) -> dict[str, Any]:
    """Collectives of a 2-layer Llama forward and backward per algorithm; the shard /
    unshard round trip; torch.compile of the model inside, against one process; a
    checkpoint saved from the cp job that plain transformers loads."""
    import torchtp
    from torchtp.cp import ContextParallel, shard_batch, unshard_sequence

    torchtp.init_parallel(cp=world)
    found: dict[str, Any] = {}
    batch = _hf_batch("plain")
    for algorithm in ("allgather", "ulysses", "ring"):
        wrapped = ContextParallel(build_cp_model("llama"), algorithm=algorithm)
        with count_collectives() as fwd:
            out = wrapped(**batch)
        with count_collectives() as bwd:
            out.loss.backward()
        found[algorithm] = (dict(fwd.counts), dict(bwd.counts), fwd.bytes_moved())
    # Parameters are replicated over cp: the model inside saves as it is, and loads anywhere.
    torch.optim.SGD(wrapped.parameters(), lr=0.1).step()  # weights moved by the cp gradient
    if rank == 0:
        wrapped.module.save_pretrained(save_dir)
    dist.barrier()
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(save_dir, dtype=torch.float64)
    found["checkpoint"] = (loaded.config._attn_implementation,
                           all(torch.equal(a, b) for a, b in zip(
                               loaded.state_dict().values(),
                               wrapped.module.state_dict().values(), strict=True)))
    # Round trip: every token back in place, padding dropped, exactly.
    x = torch.randn(2, 13, 5, dtype=torch.float64)
    local = shard_batch(batch["input_ids"], dist.group.WORLD)
    mine = _pad_cut(x, local.layout, rank)
    found["roundtrip"] = bool(torch.equal(unshard_sequence(mine, local, dist.group.WORLD), x))
    # torch.compile of the model inside (aot_eager: traces forward and backward).
    ref, model = build_cp_model("llama"), build_cp_model("llama")
    ref.set_attn_implementation("sdpa")
    wrapped = ContextParallel(torch.compile(model, backend="aot_eager"))
    errs = _train_two_steps(wrapped, model, ref, batch, batch, _same_grads(model, ref))
    assert max(errs) < HF_TOL, ("compile", errs)
    found["compile"] = max(errs)
    return found


def _pad_cut(x: torch.Tensor, layout: SequenceLayout, rank: int) -> torch.Tensor:
    padded = torch.nn.functional.pad(x, (0, 0, 0, layout.length - x.shape[1]))
    return shard_sequence(padded, layout, rank)


def pipeline_with_cp(rank: int, world: int) -> dict[str, Any]:
    """pp 2 x cp 2 (1F1B, 2 microbatches): loss, every gradient and two SGD steps against
    one process; a stage inside ContextParallel is refused on every rank."""
    import torchtp
    from torchtp.cp import ContextParallel
    from torchtp.pipeline import PipelineSchedule, decoder_stage

    cfg = torchtp.init_parallel(pp=2, cp=2, tp=1)
    ref = build_cp_model("llama")
    ref.set_attn_implementation("sdpa")
    stage = decoder_stage(build_cp_model("llama"), cfg.pp_rank, 2)
    pipe = PipelineSchedule(stage, 2, "1f1b")
    gen = torch.Generator().manual_seed(3)
    batch = {"input_ids": torch.randint(3, 32, (4, 13), generator=gen)}  # 13: padded to 16
    batch["labels"] = batch["input_ids"].clone()
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (stage, ref))
    errs = []
    for _step in range(2):
        _, ref_loss = reference_step(ref, batch)
        ref_loss.backward()
        with count_collectives() as counted:
            loss = pipe.step(batch["input_ids"], batch["labels"])
        if loss is not None:  # the last stage
            errs.append(float((loss - ref_loss.detach()).abs()))
        ref_params = dict(ref.named_parameters())
        for name, p in stage.model.named_parameters():
            errs.append(float((p.grad - ref_params[name].grad).abs().max()))
        opt.step(), opt_ref.step()
        opt.zero_grad(), opt_ref.zero_grad()
    assert max(errs) < HF_TOL, errs
    # Another ignore_index: the same loss when the ignored labels are spelled 0.
    labels = batch["labels"].clone()
    labels[:, :3] = -100
    other = PipelineSchedule(stage, 2, "1f1b", ignore_index=0)
    a = pipe.evaluate(batch["input_ids"], labels)
    b = other.evaluate(batch["input_ids"], labels.masked_fill(labels == -100, 0))
    same_ignored = a is None or bool(torch.equal(a, b))
    wrapped_stage = decoder_stage(build_cp_model("llama"), cfg.pp_rank, 2)
    ContextParallel(wrapped_stage)
    refused = _raises(lambda: PipelineSchedule(wrapped_stage, 2, "gpipe"))
    return {"worst": max(errs), "checked": len(errs), "refused": refused,
            "last": loss is not None, "counts": dict(counted.counts), "ignored": same_ignored,
            "attention": stage.model.config._attn_implementation,
            "lora": _lora_after_schedule(pipe, stage.model, ref, batch)}


def _lora_after_schedule(pipe: Any, mine: torch.nn.Module, ref: torch.nn.Module,
                         batch: dict[str, torch.Tensor]) -> float:
    """LoRA injected into a stage after its ``PipelineSchedule`` was built (parameters the
    schedule did not see): every adapter gradient against one process's. Before, they
    covered this cp rank's tokens only, silently. Returns the worst difference."""
    import zlib

    from peft import LoraConfig, inject_adapter_in_model

    for model in (mine, ref):
        inject_adapter_in_model(LoraConfig(r=2, target_modules=["q_proj", "v_proj"]), model)
        for name, p in model.named_parameters():
            if "lora_" in name:  # the same values for the same name on both sides
                gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                p.data = 0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype)
    _, ref_loss = reference_step(ref, batch)
    ref_loss.backward()
    pipe.step(batch["input_ids"], batch["labels"])
    ref_params = dict(ref.named_parameters())
    diffs = [float((p.grad - ref_params[n].grad).abs().max())
             for n, p in mine.named_parameters() if "lora_" in n]
    assert len(diffs) == 4, diffs  # this stage's layer: q, v x A, B
    return max(diffs)


def lora_after_wrap(rank: int, world: int) -> int:
    """PEFT LoRA added after ``ContextParallel(model)`` (its adapters are parameters the
    wrap did not see): loss and every adapter gradient equal one process's over the whole
    batch. Returns the adapter gradients checked."""
    from peft import LoraConfig, get_peft_model

    import torchtp
    from torchtp.cp import ContextParallel

    def lora() -> LoraConfig:
        torch.manual_seed(5)  # the same adapters on both sides
        return LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)

    torchtp.init_parallel(cp=world)
    ref = get_peft_model(build_cp_model("llama"), lora())
    ref.base_model.model.set_attn_implementation("sdpa")
    wrapped = ContextParallel(build_cp_model("llama"))
    mine = get_peft_model(wrapped.module, lora())
    batch = _hf_batch("plain")
    _, want = reference_step(ref, batch)
    want.backward()
    got = wrapped(**batch).loss
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    from ._hf_checks import compare_params

    # every adapter's gradient; before, this rank's tokens' part only
    return compare_params(mine, ref, True, {"rtol": 1e-7, "atol": HF_TOL}, named=mine)
