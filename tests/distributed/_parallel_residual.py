"""Hand-written parallel-residual blocks (``x + attention(x) + mlp(x)``), run per rank.

GPT-J, GPT-NeoX, Falcon, Phi-2, Cohere and PaLM add both branches to the
residual at once. The automatic plan leaves both output projections as partial
sums and reduces them once per layer (``reduce_residual``); these models check
that against one process, and that a layer it must not treat so keeps one
all-reduce per branch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import torchtp

from ._hand_moe import TOL, check_grads

VOCAB = 64
DIM, HEADS, FFN = 48, 6, 96  # whole heads at tp 2 and 3


class Attention(nn.Module):
    """Causal multi-head attention, float64 throughout (no rotary: its complex64 tables
    would round to float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.n_heads, self.head_dim = HEADS, DIM // HEADS
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.wo = nn.Linear(DIM, DIM)  # its bias is added once, on rank 0's partial sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # (B, heads/tp, T, hd)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, DIM)


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(DIM, FFN), nn.Linear(FFN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class ParallelBlock(nn.Module):
    """``x + dropout(attention(norm(x)) + feed_forward(norm(x)))`` (GPT-J, PaLM), or a variant
    the plan must not sum once: a scaled residual, a gate computed from ``x``, dropout on
    the residual itself."""

    def __init__(self, scale: float, p: float, gate: bool, residual_p: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()
        self.drop, self.residual_drop = nn.Dropout(p), nn.Dropout(residual_p)
        self.scale, self.gate = scale, gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)  # (B, T, DIM), read by both branches
        branches = self.attention(h) + self.feed_forward(h)
        if self.gate:
            branches = torch.sigmoid(x) * branches
        residual = self.residual_drop(x) if self.residual_drop.p else x
        return (residual if self.scale == 1 else self.scale * residual) + self.drop(branches)


class ParallelNet(nn.Module):
    """Embedding, two parallel-residual blocks, a norm and an untied head."""

    def __init__(self, scale: float = 1.0, p: float = 0.0, gate: bool = False,
                 residual_p: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(ParallelBlock(scale, p, gate, residual_p) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)  # (B, T, DIM)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.norm(x))  # (B, T, VOCAB)


KINDS = {
    "parallel": {},
    "dropout": {"p": 0.25},  # masks on the partial sums: equal on every rank (shared stream)
    "scaled": {"scale": 0.5},  # 0.5 * x is not the layer's input: no residual point
    "gated": {"gate": True},  # sigmoid(x) * branches: x's gradient would keep a partial term
    "residual_dropout": {"residual_p": 0.25},  # dropout(x), training mode only
}


def check_parallel_residual(rank: int, world_size: int, kind: str) -> dict[str, object]:
    """Two SGD steps in training mode, float64, against one process: outputs and every
    gradient each step. Returns the plan's styles, reasons and notes, and per step the
    forward's collective counts."""
    torchtp.init_tensor_parallel()
    torch.manual_seed(0)
    ref = ParallelNet(**KINDS[kind]).double().train()
    torch.manual_seed(0)
    model = ParallelNet(**KINDS[kind]).double()
    seen: dict[str, list[torch.Tensor]] = {"ref": [], "tp": []}
    for key, net in (("ref", ref), ("tp", model)):
        # A hook registered before the wrap (as HF's output_hidden_states capture can
        # be) must see the summed output; a pre-hook added after it may change the input.
        net.layers[0].register_forward_hook(lambda _m, _a, out, k=key: seen[k].append(out))
    wrapped = torchtp.DistributedModelWrapper(model).train()
    for net in (ref, wrapped.base_model):
        net.layers[1].register_forward_pre_hook(lambda _m, args: (args[0] * 1.5, *args[1:]))
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    counts = []
    for step in range(2):
        # The same dropout masks: the wrapper draws replicated dropout from the shared
        # stream, which torchtp.manual_seed(s) starts where torch.manual_seed(s) does.
        torchtp.manual_seed(step)
        with torchtp.count_collectives() as fwd:
            got = wrapped(ids[:, :-1])
        torch.manual_seed(step)
        want = ref(ids[:, :-1])
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(seen["tp"][-1], seen["ref"][-1], **TOL)
        for logits in (got, want):
            F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        check_grads(wrapped, ref)
        counts.append(dict(fwd.counts))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    plan = wrapped.resolved_plan
    return {"styles": {n: s.name for n, s in plan.assignments.items()}, "why": dict(plan.why),
            "notes": list(plan.notes), "counts": counts}


class _DictBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"hidden": x + self.proj(x)}


def check_reduce_residual_needs_a_tensor(rank: int, world_size: int) -> str:
    """A hand-written plan puts ``reduce_residual`` on a module returning a dict: the first
    forward raises a TypeError naming the module and the fix, on every rank."""
    wrapped = torchtp.DistributedModelWrapper(nn.Sequential(_DictBlock()),
                                              plan={"0": "reduce_residual"})
    try:
        wrapped(torch.randn(2, DIM))
    except TypeError as err:
        return str(err)
    raise AssertionError("reduce_residual ran on a dict output")


def check_fused_checkpoints(rank: int, world_size: int, out: str) -> list[str]:
    """GPT-NeoX with both branches reduced once per layer (at tp 3 its 4 heads split 2/1/1):
    the consolidated HF save equals the unsharded model tensor for tensor, and a DCP training
    state loads into a fresh fused model with the same logits. Returns the fused layers."""
    from torchtp.checkpoint.dcp import load_training_state, save_training_state

    from ._hf_checks import inputs
    from ._hf_models import build

    torchtp.init_tensor_parallel()
    wrapped = torchtp.DistributedModelWrapper(build("gpt_neox"))
    fused = sorted(n for n, s in wrapped.resolved_plan.assignments.items()
                   if s.name == "reduce_residual")
    wrapped.save_pretrained(f"{out}/hf")
    if rank == 0:
        from transformers import AutoModelForCausalLM

        saved = AutoModelForCausalLM.from_pretrained(f"{out}/hf").state_dict()
        for name, want in build("gpt_neox").state_dict().items():
            assert torch.equal(saved[name], want), name
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    save_training_state(f"{out}/dcp", wrapped, opt, step=1)
    fresh = torchtp.DistributedModelWrapper(build("gpt_neox", seed=5))
    load_training_state(f"{out}/dcp", fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    batch = inputs("gpt_neox")
    torch.testing.assert_close(fresh(**batch).logits, wrapped(**batch).logits, rtol=0, atol=0)
    return fused
