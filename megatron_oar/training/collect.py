"""One training step's data: prompts -> vLLM completions -> rewards -> the groups to train on.

Each rollout group (``world_size / rollout.tp`` of them) generates its share of the prompts; the
completions are gathered on every rank, every rank verifies a strided share of them with its
own verifier pool, and the rewards are gathered back, so all ranks hold the same step data.

Dynamic sampling (DAPO): groups whose rewards are all equal carry no gradient; with
``train.dynamic_sampling`` they are dropped and more prompts are generated (up to
``train.max_refill_rounds`` extra rounds) until ``prompts_per_step`` informative groups exist. If
the rounds run out, dropped groups fill the remaining places (counted in ``dynamic/filled``).

Sampling seeds derive from ``(rollout.seed, step, round, prompt)``, so a resumed run samples
exactly what the uninterrupted run would have.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_oar.data import Example, render_prompt
from megatron_oar.rollout.batch import share
from megatron_oar.seeds import ROLLOUT, derive_seed

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megatron_oar.data import PromptSampler
    from megatron_oar.rewards import RewardScorer
    from megatron_oar.rollout import RolloutEngine


@dataclass
class Sample:
    """One completion with its reward; ``group`` indexes its prompt within the step."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    reference: str
    group: int
    reward: float = 0.0
    accuracy: float = 0.0
    format: float = 0.0
    status: str = ""
    routed_experts: object = None  # vLLM's [tokens, layers, k] (model.routing_replay=rollout)
    # the policy version (updates so far) vLLM generated it with; None: the weights being trained
    # (colocated). rollout.placement=separate sets it (rollout/remote.py)
    version: int | None = None
    # rollout.partial_tokens: each response token's policy version (the oldest is ``version``)
    token_versions: list | None = None


@dataclass
class StepData:
    samples: list[Sample]    # prompts_per_step groups of group_size, group-major
    metrics: dict[str, float]


def group_share(engine: RolloutEngine, n: int) -> range:
    """The items ``[0, n)`` this rank's rollout group generates (:func:`share`)."""
    return share(engine.dp_rank, engine.dp_size, n)


def generate_samples(engine: RolloutEngine, tokenizer: PreTrainedTokenizerBase, prompts: list[Example],
                     template: str, seeds: list[int],
                     **sampling) -> list[Sample]:
    """Collective: every rollout group generates its share of ``prompts`` (``sampling``: the
    engine's ``n``/``temperature``/... overrides); all completions, prompt-major, on every rank."""
    mine = group_share(engine, len(prompts))
    ids = prompt_ids(tokenizer, prompts, template, mine)
    batch = engine.gather(engine.generate(ids, seeds=[seeds[i] for i in mine], **sampling))
    version = batch.meta.get("policy_version")
    per_token = batch.meta.get("token_versions")  # rollout.partial_tokens
    out = []
    for c in batch.completions():
        tokens = None if per_token is None else per_token[c.prompt_index][c.sample_index]
        out.append(Sample(c.prompt_ids, c.response_ids, c.logprobs, c.finish_reason, c.text,
                          prompts[c.prompt_index].answer, c.prompt_index,
                          routed_experts=c.routed_experts,
                          version=min(tokens, default=version) if tokens else version,
                          token_versions=tokens))
    return out


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompts: list[Example], template: str,
               which: range) -> list[list[int]]:
    """The token ids of ``prompts[i]`` for ``i`` in ``which``, rendered with ``template``."""
    return [tokenizer(render_prompt(prompts[i].prompt, template, tokenizer),
                      add_special_tokens=False)["input_ids"] for i in which]


def prefetch(engine, sampler: PromptSampler, tokenizer: PreTrainedTokenizerBase, *, step: int, ahead: int,
             template: str, seed: int, sampling: dict | None = None) -> None:
    """rollout.placement=separate with rollout.max_staleness=``ahead`` >= 1: sends the first
    round of steps ``step + 1 .. step + ahead`` to the rollout ranks now (``engine``: a
    :class:`~megatron_oar.rollout.remote.RemoteRollout`), with exactly the prompts and seeds
    :func:`collect` will ask for at those steps, read from a copy of ``sampler`` (which itself
    does not move: a checkpoint records no prompt as drawn that was not trained on)."""
    peek = copy.copy(sampler)
    for ahead_step in range(step + 1, step + 1 + ahead):
        try:
            prompts = next(peek)
        except StopIteration:
            return
        seeds = [derive_seed(ROLLOUT, seed, ahead_step, 0, i) for i in range(len(prompts))]
        engine.prefetch(prompt_ids(tokenizer, prompts, template, range(len(prompts))), seeds=seeds,
                        step=ahead_step + 1, **(sampling or {}))


def score_samples(samples: list[Sample], scorer: RewardScorer, group: dist.ProcessGroup) -> None:
    """Collective: every rank verifies samples ``rank::world``; results are shared with all ranks."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = list(range(rank, len(samples), world))
    part = None
    if mine:
        res = scorer([samples[i].text for i in mine], [samples[i].reference for i in mine])
        part = (mine, res.rewards.tolist(), res.accuracy.tolist(), res.format.tolist(), res.status)
    parts: list = [None] * world
    dist.all_gather_object(parts, part, group=group)
    for p in parts:
        if p is None:
            continue
        for i, r, a, f, s in zip(*p):
            samples[i].reward, samples[i].accuracy, samples[i].format, samples[i].status = r, a, f, s


def collect(engine: RolloutEngine, scorer: RewardScorer, sampler: PromptSampler,
            tokenizer: PreTrainedTokenizerBase, *, step: int, group_size: int, template: str,
            seed: int, dynamic_sampling: bool, max_refill_rounds: int,
            group: dist.ProcessGroup, sampling: dict | None = None) -> StepData:
    """Collective: the step's ``sampler.batch_size`` groups of ``group_size`` scored completions
    (``group``: a gloo group for the object gathers; ``sampling``: the engine's
    ``temperature``/``top_p``/``top_k`` overrides, the trainer's ``rollout.*``)."""
    want = sampler.batch_size
    kept: list[list[Sample]] = []
    dropped: list[list[Sample]] = []
    generated: list[Sample] = []
    gen_seconds = 0.0
    rounds = 0
    while True:
        prompts = next(sampler)
        seeds = [derive_seed(ROLLOUT, seed, step, rounds, i) for i in range(len(prompts))]
        t0 = time.perf_counter()
        samples = generate_samples(engine, tokenizer, prompts, template, seeds, **(sampling or {}))
        gen_seconds += time.perf_counter() - t0
        score_samples(samples, scorer, group)
        generated += samples
        for g in range(len(prompts)):
            members = samples[g * group_size:(g + 1) * group_size]
            rewards = {s.reward for s in members}
            (kept if (len(rewards) > 1 or not dynamic_sampling) else dropped).append(members)
        rounds += 1
        if len(kept) >= want or not dynamic_sampling or rounds > max_refill_rounds:
            break
    filled = max(0, want - len(kept))
    groups = (kept + dropped[:filled])[:want]
    out = []
    for g, members in enumerate(groups):
        for s in members:
            s.group = g
            out.append(s)
    return StepData(out, _metrics(out, generated, rounds, filled, gen_seconds))


def _metrics(samples: list[Sample], generated: list[Sample], rounds: int, filled: int,
             gen_seconds: float) -> dict[str, float]:
    n = max(len(samples), 1)
    lengths = torch.tensor([float(len(s.response_ids)) for s in samples])
    gen_tokens = sum(len(s.response_ids) for s in generated)
    statuses = [s.status for s in samples]
    return {
        "reward/mean": sum(s.reward for s in samples) / n,
        "reward/accuracy": sum(s.accuracy for s in samples) / n,
        "reward/format": sum(s.format for s in samples) / n,
        "reward/no_answer": statuses.count("no_answer") / n,
        "reward/generated_accuracy": sum(s.accuracy for s in generated) / max(len(generated), 1),
        "response/length_mean": float(lengths.mean()) if len(samples) else 0.0,
        "response/length_max": float(lengths.max()) if len(samples) else 0.0,
        "response/truncated_fraction": sum(s.finish_reason == "length" for s in samples) / n,
        "rollout/generated_sequences": float(len(generated)),
        "rollout/gen_tokens": float(gen_tokens),
        "rollout/gen_tokens_per_s": gen_tokens / gen_seconds if gen_seconds > 0 else 0.0,
        "dynamic/rounds": float(rounds),
        "dynamic/filled": float(filled),
    }
