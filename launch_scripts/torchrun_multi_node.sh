#!/usr/bin/env bash
# One node's share of a multi-node run: torchrun with an elastic (c10d) rendezvous, so a failure
# on any node restarts the worker groups of every node (up to MAX_RESTARTS times), each restart
# resuming from the newest checkpoint. Start it once per node (slurm.sbatch does this with srun).
#
#   launch_scripts/torchrun_multi_node.sh CONFIG.yaml [key=value ...]
#
# Rendezvous, from the environment:
#   MASTER_ADDR    host of the rendezvous store (Slurm: first host of $SLURM_JOB_NODELIST)
#   MASTER_PORT    default 29500
#   NNODES         number of nodes            (Slurm: $SLURM_NNODES)
#   RDZV_ID        the run's rendezvous id    (Slurm: $SLURM_JOB_ID; else megatron-oar)
#   GPUS_PER_NODE  processes per node         (Slurm: $SLURM_GPUS_ON_NODE; else 8)
# A variable that is set wins; one that is not is taken from Slurm's when inside a Slurm job.
# Node ranks are assigned by the rendezvous. Also RESUME (auto), MAX_RESTARTS (3), TORCHRUN
# (torchrun), DRYRUN=1 (print the command only), and env.sh.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
    echo "usage: $(basename "$0") CONFIG.yaml [key=value ...]" >&2
    echo "  env: MASTER_ADDR NNODES [MASTER_PORT=29500 GPUS_PER_NODE=8 RESUME=auto MAX_RESTARTS=3 DRYRUN=1]," >&2
    echo "  or run it inside a Slurm job step (srun), which provides them; see launch_scripts/README.md" >&2
    exit 2
fi
config="$1"; shift

# shellcheck source=env.sh
source "$here/env.sh"

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    NNODES="${NNODES:-${SLURM_NNODES:-}}"
    RDZV_ID="${RDZV_ID:-${SLURM_JOB_ID:-}}"
    GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}"
    if [[ -z "${MASTER_ADDR:-}" && -n "${SLURM_JOB_NODELIST:-}" ]]; then
        mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
        MASTER_ADDR="${hosts[0]:-}"
    fi
fi
MASTER_PORT="${MASTER_PORT:-29500}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"

missing=()
for name in MASTER_ADDR NNODES; do
    [[ -n "${!name:-}" ]] || missing+=("$name")
done
if [[ ${#missing[@]} -gt 0 ]]; then
    echo "$(basename "$0"): ${missing[*]} not set, and no Slurm job to take them from" \
         "(SLURM_JOB_ID, SLURM_NNODES, SLURM_JOB_NODELIST);" \
         "export MASTER_ADDR and NNODES, or run it under srun" >&2
    exit 2
fi

cmd=("${TORCHRUN:-torchrun}" --nnodes "$NNODES" --rdzv-backend c10d
     --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-megatron-oar}"
     --max-restarts "${MAX_RESTARTS:-3}" --nproc-per-node "$GPUS_PER_NODE" -m megatron_oar.commands.train --config "$config" --resume "${RESUME:-auto}" "$@")

if [[ "${DRYRUN:-0}" == 1 ]]; then
    printf "%q" "${cmd[0]}"; printf " %q" "${cmd[@]:1}"; echo
    exit 0
fi
exec "${cmd[@]}"
