"""The phases of one training step, in order, and what holds GPU memory in each: what the
colocated vLLM engine holds (``Phase.vllm_holds``) and which Megatron working set is live
(``Phase.megatron``).

The trainer opens one logger phase per entry (``time/<phase>`` in the metrics, the step line's
split; a console line each at ``log.level=debug``), ``oar plan`` budgets the
memory of each, and ``tests/test_phases.py`` checks that both follow these lists, so the plan
cannot assume a sleeping vLLM where the loop keeps it awake.

The memory handover with the colocated vLLM engine (DESIGN.md section 5), as verl and slime do
it: before generation the engine wakes its weights, receives the sync, then wakes its KV cache;
after generation (and after an evaluation) it sleeps, and every Megatron pass runs while it
sleeps. ``rollout.sleep_level: 2`` (the default) discards the engine's weights when it sleeps,
since the next sync overwrites them anyway; level 1 would copy them to pinned host memory and
back at every step.

With ``rollout.placement=separate`` the trainer runs the same phases, but the engines live on the
rollout ranks: a training GPU holds no vLLM in any phase (``oar plan``'s ``trainer_phases`` says
``nothing`` throughout), ``wake_*`` and ``sleep`` are no-ops, ``sync`` is the broadcast to the
rollout ranks and ``generate`` the wait for their batch (docs/rollout.md, "Separate placement").
"""

from __future__ import annotations

from dataclasses import dataclass

# What vLLM holds on the GPU during a phase, with ``rollout.sleep_level >= 1`` (at level 0 it
# never sleeps and holds its weights and KV cache throughout). "nothing": asleep, its weights
# discarded (level 2) or in host memory (level 1) and its KV cache freed; only its CUDA context
# and allocator overhead stay (``oar plan``'s ``VLLM_ASLEEP_GIB``).
NOTHING, WEIGHTS, WEIGHTS_KV_CACHE = "nothing", "weights", "weights+kv_cache"


@dataclass(frozen=True)
class Phase:
    name: str
    vllm_holds: str              # NOTHING | WEIGHTS | WEIGHTS_KV_CACHE, for the whole phase
    megatron: str | None = None  # the Megatron working set: sync | forward | attribution | update


# wake the engine with the current policy: its weights, the sync into them, then its KV cache
WAKE = (Phase("wake_weights", WEIGHTS), Phase("sync", WEIGHTS, "sync"),
        Phase("wake_kv_cache", WEIGHTS_KV_CACHE))
# "sleep" releases vLLM's memory: it holds all of it until the phase ends
STEP = (*WAKE,
        Phase("generate", WEIGHTS_KV_CACHE),
        Phase("sleep", WEIGHTS_KV_CACHE),
        Phase("logprob", NOTHING, "forward"),        # old log-probs (+ reference), probe teacher
        Phase("attribution", NOTHING, "attribution"),  # OAR only
        Phase("update", NOTHING, "update"))
EVAL = (*WAKE, Phase("eval", WEIGHTS_KV_CACHE), Phase("sleep", WEIGHTS_KV_CACHE))
CHECKPOINT = (Phase("checkpoint", NOTHING),)

