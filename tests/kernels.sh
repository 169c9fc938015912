#!/usr/bin/env bash
# `make test-kernels`: the numerical equality tests under other CPU kernels than this machine's
# own (docs/testing.md, "Other CPUs' kernels"), so a tolerance that only holds for one CPU's
# kernels fails here rather than on a user's machine. First prints what each level changes in the
# numbers (tests/kernel_levels.py), then runs the tests once per level and stops at the first
# failing level.
#
#   bash tests/kernels.sh [pytest args...]     e.g. bash tests/kernels.sh tests/test_padding.py
#   KERNEL_LEVELS="ATEN_CPU_CAPABILITY=default" bash tests/kernels.sh      one level
#   KERNEL_TABLE=0 bash tests/kernels.sh ...                                without the table
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
targets=("$@")
# the tests whose tolerances tests/tolerances.py derives (not the e2e command runs), and one vLLM
# rollout (vLLM's compiled kernels at each level: megatron_oar/runtime/inductor_cache.py)
[[ ${#targets[@]} -eq 0 ]] && targets=(-m "not e2e" tests/test_padding.py tests/test_micro_batches.py
    tests/test_packing.py tests/test_chunked_logits.py tests/test_sdpa_attention.py
    tests/test_loss_layouts.py tests/test_routing_replay.py tests/test_resume_layout.py tests/test_attribution.py
    tests/test_tolerances.py tests/test_inductor_cache.py tests/test_rollout.py::test_rollout_tp1_sync_seeds_stop_strings)
# ATen's vectorised kernels (scalar, AVX2, AVX-512: a level above the CPU's runs the CPU's), MKL's
# reproducible path (its GEMMs blocked and vectorised otherwise), and MKL capped at AVX2 (on an
# Intel AVX-512 CPU its own dispatch; on an AMD CPU MKL takes its generic path anyway). Each
# entry is one run: space-separated VAR=value pairs joined by '+'.
levels="${KERNEL_LEVELS:-ATEN_CPU_CAPABILITY=default ATEN_CPU_CAPABILITY=avx2 ATEN_CPU_CAPABILITY=avx512 MKL_CBWR=COMPATIBLE MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=default+MKL_CBWR=COMPATIBLE}"
if [[ "${KERNEL_TABLE:-1}" != 0 ]]; then
    echo "=== what each level changes (tests/kernel_levels.py)"
    .venv/bin/python -m tests.kernel_levels
fi
for level in $levels; do
    echo "=== ${level//+/ }: ${targets[*]}"
    start=$(date +%s)
    env ${level//+/ } .venv/bin/python -m pytest -p no:cacheprovider -q "${targets[@]}"
    echo "=== ${level//+/ } passed in $(( $(date +%s) - start )) s"
done
