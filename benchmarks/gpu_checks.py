"""torchtp on CUDA tensors at tp 2, against the unsharded model on the same device.

The test suite runs Gloo CPU processes only; this script is the GPU checklist's
exactness part (docs/benchmarks.md). Two rank processes build the benchmarks'
small Llama from one seed, wrap it, and compare with the unsharded model built
on the same device:

* ``eager``: training-mode loss, logits and every gradient, then three clipped SGD
  steps with momentum;
* ``sequence_parallel`` and ``sequence_parallel+overlap``: the same, with
  sequence parallelism (and the chunked overlap);
* ``bfloat16``: eval logits of a bf16 wrap vs the bf16 unsharded model;
* ``compile``: ``torch.compile`` of the wrapped model, loss and gradients vs eager;
* ``generate``: 8 greedy tokens vs the unsharded model's;
* ``input_check``: ranks given different token ids must each raise ``RankMismatchError``.

On a machine with one GPU both ranks share it and use ``"cpu:gloo,cuda:gloo"``
(NCCL refuses two ranks on one GPU); with one GPU per rank, pass ``--backend nccl``.
Each case reports its largest differences or its error; one failing case does not
stop the others. Prints a table and, with ``--json``, writes the results.

    python benchmarks/gpu_checks.py --device cuda --json gpu_checks.json
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torchtp
from _llama import HF_PLAN, SMALL, build_llama
from torchtp.cli._launch import launch

# fp32 products of the shards differ from the unsharded ones only by summation order
# (cuBLAS picks kernels by shape): relative 1e-4 / absolute 1e-5 leaves margin for that
# and still catches a wrong slice or a missed reduction, which are O(1).
FP32 = {"rtol": 1e-4, "atol": 1e-5}


def _batch(device: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, SMALL["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids.to(device), "labels": ids.to(device)}


def _max_diffs(wrapped: nn.Module, ref: nn.Module, grads: bool) -> float:
    """Largest |this rank's tensor - its part of the unsharded one| over every parameter."""
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in wrapped.base_model.named_parameters():
        module = wrapped.base_model.get_submodule(name.rpartition(".")[0])
        full = ref_params[name].grad if grads else ref_params[name].detach()
        mine = p.grad if grads else p.detach()
        if mine is None or full is None:
            raise AssertionError(f"{name}: no gradient")
        layout = torchtp.layouts_of(module).get(name.rpartition(".")[2])
        want = full if layout is None else layout.take(full)
        torch.testing.assert_close(mine, want, **FP32, msg=lambda m, n=name: f"{n}: {m}")
        worst = max(worst, (mine.float() - want.float()).abs().max().item())
    return worst


def _train_case(device: str, **options: Any) -> dict[str, float]:
    data = _batch(device)
    ref = build_llama().to(device).train()
    model = torchtp.DistributedModelWrapper(build_llama().to(device).train(), plan=HF_PLAN, **options)
    out, want = model(**data), ref(**data)
    out.loss.backward()
    want.loss.backward()
    torch.testing.assert_close(out.logits, want.logits, **FP32)
    found = {"logits": (out.logits - want.logits).abs().max().item(),
             "grads": _max_diffs(model, ref, grads=True)}
    # SGD keeps the parameters' difference at the gradients' scale times lr; Adam's
    # g / sqrt(v) would magnify rounding of near-zero gradients into 1e-5 steps.
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    for step in range(3):
        for m, opt in zip((model, ref), opts, strict=True):
            if step:
                opt.zero_grad(set_to_none=True)
                m(**data).loss.backward()
            clip = torchtp.clip_grad_norm_ if m is model else torch.nn.utils.clip_grad_norm_
            clip(m.parameters(), 1.0)
            opt.step()
    found["params after 3 SGD steps"] = _max_diffs(model, ref, grads=False)
    return found


def _bf16_case(device: str) -> dict[str, float]:
    ids = _batch(device)["input_ids"]
    ref = build_llama().to(device=device, dtype=torch.bfloat16)
    model = torchtp.DistributedModelWrapper(build_llama().to(device=device, dtype=torch.bfloat16),
                                            plan=HF_PLAN)
    with torch.inference_mode():
        got, want = model(ids).logits.float(), ref(ids).logits.float()
    # bf16 keeps 8 bits of mantissa: a split reduction rounds differently, so this
    # reports the difference and the logits' scale instead of asserting equality.
    return {"logits max abs diff": (got - want).abs().max().item(),
            "logits max abs": want.abs().max().item(),
            "argmax agreement": (got.argmax(-1) == want.argmax(-1)).float().mean().item()}


def _compile_case(device: str) -> dict[str, float]:
    data = _batch(device)
    eager = torchtp.DistributedModelWrapper(build_llama().to(device).train(), plan=HF_PLAN)
    model = torchtp.DistributedModelWrapper(build_llama().to(device).train(), plan=HF_PLAN)
    compiled = torch.compile(model)
    out, want = compiled(**data), eager(**data)
    out.loss.backward()
    want.loss.backward()
    torch.testing.assert_close(out.logits, want.logits, **FP32)
    worst = 0.0
    for (n, p), (_, q) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, f"{n}: no gradient"
        torch.testing.assert_close(p.grad, q.grad, **FP32, msg=lambda m, n=n: f"{n}: {m}")
        worst = max(worst, (p.grad - q.grad).abs().max().item())
    return {"logits": (out.logits - want.logits).abs().max().item(), "grads": worst}


def _generate_case(device: str) -> dict[str, float]:
    ids = _batch(device)["input_ids"][:1, :8]
    ref = build_llama().to(device)
    model = torchtp.DistributedModelWrapper(build_llama().to(device), plan=HF_PLAN)
    kw = {"max_new_tokens": 8, "do_sample": False}
    got, want = model.generate(ids, **kw), ref.generate(ids, **kw)
    assert torch.equal(got, want), f"tokens differ: {got.tolist()} vs {want.tolist()}"
    return {"tokens equal": 1.0}


def _input_check_case(device: str, rank: int) -> dict[str, float]:
    model = torchtp.DistributedModelWrapper(build_llama().to(device).train(), plan=HF_PLAN)
    ids = _batch(device)["input_ids"] + rank  # a different batch on each rank
    try:
        model(ids)
    except torchtp.RankMismatchError:
        return {"raised RankMismatchError": 1.0}
    raise AssertionError("different token ids per rank ran without an error")


def _rank(rank: int, world: int, device: str) -> dict[str, str]:
    warnings.filterwarnings("ignore")
    if device == "cuda":
        torch.cuda.set_device(0 if torch.cuda.device_count() < world else rank)
        device = f"cuda:{torch.cuda.current_device()}"
    cases: dict[str, Callable[[], dict[str, float]]] = {
        "eager": lambda: _train_case(device),
        "sequence_parallel": lambda: _train_case(device, sequence_parallel=True),
        "sequence_parallel+overlap": lambda: _train_case(device, sequence_parallel=True,
                                                         overlap=True),
        "bfloat16": lambda: _bf16_case(device),
        "compile": lambda: _compile_case(device),
        "generate": lambda: _generate_case(device),
        "input_check": lambda: _input_check_case(device, rank),
    }
    results = {}
    for name, case in cases.items():
        try:
            found = case()
            results[name] = "ok: " + ", ".join(f"{k} {v:.2e}" for k, v in found.items())
        except Exception as err:  # report each case's failure, run the rest
            where = traceback.extract_tb(err.__traceback__)[-1]
            why = " ".join(str(err).split())[:400]
            results[name] = (f"FAILED: {type(err).__name__}: {why} "
                             f"(at {Path(where.filename).name}:{where.lineno})")
        torch.distributed.barrier()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--backend", default=None, help="default: gloo on CPU, cpu:gloo,cuda:gloo on CUDA")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    backend = args.backend or ("gloo" if args.device == "cpu" else "cpu:gloo,cuda:gloo")
    per_rank = launch(_rank, 2, args.device, backend=backend, timeout=900)
    print(f"torch {torch.__version__}, device "
          f"{torch.cuda.get_device_name(0) if args.device == 'cuda' else 'cpu'}, backend {backend}")
    print("| case | rank 0 | rank 1 |\n|---|---|---|")
    for name in per_rank[0]:
        print(f"| {name} | {per_rank[0][name]} | {per_rank[1][name]} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "backend": backend,
                                               "results": per_rank}, indent=2))


if __name__ == "__main__":
    main()
