"""Small torchtp example run by the launch/*.sh scripts (any backend, any world size).

Every rank builds the same MLP from the same seed, wraps it with
:class:`torchtp.DistributedModelWrapper`, runs one forward and backward pass and
prints one line. Works unchanged on CPU (Gloo) and GPU (NCCL): the device comes
from :func:`torchtp.init_tensor_parallel`.
"""

from __future__ import annotations

import argparse
import socket
import sys

import torch
from torch import nn

import torchtp


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256, help="model width (divisible by tp)")
    parser.add_argument("--backend", default=None, help="nccl or gloo; default picks one")
    args = parser.parse_args()

    cfg = torchtp.init_tensor_parallel(backend=args.backend)
    torch.manual_seed(0)  # same seed on every rank: same full weights before sharding
    h = args.hidden
    model = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)).to(cfg.device)
    model = torchtp.DistributedModelWrapper(model)

    torch.manual_seed(1)  # same input on every rank
    x = torch.randn(8, 16, h, device=cfg.device)  # (B, L, h)
    with torchtp.count_collectives() as counter:
        y = model(x)  # (B, L, h), replicated
        loss = y.pow(2).mean()
        loss.backward()
    grad_norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm().item()
    print(f"[rank {cfg.rank}/{cfg.world_size} on {socket.gethostname()} {cfg.device} "
          f"{cfg.backend}] swapped={model.parallelized_layers} loss={loss.item():.6f} "
          f"local_grad_norm={grad_norm:.4f} collectives(fwd+bwd)={dict(counter.counts)}",
          flush=True)
    torchtp.shutdown_tensor_parallel()  # barrier + destroy (also runs at exit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
