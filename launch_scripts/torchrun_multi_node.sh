#!/usr/bin/env bash
# One node's share of a multi-node run: torchrun with a static rendezvous. Start it once per node
# (slurm.sbatch does this with srun).
#
#   launch_scripts/torchrun_multi_node.sh CONFIG.yaml [key=value ...]
#
# Rendezvous, from the environment:
#   MASTER_ADDR    host of node rank 0        (Slurm: first host of $SLURM_JOB_NODELIST)
#   MASTER_PORT    default 29500
#   NNODES         number of nodes            (Slurm: $SLURM_NNODES)
#   NODE_RANK      this node, 0..NNODES-1     (Slurm: $SLURM_NODEID)
#   GPUS_PER_NODE  processes per node         (Slurm: $SLURM_GPUS_ON_NODE; else 8)
# A variable that is set wins; one that is not is taken from Slurm's when inside a Slurm job.
# Also RESUME (auto), TORCHRUN (torchrun), DRYRUN=1 (print the command only), and env.sh.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
    echo "usage: $(basename "$0") CONFIG.yaml [key=value ...]" >&2
    echo "  env: MASTER_ADDR NNODES NODE_RANK [MASTER_PORT=29500 GPUS_PER_NODE=8 RESUME=auto DRYRUN=1]," >&2
    echo "  or run it inside a Slurm job step (srun), which provides them; see launch_scripts/README.md" >&2
    exit 2
fi
config="$1"; shift

# shellcheck source=env.sh
source "$here/env.sh"

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    NNODES="${NNODES:-${SLURM_NNODES:-}}"
    NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-}}"
    GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}"
    if [[ -z "${MASTER_ADDR:-}" && -n "${SLURM_JOB_NODELIST:-}" ]]; then
        mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
        MASTER_ADDR="${hosts[0]:-}"
    fi
fi
MASTER_PORT="${MASTER_PORT:-29500}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"

missing=()
for name in MASTER_ADDR NNODES NODE_RANK; do
    [[ -n "${!name:-}" ]] || missing+=("$name")
done
if [[ ${#missing[@]} -gt 0 ]]; then
    echo "$(basename "$0"): ${missing[*]} not set, and no Slurm job to take them from" \
         "(SLURM_JOB_ID, SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST);" \
         "export MASTER_ADDR, NNODES and NODE_RANK, or run it under srun" >&2
    exit 2
fi

cmd=("${TORCHRUN:-torchrun}" --nnodes "$NNODES" --node-rank "$NODE_RANK"
     --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --nproc-per-node "$GPUS_PER_NODE"
     -m megatron_oar.train --config "$config" --resume "${RESUME:-auto}" "$@")

if [[ "${DRYRUN:-0}" == 1 ]]; then
    printf "%q" "${cmd[0]}"; printf " %q" "${cmd[@]:1}"; echo
    exit 0
fi
exec "${cmd[@]}"
