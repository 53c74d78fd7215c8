#!/usr/bin/env bash
# N CPU processes on this machine, Gloo backend.
#
# Usage: launch/cpu_gloo.sh [NPROC] [script.py [args...]]
#   NPROC       number of processes (default 2); the model width must divide by it
#   script.py   default launch/example.py
# Example: launch/cpu_gloo.sh 4 launch/example.py --hidden 512
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC="${1:-2}"
shift || true
SCRIPT="${1:-launch/example.py}"
shift || true
TORCHRUN="${TORCHRUN:-.venv/bin/torchrun}"
# One thread per process: N processes share the cores (torchrun also defaults to 1).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# CUDA_VISIBLE_DEVICES="" keeps init_tensor_parallel() on gloo even on a GPU machine.
CUDA_VISIBLE_DEVICES="" exec "$TORCHRUN" --standalone --nproc-per-node "$NPROC" \
    "$SCRIPT" "$@"
