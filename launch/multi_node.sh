#!/usr/bin/env bash
# Several nodes, one process per GPU, NCCL backend, c10d rendezvous.
#
# Run the SAME command on every node, changing only NODE_RANK:
#   node 0:  NNODES=2 NODE_RANK=0 MASTER=node0.example:29500 launch/multi_node.sh
#   node 1:  NNODES=2 NODE_RANK=1 MASTER=node0.example:29500 launch/multi_node.sh
# Variables:
#   NNODES          number of nodes (required)
#   NODE_RANK       this node's index, 0..NNODES-1 (required)
#   MASTER          rendezvous endpoint host:port reachable from every node (required);
#                   usually node 0 and a free port
#   NPROC_PER_NODE  processes per node (default: visible GPUs)
#   RDZV_ID         job id shared by all nodes (default torchtp)
#   BACKEND         nccl (default) or gloo (CPU nodes; set NPROC_PER_NODE then)
# Extra arguments go to the script: launch/multi_node.sh [script.py [args...]]
# The TP group spans all NNODES*NPROC_PER_NODE processes; keep tensor parallelism inside
# a node when you can (NVLink), since every layer pair all-reduces activations.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NNODES:?set NNODES (number of nodes)}"
: "${NODE_RANK:?set NODE_RANK (0..NNODES-1)}"
: "${MASTER:?set MASTER=host:port (rendezvous endpoint, usually node 0)}"
BACKEND="${BACKEND:-nccl}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE="$(nvidia-smi -L | wc -l)"
fi
SCRIPT="${1:-launch/example.py}"
shift || true
TORCHRUN="${TORCHRUN:-.venv/bin/torchrun}"
exec "$TORCHRUN" \
    --nnodes "$NNODES" \
    --node-rank "$NODE_RANK" \
    --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$MASTER" \
    --rdzv-id "${RDZV_ID:-torchtp}" \
    "$SCRIPT" --backend "$BACKEND" "$@"
