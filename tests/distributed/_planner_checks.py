"""What a real torchtp training step allocates per rank, beside the planner's prediction.

One rank function (:func:`measure`) builds a tiny float32 HuggingFace model
under a layout with torchtp's public pieces (``init_parallel``, pipeline
stages, ``DistributedModelWrapper``, ``ContextParallel``, DDP or FSDP2,
AdamW), runs one training step and counts what the rank holds:

* parameters, gradients, optimizer state: the bytes of every local tensor
  (an FSDP2 parameter's local shard, a tied weight once per holder);
* activations: the most bytes autograd held saved for the backward at once
  during a step after the first (storages counted while alive, parameters
  excluded), the planner's definition (docs/planning.md).

Run by tests/distributed/test_planner.py and benchmarks/planner_memory.py.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

CONFIGS: dict[str, dict[str, Any]] = {
    # 4 layers so 2 and 4 pipeline stages split them; 8 heads, 4 KV heads: tp 8
    # replicates KV heads; a 256-token vocabulary so the logits are not everything.
    "llama": {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 4, "max_position_embeddings": 64},
    "qwen3_moe": {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64,
                  "intermediate_size": 128, "moe_intermediate_size": 32, "head_dim": 8,
                  "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
                  "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 64},
}
SEQ, BATCH = 32, 8  # tokens per sequence (a multiple of 2 * cp), sequences per step


def config(arch: str) -> Any:
    import transformers

    data = dict(CONFIGS[arch])
    return transformers.AutoConfig.for_model(data.pop("model_type"), **data)


class SavedPeak:
    """The most bytes of distinct storages autograd holds saved at once (parameters excluded)."""

    def __init__(self, params: Any) -> None:
        self.params = params  # called at each pack: FSDP2 swaps its parameters in and out
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr and ptr not in self.live and ptr not in self.params():
            self.live[ptr] = (StorageWeakRef(st), st.nbytes())
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return t

    @contextlib.contextmanager
    def watch(self) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield self


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _param_ptrs(module: torch.nn.Module) -> Any:
    def ptrs() -> set[int]:
        out = set()
        for p in module.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            out.add(local.untyped_storage().data_ptr())
            out.add(p.untyped_storage().data_ptr() if not hasattr(p, "to_local") else 0)
        return out
    return ptrs


def build(case: dict[str, Any], cfg: Any) -> tuple[Any, torch.nn.Module, Any]:
    """(what to call for a step, the module whose parameters the rank holds, the step)."""
    import transformers
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import torchtp
    from torchtp.cp import ContextParallel
    from torchtp.pipeline import PipelineSchedule, decoder_stage

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(case["arch"])).train()
    model.set_attn_implementation("sdpa")
    if case["recompute"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    pp, dp, cp, tp = case["pp"], case["dp"], case["cp"], case["tp"]
    split = list(case["split"]) if case.get("split") else None
    held: Any = decoder_stage(model, cfg.pp_rank, pp, split=split) if pp > 1 else model
    inner = held.model if pp > 1 else model
    runner: Any = held
    if tp > 1:
        wrapped = torchtp.DistributedModelWrapper(inner, sequence_parallel=case["sp"],
                                                  expert_parallel=case["ep"] if case["ep"] > 1
                                                  else False)
        runner = held if pp > 1 else wrapped
    if cp > 1 and pp == 1:
        runner = ContextParallel(runner)
    if dp > 1 and case["dp_kind"] == "ddp":
        runner = DistributedDataParallel(runner, process_group=cfg.dp_group,
                                         find_unused_parameters=pp > 1)
    elif dp > 1:
        for block in (inner.model.layers if hasattr(inner, "model") else []):
            if not getattr(block, "held_elsewhere", False):
                fully_shard(block, mesh=cfg.mesh["dp"])
        fully_shard(held, mesh=cfg.mesh["dp"])
    if pp > 1:
        pipe = PipelineSchedule(runner, case["microbatches"], case["schedule"])
        return pipe, held, "pipeline"
    return runner, held, "model"


def _batch(cfg: Any, dp: int) -> torch.Tensor:
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    rows = BATCH // dp
    return ids[cfg.dp_rank * rows:(cfg.dp_rank + 1) * rows]


def measure(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """One AdamW step of ``case`` (see :func:`case`): measured bytes and the planner's."""
    import torchtp

    cfg = torchtp.init_parallel(pp=case["pp"], dp=case["dp"], cp=case["cp"], tp=case["tp"],
                                ep=case["ep"] if case["ep"] > 1 else None)
    runner, held, kind = build(case, cfg)
    opt = torch.optim.AdamW(held.parameters(), lr=1e-3)
    ids = _batch(cfg, case["dp"])

    def step() -> None:
        if kind == "pipeline":
            runner.step(ids, ids)
        else:
            runner(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    step()  # a job's first step also infers the pipeline's shapes (the planner's transient)
    saved = SavedPeak(_param_ptrs(held))
    with saved.watch():
        step()
    params = list(held.parameters())
    got = {"params": sum(_local_bytes(p) for p in params),
           "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
           "optimizer": sum(_local_bytes(v) for st in opt.state.values() for v in st.values()
                            if isinstance(v, torch.Tensor)),
           "activations": saved.peak}
    want = predict(case, cfg.pp_rank, cfg.rank, cfg.dp_rank).as_dict()
    dist.barrier()
    return {"got": got, "want": want, "where": (cfg.pp_rank, cfg.dp_rank, cfg.cp_rank, cfg.rank)}


def predict(case: dict[str, Any], stage: int, tp_rank: int, dp_rank: int) -> Any:
    """The planner's :class:`~torchtp.planner.memory.Memory` of that rank."""
    import transformers

    from torchtp.comm.layout_file import Layout
    from torchtp.planner import Training, arch_from_config, inventory_from_model, rank_memory

    conf = config(case["arch"])
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(conf)
    inv = inventory_from_model(meta, case["tp"], case["ep"], sequence_parallel=case["sp"])
    layout = Layout(pp=case["pp"], dp=case["dp"], cp=case["cp"], tp=case["tp"], ep=case["ep"],
                    microbatches=case["microbatches"], schedule=case["schedule"],
                    stage_layers=tuple(case.get("split") or ()), sequence_parallel=case["sp"])
    training = Training(BATCH, SEQ, precision="fp32", optimizer="adamw",
                        data_parallel=case["dp_kind"] if case["dp"] > 1 else "ddp",
                        recompute="full" if case["recompute"] else "none")
    return rank_memory(arch_from_config(conf), inv, layout, training, stage, tp_rank, dp_rank)


def case(arch: str = "llama", pp: int = 1, dp: int = 1, cp: int = 1, tp: int = 1, ep: int = 1,
         sp: bool = False, dp_kind: str = "ddp", recompute: bool = False,
         microbatches: int = 1, schedule: str = "1f1b",
         split: tuple[int, ...] = ()) -> dict[str, Any]:
    """A layout to measure, as plain data (it crosses into the rank processes); ``split``:
    layers per pipeline stage (empty: balanced)."""
    return {"arch": arch, "pp": pp, "dp": dp, "cp": cp, "tp": tp, "ep": ep, "sp": sp,
            "dp_kind": dp_kind, "recompute": recompute, "microbatches": microbatches,
            "schedule": schedule, "split": split}


def name(c: dict[str, Any]) -> str:
    """``llama pp2 dp2(fsdp) tp2 sp``: a case's short name."""
    dims = [f"{k}{c[k]}" + (f"({c['dp_kind']})" if k == "dp" else "")
            for k in ("pp", "dp", "cp", "tp", "ep") if c[k] > 1]
    flags = [f for f, on in (("sp", c["sp"]), ("recompute", c["recompute"])) if on]
    sched = [f"{c['schedule']} x{c['microbatches']}"] if c["pp"] > 1 else []
    sched += [f"layers {'/'.join(map(str, c['split']))}"] if c.get("split") else []
    return " ".join([c["arch"], *(dims or ["one rank"]), *flags, *sched])


def measure_many(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`measure` of every case in turn, on one group (each lays out its own mesh)."""
    return [measure(rank, world, one) for one in cases]


def launch_from_layout(rank: int, world: int, good: str, bad: str) -> dict[str, Any]:
    """``init_parallel(layout=...)``: a matching file lays out the mesh; a file planned for
    another world, or a size given beside the file that differs, is refused."""
    import time

    import torchtp

    cfg = torchtp.init_parallel(layout=good)
    found: dict[str, Any] = {"sizes": (cfg.pp_size, cfg.dp_size, cfg.cp_size, cfg.world_size)}
    for label, call in (("too few ranks", lambda: torchtp.init_parallel(layout=bad)),
                        ("size beside it", lambda: torchtp.init_parallel(tp=1, layout=good))):
        start = time.perf_counter()
        try:
            call()
        except Exception as exc:  # the kind and message are the result
            found[label] = (type(exc).__name__, str(exc), time.perf_counter() - start)
        else:
            found[label] = ("no error", "", time.perf_counter() - start)
    dist.barrier()
    return found


def measure_each(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`measure_many`, a case that raises recorded as its error (benchmarks only)."""
    import sys
    import time

    out = []
    for one in cases:
        start = time.perf_counter()
        try:
            out.append(measure(rank, world, one))
        except Exception as exc:  # reported in the benchmark's table
            out.append({"error": f"{type(exc).__name__}: {str(exc)[:200]}"})
        if rank == 0:
            sys.stderr.write(f"  {name(one)}: {time.perf_counter() - start:.1f} s\n")
            sys.stderr.flush()
    return out
