"""``torchrun --nproc-per-node N -m megatron_oar.commands.train --config X.yaml [key=value ...]``

Exit status: 0 when ``train.steps`` are done; 2 for a config error (which ``oar train``'s torchrun,
``commands/torchrun.py``, never restarts); ``EXIT_PREEMPTED`` (75) when
SIGTERM / SIGUSR1 stopped it after a checkpoint (run it again to continue); ``EXIT_HANG`` (124)
when a phase ran past ``train.phase_timeout_s``; 1 for any other error.

Also ``oar train`` (which starts torchrun itself when ``--nproc-per-node`` > 1). Overrides are
dotted keys of the config schema (``megatron_oar.config``), e.g. ``train.steps=10 credit=grpo``;
``--resume auto|none|PATH`` sets ``checkpoint.resume``. Config errors are reported before any
work starts, naming the key.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_oar.log_setup import setup_logging


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megatron_oar.commands.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML config (see examples/)")
    p.add_argument("--resume", default=None,
                   help="auto (latest complete checkpoint, if any) | none | a step directory")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=10")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace):
    from megatron_oar.config import load_config

    overrides = list(args.overrides)
    if args.resume is not None:
        overrides.append(f"checkpoint.resume={args.resume}")
    return load_config(args.config, overrides)


def choose_run_budgets(cfg, *, world: int, rank: int = 0):
    """The token budgets of a run of ``cfg`` on ``world`` processes, chosen as ``oar plan``
    chooses them (:func:`megatron_oar.commands.plan.budgets.choose_token_budgets`, for GPUs of
    ``launch.gpu_mem_gib``) at the longest sequence the run can see: ``cfg`` with the unset ones
    filled in (the set ones kept, a warning logged where they do not fit), and the choice. Rank 0
    logs them. A config the plan cannot size (no ``config.json`` at ``model.path``, an invalid
    layout) is returned as it is, for the trainer to report."""
    import logging

    from megatron_oar.commands.plan.budget_search import with_budgets
    from megatron_oar.commands.plan.budgets import choose_token_budgets
    from megatron_oar.commands.plan.hardware import Hardware
    from megatron_oar.config import ConfigError, validate
    from megatron_oar.models import ModelConfigError, read_hf_config

    log = logging.getLogger("megatron_oar.train")
    path = cfg.model.hf_dir() / "config.json"
    if not path.is_file():
        return cfg, None
    try:
        hf = read_hf_config(path)
        validate(cfg, world_size=world, hf_config=hf)
        choice = choose_token_budgets(cfg, hf, world=world, hw=Hardware(gpu_mem_gib=cfg.launch.gpu_mem_gib),
                                      source=str(path))
    except (ConfigError, ModelConfigError):
        return cfg, None
    if rank == 0 and choice.tokens:
        seq = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
        log.info("token budgets for %d-token sequences on %g GiB GPUs (launch.gpu_mem_gib): %s", seq,
                 cfg.launch.gpu_mem_gib, ", ".join(
                     f"{k}={n} ({'chosen' if k in choice.chosen else 'set'}, {choice.phase_gib[k]:.1f} GiB)"
                     for k, n in choice.tokens.items()))
        for w in choice.warnings:
            log.warning("%s", w)
    return with_budgets(cfg, {k: choice.tokens[k] for k in choice.chosen}), choice


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(rank)
    from megatron_oar.config import ConfigError

    try:
        cfg = config_from_args(args)
        setup_logging(rank, cfg.log.level)
        from megatron_oar.runtime import destroy_runtime
        from megatron_oar.training.preemption import EXIT_PREEMPTED
        from megatron_oar.training.trainer import Trainer

        cfg, _ = choose_run_budgets(cfg, world=int(os.environ.get("WORLD_SIZE", "1")), rank=rank)
        if cfg.rollout.separate:  # checked before the world is split, as a colocated run is
            validate_for_world(cfg)
        try:
            if cfg.rollout.separate and _serve_rollouts_here(cfg):
                return 0  # a rollout rank: served the trainer until it stopped
            trainer = Trainer(cfg)
            trainer.run()
        finally:
            destroy_runtime()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return EXIT_PREEMPTED if trainer.preempted else 0


def validate_for_world(cfg, world: int | None = None, quiet: bool = False) -> None:
    """``validate`` for a world of ``world`` processes (default: torchrun's ``WORLD_SIZE``) with
    the model's config.json where there is one (a ConfigError names the key), before the world
    is split into roles. ``oar train --nproc-per-node N`` calls it before it starts torchrun, with
    ``quiet``: the legal-but-odd combinations ``validate`` logs are left to the ranks."""
    import logging

    from megatron_oar.config import ConfigError, validate
    from megatron_oar.models import ModelConfigError, read_hf_config

    world = int(os.environ.get("WORLD_SIZE", "1")) if world is None else world
    path = cfg.model.hf_dir() / "config.json"
    try:  # without config.json here the ranks report it (the trainer reads the model)
        hf = read_hf_config(path) if path.is_file() or not quiet else None
    except ModelConfigError as e:
        raise ConfigError(f"model.path: {e}") from None
    config_log = logging.getLogger("megatron_oar.config")
    disabled, config_log.disabled = config_log.disabled, quiet or config_log.disabled
    try:
        validate(cfg, world_size=world, hf_config=hf)
    finally:
        config_log.disabled = disabled


def _serve_rollouts_here(cfg) -> bool:
    """rollout.placement=separate: splits torchrun's world (``runtime/roles.py``); on a rollout
    rank serves the trainer until it stops and returns True, on a training rank returns False."""
    from megatron_oar.rollout.remote import serve_rollouts
    from megatron_oar.runtime.roles import ROLLOUT, split_world

    roles = split_world(cfg.rollout.ranks, timeout_minutes=cfg.parallel.timeout_minutes,
                        pipeline_stages=cfg.parallel.pp)
    if roles.role != ROLLOUT:
        return False
    serve_rollouts(cfg, roles)
    return True


if __name__ == "__main__":
    from megatron_oar.process_exit import exit_after

    exit_after(main)
