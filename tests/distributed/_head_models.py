"""Hand-written attention models as people write them (no torchtitan/timm dependency).

* :class:`TitanLlama` - torchtitan's Llama attention: ``wq``/``wk``/``wv``/``wo``,
  ``n_heads``/``n_kv_heads``/``n_rep``/``head_dim`` attributes, ``view(bs, seqlen,
  -1, head_dim)``, KV heads repeated ``n_rep`` times, rotary embeddings, and a
  SwiGLU feed-forward ``w1``/``w2``/``w3``.
* :class:`TimmViT` - timm's ViT attention: one fused ``qkv`` Linear reshaped to
  ``(B, N, 3, num_heads, head_dim)``, ``q_norm``/``k_norm`` (``nn.Identity`` as timm's default),
  ``proj``; an MLP ``fc1``/``fc2``.

Sizes give uneven heads at tp 3: 4 query heads (2/1/1), and for the Llama 2 KV
heads (each replicated over the ranks of its group).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on ``(bs, seq, heads, head_dim)`` (interleaved pairs, as torchtitan)."""
    seq, dim = x.shape[1], x.shape[-1]
    freqs = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)  # (seq, dim/2)
    rot = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * rot).flatten(3).type_as(x)


class TitanAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.n_rep = n_heads // n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = _rotary(xq), _rotary(xk)
        keys = xk.repeat_interleave(self.n_rep, dim=2)
        values = xv.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), keys.transpose(1, 2),
                                             values.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class TitanBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = TitanAttention(dim, n_heads, n_kv_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class TitanLlama(nn.Module):
    def __init__(self, vocab: int = 61, dim: int = 32, n_heads: int = 4, n_kv_heads: int = 2,
                 hidden: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TitanBlock(dim, n_heads, n_kv_heads, hidden)
                                    for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class TimmAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, qk_norm: bool = False) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        # timm's default (qk_norm=False) is nn.Identity.
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
        x = (self.attn_drop(attn) @ v).transpose(1, 2).reshape(B, N, -1)
        return self.proj_drop(self.proj(x))


class TimmBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = TimmAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TimmViT(nn.Module):
    def __init__(self, dim: int = 32, num_heads: int = 4, hidden: int = 64, layers: int = 2,
                 classes: int = 5) -> None:
        super().__init__()
        self.patch_embed = nn.Linear(12, dim)
        self.blocks = nn.ModuleList(TimmBlock(dim, num_heads, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(patches)  # (B, N, 12) -> (B, N, dim)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))
