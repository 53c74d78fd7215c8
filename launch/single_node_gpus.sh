#!/usr/bin/env bash
# One node, N GPUs, NCCL backend: one process per GPU.
#
# Usage: launch/single_node_gpus.sh [NGPUS] [script.py [args...]]
#   NGPUS       default: every visible GPU (nvidia-smi -L); select GPUs with CUDA_VISIBLE_DEVICES
#   script.py   default launch/example.py
# Example: CUDA_VISIBLE_DEVICES=0,1,2,3 launch/single_node_gpus.sh 4
# init_tensor_parallel() picks nccl when CUDA is available and binds each process to
# cuda:LOCAL_RANK. Set NCCL_DEBUG=WARN (or INFO) to see NCCL's own diagnostics.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ $# -ge 1 && "$1" =~ ^[0-9]+$ ]]; then
    NGPUS="$1"
    shift
else
    NGPUS="$(nvidia-smi -L | wc -l)"
fi
SCRIPT="${1:-launch/example.py}"
shift || true
TORCHRUN="${TORCHRUN:-.venv/bin/torchrun}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
exec "$TORCHRUN" --standalone --nproc-per-node "$NGPUS" "$SCRIPT" --backend nccl "$@"
