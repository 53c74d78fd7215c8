"""Bytes autograd saves for the backward, per rank and microbatch, as torchtp's runs save them.

Each term is a tensor that HuggingFace's modules (SDPA attention, RMSNorm,
gated MLP, grouped-mm experts) and torchtp's parallel layers save, counted
from what they save in float32 and bfloat16 (``benchmarks/planner_memory.py``
lists them): ``T`` tokens on the rank (``microbatch * seq / cp``), ``a``
bytes per activation element, statistics in float32.

=======================  ==============================================================
RMSNorm                  input in float32, normalized and output in ``a``, 1/rms per token:
                         ``T_n * (h * (4 + 2a) + 4)``; ``T_n = T / tp`` with sequence
                         parallelism, else ``T``
attention (SDPA)         q, k, v, output in ``a``, log-sum-exp in float32:
                         ``T * ((2 q + 2 kv) a + 4 H) / tp``; per-head q/k norms
                         (Qwen3) add their input in float32 and normalized values
context-parallel         q, k, v (recomputed in the backward) and the output that
attention                ``o_proj`` saves: ``T * (2 q + 2 kv) a / tp``, no log-sum-exp
gated MLP                gate, its SiLU, up, their product: ``4 T f a / tp``
experts (grouped mm)     router scores and indices, every routed copy of a token in and
                         out (``2 h``) and its expert activations (``4 f``):
                         ``T k (2 h + 4 f ep / tp) a`` plus ``T (4 E + 36 k)``; every
                         rank runs all ``T k`` copies (the all-reduce dispatch masks
                         the experts other ranks hold)
LM head and loss         final norm, the float32 logits the loss saves (``V / tp`` with
                         loss parallelism), the labels
whole blocks (sequence     a MoE block or latent attention all-gathers its input and saves
parallelism)             it (``T h a``) where a norm's output on shards (``T_n h a``) was
                         counted
full recomputation       each layer keeps its input (``T_n h a``); one layer's
                         activations live again while it is recomputed
=======================  ==============================================================

``stack="fused"`` (Megatron-LM, Transformer Engine) keeps a norm's input
and output in ``a`` (no float32 copy) and one MLP tensor less (the SiLU or
GELU output is recomputed from its input in the fused kernel's backward);
it is not measured here, only used for the published runs.

A KV head is held whole on the ranks that share it (``tp`` above the KV
heads), so ``kv`` per rank is at least one head.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm.layout_file import Layout
from .arch import Arch
from .setup import Training

F32, I64 = 4, 8


@dataclass(frozen=True)
class Shares:
    """What one rank holds of a layer's widths and of a microbatch's tokens."""

    tokens: int  # T: tokens of the microbatch on this rank
    norm_tokens: int  # T_n: tokens a norm runs on (T / tp with sequence parallelism)
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    a: int  # bytes per activation element


def shares(arch: Arch, layout: Layout, training: Training, microbatch: int) -> Shares:
    """This rank's share of ``microbatch`` sequences under ``layout``."""
    tokens = microbatch * training.seq // layout.cp
    tp = layout.tp
    return Shares(tokens=tokens, norm_tokens=tokens // tp if layout.sequence_parallel else tokens,
                  heads=max(1, arch.heads // tp), kv_heads=max(1, arch.kv_heads // tp),
                  head_dim=arch.head_dim, ffn=arch.ffn // tp, a=training.activation_bytes)


def norm(s: Shares, width: int, tokens: int | None = None, stack: str = "torchtp") -> int:
    """An RMSNorm over ``width`` features of ``tokens`` (default the norm tokens).

    ``"torchtp"``: input in float32, normalized and output in ``a``; ``"fused"``:
    input and output in ``a``. Both keep a float32 statistic per token.
    """
    t = s.norm_tokens if tokens is None else tokens
    per = 2 * s.a if stack == "fused" else F32 + 2 * s.a
    return t * (width * per + F32)


def attention(arch: Arch, s: Shares, cp: int) -> int:
    """One attention block between its norm and ``o_proj`` (see the module docstring)."""
    if arch.latent is not None:  # latent: per-head q/k of nope+rope, values of v_dim
        lat = arch.latent
        q = s.heads * (lat.nope_dim + lat.rope_dim)
        kv = s.heads * (lat.nope_dim + lat.rope_dim + lat.v_dim) // 2
        latent = s.tokens * (lat.kv_rank + lat.q_rank) * (F32 + 2 * s.a)
    else:
        q, kv, latent = s.heads * s.head_dim, s.kv_heads * s.head_dim, 0
    saved = s.tokens * (2 * q + 2 * kv) * s.a + latent
    if cp == 1:
        saved += s.tokens * s.heads * F32  # the log-sum-exp (recomputed under cp)
    if arch.qk_norm:
        saved += s.tokens * (q * (F32 + s.a) + s.heads * F32 + kv * (F32 + s.a)
                             + s.kv_heads * F32)
    return saved


def mlp(s: Shares, ffn: int, gated: bool = True, stack: str = "torchtp") -> int:
    """A dense MLP of ``ffn`` features per rank (``"fused"``: one tensor less)."""
    tensors = (4 if gated else 2) - (1 if stack == "fused" else 0)
    return tensors * s.tokens * ffn * s.a


def experts(arch: Arch, s: Shares, layout: Layout) -> int:
    """A mixture-of-experts block after its norm (router, dispatch, experts, shared experts)."""
    assert arch.experts is not None
    e = arch.experts
    ep, tp = layout.ep, layout.tp
    # Routed copies of tokens a rank runs: all of them (the all-reduce dispatch masks the
    # other ranks' experts; all-to-all across data-parallel ranks brings as many, balanced).
    slots = s.tokens * e.top_k
    ffn = e.ffn * ep // tp if ep <= tp else e.ffn
    saved = s.tokens * (e.count * F32 + 4 * e.top_k * I64) + slots * F32
    saved += slots * (2 * arch.hidden + 4 * ffn) * s.a
    if ep > 1:  # which routed copies are this rank's (bool masks)
        saved += s.tokens * e.top_k + slots
    if e.shared_ffn:
        saved += mlp(s, e.shared_ffn // tp)
    return saved


def layer(arch: Arch, index: int, s: Shares, layout: Layout, stack: str = "torchtp") -> int:
    """Every tensor decoder layer ``index`` saves for one microbatch."""
    h = arch.hidden
    saved = 2 * norm(s, h, stack=stack) + attention(arch, s, layout.cp)
    moe = arch.is_moe_layer(index)
    if layout.sequence_parallel:  # blocks run whole save their gathered input (sp/hf_plan.py)
        saved += ((arch.latent is not None) + moe) * (s.tokens - s.norm_tokens) * h * s.a
    if moe:
        return saved + experts(arch, s, layout)
    return saved + mlp(s, s.ffn, arch.mlp == "gated", stack)


def head(arch: Arch, s: Shares, layout: Layout, loss_parallel: bool = False) -> int:
    """The final norm, the logits the loss keeps and the labels (the last stage)."""
    h = arch.hidden
    saved = norm(s, h, s.norm_tokens)
    if layout.sequence_parallel:  # the LM head's input is gathered from the sequence shards
        saved += s.tokens * h * s.a - s.norm_tokens * h * s.a
    vocab = arch.vocab // layout.tp if loss_parallel else arch.vocab
    return saved + s.tokens * vocab * F32 + s.tokens * I64 + F32


def embed(arch: Arch, s: Shares) -> int:
    """The token ids the embedding keeps (the first stage)."""
    return s.tokens * I64


def rotary(arch: Arch, s: Shares, microbatch: int) -> int:
    """The rotary cos/sin every stage computes once per microbatch (one row per position)."""
    if arch.positions:
        return 0
    return 2 * (s.tokens // microbatch) * arch.head_dim * s.a


def checkpointed_layer(s: Shares, arch: Arch) -> int:
    """What a layer keeps under full recomputation: its input."""
    return s.norm_tokens * arch.hidden * s.a
