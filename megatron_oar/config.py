"""The trainer's configuration: one dataclass schema, YAML + dotted overrides, validation.

.. code-block:: python

    cfg = load_config("examples/qwen2.5-7b_oar_g.yaml", ["train.steps=10", "credit=oar_p"])
    validate(cfg, world_size=8, hf_config=read_hf_config(cfg.model.hf_dir()))
    save_config(cfg, Path(cfg.run_dir) / "config.yaml")

Sections are the components' own dataclasses (``parallel`` is a ``ParallelConfig``, ``rollout`` a
``RolloutConfig``, ``shaping`` a ``ShapingConfig``, ...), so the trainer hands them on as they are.
A setting that two components carry has one key; :data:`DERIVED` lists the copies, which
``Config.sync()`` fills in and which a YAML file or an override may not set.

Errors are :class:`ConfigError` (a ``ValueError``) naming the key and where it came from, e.g.
``examples/x.yaml: unknown key 'train.stepz' (did you mean 'steps'?)``.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException, ValidationError

from megatron_oar.algorithms import PolicyLossConfig, ShapingConfig
from megatron_oar.algorithms.loss import SEQUENCE_ADVANTAGE_LOSSES
from megatron_oar.attribution import AttributionConfig
from megatron_oar.data import ANSWER_FORMATS, PRESETS, TEMPLATES, ArithmeticConfig, FieldMap
from megatron_oar.eval_config import EvalConfig
from megatron_oar.fileio import atomic_write_text
from megatron_oar.log_setup import LEVELS as LOG_LEVELS
from megatron_oar.methods import ATTRIBUTION_METHODS, CREDIT_METHODS, shaping_scheme
from megatron_oar.models import DTYPES, ModelConfigError, ModelOptions, check_layout, parse_arch
from megatron_oar.models.builder import (
    ATTENTIONS,
    MOE_DISPATCHERS,
    ROUTING_REPLAY_MODES,
    check_fp8_recipe_device,
    check_spec_features,
    resolve_attention,
    resolve_spec,
)
from megatron_oar.models.chunked_logits import DEFAULT_CHUNK_TOKENS
from megatron_oar.models.micro_batches import BATCHINGS
from megatron_oar.models.model_checkpoint import HF_DIR, META_FILE
from megatron_oar.rewards import RewardConfig
from megatron_oar.rollout.config import RolloutConfig
from megatron_oar.runtime.distributed import ParallelConfig

log = logging.getLogger(__name__)

# copy -> the one key it is copied from (Config.sync); YAML and overrides may set only the latter
DERIVED = {"model.sequence_parallel": "parallel.sequence_parallel", "shaping.scheme": "credit",
           "attribution.method": "credit", "rollout.n": "train.group_size",
           "rollout.return_routed_experts": "model.routing_replay"}
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
# train.max_tokens_per_micro_batch=null: this many rows of the longest possible length
# (data.max_prompt_tokens + rollout.max_new_tokens), the padded path's default micro-batch
DEFAULT_BUDGET_ROWS = 4
LR_SCHEDULES = ("constant", "cosine", "linear")
EXECUTORS = ("local", "slurm")
OPTIM_SHARDINGS = ("dp_reshardable", "fully_reshardable")  # checkpoint.optim_sharding (megatron's names)
# Rank 0 converts an HF model.path at the start and exports HF at the end while the others wait:
# 72B is ~145 GB to read and write, well past the process group's 30 minutes
CONVERT_TIMEOUT_MINUTES = 180.0
_ABSENT = object()


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the key and its source."""


def credit_scheme(credit: str) -> tuple[str, str | None]:
    """``credit`` -> ``(ShapingConfig.scheme, AttributionConfig.method or None)``."""
    if credit not in CREDIT_METHODS:
        raise ConfigError(f"credit={credit!r}: expected one of {list(CREDIT_METHODS)}")
    return shaping_scheme(credit), (credit if credit in ATTRIBUTION_METHODS else None)


@dataclass
class ModelConfig(ModelOptions):
    """``ModelOptions`` (spec, dtype, fp8, ...) plus where the weights and tokenizer are.
    ``sequence_parallel`` is copied from ``parallel.sequence_parallel``."""

    path: str = ""                # HF model dir, or a Megatron checkpoint dir written by oar-convert
    tokenizer: str | None = None  # HF tokenizer dir; null: the model's (see hf_dir())

    def hf_dir(self) -> Path:
        """Where config.json and the tokenizer are: ``path``, or ``path/hf`` for a checkpoint."""
        p = Path(self.path)
        return p / HF_DIR if (p / META_FILE).is_file() else p

    def tokenizer_dir(self) -> Path:
        return Path(self.tokenizer) if self.tokenizer else self.hf_dir()


@dataclass
class SyntheticConfig(ArithmeticConfig):
    """The built-in arithmetic task (``make_arithmetic(n, seed, cfg)``) instead of dataset files."""

    n: int = 2000  # problems generated
    seed: int = 0
    eval_n: int = 0  # held-out eval problems: drawn with seed + 1, training prompts removed


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # JSONL / JSON / Parquet; or `synthetic`
    eval_files: list[str] = field(default_factory=list)   # evaluated every train.eval_interval steps
    fields: str = "auto"             # preset (data.PRESETS: dapo, math500, gsm8k, ...) or auto
    field_map: FieldMap | None = None  # custom dotted paths {prompt, answer, ...}; replaces `fields`
    eval_fields: str = "auto"        # the same for eval_files
    template: str = "answer_tag"     # prompt template (data.TEMPLATES)
    strict: bool = False             # a malformed row is an error instead of a counted skip
    max_prompt_tokens: int = 1024    # longer rendered prompts are dropped (counted)
    limit: int | None = None         # read at most this many training examples
    synthetic: SyntheticConfig | None = None  # {n, seed, operators, ...}: arithmetic, no files

    @property
    def has_eval_set(self) -> bool:
        """Evaluation problems exist: ``eval_files``, or the synthetic task's held-out draw."""
        return bool(self.eval_files) or (self.synthetic is not None and self.synthetic.eval_n > 0)


@dataclass
class AdvantageConfig:
    """Group-relative sequence advantages (Eq. 2)."""

    std_normalize: bool = True  # divide by the group std (false: Dr.GRPO)
    eps: float = 1e-6


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0             # where cosine / linear decay ends (at train.steps)
    lr_schedule: str = "constant"   # constant | cosine | linear (after warm-up)
    warmup_steps: int = 0           # linear warm-up from 0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.01
    clip_grad: float = 1.0          # global grad-norm clip (0: off)
    use_distributed_optimizer: bool = True  # shard optimizer state over DP (megatron ZeRO-1)


@dataclass
class TrainConfig:
    steps: int = 100                # policy-update steps (one rollout batch each)
    prompts_per_step: int = 64      # prompts per step; each gets group_size completions
    group_size: int = 8             # G completions per prompt (copied into rollout.n)
    batching: str = "token_budget"  # token_budget | packed | padded: how the logprob and update passes group rows
    micro_batch_size: int = 4       # rows per micro-batch per DP rank; batching=padded only (else ignored)
    max_tokens_per_micro_batch: int | None = None  # padded tokens per micro-batch per DP rank;
    #                                 batching=token_budget/packed only (else ignored); null: oar train
    #                                 chooses the largest that fits launch.gpu_mem_gib (oar plan's memory
    #                                 model, docs/scaling.md); a Config used on its own: four full-length
    #                                 rows, 4 x (data.max_prompt_tokens + rollout.max_new_tokens)
    logits_chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # positions whose logits exist at a time in the
    #                                 logprob, reference and update passes and the oracle (computed from
    #                                 the hidden states, recomputed in the backward); 0: whole micro-batches
    mini_batches: int = 1           # optimizer steps per PPO epoch (the step's samples split evenly)
    balance_dp_tokens: bool = True  # give DP ranks equal tokens per mini-batch (else samples d, d+DP, ...)
    peak_tflops: float | None = None  # per GPU, for perf/mfu; null: by the GPU's name (models/flops.py)
    ppo_epochs: int = 1             # passes over the step's samples
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill them
    max_refill_rounds: int = 3      # extra rollout rounds per step for refilling
    overlong_filter: bool = False   # no loss on truncated (length-capped) responses
    max_nonfinite_steps: int = 3    # abort after this many non-finite (loss/grad) steps in a row
    phase_timeout_s: float = 3600.0  # a phase running longer: dump stacks, exit, restart (0: off)
    eval_interval: int = 0          # steps between evaluations on the eval set (0: never)
    eval_n: int = 1                 # completions per eval prompt
    eval_temperature: float = 0.0   # 0: greedy (then eval_n must be 1)
    eval_max_prompts: int | None = None  # use the first N eval prompts (null: all)
    seed: int = 1                   # prompt order; megatron: parallel.seed, vLLM: rollout.seed


@dataclass
class CheckpointConfig:
    dir: str | None = None          # null: {run_dir}/checkpoints
    interval: int = 50              # steps between saves (0: only at the end)
    keep_last: int = 2              # checkpoints kept (0: all)
    resume: str | None = "auto"     # auto: latest in dir, if any | none (or null): fresh | a path
    export_hf_at_end: bool = True   # also write an HF model dir after the last step
    optim_sharding: str = OPTIM_SHARDINGS[0]  # the optimizer's format: dp_reshardable (resume at the
    #                                 same TP/PP, any DP) | fully_reshardable (any TP/PP/DP; each save
    #                                 gathers the state over DP in host memory, each load reads it whole)
    convert_timeout_minutes: float = CONVERT_TIMEOUT_MINUTES  # rank 0 converting model.path (HF) at
    #                                 the start or exporting HF at the end: how long the others wait


@dataclass
class LogConfig:
    dir: str | None = None          # null: {run_dir}/logs
    interval: int = 1               # steps between metric records
    jsonl: bool = True              # {dir}/metrics.jsonl
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "megatron-oar"
    wandb_name: str | None = None   # null: the run_dir's name
    console: bool = True            # one line per step, with its phase split (rank 0)
    phase_lines: bool = False       # and one line per phase as it ends (always at level=debug)
    level: str = "info"             # info | debug (debug: our DEBUG lines and vLLM's INFO ones)
    credit_records: int = 0         # every N steps, each rollout's tokens, importance, weights and
    #                                 advantages to {run_dir}/credit_records/ (`oar analyze credit`); 0: off

    def __post_init__(self):
        if self.level not in LOG_LEVELS:
            raise ValueError(f"log.level={self.level!r}: must be one of {', '.join(LOG_LEVELS)}")


@dataclass
class SlurmConfig:
    """The Slurm side of ``launch`` (``oar launch --executor slurm``)."""

    account: str | None = None
    partition: str | None = None
    time: str = "04:00:00"            # wall-clock limit, HH:MM:SS or D-HH:MM:SS
    job_name: str | None = None       # null: the run_dir's name
    job_dir: str = "slurm_jobs"       # where the sbatch script and job logs are written
    container_image: str | None = None  # pyxis/enroot image; null: the nodes' own environment
    container_mounts: list[str] = field(default_factory=list)  # "src:dst" for the container
    exclusive: bool = True
    max_requeues: int = 3             # requeues after a failed attempt (preemption requeues too)


@dataclass
class LaunchConfig:
    """The cluster a config is written for: ``oar launch`` starts it there, ``oar plan`` checks
    it fits there. The trainer itself takes its world from torchrun."""

    nodes: int = 1
    gpus_per_node: int = 8
    gpu_mem_gib: float = 80.0         # per GPU (H100 SXM: 80)
    executor: str = "local"           # local (torchrun on this node) | slurm
    max_restarts: int = 3             # torchrun restarts of the worker group; each resumes (0: none)
    preemption_grace_s: int = 600     # Slurm signals this long before the time limit; torchrun
    #                                   waits this long for the workers' final checkpoint
    env: dict[str, str] = field(default_factory=dict)  # on top of env.sh's defaults (megatron_oar/resources)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class Config:
    credit: str = "oar_g"           # grpo | random | entropy | oar_g | oar_p | oar_p_screened
    run_dir: str = "runs/default"   # checkpoints, logs and the resolved config.yaml
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # tp, pp, sequence_parallel
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)     # vLLM engine + sampling
    rewards: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    shaping: ShapingConfig = field(default_factory=ShapingConfig)       # OAR tau/beta, entropy alpha
    attribution: AttributionConfig = field(default_factory=AttributionConfig)  # OAR-G/-P, probe
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)  # policy_loss, clips, agg, rollout_correction
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)  # nodes, GPUs, Slurm (oar launch/plan)
    eval: EvalConfig = field(default_factory=EvalConfig)  # oar eval: model, benchmarks, n, k, out

    def __post_init__(self) -> None:
        self.checkpoint.dir = self.checkpoint.dir or str(Path(self.run_dir) / "checkpoints")
        self.log.dir = self.log.dir or str(Path(self.run_dir) / "logs")
        self.checkpoint.resume = self.checkpoint.resume or "none"
        self.sync()

    def sync(self) -> None:
        """Copies the one-place settings into the components that also carry them (DERIVED)."""
        scheme, method = credit_scheme(self.credit)
        self.model.sequence_parallel = self.parallel.sequence_parallel
        self.shaping.scheme = scheme
        if method is not None:
            self.attribution.method = method
        self.rollout.n = self.train.group_size
        self.rollout.return_routed_experts = self.model.routing_replay == "rollout"

    @property
    def uses_attribution(self) -> bool:
        return credit_scheme(self.credit)[1] is not None

    @property
    def micro_batch_tokens(self) -> int:
        """The token budget of a micro-batch (``train.batching=token_budget`` or ``packed``):
        ``train.max_tokens_per_micro_batch``, or :data:`DEFAULT_BUDGET_ROWS` full-length rows."""
        return self.train.max_tokens_per_micro_batch or DEFAULT_BUDGET_ROWS * (
            self.data.max_prompt_tokens + self.rollout.max_new_tokens)

    def attribution_config(self) -> AttributionConfig:
        """``attribution`` with its null batching keys filled from the training ones:
        ``batching`` from ``train.batching`` (``packed``: ``token_budget``, attribution does not
        pack), ``micro_batch_size`` from ``train.micro_batch_size``, both token budgets from
        :attr:`micro_batch_tokens`. What the attribution passes run with."""
        return self.attribution.resolve(batching=self.train.batching,
                                        micro_batch_size=self.train.micro_batch_size,
                                        max_tokens=self.micro_batch_tokens)


# ----------------------------------------------------------------------------------- loading

def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _omegaconf_error(e: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(e, "full_key", None) or ""
    if isinstance(e, ConfigKeyError):
        hint = re.search(r"Did you mean: '([^']+)'", str(e))
        return ConfigError(f"{source}: unknown key '{key}'"
                           + (f" (did you mean '{hint.group(1)}'?)" if hint else ""))
    if isinstance(e, MissingMandatoryValue):
        return ConfigError(f"{source}: '{key}' needs a value")
    if isinstance(e, ValidationError) and key:
        return ConfigError(f"{source}: bad value for '{key}': {_first_line(e)}")
    return ConfigError(f"{source}: {key + ': ' if key else ''}{_first_line(e)}")


def _merge(base: DictConfig, other: DictConfig, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)
    except OmegaConfBaseException as e:
        raise _omegaconf_error(e, source) from None


def _reject_derived(node: DictConfig, source: str) -> None:
    for key, owner in DERIVED.items():
        try:
            present = OmegaConf.select(node, key, default=_ABSENT) is not _ABSENT
        except OmegaConfBaseException:  # e.g. the section is not a mapping; merge will say so
            present = False
        if present:
            raise ConfigError(f"{source}: '{key}' is set from '{owner}'; set that key instead")


def _read_yaml(path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        node = OmegaConf.load(path)
    except (yaml.YAMLError, UnicodeDecodeError, OmegaConfBaseException) as e:
        raise ConfigError(f"{path}: not valid YAML ({_first_line(e)})") from None
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return node


@functools.cache
def _schema() -> DictConfig:
    """The schema's defaults as a node, built once per process: ``OmegaConf.structured`` walks
    every section's dataclass, most of a load's time. Never changed: a merge returns a copy."""
    return OmegaConf.structured(Config)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """The YAML file ``path`` merged onto the schema's defaults, then the ``key=value``
    ``overrides`` in order; returns a :class:`Config` of plain dataclass instances."""
    node = _schema()
    source = str(path) if path is not None else "<defaults>"
    if path is not None:
        raw = _read_yaml(Path(path))
        _reject_derived(raw, source)
        node = _merge(node, raw, source)
    for item in overrides:
        where = f"override {item!r}"
        key, eq, _ = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"{where}: expected key=value (e.g. train.steps=10)")
        try:
            dot = OmegaConf.from_dotlist([item])
        except (yaml.YAMLError, OmegaConfBaseException) as e:
            raise ConfigError(f"{where}: {_first_line(e)}") from None
        _reject_derived(dot, where)
        node = _merge(node, dot, where)
    if overrides:
        source += " + overrides"
    return _to_config(node, source)


def _to_config(node: DictConfig, source: str) -> Config:
    """Section by section, so a component's own ``__post_init__`` error names its section."""
    kwargs: dict[str, Any] = {}
    for f in fields(Config):
        try:
            value = node[f.name]
            kwargs[f.name] = OmegaConf.to_object(value) if isinstance(value, DictConfig) else value
        except OmegaConfBaseException as e:
            raise _omegaconf_error(e, source) from None
        except (ValueError, TypeError) as e:  # the component's own __post_init__
            msg = str(e) if str(e).startswith(f"{f.name}.") else f"{f.name}: {e}"
            raise ConfigError(f"{source}: {msg}") from None
    try:
        return Config(**kwargs)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def save_config(cfg: Config, path: str | Path) -> Path:
    """Writes the resolved config as YAML (temp file + rename); ``load_config(path)`` reloads it."""
    cfg.sync()
    data = OmegaConf.to_container(OmegaConf.structured(cfg))
    for key in DERIVED:  # written once, under the key they come from
        section, name = key.split(".")
        data[section].pop(name, None)
    text = ("# megatron-oar resolved config (save_config); rerun with: oar train --config <this file>\n"
            + OmegaConf.to_yaml(data))
    return atomic_write_text(path, text)


# -------------------------------------------------------------------------------- validation

def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _at_least(cfg: Config, keys: str, minimum: int = 1) -> None:
    for key in keys.split():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        _need(value >= minimum, f"{key}={value}: must be >= {minimum}")


def _one_of(key: str, value: Any, allowed: Sequence) -> None:
    _need(value in allowed, f"{key}={value!r}: expected one of {list(allowed)}")


def _component(check, *args) -> None:
    """Runs a component's own ``validate``; its ValueError already names the key."""
    try:
        check(*args)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_spec(m: ModelConfig) -> None:
    """``model.spec=auto`` resolved on this machine (``te`` where CUDA and Transformer Engine are,
    else ``local``), then what that spec cannot build: sequence parallelism and FP8 need ``te``.
    An explicit ``te`` is taken as written (configs are written for a cluster, and checked on
    login nodes and laptops); the model build refuses it where TE is missing. ``mxfp8`` is
    refused on a pre-Blackwell GPU; with no GPU here it is only a warning, and the build on the
    GPU checks it again."""
    try:
        spec = resolve_spec(m) if m.spec == "auto" else m.spec
        check_spec_features(m, spec)
        resolve_attention(m.attention, spec)
        if not check_fp8_recipe_device(m):
            log.warning("model.fp8_recipe=mxfp8 needs a Blackwell GPU (compute capability >= 10.0; "
                        "not H100/H200): no GPU here to check it, the model build checks it there")
    except ModelConfigError as e:
        raise ConfigError(str(e)) from None


def validate(cfg: Config, world_size: int | None = None, hf_config: dict | None = None) -> None:
    """Raises :class:`ConfigError` naming the key for a setting that cannot work, before any work.

    ``world_size`` adds the layout, batch-divisibility and data-parallel checks; ``hf_config``
    (the model's config.json as a dict) adds TP/PP against heads, KV groups and layers, and
    context length. ``model.spec=auto`` is resolved for the machine this runs on.
    """
    cfg.sync()
    dp = _check_model_and_layout(cfg, world_size)
    _check_batches(cfg, dp)
    _check_data(cfg)
    if hf_config is not None:
        _check_model_shape(cfg, hf_config)
    _check_algorithm(cfg)
    _check_optimizer_and_run(cfg)
    _warn_mismatches(cfg)


def _check_model_and_layout(cfg: Config, world_size: int | None) -> int:
    """model.*, parallel.*, rollout.*; returns the data-parallel size (1 without a world size)."""
    m, p, r = cfg.model, cfg.parallel, cfg.rollout
    _need(bool(m.path), "model.path: not set (an HF model dir or an oar-convert checkpoint dir)")
    _one_of("model.spec", m.spec, ("auto", "local", "te"))
    _one_of("model.attention", m.attention, ATTENTIONS)
    _one_of("model.dtype", m.dtype, tuple(DTYPES))
    _one_of("model.fp8", m.fp8, (None, "hybrid", "e4m3"))
    _one_of("model.fp8_recipe", m.fp8_recipe, FP8_RECIPES)
    _one_of("model.recompute", m.recompute, (None, "selective", "full"))
    _one_of("model.moe_dispatcher", m.moe_dispatcher, MOE_DISPATCHERS)
    _one_of("model.routing_replay", m.routing_replay, ROUTING_REPLAY_MODES)
    _at_least(cfg, "model.vocab_multiple parallel.tp parallel.pp parallel.cp parallel.ep")
    _need(p.etp is None or p.etp >= 1, f"parallel.etp={p.etp}: must be >= 1 (or null: parallel.tp)")
    _need(not p.sequence_parallel or p.tp > 1, "parallel.sequence_parallel needs parallel.tp > 1")
    _check_spec(m)
    dp = 1
    _component(r.validate, world_size)  # the placement first: it says which ranks train
    if world_size is not None:
        train_world = r.training_world_size(world_size)
        which = (f"the world size {world_size}" if train_world == world_size else
                 f"the training ranks {train_world} (world size {world_size} - rollout.ranks={r.ranks})")
        mp, mp_keys = p.tp * p.pp * p.cp, (f"parallel.tp*parallel.pp = {p.tp}*{p.pp}" if p.cp == 1 else
                                           f"parallel.tp*parallel.pp*parallel.cp = {p.tp}*{p.pp}*{p.cp}")
        _need(train_world % mp == 0, f"{mp_keys} does not divide {which}")
        etp = p.tp if p.etp is None else p.etp
        _need(train_world % (etp * p.ep * p.pp) == 0,
              f"parallel.etp*parallel.ep*parallel.pp = {etp}*{p.ep}*{p.pp} does not divide "
              f"{which} (the experts' layout; parallel.etp defaults to parallel.tp)")
        dp = train_world // mp
    # TE's delayed-scaling amax reduction is a collective over TP x DP at every FP8 autocast exit
    # of a grad-enabled pass; DP ranks score different numbers of sequences (only A_i != 0), so
    # their counts of such exits differ and the reductions pair up wrongly or hang.
    _need(not (cfg.uses_attribution and cfg.attribution.allow_fp8 and m.fp8 and dp > 1),
          f"attribution.allow_fp8=true with model.fp8={m.fp8!r} and data-parallel size {dp} "
          f"(world size {world_size} / parallel.tp*parallel.pp = {p.tp}*{p.pp}) can deadlock: DP "
          "ranks score different numbers of sequences, and Transformer Engine's amax reduction "
          "runs over TP x DP at each FP8 autocast exit. Set attribution.allow_fp8=false "
          "(attribution in bf16, the default) or use a layout with DP=1")
    _need(not (r.separate and m.routing_replay == "rollout"),
          "model.routing_replay=rollout with rollout.placement=separate: vLLM's routed experts stay "
          "on the rollout ranks; use model.routing_replay=record (or the colocated placement)")
    _check_rollout_sampling(cfg)
    _check_context_parallel(cfg)
    return dp


# what parallel.cp > 1 does not run yet (docs/scaling.md, "Context parallelism"): key -> why
def _cp_unsupported(cfg: Config) -> list[str]:
    m, out = cfg.model, []
    spec = resolve_spec(m) if m.spec == "auto" else m.spec
    if resolve_attention(m.attention, spec) == "unfused":
        out.append("model.attention=unfused (megatron's unfused attention has no context "
                   "parallelism; use model.attention=sdpa or the TE spec)")
    return out


def _check_context_parallel(cfg: Config) -> None:
    """``parallel.cp > 1`` against what does not run under context parallelism yet: refused,
    naming each key."""
    if cfg.parallel.cp == 1:
        return
    for what in _cp_unsupported(cfg):
        raise ConfigError(f"parallel.cp={cfg.parallel.cp} > 1 is not yet supported with {what}")


def _check_rollout_sampling(cfg: Config) -> None:
    """rollout.temperature / top_p / top_k against the trainer's log-probs, which are of
    ``softmax(logits / rollout.temperature)`` over the whole vocabulary (old-logprob, reference
    and update passes): top-p and top-k sample from a truncated distribution those log-probs do
    not describe (the PPO ratio, the rollout correction and the mismatch check would then compare
    different policies), and vLLM's ``raw_logprobs`` are at temperature 1."""
    r = cfg.rollout
    _need(r.temperature > 0,
          f"rollout.temperature={r.temperature}: training samples from the policy at this "
          "temperature and divides its logits by it; greedy decoding (0) is for evaluation "
          "(train.eval_temperature)")
    truncated = {"top_p": r.top_p != 1.0, "top_k": r.top_k not in (0, -1)}
    for key, off in (("top_p", "1"), ("top_k", "0")):
        _need(not truncated[key],
              f"rollout.{key}={getattr(r, key)}: the trainer's log-probs are of the whole softmax at "
              f"rollout.temperature, not of the {key} truncated distribution vLLM would sample from, "
              "so the PPO ratio and the rollout correction would compare other policies: set "
              f"rollout.{key}={off} (a lower rollout.temperature sharpens sampling instead)")
    _need(r.max_logprob_mismatch is None or r.reports_policy_logprobs,
          f"rollout.logprobs_mode={r.logprobs_mode!r} at rollout.temperature={r.temperature}: vLLM "
          "reports temperature-1 log-probs, the trainer's are at the rollout temperature, and "
          f"rollout.max_logprob_mismatch={r.max_logprob_mismatch} compares them: set "
          "rollout.logprobs_mode=processed_logprobs (or rollout.max_logprob_mismatch=null)")


def _check_batches(cfg: Config, dp: int) -> None:
    """train.*: the step's samples divide into mini-batches and micro-batches over DP."""
    t = cfg.train
    _at_least(cfg, "train.steps train.prompts_per_step train.micro_batch_size train.mini_batches "
                   "train.ppo_epochs train.max_nonfinite_steps")  # micro_batch_size: any batching
    _at_least(cfg, "train.group_size", 2)  # a group of one always has zero advantage
    _one_of("train.batching", t.batching, BATCHINGS)
    # THD sequences: TE's or SDPA's attention (model.attention=te needs the TE spec: _check_spec);
    # megatron's unfused attention refuses them
    _need(t.batching != "packed" or cfg.model.attention != "unfused",
          "train.batching=packed needs model.attention=auto, sdpa or te (THD attention); megatron's "
          "unfused attention (model.attention=unfused) refuses packed sequences")
    _need(t.max_tokens_per_micro_batch is None or t.max_tokens_per_micro_batch >= 1,
          f"train.max_tokens_per_micro_batch={t.max_tokens_per_micro_batch}: must be >= 1 or null")
    _need(t.logits_chunk_tokens >= 0, f"train.logits_chunk_tokens={t.logits_chunk_tokens}: must be >= 0 "
          "(positions per logits chunk; 0: each micro-batch's logits whole)")
    _need(t.peak_tflops is None or t.peak_tflops > 0, f"train.peak_tflops={t.peak_tflops}: must be > 0 or null")
    _at_least(cfg, "train.max_refill_rounds train.eval_interval", 0)
    _at_least(cfg, "train.eval_n")
    _need(t.eval_temperature >= 0, f"train.eval_temperature={t.eval_temperature}: must be >= 0")
    _need(t.eval_temperature > 0 or t.eval_n == 1,
          f"train.eval_n={t.eval_n} with train.eval_temperature=0 (greedy) repeats one completion; "
          "set a temperature or eval_n=1")
    _need(t.eval_max_prompts is None or t.eval_max_prompts >= 1,
          f"train.eval_max_prompts={t.eval_max_prompts}: must be >= 1 or null")
    samples = t.prompts_per_step * t.group_size
    _need(samples % t.mini_batches == 0, f"train.mini_batches={t.mini_batches} does not divide "
                                         f"train.prompts_per_step*train.group_size = {samples}")
    mini = samples // t.mini_batches
    where = (f"train.prompts_per_step*train.group_size = {samples} samples per step"
             + (f" in {t.mini_batches} mini-batches of {mini}" if t.mini_batches > 1 else ""))
    if t.batching == "padded":  # micro-batches of micro_batch_size rows on each DP rank
        _need(mini % (t.micro_batch_size * dp) == 0,
              f"{where} is not divisible by train.micro_batch_size*DP = {t.micro_batch_size}*{dp} "
              "(train.batching=padded)")
    else:  # token budgets take any number of rows; each DP rank gets the same number
        _need(mini % dp == 0, f"{where} is not divisible by the data-parallel size {dp}")


def _check_data(cfg: Config) -> None:
    """data.*: one source of training problems, an eval set where evaluations run, lengths."""
    d, r, t = cfg.data, cfg.rollout, cfg.train
    _need(bool(d.train_files) != (d.synthetic is not None),
          "data.train_files and data.synthetic: set exactly one (dataset files or the arithmetic task)")
    _one_of("data.fields", d.fields, ("auto", *PRESETS))
    _one_of("data.eval_fields", d.eval_fields, ("auto", *PRESETS))
    if d.field_map is not None:
        _one_of("data.field_map.answer_format", d.field_map.answer_format, ANSWER_FORMATS)
    _one_of("data.template", d.template, tuple(TEMPLATES))
    _at_least(cfg, "data.max_prompt_tokens")
    _need(d.limit is None or d.limit >= 1, f"data.limit={d.limit}: must be >= 1 or null")
    if d.synthetic is not None:
        _component(d.synthetic.validate)
        _need(d.synthetic.n >= t.prompts_per_step, f"data.synthetic.n={d.synthetic.n}: fewer problems "
                                                   f"than train.prompts_per_step={t.prompts_per_step}")
        _need(d.synthetic.eval_n >= 0, f"data.synthetic.eval_n={d.synthetic.eval_n}: must be >= 0")
    _need(not t.eval_interval or d.has_eval_set,
          f"train.eval_interval={t.eval_interval} needs an eval set: data.eval_files, or "
          "data.synthetic.eval_n > 0 for the arithmetic task")
    _need(d.max_prompt_tokens + r.max_new_tokens <= r.max_model_len,
          f"data.max_prompt_tokens + rollout.max_new_tokens = {d.max_prompt_tokens}+{r.max_new_tokens} "
          f"exceeds rollout.max_model_len={r.max_model_len}")


def _check_model_shape(cfg: Config, hf_config: dict) -> None:
    """TP/PP against the model's heads, KV groups and layers; the context against its positions."""
    m, p, r = cfg.model, cfg.parallel, cfg.rollout
    try:
        arch = parse_arch(hf_config, source=f"{m.path or 'model'}/config.json")
        check_layout(arch, p.tp, p.pp, m.vocab_multiple, flag="parallel.tp", ep=p.ep, etp=p.etp)
    except ModelConfigError as e:
        raise ConfigError(str(e)) from None
    _check_vllm_tp(arch, r.tp)
    _need(m.routing_replay == "none" or arch.is_moe,
          f"model.routing_replay={m.routing_replay!r} needs a mixture-of-experts model; "
          f"{m.path or 'model'}/config.json is a dense {arch.family} model")
    _need(r.max_model_len <= arch.max_position_embeddings,
          f"rollout.max_model_len={r.max_model_len} exceeds the model's "
          f"max_position_embeddings={arch.max_position_embeddings}")


def _check_vllm_tp(arch, tp: int) -> None:
    """rollout.tp against vLLM's tensor-parallel rules (not Megatron's): the attention heads split
    over TP; the KV heads too, or when TP exceeds them vLLM replicates each over ``tp / KV heads``
    ranks (QKVParallelLinear), so TP must be a multiple of them; each expert of a MoE model is
    split over TP (``moe_intermediate_size``). The vocabulary vLLM pads itself."""
    _need(arch.num_heads % tp == 0,
          f"rollout.tp={tp} does not divide num_attention_heads={arch.num_heads}")
    kv = arch.num_kv_heads
    _need(kv % tp == 0 if tp <= kv else tp % kv == 0,
          f"rollout.tp={tp} does not divide num_key_value_heads={kv} (KV groups)" if tp <= kv else
          f"rollout.tp={tp} is not a multiple of num_key_value_heads={kv} (vLLM replicates each KV "
          "head over rollout.tp / KV heads ranks)")
    _need(not arch.is_moe or arch.moe_intermediate_size % tp == 0,
          f"rollout.tp={tp} does not divide moe_intermediate_size={arch.moe_intermediate_size} "
          "(vLLM splits every expert over its TP ranks)")


def _check_algorithm(cfg: Config) -> None:
    """attribution, loss, advantage and rewards settings that need each other."""
    m = cfg.model
    answer_probe = cfg.uses_attribution and cfg.attribution.probe.kind.startswith("answer")
    _need(not answer_probe or bool(m.tokenizer or m.path),
          f"attribution.probe.kind={cfg.attribution.probe.kind!r} (credit={cfg.credit}) needs a "
          "tokenizer to find answer spans: set model.tokenizer")
    _need(cfg.loss.agg != "seq_mean_token_sum_norm" or cfg.loss.norm_len is not None,
          "loss.norm_len: seq_mean_token_sum_norm needs a constant (e.g. rollout.max_new_tokens)")
    _check_loss_composition(cfg)
    _need(cfg.advantage.eps >= 0, f"advantage.eps={cfg.advantage.eps}: must be >= 0")
    _component(cfg.rewards.validate)


def _check_loss_composition(cfg: Config) -> None:
    """``loss.policy_loss`` with ``credit`` (docs/algorithms.md, "Policy losses and OAR"), and
    ``loss.rollout_correction`` with the log-probs vLLM reports."""
    loss, r = cfg.loss, cfg.rollout
    _need(loss.policy_loss not in SEQUENCE_ADVANTAGE_LOSSES or shaping_scheme(cfg.credit) == "grpo",
          f"loss.policy_loss={loss.policy_loss} with credit={cfg.credit}: GSPO's one ratio per "
          f"sequence multiplies one advantage per sequence, so the token advantages credit="
          f"{cfg.credit} reshapes would be averaged back to the sequence advantage and its "
          "reshaping silently dropped. Use loss.policy_loss=gspo_token (GSPO's sequence ratio, "
          "token advantages) or cispo, or credit=grpo")
    _need(loss.rollout_correction == "none" or r.reports_policy_logprobs,
          f"loss.rollout_correction={loss.rollout_correction} weighs by pi_old / pi_rollout with the "
          f"trainer's log-probs at rollout.temperature={r.temperature} (softmax(logits / T)), but "
          "rollout.logprobs_mode='raw_logprobs' reports vLLM's temperature-1 log-probs: use "
          "rollout.logprobs_mode=processed_logprobs")


def _check_optimizer_and_run(cfg: Config) -> None:
    """optim.*, checkpoint.*, log.*, launch.*."""
    o = cfg.optim
    _need(o.lr > 0, f"optim.lr={o.lr}: must be > 0")
    _need(0 <= o.min_lr <= o.lr, f"optim.min_lr={o.min_lr}: must be in [0, optim.lr={o.lr}]")
    _one_of("optim.lr_schedule", o.lr_schedule, LR_SCHEDULES)
    for key in ("adam_beta1", "adam_beta2"):
        _need(0 <= getattr(o, key) < 1, f"optim.{key}={getattr(o, key)}: must be in [0, 1)")
    for key in ("weight_decay", "clip_grad"):
        _need(getattr(o, key) >= 0, f"optim.{key}={getattr(o, key)}: must be >= 0")
    _need(o.adam_eps > 0, f"optim.adam_eps={o.adam_eps}: must be > 0")
    _at_least(cfg, "optim.warmup_steps checkpoint.interval checkpoint.keep_last", 0)
    _one_of("checkpoint.optim_sharding", cfg.checkpoint.optim_sharding, OPTIM_SHARDINGS)
    _at_least(cfg, "log.interval")
    _at_least(cfg, "log.credit_records", 0)
    _at_least(cfg, "launch.nodes launch.gpus_per_node")
    _at_least(cfg, "launch.max_restarts launch.preemption_grace_s train.phase_timeout_s", 0)
    _at_least(cfg, "parallel.timeout_minutes")
    _need(cfg.checkpoint.convert_timeout_minutes > 0,
          f"checkpoint.convert_timeout_minutes={cfg.checkpoint.convert_timeout_minutes}: must be > 0")
    _need(cfg.launch.slurm.max_requeues >= 0,
          f"launch.slurm.max_requeues={cfg.launch.slurm.max_requeues}: must be >= 0")
    _need(cfg.launch.gpu_mem_gib > 0, f"launch.gpu_mem_gib={cfg.launch.gpu_mem_gib}: must be > 0")
    _one_of("launch.executor", cfg.launch.executor, EXECUTORS)
    _need(bool(re.fullmatch(r"(\d+-)?\d{1,2}:\d{2}:\d{2}", cfg.launch.slurm.time)),
          f"launch.slurm.time={cfg.launch.slurm.time!r}: expected HH:MM:SS or D-HH:MM:SS")


def _ignored_batching_keys(cfg: Config) -> list[str]:
    """Batching keys set (away from their defaults) under a batching that does not read them:
    each key means one thing, rows (``*micro_batch_size``, ``padded`` only) or tokens
    (``max_tokens_*``, ``token_budget``/``packed`` only), so the other one is ignored, as verl
    ignores ``ppo_micro_batch_size_per_gpu`` under ``use_dynamic_bsz``."""
    t, at = cfg.train, cfg.attribution
    out = []
    if t.batching == "padded" and t.max_tokens_per_micro_batch is not None:
        out.append(f"train.max_tokens_per_micro_batch={t.max_tokens_per_micro_batch} (tokens; "
                   "train.batching=padded runs train.micro_batch_size rows)")
    if t.batching != "padded" and t.micro_batch_size != TrainConfig.micro_batch_size:
        out.append(f"train.micro_batch_size={t.micro_batch_size} (rows; train.batching={t.batching} "
                   f"runs train.max_tokens_per_micro_batch tokens, here {cfg.micro_batch_tokens})")
    if cfg.uses_attribution:
        batching = cfg.attribution_config().batching
        via = f"attribution.batching={batching}" + (f", from train.batching={t.batching}"
                                                     if at.batching is None else "")
        if batching == "padded":
            out += [f"attribution.{k}={getattr(at, k)} (tokens; {via})"
                    for k in ("max_tokens_per_micro_batch", "max_tokens_per_copy_micro_batch")
                    if getattr(at, k) is not None]
        else:
            if at.micro_batch_size is not None:
                out.append(f"attribution.micro_batch_size={at.micro_batch_size} (rows; {via})")
            if at.perturb_micro_batch_size != AttributionConfig.perturb_micro_batch_size:
                out.append(f"attribution.perturb_micro_batch_size={at.perturb_micro_batch_size} (rows; {via})")
    return out


def _warn_mismatches(cfg: Config) -> None:
    """Legal but probably unintended combinations (logged, not raised)."""
    for key in _ignored_batching_keys(cfg):
        log.warning("%s is ignored", key)
    boxed = cfg.data.template == "boxed"
    if boxed and cfg.uses_attribution and cfg.attribution.probe.answer_pattern != "boxed":
        log.warning("data.template=boxed but attribution.probe.answer_pattern looks for <answer> tags")
    if boxed and cfg.rewards.format_weight and cfg.rewards.format_style != "boxed":
        log.warning("data.template=boxed but rewards.format_style=%s", cfg.rewards.format_style)
    if cfg.loss.policy_loss == "gspo" and cfg.loss.agg != "seq_mean_token_mean":
        log.warning("loss.policy_loss=gspo with loss.agg=%s: the GSPO paper averages its sequence "
                    "losses over sequences (loss.agg=seq_mean_token_mean); %s weighs them %s",
                    cfg.loss.agg, cfg.loss.agg, "by length" if cfg.loss.agg == "token_mean"
                    else "by length over loss.norm_len")
    if any("</answer>" in s for s in cfg.rollout.stop):
        log.warning("rollout.stop has '</answer>': vLLM drops stop strings from its output, so the "
                    "answer tag would be cut off")
