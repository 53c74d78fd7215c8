"""Make sure a swap keeps what the original module computed.

Subclasses of ``nn.Linear``/``nn.Embedding`` may override ``forward``
(LoRA adapters, quantized layers, Gemma's scaled embedding). Swapping them for
a parallel layer would silently drop that behaviour, so before any weight is
touched a small probe runs the module locally (no communication):

* Linear-like: the module's output must equal the plain linear map.
* Embedding: the sum of per-rank partial lookups, each run through the
  module's own forward, must equal its full output (true for a scale, false
  for a bias or a norm), so vocab-splitting it in place stays exact.

Meta-device modules cannot be probed; they are trusted and a note says so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..core.layouts import shard_range
from ..core.torch_compat import shallow_copy_module
from .linear_view import conv1d_type, linear_view

_PLAIN_FORWARDS = {nn.Linear.forward, nn.Embedding.forward}


def _plain(module: nn.Module) -> bool:
    forward = type(module).forward
    if forward in _PLAIN_FORWARDS:
        return True
    conv1d = conv1d_type()
    return conv1d is not None and forward is getattr(conv1d, "forward", None)


def _on_meta(module: nn.Module) -> bool:
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return any(t.is_meta for t in tensors)


@torch.no_grad()
def check_linear_forward(module: nn.Module, fqn: str, style: str) -> None:
    """Raise if ``module``'s forward is not the linear map a parallel Linear computes."""
    if _plain(module) or _on_meta(module):
        return
    view = linear_view(module)
    assert view is not None, "check_linear_forward needs a Linear-like module"
    weight = view.checkpoint_weight.t() if view.transposed else view.checkpoint_weight
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, view.in_features, generator=gen).to(weight.device, weight.dtype)
    want = F.linear(x, weight, view.bias)
    try:
        got = module(x)
    except Exception as err:  # a forward that cannot even run on a plain input
        raise ValueError(_custom(fqn, module, style)) from err
    if isinstance(got, torch.Tensor) and got.dtype != want.dtype:  # Ergo's float32 logits
        raise ValueError(_custom(fqn, module, style, f" (its output is {got.dtype} where the "
                                 f"plain map's is {want.dtype})"))
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or not torch.allclose(
            got, want, rtol=1e-3, atol=1e-5):
        raise ValueError(_custom(fqn, module, style))


def custom_forward(module: nn.Module, fqn: str) -> str | None:
    """Why a Linear-like ``module`` stays whole in the automatic plan (its forward is not
    the plain linear map: :func:`check_linear_forward`), or ``None`` when it may be split."""
    try:
        check_linear_forward(module, fqn, "colwise")
    except ValueError:
        return (f"kept whole: module '{fqn}' ({type(module).__name__}) overrides forward and "
                "does not compute a plain linear map; a split would drop what its forward adds")
    return None


def _custom(fqn: str, module: nn.Module, style: str, detail: str = "") -> str:
    return (f"module '{fqn}' ({type(module).__name__}) overrides forward and does not compute a "
            f"plain linear map{detail}, so style {style!r} would drop its extra behaviour (LoRA, "
            "quantization, a cast...); merge it into a plain nn.Linear first or mark it "
            "'replicate'")


@torch.no_grad()
def embedding_splits_exactly(emb: nn.Embedding, world_size: int) -> bool | None:
    """Whether summed per-rank partial lookups through ``emb``'s forward equal the full one.

    Returns ``None`` when the module is on the meta device (not checkable).
    """
    if _on_meta(emb):
        return None
    rows = 2 * max(world_size, 2)
    gen = torch.Generator(device="cpu").manual_seed(0)
    full = torch.randn(rows, emb.embedding_dim, generator=gen).to(emb.weight)  # (rows, dim)
    ids = torch.arange(rows, device=emb.weight.device)
    probe = shallow_copy_module(emb)  # shares buffers (e.g. a scale), own parameter dict
    probe.padding_idx = None
    want = _lookup(probe, full, ids)
    total = torch.zeros_like(want)
    for rank in range(world_size):
        start, count = shard_range(rows, world_size, rank)
        masked = torch.zeros_like(full)
        masked[start:start + count] = full[start:start + count]  # a rank sees only its vocab rows
        total += _lookup(probe, masked, ids)
    return bool(torch.allclose(total, want, rtol=1e-4, atol=1e-6))


def _lookup(probe: nn.Embedding, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    probe.weight = nn.Parameter(weight, requires_grad=False)
    return probe(ids)
