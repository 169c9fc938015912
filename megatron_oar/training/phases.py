"""The phases of one training step, in order, and what holds GPU memory in each.

The trainer opens one logger phase per entry (one console line each), ``oar plan`` budgets the
memory of each, and ``tests/test_phases.py`` checks that both follow these lists, so the plan
cannot assume a sleeping vLLM where the loop keeps it awake.

The memory handover with the colocated vLLM engine (DESIGN.md section 5), as verl and slime do
it: before generation the engine wakes its weights, receives the sync, then wakes its KV cache;
after generation (and after an evaluation) it sleeps, and every Megatron pass runs while it
sleeps. ``rollout.sleep_level: 2`` (the default) discards the engine's weights when it sleeps,
since the next sync overwrites them anyway; level 1 would copy them to pinned host memory and
back at every step.
"""

from __future__ import annotations

from dataclasses import dataclass

ASLEEP, WEIGHTS, AWAKE = "asleep", "weights", "awake"  # what vLLM holds on the GPU


@dataclass(frozen=True)
class Phase:
    name: str
    vllm: str                   # ASLEEP | WEIGHTS | AWAKE during the phase
    megatron: str | None = None  # the Megatron working set: sync | forward | attribution | update


# wake the engine with the current policy; it is awake when the block ends
WAKE = (Phase("wake_weights", WEIGHTS), Phase("sync", WEIGHTS, "sync"),
        Phase("wake_kv_cache", AWAKE))
STEP = (*WAKE,
        Phase("generate", AWAKE),
        Phase("sleep", AWAKE),
        Phase("logprob", ASLEEP, "forward"),        # old log-probs (+ reference), probe teacher
        Phase("attribution", ASLEEP, "attribution"),  # OAR only
        Phase("update", ASLEEP, "update"))
EVAL = (*WAKE, Phase("eval", AWAKE), Phase("sleep", AWAKE))
CHECKPOINT = (Phase("checkpoint", ASLEEP),)

