"""torch.compile(fullgraph=True) traces wrapped models without graph breaks (CPU, Gloo)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchtp

from ._models import mlp
from ._reference import seeded, tol


def _compiled(rank: int, world_size: int) -> str:
    ref = mlp()
    wrapped = torchtp.DistributedModelWrapper(mlp())
    # fullgraph=True raises on any graph break, so passing proves there is none.
    # aot_eager traces forward and backward like inductor does, without C++ builds.
    compiled = torch.compile(wrapped, fullgraph=True, backend="aot_eager")
    x = seeded(4, 16, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), ref(x), **tol(torch.float32))
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    compiled(xs).square().sum().backward()
    ref(xr).square().sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad, **tol(torch.float32))
    # Compiled code does not switch torchtp's RNG streams: active dropout in
    # training mode is refused (dynamo reports the error it traced), eval compiles.
    drop = torchtp.DistributedModelWrapper(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 16)))
    with pytest.raises(Exception, match=r"torch\.compile of a tensor-parallel model \(tp=2\) "
                       r"in training mode with dropout at 2 \(p=0\.1\).*train it eagerly"):
        torch.compile(drop, fullgraph=True, backend="aot_eager")(x)
    drop.eval()
    torch.compile(drop, fullgraph=True, backend="aot_eager")(x)
    # The refusal is the forward door's, decided when traced: it sees a dropout PEFT added
    # after the wrap, with the PEFT model compiled on its own (the wrapper never called).
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(torchtp.DistributedModelWrapper(mlp()).base_model,
                          LoraConfig(r=2, target_modules=["0"], lora_dropout=0.3))
    with pytest.raises(Exception, match=r"torch\.compile of a tensor-parallel model \(tp=2\) "
                       r"in training mode with dropout at .*0\.lora_dropout\.default \(p=0\.3\)"):
        torch.compile(lora.train(), fullgraph=True, backend="aot_eager")(x)
    _ddp_compiled_training(x)
    return "ok"


def _ddp_compiled_training(x: torch.Tensor) -> None:
    """torch.compile around DDP over the TP group around the wrapper: SGD steps stay exact.

    DDP leaves the shards alone and averages the replicated parameters' equal
    gradients; dynamo's DDP optimizer splits the graph at DDP's buckets.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    ref, wrapped = mlp(), torchtp.DistributedModelWrapper(mlp())
    model = torch.compile(DDP(wrapped), backend="aot_eager")
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            m(x + step).square().mean().backward()
            o.step()
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), **tol(torch.float32))
    # Each shard equals the unsharded weight's slice after the steps: none was overwritten.
    full = dict(ref.named_parameters())
    for mname, mod in wrapped.base_model.named_modules():
        for pname, layout in torchtp.layouts_of(mod).items():
            torch.testing.assert_close(getattr(mod, pname).detach(),
                                       layout.take(full[f"{mname}.{pname}"].detach()),
                                       **tol(torch.float32))


def test_fullgraph_compile_matches_eager(ranks):
    assert ranks(_compiled, 2, timeout=300) == ["ok", "ok"]


def test_eager_when_compiled_runs_eagerly_and_never_recompiles():
    """A function torchtp keeps out of compiled graphs (the MoE dispatch, the gradient
    sync's hooks) runs eagerly inside ``torch.compile`` and leaves nothing for dynamo's
    guards to see change: a second call does not recompile (``fail_on_recompile``)."""
    from torchtp.core.torch_compat import eager_when_compiled

    seen: list[bool] = []

    @eager_when_compiled
    def host_side(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.compiler.is_compiling())  # False: not traced
        return x * 2

    compiled = torch.compile(lambda x: host_side(x + 1) - 1, backend="eager")
    x = torch.randn(4)
    torch.testing.assert_close(compiled(x), (x + 1) * 2 - 1)
    with torch.compiler.set_stance("fail_on_recompile"):
        for _ in range(2):
            torch.testing.assert_close(compiled(x), (x + 1) * 2 - 1)
    assert seen == [False, False, False]


def test_compiled_dropout_on_context_shards_is_refused() -> None:
    # ContextParallel's training forward with dropout switches to a stream per rank's
    # tokens in eager mode only (layers/rng.py): traced, it raises instead of giving every
    # rank's tokens the same masks.
    from torchtp.layers import rng

    def forward(x: torch.Tensor) -> torch.Tensor:
        with rng.own_tokens(1, 1, "transformer.drop (p=0.1)"):
            return nn.functional.dropout(x, 0.1)

    with pytest.raises(Exception, match=r"torch\.compile of a context-parallel model in "
                       r"training mode with dropout at transformer\.drop \(p=0\.1\)"):
        torch.compile(forward, fullgraph=True, backend="aot_eager")(torch.ones(4))
