"""Rewards: answer extraction, math verification in a time-limited worker pool, format reward.

    from megatron_oar.rewards import RewardConfig, RewardScorer, score_batch

    batch = score_batch(responses, references, RewardConfig(timeout_s=5))   # one-off
    with RewardScorer(RewardConfig()) as scorer:                           # training: pool stays up
        batch = scorer(responses, references)
    batch.rewards, batch.accuracy, batch.format, batch.status, batch.metrics()

Importing this package is light: sympy / math-verify load only in the worker processes.
"""

from megatron_oar.rewards.extract import (
                                          EXTRACTORS,
                                          AnswerParseError,
                                          Extraction,
                                          extract_answer,
                                          extract_answer_line,
                                          extract_answer_tag,
                                          extract_boxed,
                                          extract_gsm8k,
                                          normalize_answer,
                                          normalize_reference,
                                          sanitize,
)
from megatron_oar.rewards.format_reward import FORMAT_STYLES, format_score
from megatron_oar.rewards.pool import STATUSES, VerifierPool, VerifyResult
from megatron_oar.rewards.score import RewardBatch, RewardConfig, RewardScorer, score_batch

__all__ = [
    "EXTRACTORS", "FORMAT_STYLES", "STATUSES", "AnswerParseError", "Extraction", "RewardBatch",
    "RewardConfig", "RewardScorer", "VerifierPool", "VerifyResult", "extract_answer",
    "extract_answer_line", "extract_answer_tag", "extract_boxed", "extract_gsm8k", "format_score",
    "normalize_answer", "normalize_reference", "sanitize", "score_batch",
]
