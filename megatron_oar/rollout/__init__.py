"""Rollouts with vLLM colocated with the Megatron shards: generation, sleep/wake, weight sync.

vLLM is imported lazily (by :class:`RolloutEngine`), so importing this package is cheap.
"""

from megatron_oar.rollout.batch import Completion, RolloutBatch
from megatron_oar.rollout.config import RolloutConfig, RolloutConfigError
from megatron_oar.rollout.engine import RolloutEngine, SyncStats, gather_rollouts
from megatron_oar.rollout.sync_check import (
    LogprobAgreement,
    WeightSyncError,
    check_policy_agreement,
    logprob_agreement,
    token_logprobs,
)
from megatron_oar.rollout.weight_sync import WeightBucket, iter_hf_buckets, mcore_tensor_to_hf

__all__ = [
    "Completion", "LogprobAgreement", "RolloutBatch", "RolloutConfig", "RolloutConfigError",
    "RolloutEngine", "SyncStats", "WeightBucket", "WeightSyncError", "check_policy_agreement",
    "gather_rollouts", "iter_hf_buckets", "logprob_agreement", "mcore_tensor_to_hf", "token_logprobs",
]
