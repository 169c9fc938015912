"""The policy being trained: a megatron-core ``GPTModel`` shard in megatron's DDP wrapper, its
optimizer (megatron's, distributed over DP when ``optim.use_distributed_optimizer``) and the LR
schedule (megatron's ``OptimizerParamScheduler``).

Initial weights come from ``model.path``: an oar checkpoint (``oar-convert hf-to-megatron``, or a
step directory a training run wrote) is loaded as is; an HF directory is converted once, by rank 0
in a child process, into ``{run_dir}/init_checkpoint`` (reused by later runs and resumes), while
the other ranks wait on a gloo group for up to ``checkpoint.convert_timeout_minutes``.
"""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_oar.config import CONVERT_TIMEOUT_MINUTES
from megatron_oar.models import DTYPES, build_gpt_model
from megatron_oar.models.model_checkpoint import META_FILE, load_model
from megatron_oar.runtime.distributed import env_without_launcher, on_rank0

if TYPE_CHECKING:  # megatron-core's optimizer and DDP modules load only when a policy is built
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_oar.config import ModelConfig, OptimConfig

log = logging.getLogger(__name__)

INIT_CHECKPOINT = "init_checkpoint"


@dataclass
class Policy:
    model: DistributedDataParallel        # megatron's DDP around ``gpt``
    gpt: GPTModel                         # this rank's shard
    optimizer: MegatronOptimizer          # a ChainedOptimizer with the distributed optimizer
    scheduler: OptimizerParamScheduler


def init_checkpoint(model_path: str | Path, run_dir: str | Path, dtype: str, *,
                    timeout_minutes: float = CONVERT_TIMEOUT_MINUTES) -> Path:
    """Collective: the oar checkpoint to start from (converting an HF directory on rank 0, while
    the other ranks wait up to ``timeout_minutes``: ``checkpoint.convert_timeout_minutes``)."""
    path = Path(model_path)
    if (path / META_FILE).is_file():
        return path
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.path={model_path}: neither an oar checkpoint ({META_FILE}) "
                                "nor an HF model directory (config.json)")
    out = Path(run_dir) / INIT_CHECKPOINT

    def convert() -> None:
        from checkpoints_convert.cli import hf_to_megatron_command

        if (out / META_FILE).is_file():
            return
        out.parent.mkdir(parents=True, exist_ok=True)
        # The converter runs as its own one-process megatron world, so not in this torchrun rank.
        env = env_without_launcher()
        log.info("converting %s -> %s (once; later runs reuse it)", path, out)
        done = subprocess.run(hf_to_megatron_command(path, out, dtype), env=env, capture_output=True,
                              text=True, timeout=60 * timeout_minutes)
        if done.returncode != 0:
            raise RuntimeError(f"converting model.path={model_path} to {out} failed:\n"
                               f"{done.stderr[-3000:]}")

    on_rank0(convert, timeout_minutes=timeout_minutes, setting="checkpoint.convert_timeout_minutes",
             what=f"converting model.path={model_path} to {out}")
    return out


def _optimizer_config(optim: OptimConfig, dtype: str):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad, bf16=dtype == "bf16", fp16=dtype == "fp16",
        params_dtype=DTYPES[dtype], use_distributed_optimizer=optim.use_distributed_optimizer,
        # fp16 only: dynamic loss scaling as Megatron-LM does it
        initial_loss_scale=2.0 ** 16 if dtype == "fp16" else None)


def build_scheduler(optimizer: MegatronOptimizer, optim: OptimConfig,
                    total_optimizer_steps: int) -> OptimizerParamScheduler:
    """Linear warm-up from 0, then constant / cosine / linear decay to ``min_lr`` at the end."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = max(total_optimizer_steps, optim.warmup_steps + 1)
    style = optim.lr_schedule
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=optim.lr,
        min_lr=optim.lr if style == "constant" else optim.min_lr,
        lr_warmup_steps=optim.warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style="constant" if style == "constant" else style,
        start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=decay_steps,
        wd_incr_style="constant")


def build_policy(hf_config: dict, model_cfg: ModelConfig, optim: OptimConfig, *, checkpoint: str | Path,
                 total_optimizer_steps: int) -> Policy:
    """Collective: the model shard loaded from ``checkpoint``, wrapped for training."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import get_megatron_optimizer

    # perform_initialization stays on: with CPU initialisation megatron marks the TP-sharded
    # parameters (tensor_model_parallel, partition_dim) only while initialising them
    gpt = build_gpt_model(hf_config, model_cfg)
    load_model(gpt, checkpoint)
    # overlap_grad_reduce stays off: the chunked logits' backward accumulates the output weight's
    # gradient into main_grad itself and hands DDP's hook no gradient (models.chunked_logits),
    # which that hook asserts against when the reduction overlaps the backward
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=optim.use_distributed_optimizer, check_for_nan_in_grad=False)
    model = DistributedDataParallel(gpt.config, ddp_config, gpt)
    optimizer = get_megatron_optimizer(_optimizer_config(optim, model_cfg.dtype), [model])
    # The hooks megatron's schedule calls during a training step (attribution passes null them).
    gpt.config.finalize_model_grads_func = finalize_model_grads
    gpt.config.grad_scale_func = optimizer.scale_loss
    gpt.config.no_sync_func = model.no_sync
    scheduler = build_scheduler(optimizer, optim, total_optimizer_steps)
    return Policy(model, gpt, optimizer, scheduler)


def build_reference(hf_config: dict, model_cfg: ModelConfig, checkpoint: str | Path) -> GPTModel:
    """Collective: a frozen copy of the initial policy for the reference KL (``loss.kl_coef``)."""
    ref = build_gpt_model(hf_config, model_cfg)
    load_model(ref, checkpoint)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref
