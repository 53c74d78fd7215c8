"""Peak resident memory per rank: ``from_pretrained`` versus load-full-then-wrap.

Makes a ~1.1 GB fp32 random-weight Llama-architecture model once (cached in
the temp dir), then for each tp size starts ``tp`` fresh rank processes (Gloo,
file store; NCCL with one GPU per rank when there are enough GPUs) per recipe
and records each rank's peak RSS (``ru_maxrss``), its RSS after imports (the
idle baseline) and, with CUDA, its peak device memory (``max_memory_allocated``). Target per rank:
``1.2 x (replicated + sharded/tp) + baseline``. Also times an offline
reshard (tp=2 -> tp=4) and its peak RSS.

Usage:
    python benchmarks/load_memory.py                 # tp 1, 2, 4 (a few minutes on 2 cores)
    python benchmarks/load_memory.py --tps 1,2 --cache /tmp/x
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

GB = 2**30


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def make_model(path: str) -> None:
    """A random-weight Llama (hidden 2048, 3 layers, vocab 32000): ~1.09 GB in fp32."""
    import torch
    import transformers as tf

    if os.path.isfile(os.path.join(path, "config.json")):
        return
    config = tf.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=3,
                            num_attention_heads=16, num_key_value_heads=8, vocab_size=32000)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(path)


def worker(args: argparse.Namespace) -> None:
    """One rank: load by ``args.recipe`` and print JSON with its memory numbers."""
    import torch
    import torch.distributed as dist
    import transformers as tf

    import torchtp

    rank, tp = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    # One GPU per rank: NCCL, and torchtp's defaults put the shards on cuda:rank.
    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= tp
    if on_gpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"file://{args.store}",
                            rank=rank, world_size=tp)
    # Idle baseline: interpreter, torch, transformers' Llama code and torchtp loaded, no weights.
    import torchtp.checkpoint

    _ = tf.LlamaForCausalLM
    baseline = _rss_now()
    start = time.perf_counter()
    if args.recipe == "from_pretrained":
        w = torchtp.DistributedModelWrapper.from_pretrained(args.model, progress=False)
    else:
        full = tf.AutoModelForCausalLM.from_pretrained(args.model)
        w = torchtp.DistributedModelWrapper(full.to("cuda") if on_gpu else full)
    seconds = time.perf_counter() - start
    local = sharded_full = replicated = 0
    for name, p in w.base_model.named_parameters():
        module = w.base_model.get_submodule(name.rpartition(".")[0])
        layout = torchtp.layouts_of(module).get(name.rpartition(".")[2])
        nbytes = p.numel() * p.element_size()
        local += nbytes
        if layout is None:
            replicated += nbytes
        else:
            sharded_full += nbytes * layout.full_shape[layout.dim] // sum(
                n for _, n in layout.segments)
    dist.barrier()
    device_peak = torch.cuda.max_memory_allocated() if on_gpu else 0
    print(json.dumps({"rank": rank, "baseline": baseline, "peak": _peak(), "seconds": seconds,
                      "local": local, "replicated": replicated, "sharded": sharded_full,
                      "device_peak": device_peak}))
    dist.destroy_process_group()


def launch(model: str, recipe: str, tp: int) -> list[dict]:
    store = tempfile.mktemp(prefix="torchtp-bench-store-")
    procs = []
    for rank in range(tp):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(tp)}
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", "--recipe", recipe, "--model", model,
             "--store", store], env=env, stdout=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=1800)
        if p.returncode:
            raise RuntimeError(f"{recipe} tp={tp}: a rank failed (exit {p.returncode})")
        out.append(json.loads(text.strip().splitlines()[-1]))
    return out


def reshard_run(model: str, cache: str) -> dict:
    code = ("import json,resource,time,sys\nfrom torchtp.checkpoint import reshard\n"
            "t=time.perf_counter(); reshard(sys.argv[1], sys.argv[2], int(sys.argv[3]))\n"
            "print(json.dumps({'seconds': time.perf_counter()-t, "
            "'peak': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss*1024}))")
    results = {}
    for src, dst, tp in ((model, f"{cache}/tp2", 2), (f"{cache}/tp2", f"{cache}/tp4", 4)):
        done = subprocess.run([sys.executable, "-c", code, src, dst, str(tp)], check=True,
                              capture_output=True, text=True)
        results[f"{os.path.basename(src)} -> tp={tp}"] = json.loads(done.stdout.splitlines()[-1])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "torchtp-bench-llama1g"))
    parser.add_argument("--tps", default="1,2,4")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--recipe", default="from_pretrained", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--make", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    model = os.path.join(args.cache, "hf")
    if args.make:
        make_model(model)
        return
    # Build the model in its own process: Linux keeps a process's peak RSS across
    # fork and exec, so ranks started from a parent that held the full model
    # would all report at least its size.
    subprocess.run([sys.executable, __file__, "--make", "--cache", args.cache], check=True)
    print("| recipe | tp | baseline GiB | peak RSS GiB (max rank) | local params GiB | "
          "target GiB | within target | load s | peak device GiB (max rank; CUDA only) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tp in (int(t) for t in args.tps.split(",")):
        for recipe in ("from_pretrained", "full_then_wrap"):
            ranks = launch(model, recipe, tp)
            worst = max(ranks, key=lambda r: r["peak"] - r["baseline"])
            target = 1.2 * (worst["replicated"] + worst["sharded"] / tp) + worst["baseline"]
            print(f"| {recipe} | {tp} | {worst['baseline'] / GB:.2f} | {worst['peak'] / GB:.2f} | "
                  f"{worst['local'] / GB:.2f} | {target / GB:.2f} | "
                  f"{'yes' if worst['peak'] <= target else 'no'} | "
                  f"{max(r['seconds'] for r in ranks):.1f} | "
                  f"{max(r['device_peak'] for r in ranks) / GB:.2f} |", flush=True)
    print("\n| reshard (offline, one process) | seconds | peak RSS GiB |\n|---|---|---|")
    for what, r in reshard_run(model, args.cache).items():
        print(f"| {what} | {r['seconds']:.1f} | {r['peak'] / GB:.2f} |")


if __name__ == "__main__":
    main()
