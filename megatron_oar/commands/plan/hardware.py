"""The GPU ``oar plan`` plans for, and the unit it reports memory in."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024 ** 3


@dataclass(frozen=True)
class Hardware:
    """One GPU and the efficiencies the time estimate assumes (H100 SXM defaults)."""

    gpu_mem_gib: float = 80.0
    peak_tflops: float = 989.0   # dense bf16 (NVIDIA H100 SXM datasheet)
    hbm_tb_s: float = 3.35       # HBM3 bandwidth
    mfu: float = 0.35            # model-FLOPs utilisation assumed for Megatron passes
    bandwidth_eff: float = 0.6   # fraction of HBM bandwidth a decode step reaches
    reserve_gib: float = 4.0     # CUDA context, NCCL buffers, fragmentation
    # the separate placement's weight broadcast (training rank 0 -> rollout ranks): one
    # 400 Gb/s NIC at 80%, as an InfiniBand NDR link per GPU would give
    net_gb_s: float = 40.0
    # inside a node: context parallelism's K/V all-gather (and its gradients' reduce-scatter)
    # over NVLink 4, 450 GB/s per direction per H100 SXM, at 80%
    intra_node_gb_s: float = 360.0
