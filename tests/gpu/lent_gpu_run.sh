#!/usr/bin/env bash
# The issue-32 sequence on a lent GPU machine that has torch but no internet (docs/gpu-validation.md).
# Packages travel as files in an ignored folder (DEPS: cp312 wheels, optionally antlr4.zip with a
# pure-Python antlr4 runtime, a zstd binary with its libraries, Transformer Engine's torch-extension
# sdist te_torch.tar.gz), vLLM (vz.*) and TE's core wheel unpacked (te.*) as zstd tarballs in
# pieces. tests/gpu/build_payload.sh makes all of them in gpu_payload/ (its header: what and how big).
#
#   bash tests/gpu/lent_gpu_run.sh setup DEPS [PIECE...]  # install DEPS into /tmp/site; OAR_GPU_BG picks
#                                                       # what runs in the background: logits (the 8k
#                                                       # logits-memory bench), pytest (tests/gpu), none
#   bash tests/gpu/lent_gpu_run.sh piece FILE...        # keep pieces of the tarballs
#   bash tests/gpu/lent_gpu_run.sh te                   # unpack TE's core; build its torch extension
#                                                       # in the background (setsid)
#   bash tests/gpu/lent_gpu_run.sh vllm OUT             # unpack vLLM; one GRPO and one OAR-G run of a
#                                                       # 0.5B-shaped model (step 6); the bench's results
#   bash tests/gpu/lent_gpu_run.sh cublas               # optional: unpack a newer cuBLAS (cb.* pieces,
#                                                       # nvidia/cu13/lib/... in the tar): only for
#                                                       # TE >= 2.13, whose cu13 core needs cuBLASLt
#                                                       # >= 13.2 while torch 2.11+cu130 brings 13.1;
#                                                       # TE 2.12 (what build_payload.sh carries) needs
#                                                       # nothing newer; later stages preload it
#   bash tests/gpu/lent_gpu_run.sh tests OUT [FILE...]  # wait for TE; pytest the GPU test files
#
# A lease, as device calls (tests/gpu/build_payload.sh's files; each call under 64 MiB with the
# repository; `carry` names the gpu_payload/ paths that the call reads):
#   1. setup gpu_payload/deps gpu_payload/te.ac          carry gpu_payload/deps, gpu_payload/te.ac
#   2. piece gpu_payload/te.aa                           carry gpu_payload/te.aa
#   3. piece gpu_payload/te.ab && ... te                 carry gpu_payload/te.ab (TE builds meanwhile)
#   4. piece gpu_payload/vz.aa                           carry gpu_payload/vz.aa
#   5. piece gpu_payload/vz.ab                           carry gpu_payload/vz.ab
#   6. piece gpu_payload/vz.ac && ... vllm $OUT          carry gpu_payload/vz.ac
#   7. tests $OUT tests/gpu/...                          carry nothing
# (each line is `bash tests/gpu/lent_gpu_run.sh STAGE ARGS`; pieces wait in /tmp/pieces on the
# warm machine, so a machine given back in between means starting again from 1)
#   bash tests/gpu/lent_gpu_run.sh collect OUT          # wait for the setup's background job; its log
#                                                       # and outputs as OUT/bg.tgz
#   bash tests/gpu/lent_gpu_run.sh unpack-vllm          # unpack vLLM's pieces (vz.*) only
#   bash tests/gpu/lent_gpu_run.sh bench-te OUT         # wait for TE; the vs-hf bench with the TE spec
#                                                       # (bf16, FP8 delayed and tensorwise) beside SDPA
#   bash tests/gpu/lent_gpu_run.sh bench-recompute OUT  # after setup only: the vs-hf bench's long batch,
#                                                       # SDPA with and without full recompute (OAR-G's
#                                                       # and the update's peak and time; issue 50)
#
# Issue 52's lease (round 4; docs/gpu-validation.md, "Next lease"), after the six payload calls above,
# each stage one call, in this order (a lease cut short loses the last ones):
#   bash tests/gpu/lent_gpu_run.sh round4-confirm OUT   # test_gpu_vllm.py (the level-2 wake fix), then
#                                                       # OAR-G on vs-hf's long batch without and with
#                                                       # full recompute (--ours sdpa,sdpa-recompute)
#   bash tests/gpu/lent_gpu_run.sh round4-trl OUT       # oar bench vs-trl at the 1.5B shape
#   bash tests/gpu/lent_gpu_run.sh round4-widths OUT    # vs-hf at the 7B/32B/14B layer widths: SDPA, TE,
#                                                       # FP8 delayed and tensorwise
#   bash tests/gpu/lent_gpu_run.sh round4-profile OUT   # if time is left: vs-hf --profile, 1.5B, SDPA
#                                                       # and TE (old-logprob vs HF, TE vs local)
set -uo pipefail
SITE=/tmp/site
TE_SITE=/tmp/te_site
export PYTHONPATH=$PWD:$SITE PYTHONUNBUFFERED=1
CUBLAS=/tmp/cublas
# a carried cuBLAS replaces torch's for the whole process (same soname, newer minor release): the
# libraries that the cublas stage unpacked, libcublasLt alone or with libcublas
pre=$(ls $CUBLAS/libcublasLt.so.13 $CUBLAS/libcublas.so.13 2>/dev/null | paste -sd:)
[ -n "$pre" ] && export LD_PRELOAD=$pre
# where nvcc is, the CUDA toolkit: TE's build and its NVRTC kernels read their headers there
nvcc=$(command -v nvcc || ls -d /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1)
[ -z "${CUDA_HOME:-}" ] && [ -n "$nvcc" ] && export CUDA_HOME=${nvcc%/bin/nvcc}
[ -z "${NVTE_CUDA_INCLUDE_DIR:-}" ] && [ -f "${CUDA_HOME:-/none}/include/cuda_runtime.h" ] &&
  export NVTE_CUDA_INCLUDE_DIR=$CUDA_HOME/include
unzst() {  # zstd -dc of stdin: the machine's zstd, else the carried one, else Python's zstandard (DEPS)
  if command -v zstd >/dev/null; then zstd -dc
  elif LD_LIBRARY_PATH=/tmp/zs /tmp/zs/zstd -V >/dev/null 2>&1; then LD_LIBRARY_PATH=/tmp/zs /tmp/zs/zstd -dc
  else python3 -c 'import sys, zstandard
zstandard.ZstdDecompressor(max_window_size=1 << 31).copy_stream(sys.stdin.buffer, sys.stdout.buffer)'
  fi
}
stage=$1
shift
case $stage in
setup)
  deps=$1
  shift
  mkdir -p $SITE /tmp/pieces /tmp/zs
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SITE "$deps"/*.whl || exit 1
  if [ -f "$deps"/antlr4.zip ]; then (cd $SITE && python3 -m zipfile -e "$OLDPWD/$deps/antlr4.zip" .) || exit 1; fi
  cp "$deps"/zstd "$deps"/*.so* /tmp/zs/ 2>/dev/null
  cp "$deps"/te_torch.tar.gz /tmp/ 2>/dev/null
  [ $# -gt 0 ] && cp "$@" /tmp/pieces/
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, megatron.core, transformers, omegaconf, math_verify; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'megatron-core', megatron.core.__version__, 'transformers', transformers.__version__)" || exit 1
  case ${OAR_GPU_BG:-logits} in
  pytest) bg="python3 -m pytest -q -s -p no:cacheprovider tests/gpu -k 'not vllm and not e2e'" ;;
  logits) bg="python3 -m megatron_oar.cli bench logits-memory --responses 2048,4096,8192 --repeats 2 --out /tmp/logits_out" ;;
  # the attention issue's side-by-side on Qwen2.5-1.5B's shape, 80 GB of memory, then what drawing
  # OAR-G's noise on the CPU cost (tests/gpu/noise_cost.py)
  vshf) bg="python3 -m megatron_oar.cli bench vs-hf --preset qwen2.5-1.5b --dtype bf16 --batch short --batch long \
    --ours sdpa,unfused --repeats 2 --memory-cap-gib 79 --profile --out /tmp/vshf_out; python3 tests/gpu/noise_cost.py" ;;
  *) bg="echo skipped" ;;
  esac
  setsid nohup bash -c "{ $bg; } > /tmp/bg.log 2>&1; echo \$? > /tmp/bg.done" >/dev/null 2>&1 &
  sleep 5; tail -3 /tmp/bg.log ;;
piece)
  cp "$@" /tmp/pieces/ && ls -la /tmp/pieces && tail -2 /tmp/bg.log ;;
te)
  # TE goes to its own folder, on the path only once its torch extension is built: megatron
  # imports TE where it finds it, and a TE without the extension raises more than ImportError
  mkdir -p $TE_SITE
  cat /tmp/pieces/te.* | unzst | tar -xf - -C $TE_SITE || exit 1
  rm -f /tmp/pieces/te.*
  mkdir -p /tmp/te_src && tar -xzf /tmp/te_torch.tar.gz -C /tmp/te_src --strip-components=1 || exit 1
  echo "nvcc ${nvcc:-not found}, CUDA_HOME ${CUDA_HOME:-unset}"
  # the torch extension is C++ only (TE 2.12's and 2.14's CppExtension): ninja builds it; the core wheel's
  # libtransformer_engine.so came unpacked above
  setsid nohup bash -c "cd /tmp/te_src && PATH=$SITE/bin:$SITE/ninja/data/bin:\$PATH MAX_JOBS=10 \
    NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=90 NVTE_PYTORCH_FORCE_BUILD=TRUE \
    python3 setup.py build_ext --inplace > /tmp/te_build.log 2>&1 && cp transformer_engine_torch*.so $TE_SITE/ \
    && cd /tmp && PYTHONPATH=\$PYTHONPATH:$TE_SITE python3 -c 'import transformer_engine.pytorch as te, transformer_engine; print(\"te\", transformer_engine.__version__)' >> /tmp/te_build.log 2>&1; \
    echo \$? > /tmp/te_build.done" >/dev/null 2>&1 &
  sleep 20; tail -3 /tmp/te_build.log; tail -2 /tmp/bg.log ;;
cublas)
  mkdir -p $CUBLAS
  cat /tmp/pieces/cb.* | unzst | tar -xf - -C $CUBLAS --strip-components=3 || exit 1
  rm -f /tmp/pieces/cb.*
  ls -la $CUBLAS ;;
vllm)
  out=$1
  # unpacked once per machine: a second call on the same warm machine (its pieces deleted) reuses it
  if ! python3 -c "import vllm" 2>/dev/null; then
    cat /tmp/pieces/vz.* | unzst | tar -xf - -C $SITE || exit 1
    rm -f /tmp/pieces/vz.*
  fi
  python3 -c "import vllm; print('vllm', vllm.__version__)" || exit 1
  for _ in $(seq 1 60); do [ -f /tmp/bg.done ] && break; sleep 2; done  # the setup's background job
  echo "background exit $(cat /tmp/bg.done 2>/dev/null)"; cp /tmp/bg.log "$out"/; tail -20 /tmp/bg.log
  cp -r /tmp/logits_out "$out"/ 2>/dev/null
  # vLLM 0.24 asks FlashInfer about its sampler unless told not to; FlashInfer is not carried
  python3 -c "import flashinfer" 2>/dev/null || export VLLM_USE_FLASHINFER_SAMPLER=0
  python3 -c "from megatron_oar.repro.demo_model import make_demo_model as m; m('/tmp/b05', hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048)"
  for credit in ${OAR_GPU_CREDITS:-grpo oar_g}; do  # OAR_GPU_OVERRIDES: more config overrides
    rm -rf /tmp/run_$credit  # a run_dir left by an earlier call would resume past its last step
    timeout 180 python3 -m megatron_oar.cli train --config examples/tiny_cpu.yaml model.path=/tmp/b05 \
      run_dir=/tmp/run_$credit credit=$credit model.spec=local model.dtype=bf16 rollout.dtype=bf16 parallel.tp=1 \
      launch.gpus_per_node=1 rollout.enforce_eager=false rollout.gpu_memory_utilization=0.5 \
      rollout.max_model_len=1100 rollout.max_new_tokens=1024 train.steps=3 train.prompts_per_step=16 \
      train.group_size=8 train.mini_batches=1 train.max_tokens_per_micro_batch=8448 \
      attribution.max_tokens_per_micro_batch=8448 train.eval_interval=0 checkpoint.interval=100 \
      checkpoint.export_hf_at_end=false log.tensorboard=false attribution.probe.warmup_steps=0 \
      rewards.format_weight=1.0 rewards.accuracy_weight=0.0 'rewards.format_pattern=.*[0-9].*' \
      ${OAR_GPU_OVERRIDES:-} > "$out"/bench_$credit.log 2>&1
    echo "$credit exit $?"; cp /tmp/run_$credit/logs/metrics.jsonl "$out"/metrics_$credit.jsonl
    grep -E "Error|error" "$out"/bench_$credit.log | tail -5
  done
  tail -3 /tmp/te_build.log ;;
collect)
  out=$1
  for _ in $(seq 1 ${OAR_GPU_BG_WAIT:-150}); do [ -f /tmp/bg.done ] && break; sleep 2; done
  echo "background exit $(cat /tmp/bg.done 2>/dev/null || echo 'still running')"; tail -5 /tmp/bg.log
  tar -czf "$out"/bg.tgz -C /tmp bg.log $(cd /tmp && ls -d vshf_out logits_out 2>/dev/null) ;;
bench-te)
  out=$1
  for _ in $(seq 1 150); do [ -f /tmp/te_build.done ] && break; sleep 2; done
  [ "$(cat /tmp/te_build.done 2>/dev/null)" = 0 ] && export PYTHONPATH=$PYTHONPATH:$TE_SITE
  python3 -m megatron_oar.cli bench vs-hf --preset qwen2.5-1.5b --dtype bf16 --batch short --batch long \
    --ours sdpa,te,te-fp8,te-fp8-tensorwise --repeats 2 --memory-cap-gib 79 --out /tmp/vshf_te > /tmp/vshf_te.log 2>&1
  echo "bench exit $?"; tail -3 /tmp/vshf_te.log
  tar -czf "$out"/bench_te.tgz -C /tmp vshf_te.log $(cd /tmp && ls -d vshf_te 2>/dev/null) ;;
bench-recompute)
  out=$1
  python3 -m megatron_oar.cli bench vs-hf --preset qwen2.5-1.5b --dtype bf16 --batch long \
    --ours sdpa,sdpa-recompute --repeats 2 --memory-cap-gib 79 --out /tmp/vshf_rc > /tmp/vshf_rc.log 2>&1
  echo "bench exit $?"; tail -3 /tmp/vshf_rc.log
  tar -czf "$out"/bench_recompute.tgz -C /tmp vshf_rc.log $(cd /tmp && ls -d vshf_rc 2>/dev/null) ;;
round4-confirm)
  out=$1
  python3 -c "import flashinfer" 2>/dev/null || export VLLM_USE_FLASHINFER_SAMPLER=0
  timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_vllm.py > "$out"/vllm_tests.log 2>&1
  echo "test_gpu_vllm exit $?"; grep -E "passed|failed|Error|FAILED" "$out"/vllm_tests.log | tail -8
  # OAR-G and the update with and without full recompute in one run (the table's comparison line)
  timeout 300 python3 -m megatron_oar.cli bench vs-hf --preset qwen2.5-1.5b --dtype bf16 --batch long \
    --ours sdpa,sdpa-recompute --repeats 1 --memory-cap-gib 79 --out /tmp/r4_recompute > /tmp/r4_recompute.log 2>&1
  echo "vs-hf long batch, recompute: exit $?"; grep -E "OAR-G|old-logprob|update|Full recompute" /tmp/r4_recompute.log | tail -6
  tar -czf "$out"/confirm.tgz -C /tmp r4_recompute.log $(cd /tmp && ls -d r4_recompute 2>/dev/null) ;;
round4-trl)
  out=$1
  python3 -c "import trl, datasets; print('trl', trl.__version__, 'datasets', datasets.__version__)" || exit 1
  python3 -c "import flashinfer" 2>/dev/null || export VLLM_USE_FLASHINFER_SAMPLER=0
  # per step 8 prompts x 8 completions of exactly 512 tokens (128-token prompts), 8 rows per
  # micro-batch; 3 steps, the first a warm-up; ours GRPO, OAR-G, screened OAR-P, then TRL
  timeout 570 python3 -m megatron_oar.cli bench vs-trl --preset qwen2.5-1.5b --dtype bf16 --prompts 8 \
    --group-size 8 --prompt-tokens 128 --response-tokens 512 --rows-per-micro-batch 8 --steps 3 --warmup 1 \
    --gpu-memory-utilization 0.5 --timeout-s 200 --out /tmp/r4_trl > /tmp/r4_trl.log 2>&1
  echo "vs-trl exit $?"; tail -15 /tmp/r4_trl.log
  tar --exclude=r4_trl/model --exclude='r4_trl/runs/*/checkpoints' -czf "$out"/trl.tgz -C /tmp r4_trl.log r4_trl ;;
round4-widths)
  out=$1
  for _ in $(seq 1 150); do [ -f /tmp/te_build.done ] && break; sleep 2; done
  [ "$(cat /tmp/te_build.done 2>/dev/null)" = 0 ] && export PYTHONPATH=$PYTHONPATH:$TE_SITE
  for w in 7b 32b 14b; do
    timeout 180 python3 -m megatron_oar.cli bench vs-hf --preset qwen2.5-$w-width --dtype bf16 --batch short \
      --ours sdpa,te,te-fp8,te-fp8-tensorwise --repeats 1 --memory-cap-gib 79 --out /tmp/r4_$w > /tmp/r4_$w.log 2>&1
    echo "$w-width exit $?"; grep -E "^\| (old-logprob|update)" /tmp/r4_$w.log | tail -2
  done
  tar -czf "$out"/widths.tgz -C /tmp $(cd /tmp && ls -d r4_*b r4_*b.log 2>/dev/null) ;;
round4-profile)
  out=$1
  for _ in $(seq 1 150); do [ -f /tmp/te_build.done ] && break; sleep 2; done
  [ "$(cat /tmp/te_build.done 2>/dev/null)" = 0 ] && export PYTHONPATH=$PYTHONPATH:$TE_SITE
  timeout 300 python3 -m megatron_oar.cli bench vs-hf --preset qwen2.5-1.5b --dtype bf16 --batch short \
    --ours sdpa,te --repeats 1 --memory-cap-gib 79 --profile --out /tmp/r4_profile > /tmp/r4_profile.log 2>&1
  echo "profile exit $?"; grep -A12 "^Profile" /tmp/r4_profile.log | head -14
  tar -czf "$out"/profile.tgz -C /tmp r4_profile.log r4_profile ;;
unpack-vllm)
  if ! python3 -c "import vllm" 2>/dev/null; then
    cat /tmp/pieces/vz.* | unzst | tar -xf - -C $SITE || exit 1
    rm -f /tmp/pieces/vz.*
  fi
  python3 -c "import vllm; print('vllm', vllm.__version__)" ;;
tests)
  out=$1
  shift
  for _ in $(seq 1 150); do [ -f /tmp/te_build.done ] && break; sleep 2; done
  echo "TE build exit $(cat /tmp/te_build.done 2>/dev/null)"; cp /tmp/te_build.log "$out"/; tail -5 /tmp/te_build.log
  [ "$(cat /tmp/te_build.done 2>/dev/null)" = 0 ] && export PYTHONPATH=$PYTHONPATH:$TE_SITE
  python3 -c "import flashinfer" 2>/dev/null || export VLLM_USE_FLASHINFER_SAMPLER=0
  export OAR_GPU_FIGURES=$out/figures.jsonl
  timeout ${OAR_GPU_TESTS_TIMEOUT:-400} python3 -m pytest -q -s -p no:cacheprovider "$@" > "$out"/tests.log 2>&1
  echo "pytest exit $?"; grep -E "GPU-FIGURE|passed|failed|Error|FAILED" "$out"/tests.log | tail -40 ;;
esac
