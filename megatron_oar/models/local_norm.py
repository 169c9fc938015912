"""The local layer spec's RMSNorm: torch's ``RMSNorm``, usable under sequence parallelism.

megatron-core's local spec builds its norms as ``WrappedTorchNorm``, which asserts
``not config.sequence_parallel``. Nothing in torch's norm depends on it, though: under sequence
parallelism a norm sees its rank's share of the sequence and its weight is replicated over TP,
so each rank's weight gradient covers only its tokens. megatron-core sums those gradients over
TP for parameters marked ``param.sequence_parallel = True`` (``finalize_model_grads`` ->
``_allreduce_non_tensor_model_parallel_grads``, megatron-core 0.16; its apex ``FusedLayerNorm``
and Transformer Engine's norms set the same attribute). This norm sets it from the config and is
otherwise torch's, so outputs and checkpoint keys equal ``WrappedTorchNorm``'s. MoE models need
it on CPU: megatron's MoE layer requires sequence parallelism at TP > 1.
"""

from __future__ import annotations

import torch


class TorchRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built from megatron's norm arguments; ``weight.sequence_parallel`` is
    ``config.sequence_parallel`` (the gradient of a sequence-parallel norm is summed over TP)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        if config.normalization != "RMSNorm":
            raise ValueError(f"TorchRMSNorm: config.normalization={config.normalization!r}; "
                             "Qwen models use RMSNorm")
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError("TorchRMSNorm: zero-centred gamma and memory-efficient layer norm "
                             "are Transformer Engine features (model.spec=te)")
        # where megatron's own layers put their parameters (``_initialize_affine_weight_gpu``):
        # the current CUDA device unless ``use_cpu_initialization``; the trainer and
        # ``oar-convert verify`` build on the GPU and never call ``.cuda()``
        on_gpu = torch.cuda.is_available() and not config.use_cpu_initialization
        super().__init__(normalized_shape=hidden_size, eps=eps,
                         device=torch.cuda.current_device() if on_gpu else None)
        self.weight.sequence_parallel = bool(config.sequence_parallel)
