"""A tensor-parallel Llama forward issues the minimum number of collectives.

Two all-reduces per decoder layer (after ``o_proj`` and after ``down_proj``)
and nothing else with ``lm_head`` replicated, which is also what torchtp
chooses by cost with no plan (``plan=None``: the model's own HF plan, its
64-token vocabulary head and embedding kept whole); one extra all-gather when
``lm_head`` is ``colwise_gather_output``; and one all-reduce more with the
HF plan as written (``plan="auto-memory"``, the leanest), whose vocab-parallel
embedding sums its partial lookups. Counted with torchtp.count_collectives.

In training, the backward adds two all-reduces per layer, not five: q/k/v
(and gate/up) receive the same input, so their input gradients are summed
before one all-reduce, with every gradient still equal to the unsharded one.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from ._models import gather_param

LAYERS = 3
PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                                   num_key_value_heads=4, intermediate_size=64, vocab_size=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def _count(rank: int, world_size: int) -> list[dict[str, int]]:
    import torchtp

    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    counts = []
    for plan in (PLAN, {**PLAN, "lm_head": "colwise_gather_output"}, None, "auto-memory"):
        ref = _llama()
        model = torchtp.DistributedModelWrapper(_llama(), plan=plan)
        with torch.no_grad(), torchtp.count_collectives() as prefill:
            out = model(ids, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        with torch.no_grad(), torchtp.count_collectives() as decode:
            model(token, past_key_values=out.past_key_values, use_cache=True)
        torch.testing.assert_close(out.logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
        counts += [dict(prefill.counts), dict(decode.counts)]
    return counts


def _training_counts(world_size: int) -> tuple[dict[str, int], dict[str, int]]:
    import torchtp
    from torchtp.comm import regions

    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    ref, model = _llama().train(), torchtp.DistributedModelWrapper(_llama().train(), plan=PLAN)
    ref(input_ids=ids, labels=ids).loss.backward()
    with torchtp.count_collectives() as fwd:
        loss = model(input_ids=ids, labels=ids).loss
    # The shared-input entries end with the forward (they would keep its graph alive).
    assert not regions._LAST_COPY
    with torchtp.count_collectives() as bwd:
        loss.backward()
    want = dict(ref.named_parameters())
    for name, p in model.base_model.named_parameters():
        full = gather_param(model.base_model, name, p.grad, world_size)
        # fp32; the partial input gradients are summed in another order than one matmul.
        torch.testing.assert_close(full, want[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    return dict(fwd.counts), dict(bwd.counts)


def _copy_to_sharing(world_size: int) -> list[bool]:
    """Same unmodified tensor: one shared output; modified in place, or another tensor: not."""
    import torch.distributed as dist

    import torchtp

    group = dist.group.WORLD
    x0 = torch.ones(3, 4, requires_grad=True)
    x = x0 * 2  # (3, 4), non-leaf
    a, b = (torchtp.copy_to_tensor_parallel_region(x, group) for _ in range(2))
    first = a.sum() + 2 * b.sum()
    x.add_(1)  # bumps the version a and b share with x
    c = torchtp.copy_to_tensor_parallel_region(x, group)
    d = torchtp.copy_to_tensor_parallel_region(x.clone(), group)
    with torchtp.count_collectives() as bwd:
        (first + 4 * c.sum() + d.sum()).backward()
    # d(loss)/dx summed over ranks: (1 + 2 + 4 + 1) * world_size; dx/dx0 = 2.
    exact = torch.equal(x0.grad, torch.full((3, 4), 16.0 * world_size))
    return [a is b, b is c, c is d, bwd.counts["all_reduce"] == 3, exact]


def _rank(rank: int, world_size: int) -> dict[str, object]:
    return {"inference": _count(rank, world_size), "training": _training_counts(world_size),
            "sharing": _copy_to_sharing(world_size)}


@pytest.mark.parametrize("world_size", [2])
def test_llama_needs_two_all_reduces_per_layer_forward_and_backward(ranks, world_size):
    for out in ranks(_rank, world_size, timeout=180):
        counts = out["inference"]
        minimum = {"all_reduce": 2 * LAYERS}
        assert counts[0] == minimum and counts[1] == minimum  # prefill, decode
        with_head = {"all_reduce": 2 * LAYERS, "all_gather": 1}
        assert counts[2] == with_head and counts[3] == with_head
        # No plan: the cost model keeps the small head and embedding whole (the minimum).
        assert counts[4] == minimum and counts[5] == minimum
        # The HF plan as written also splits the embedding by vocab: one all-reduce more.
        own = {"all_reduce": 2 * LAYERS + 1, "all_gather": 1}
        assert counts[6] == own and counts[7] == own
        # Training: the backward all-reduces each layer's attention and MLP input gradients.
        assert out["training"] == ({"all_reduce": 2 * LAYERS}, {"all_reduce": 2 * LAYERS})
        assert out["sharing"] == [True, False, False, True, True]


# Ported from PyTorch's test_tp_style (ColwiseParallel, RowwiseParallel): the collectives a
# single layer needs, forward and backward, with torchtp's checks on. The input check
# rides them; only a step with none at all pays one all-reduce of its own (issue 35).
def _one(style: str) -> torch.nn.Module:
    """One Linear (16 -> 16), the same weights on every rank."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16))


def _style_counts(style: str, grad_input: bool, train: bool,
                  x: torch.Tensor) -> tuple[dict[str, int], dict[str, int]]:
    import torch.distributed as dist

    import torchtp

    ref, model = _one(style), torchtp.DistributedModelWrapper(_one(style), plan={"0": style})
    full, x = x, x.clone().requires_grad_(grad_input)
    if style == "rowwise":  # a lone rowwise layer takes this rank's input shard, as in PyTorch
        x = x.detach().chunk(dist.get_world_size(), -1)[dist.get_rank()]
    with torch.set_grad_enabled(train), torchtp.count_collectives() as fwd:
        out = model(x)
    with torchtp.count_collectives() as bwd:
        if train:
            out.sum().backward()
    if style != "colwise":  # a colwise output stays split: its check is the gradient's
        torch.testing.assert_close(out, ref(full), rtol=1e-5, atol=1e-6)
    if train and grad_input:  # the input's gradient is the unsharded one
        x_ref = x.detach().clone().requires_grad_()
        ref(x_ref).sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    return dict(fwd.counts), dict(bwd.counts)


def _mismatch_in_backward(rank: int) -> str:
    """Colwise, training: the forward has no collective, so the hash of per-rank inputs
    rides the backward's input-gradient all-reduce and the backward raises, on every rank."""
    import torchtp

    model = torchtp.DistributedModelWrapper(_one("colwise"), plan={"0": "colwise"})
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    out = model(x)  # no collective yet: nothing can be known
    with pytest.raises(torchtp.RankMismatchError, match="differs on TP ranks") as err:
        out.sum().backward()
    same = torch.randn(4, 16, generator=torch.Generator().manual_seed(7), requires_grad=True)
    model(same).sum().backward()  # still in step afterwards
    # Eval-like: the check's own all-reduce at the forward's end.
    with pytest.raises(torchtp.RankMismatchError, match="differs on TP ranks"), torch.no_grad():
        model(x)
    gather = torchtp.DistributedModelWrapper(_one("colwise_gather_output"),
                                             plan={"0": "colwise_gather_output"})
    with pytest.raises(torchtp.RankMismatchError, match="differs on TP ranks"):
        gather(x)  # rides the forward's all-gather: raised by the forward itself
    return str(err.value)


def _styles(rank: int, world_size: int) -> dict[str, object]:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    cases = {
        "colwise train": ("colwise", True, True), "colwise train, input without grad":
        ("colwise", False, True), "colwise eval": ("colwise", True, False),
        "colwise gather train": ("colwise_gather_output", True, True),
        "colwise gather eval": ("colwise_gather_output", False, False),
        "rowwise train": ("rowwise", False, True), "rowwise eval": ("rowwise", False, False),
    }
    out: dict[str, object] = {name: _style_counts(*case, x) for name, case in cases.items()}
    out["mismatch"] = _mismatch_in_backward(rank)
    return out


def test_checks_ride_the_collectives_a_step_already_has(ranks):
    for out in ranks(_styles, 2, timeout=180):
        # PyTorch's test_colwise_parallel_style: nothing forward, one all-reduce backward.
        assert out["colwise train"] == ({}, {"all_reduce": 1})
        assert out["colwise gather train"] == ({"all_gather": 1}, {"all_reduce": 1})
        # test_rowwise_parallel_style: one all-reduce forward (the input needs no gradient).
        assert out["rowwise train"] == ({"all_reduce": 1}, {})
        assert out["rowwise eval"] == ({"all_reduce": 1}, {})
        assert out["colwise gather eval"] == ({"all_gather": 1}, {})
        # Steps with no collective at all: the check's own all-reduce of 64 values.
        assert out["colwise eval"] == ({"all_reduce": 1}, {})
        assert out["colwise train, input without grad"] == ({"all_reduce": 1}, {})
        assert "argument 0 differs on TP ranks [1]" in out["mismatch"]
