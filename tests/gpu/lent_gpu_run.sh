#!/usr/bin/env bash
# The issue-32 sequence on a lent GPU machine that has torch but no internet (docs/gpu-validation.md).
# Packages travel as files in an ignored folder (DEPS: cp312 wheels, antlr4.zip with omegaconf's
# pure-Python antlr4 runtime, optionally a zstd binary) and vLLM as a zstd tarball in pieces.
#
#   bash tests/gpu/lent_gpu_run.sh setup DEPS       # install DEPS into /tmp/site, start tests/gpu in the background
#   bash tests/gpu/lent_gpu_run.sh piece FILE...    # keep pieces of the vLLM tarball
#   bash tests/gpu/lent_gpu_run.sh vllm OUT         # unpack vLLM; the vLLM and `oar train` GPU tests
#   bash tests/gpu/lent_gpu_run.sh bench OUT        # one GRPO and one OAR-G run of a 0.5B-shaped model
set -uo pipefail
SITE=/tmp/site
export PYTHONPATH=$PWD:$SITE PYTHONUNBUFFERED=1
stage=$1
shift
case $stage in
setup)
  mkdir -p $SITE /tmp/pieces /tmp/zs
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SITE "$1"/*.whl || exit 1
  (cd $SITE && python3 -m zipfile -e "$OLDPWD/$1/antlr4.zip" .) || exit 1
  cp "$1"/zstd "$1"/*.so* /tmp/zs/ 2>/dev/null
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, megatron.core, transformers, omegaconf, math_verify; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'megatron-core', megatron.core.__version__, 'transformers', transformers.__version__)" || exit 1
  if [ "${OAR_GPU_BG:-1}" = 1 ]; then  # the other GPU tests, in the background while pieces arrive
    setsid nohup bash -c "python3 -m pytest -q -s -p no:cacheprovider tests/gpu -k 'not vllm and not e2e' > /tmp/bg_pytest.log 2>&1; echo \$? > /tmp/bg_pytest.done" >/dev/null 2>&1 &
    sleep 15; tail -3 /tmp/bg_pytest.log
  else
    echo skipped > /tmp/bg_pytest.log; echo skipped > /tmp/bg_pytest.done
  fi ;;
piece)
  cp "$@" /tmp/pieces/ && ls -la /tmp/pieces && tail -3 /tmp/bg_pytest.log ;;
vllm)
  out=$1
  zstd=$(command -v zstd || echo /tmp/zs/zstd)
  cat /tmp/pieces/vz.* | LD_LIBRARY_PATH=/tmp/zs $zstd -dc | tar -xf - -C $SITE || exit 1
  python3 -c "import vllm; print('vllm', vllm.__version__)" || exit 1
  # vLLM 0.24 asks FlashInfer about its sampler unless told not to; FlashInfer is not carried
  python3 -c "import flashinfer" 2>/dev/null || export VLLM_USE_FLASHINFER_SAMPLER=0
  for _ in $(seq 1 150); do [ -f /tmp/bg_pytest.done ] && break; sleep 2; done
  cp /tmp/bg_pytest.log "$out"/
  echo "tests/gpu (background) exit $(cat /tmp/bg_pytest.done 2>/dev/null)"; tail -5 /tmp/bg_pytest.log
  export OAR_GPU_FIGURES=$out/figures.jsonl
  timeout 240 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_vllm.py > "$out"/vllm.log 2>&1
  echo "test_gpu_vllm exit $?"; grep -E "GPU-FIGURE|passed|failed|Error" "$out"/vllm.log | tail -30
  timeout 300 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_gpu_train_e2e.py > "$out"/e2e.log 2>&1
  echo "test_gpu_train_e2e exit $?"; grep -E "GPU-FIGURE|passed|failed|Error" "$out"/e2e.log | tail -30 ;;
bench)
  out=$1
  python3 -c "from megatron_oar.repro.demo_model import make_demo_model as m; m('/tmp/b05', hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048)"
  for credit in grpo oar_g; do
    timeout 200 python3 -m megatron_oar.cli train --config examples/tiny_cpu.yaml model.path=/tmp/b05 \
      run_dir=/tmp/run_$credit credit=$credit model.dtype=bf16 rollout.dtype=bf16 parallel.tp=1 \
      launch.gpus_per_node=1 rollout.enforce_eager=false rollout.gpu_memory_utilization=0.4 \
      rollout.max_model_len=1100 rollout.max_new_tokens=1024 train.steps=3 train.prompts_per_step=16 \
      train.group_size=8 train.mini_batches=1 train.max_tokens_per_micro_batch=8448 \
      attribution.max_tokens_per_micro_batch=8448 train.eval_interval=0 checkpoint.interval=100 \
      checkpoint.export_hf_at_end=false log.tensorboard=false attribution.probe.warmup_steps=0 \
      rewards.format_weight=1.0 rewards.accuracy_weight=0.0 'rewards.format_pattern=.*[0-9].*' \
      > "$out"/bench_$credit.log 2>&1
    echo "$credit exit $?"; cp /tmp/run_$credit/logs/metrics.jsonl "$out"/metrics_$credit.jsonl
    grep -E "Error|error" "$out"/bench_$credit.log | tail -5
  done ;;
esac
