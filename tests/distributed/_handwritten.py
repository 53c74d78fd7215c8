"""Hand-written models the way their projects write them, scaled down, with Megatron plans.

* :class:`MLP` - ``fc1 -> GELU -> dropout -> fc2`` as attributes (no nn.Sequential).
* :class:`TitanLlama` - torchtitan's Llama: ``wq/wk/wv/wo`` with ``n_heads``,
  ``n_kv_heads`` (GQA), ``head_dim``, ``n_rep``; complex RoPE; SwiGLU ``w1/w2/w3``;
  RMSNorm; layers in a ModuleDict; untied ``output``.
* :class:`ViT` - timm's VisionTransformer: fused ``qkv`` reshaped with
  ``num_heads``/``head_dim`` and merged back with ``attn_dim``; ``Mlp`` with
  ``fc1/act/fc2``; class token; a classifier ``head``.
* :class:`NanoGPT` - nanoGPT: fused ``c_attn`` split with ``n_embd`` and viewed
  with ``C // n_head`` where ``C`` comes from the input; ``lm_head`` tied to ``wte``.
* :class:`ToyTransformer` - PyTorch's DTensor test Transformer: ``wq/wk/wv/wo``
  viewed with ``self.n_heads``, a GELU ``FeedForward``, learned positions.
* :func:`seed_sequential` - the seed guide's ``nn.Sequential`` MLP.

Every builder takes a seed, so every rank builds the same weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64


class MLP(nn.Module):
    """A transformer MLP written as a class."""

    def __init__(self, dim: int = 16, hidden: int = 48) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.0)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(self.act(self.fc1(x))))


# torchtitan (models/llama3/model.py), reduced.
def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, dtype=torch.float32)
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs))  # complex64


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim)
            .reshape(bs, slen, n_kv_heads * n_rep, head_dim))


class TitanAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.n_rep = n_heads // n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class TitanFeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden_dim: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.dim = dim
        self.attention = TitanAttention(dim, n_heads, n_kv_heads)
        self.feed_forward = TitanFeedForward(dim, hidden_dim)
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    def __init__(self, dim: int = 32, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2,
                 hidden_dim: int = 64, max_seq_len: int = 16) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, max_seq_len),
                             persistent=False)
        self.layers = nn.ModuleDict({str(i): TitanBlock(dim, n_heads, n_kv_heads, hidden_dim)
                                     for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


TITAN_PLAN = {
    "layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise", "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise", "output": "colwise_gather_output",
}


# timm (layers/attention.py, layers/mlp.py, models/vision_transformer.py), reduced.
class TimmAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.attn_dim = num_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, self.attn_dim * 3, bias=True)
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(self.attn_dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        q = q * self.scale
        attn = (q @ k.transpose(-2, -1)).softmax(dim=-1)
        x = self.attn_drop(attn) @ v
        x = x.transpose(1, 2).reshape(B, N, self.attn_dim)
        return self.proj_drop(self.proj(x))


class TimmMlp(nn.Module):
    def __init__(self, in_features: int, hidden_features: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(0.0)
        self.norm = nn.Identity()
        self.fc2 = nn.Linear(hidden_features, in_features)
        self.drop2 = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


class TimmBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = TimmAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = TimmMlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, img_size: int = 8, patch_size: int = 4, embed_dim: int = 32,
                 depth: int = 2, num_heads: int = 4, num_classes: int = 16) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, embed_dim, kernel_size=patch_size, stride=patch_size)
        num_patches = (img_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.randn(1, 1, embed_dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, embed_dim) * 0.02)
        self.blocks = nn.Sequential(*[TimmBlock(embed_dim, num_heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, patches, dim)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


VIT_PLAN = {
    "blocks.*.attn.qkv": "packed_colwise", "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "rowwise",
    "head": "colwise_gather_output",
}


# nanoGPT (model.py), reduced.
class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(0.0)
        self.resid_dropout = nn.Dropout(0.0)
        self.n_head = n_head
        self.n_embd = n_embd
        self.dropout = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class GPTMLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class GPTBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = GPTMLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, n_embd: int = 32, n_head: int = 4, n_layer: int = 2,
                 block_size: int = 16) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, n_embd), wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(0.0), h=nn.ModuleList([GPTBlock(n_embd, n_head) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return self.lm_head(x[:, [-1], :]), None


# nanoGPT's attention reads C from its input, so no plan can split it unmodified.
NANOGPT_PLAN = {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}


# PyTorch (torch/testing/_internal/distributed/_tensor/common_dtensor.py), reduced.
class ToyAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.n_heads = n_heads
        self.resid_dropout = nn.Dropout(0.0)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.size()
        queries, keys, values = self.wq(x), self.wk(x), self.wv(x)
        queries = queries.view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        keys = keys.view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        values = values.view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        output = F.scaled_dot_product_attention(queries, keys, values, None, 0.0, True)
        return self.resid_dropout(self.wo(output.transpose(1, 2).reshape(bsz, seq_len, -1)))


class ToyFeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.gelu = nn.GELU()
        self.w2 = nn.Linear(hidden_dim, dim)
        self.resid_dropout = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resid_dropout(self.w2(self.gelu(self.w1(x))))


class ToyBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = ToyAttention(dim, n_heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = ToyFeedForward(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class ToyTransformer(nn.Module):
    def __init__(self, dim: int = 32, n_heads: int = 4, n_layers: int = 2,
                 max_seq_len: int = 16) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.pos_embeddings = nn.Embedding(max_seq_len, dim)
        self.dropout = nn.Dropout(0.0)
        self.layers = nn.ModuleList([ToyBlock(dim, n_heads) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(0, tokens.size(1), device=tokens.device)
        h = self.dropout(self.tok_embeddings(tokens) + self.pos_embeddings(pos))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


# The same names as torchtitan's, with a GELU MLP (no w3).
TOY_PLAN = {k: v for k, v in TITAN_PLAN.items() if not k.endswith(".w3")}


def seed_sequential(d: int = 32, h: int = 128) -> nn.Sequential:
    """The seed guide's ``nn.Sequential(Linear(4096, 16384), ReLU, Linear(16384, 4096))``, scaled."""
    return nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, d))


MLP_PLAN = {"fc1": "colwise", "fc2": "rowwise"}
SEQ_PLAN = {"0": "colwise", "2": "rowwise"}


def build(kind: str, seed: int = 0) -> nn.Module:
    """A fresh ``kind`` model under ``seed`` (the same weights on every rank)."""
    torch.manual_seed(seed)
    return {"mlp": MLP, "titan": TitanLlama, "vit": ViT, "nanogpt": NanoGPT,
            "toy": ToyTransformer, "sequential": seed_sequential}[kind]()


PLANS = {"mlp": MLP_PLAN, "titan": TITAN_PLAN, "vit": VIT_PLAN, "nanogpt": NANOGPT_PLAN,
         "toy": TOY_PLAN, "sequential": SEQ_PLAN}


def batch(kind: str) -> tuple[torch.Tensor, ...]:
    """Inputs and targets for one training step of ``kind`` (same on every rank)."""
    gen = torch.Generator().manual_seed(7)
    if kind in ("titan", "nanogpt", "toy"):
        ids = torch.randint(0, VOCAB, (2, 9), generator=gen)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    if kind == "vit":
        return torch.randn(2, 3, 8, 8, generator=gen), torch.randint(0, 16, (2,), generator=gen)
    x = torch.randn(2, 5, 16 if kind == "mlp" else 32, generator=gen)
    return x, torch.randn(x.shape, generator=gen)


def loss_of(kind: str, model: nn.Module, data: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, target = data
    if kind == "nanogpt":
        return model(x, target)[1]
    out = model(x)
    if kind in ("titan", "toy"):
        return F.cross_entropy(out.flatten(0, 1), target.flatten())
    if kind == "vit":
        return F.cross_entropy(out, target)
    return F.mse_loss(out, target)


def example_inputs(kind: str) -> tuple[torch.Tensor, ...] | None:
    """What the user passes as ``example_inputs`` (ViT's first layer is a Conv2d)."""
    return (torch.zeros(1, 3, 8, 8),) if kind == "vit" else None
