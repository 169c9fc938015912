#!/usr/bin/env bash
# One node: torchrun --standalone with GPUS_PER_NODE (default 8) processes.
#
#   launch_scripts/torchrun_single_node.sh CONFIG.yaml [key=value ...]
#
# Environment: GPUS_PER_NODE (8), RESUME (auto | none | a checkpoint step dir; default auto),
# MAX_RESTARTS (3: torchrun restarts the group after a failure or a hang, and each restart resumes
# from the newest checkpoint), TORCHRUN (torchrun), DRYRUN=1 (print the command, run nothing),
# and everything in env.sh.
# Relative paths (CONFIG, and model/data/run paths inside it) are relative to where you run it.
# Every setting, vLLM's GPU share included, is a key=value override: rollout.gpu_memory_utilization=0.4.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
    echo "usage: $(basename "$0") CONFIG.yaml [key=value ...]" >&2
    echo "  env: GPUS_PER_NODE=8 RESUME=auto MAX_RESTARTS=3 DRYRUN=1 (print only); see launch_scripts/README.md" >&2
    exit 2
fi
config="$1"; shift

# shellcheck source=env.sh
source "$here/env.sh"

cmd=("${TORCHRUN:-torchrun}" --standalone --nproc-per-node "${GPUS_PER_NODE:-8}"
     --max-restarts "${MAX_RESTARTS:-3}" -m megatron_oar.commands.train --config "$config" --resume "${RESUME:-auto}" "$@")

if [[ "${DRYRUN:-0}" == 1 ]]; then
    printf "%q" "${cmd[0]}"; printf " %q" "${cmd[@]:1}"; echo
    exit 0
fi
exec "${cmd[@]}"
