"""torchrun/parallel_state initialisation and the CPU backend for megatron-core."""

from megatron_oar.runtime.distributed import (
    ParallelConfig,
    RuntimeInfo,
    destroy_runtime,
    env_without_launcher,
    gloo_group,
    init_runtime,
    validate_layout,
)

__all__ = ["ParallelConfig", "RuntimeInfo", "init_runtime", "destroy_runtime", "env_without_launcher",
           "gloo_group", "validate_layout"]
