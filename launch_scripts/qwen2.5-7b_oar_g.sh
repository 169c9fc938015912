#!/usr/bin/env bash
# Qwen2.5-7B + OAR-G (examples/qwen2.5-7b_oar_g.yaml) on one node of 8x H100.
#
#   launch_scripts/qwen2.5-7b_oar_g.sh [key=value ...]      e.g. train.steps=10
#
# Runs from the repository root, where the example's relative paths (models/, data/, runs/)
# point. Environment as for torchrun_single_node.sh (DRYRUN=1 prints the command).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here/.."
GPUS_PER_NODE="${GPUS_PER_NODE:-8}" exec "$here/torchrun_single_node.sh" examples/qwen2.5-7b_oar_g.yaml "$@"
