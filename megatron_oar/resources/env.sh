# The environment every megatron-oar launch needs: THE one place for it.
#
# This file is megatron_oar/resources/env.sh, shipped inside the package, so that `oar launch`
# (megatron_oar/commands/launch.py) reads these defaults after any install and adds the config's
# `launch.env` on top; launch_scripts/env.sh is a symlink to it, which the launch scripts source.
# Each line keeps a value that is already exported, so
# `NCCL_DEBUG=INFO launch_scripts/qwen2.5-7b_oar_g.sh` works.
# Keep every setting in the form  export NAME="${NAME:-default}"  (one per line, a comment
# above it): megatron_oar.commands.launch.parse_env_sh reads exactly that form.

# Megatron-core: one hardware work queue per device, so the async TP / sequence-parallel
# all-gather is scheduled before the GEMM that overlaps it (megatron/core/tensor_parallel/layers.py
# relies on this ordering; without it the overlap silently serialises or reorders).
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"

# NCCL: warnings and errors only (INFO prints every ring/tree on every rank of every node).
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

# NCCL over InfiniBand (H100 nodes): the per-retry IB verbs timeout is 4.096 us * 2^N; 22 (~17 s)
# rides out transient fabric congestion at 32+ ranks instead of failing the job.
export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"

# A failed or timed-out collective takes its process down (3 = SkipCleanUp, torch's default),
# so torchrun / srun end the whole job instead of ranks hanging. Written out because the TORCH_
# name wins over a cluster profile's legacy NCCL_ASYNC_ERROR_HANDLING=0.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}"

# Async collectives keep their tensors alive by reference instead of recordStream, which holds
# freed blocks until the NCCL stream catches up (less caching-allocator fragmentation; megatron's
# gradient/parameter buffers are written with this in mind).
export TORCH_NCCL_AVOID_RECORD_STREAMS="${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}"

# HF tokenizers: no Rust thread pool per rank (and no fork-after-parallelism warning when the
# reward workers are forked).
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"

# CPU threads per rank (torchrun would set 1 and warn): 8 ranks x 8 threads fit a two-socket
# H100 node; the CPU side is tokenisation, data loading and the optimizer's host work.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"

# torchrun (torch >= 2.9) forwards SIGUSR1 to the workers as well as SIGTERM/SIGINT/SIGHUP/SIGQUIT:
# Slurm sends SIGUSR1 ahead of the time limit (slurm.sbatch's --signal), and the workers then
# stop at the next phase boundary, checkpoint and exit (megatron_oar/training/preemption.py). Without SIGUSR1 in
# the list torchrun dies of it and the workers' final checkpoint is lost.
export PET_SIGNALS_TO_HANDLE="${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}"

# How long torchrun waits for the workers after forwarding such a signal before SIGKILL (its
# default is 30 s, too short to finish a step and write a 72B checkpoint); torch releases that
# read it use it, older ones keep 30 s. The same 600 s as slurm.sbatch's --signal=B:USR1@600 and
# the config's launch.preemption_grace_s.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}"

# A restarted worker group (torchrun --max-restarts) must not read the previous attempt's
# addresses: with the rendezvous TCPStore shared with the workers (torch's default since 2.5),
# stale keys make the restarted ranks' init_process_group connect to dead ports (pytorch#135712,
# #167288; seen here as gloo "connectFullMesh ... Connection refused"). 1: each attempt's rank 0
# hosts a fresh store.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

# Deliberately NOT set here:
# * vLLM's share of each GPU: that is the config key rollout.gpu_memory_utilization alone (in the
#   YAML, or as an argument: launch_scripts/qwen2.5-7b_oar_g.sh rollout.gpu_memory_utilization=0.4).
# * PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -- vLLM's sleep mode allocates the engine's
#   weights and KV cache from a CuMem memory pool that expandable segments are incompatible with
#   (pytorch#147851): older vLLM asserts and refuses to start, vLLM 0.32 turns them off around its
#   pool (vllm/device_allocator/cumem.py). Leave it unset.
# * VLLM_USE_V1 -- vLLM 0.32 has only the V1 engine and no such variable (vllm/envs.py); the engine
#   (rollout/engine.py) sets VLLM_ENABLE_V1_MULTIPROCESSING=0 itself, as external_launcher requires.
