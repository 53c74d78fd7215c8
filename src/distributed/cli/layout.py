"""``torchtp plan MODEL --gpus N``: the ranked layouts of a training job, and the file to launch it.

Everything is arithmetic over the model's shapes (a HuggingFace config, or a
published model by name) and torchtp's own plan on the meta device: no
weights are read and no process group is started.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from ..planner import (
    Arch,
    Cluster,
    Training,
    arch_from_config,
    get_gpu,
    inventory_from_model,
    plan_layouts,
    write_layout,
)
from ..planner.explain import table
from ..planner.published import DEEPSEEK_V3, LLAMA3_405B
from ..planner.setup import DATA_PARALLEL, OPTIMIZERS, PRECISIONS, RECOMPUTE
from ._common import CliError, dump_json, positive_int
from ._hf import build_model, load_config, parse_dtype

KNOWN: dict[str, Arch] = {"llama3-405b": LLAMA3_405B, "deepseek-v3": DEEPSEEK_V3}
"""Published models by name, for when no config is at hand."""


def add_options(p: argparse.ArgumentParser) -> None:
    """The layout planner's options of ``torchtp plan``."""
    g = p.add_argument_group("layout planning (with --gpus)")
    g.add_argument("--gpus", type=positive_int, help="GPUs in all: plan dp x tp x pp x ep x cp")
    g.add_argument("--nodes", type=positive_int, help="nodes (default: gpus / gpus-per-node)")
    g.add_argument("--gpus-per-node", type=positive_int, default=8)
    g.add_argument("--hardware", default="h100-80gb",
                   help="GPU profile (h100-80gb, a100-80gb, h800-80gb)")
    g.add_argument("--global-batch", type=positive_int, help="sequences per optimizer step "
                   "(default: 4 per GPU)")
    g.add_argument("--seq", type=positive_int, default=4096, help="tokens per sequence")
    g.add_argument("--precision", choices=PRECISIONS, default="bf16")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    g.add_argument("--data-parallel", choices=DATA_PARALLEL, default="fsdp")
    g.add_argument("--recompute", choices=RECOMPUTE, default="auto")
    g.add_argument("--objective", choices=("time", "tokens"), default="time",
                   help="time: the fastest step that fits; tokens: the most tokens a rank holds")
    g.add_argument("--top", type=positive_int, default=10, help="rows of the table")
    g.add_argument("--runnable", action="store_true",
                   help="only layouts torchtp runs today")
    g.add_argument("--out", help="write the winner as a layout file for init_parallel(layout=...)")
    g.add_argument("--inventory", choices=("plan", "shapes"), default="plan",
                   help="parameter bytes from torchtp's own plan on the meta device (plan: "
                   "exact; its head probe runs one layer on the CPU, GBs for 100B+ models) or "
                   "from the model's shapes split evenly (shapes: fast)")


def _model(path: str, exact: bool) -> tuple[Arch, Any]:
    """The model's shape and an inventory factory (torchtp's own plan for a config, when
    ``exact``; ``None``: the even split of the shapes)."""
    if path in KNOWN:
        return KNOWN[path], None
    config = load_config(path)
    arch = arch_from_config(config, source=str(path))
    if not exact:
        return arch, None
    meta = build_model(config, parse_dtype(None, config), device="meta")

    def inventory(tp: int, ep: int) -> Any:
        return inventory_from_model(meta, tp, ep)
    return arch, inventory


def run(args: argparse.Namespace) -> int:
    """Print the ranked layouts; write ``--out``. Exit status 1 when nothing fits."""
    try:
        gpu = get_gpu(args.hardware)
        nodes = args.nodes or -(-args.gpus // args.gpus_per_node)
        if nodes * args.gpus_per_node != args.gpus:
            raise ValueError(f"--gpus {args.gpus} is not --nodes {nodes} x --gpus-per-node "
                             f"{args.gpus_per_node}")
        cluster = Cluster(gpu, nodes=nodes, gpus_per_node=args.gpus_per_node)
        training = Training(args.global_batch or 4 * args.gpus, args.seq,
                            precision=args.precision, optimizer=args.optimizer,
                            data_parallel=args.data_parallel,
                            recompute="none" if args.recompute == "auto" else args.recompute)
        arch, inventory = _model(args.path, args.inventory == "plan")
        ranked = plan_layouts(arch, cluster, training, inventory, objective=args.objective,
                              recompute=args.recompute, only_runnable=args.runnable)
    except ValueError as err:
        raise CliError(str(err)) from None
    best = ranked[0]
    if args.out:
        write_layout(replace(best.layout, extra={
            "model": arch.name, "hardware": gpu.name, "recompute": best.recompute,
            "predicted": {"memory": best.memory.as_dict(), "time": best.time.as_dict()}}),
            args.out)
    if args.json:
        print(dump_json({"model": arch.as_dict(), "gpus": args.gpus, "hardware": gpu.name,
                         "training": training.as_dict(),
                         "layouts": [c.as_dict() for c in ranked[:args.top]]}))
    else:
        print(f"model: {arch.name}, {args.gpus} x {gpu.name} ({nodes} nodes of "
              f"{args.gpus_per_node}); {training.global_batch} x {training.seq} tokens a step, "
              f"{training.precision}, {training.optimizer}, {training.data_parallel}")
        print(table(ranked, gpu.memory, args.top))
        if args.out:
            print(f"wrote {args.out}: launch {best.layout.world} ranks with "
                  f"init_parallel(layout={args.out!r})")
    return 0 if best.fits else 1
