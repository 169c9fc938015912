"""``oar analyze oracle``: the counterfactual causal-token oracle of the paper's Section 5.1.

For a correct trajectory ``y``, token ``y_t`` is a **causal pivot** when replacing it with the
second most probable token under ``pi(. | y_<t)`` and greedily decoding the rest makes the final
answer wrong. (When ``y_t`` is not the model's top token, the top token is used instead, so the
substitute always differs from ``y_t``: "the most probable other token".) The importance signals
(OAR-P, OAR-G, entropy, random) are then judged by how many pivots they rank in their top K%
(:mod:`megatron_oar.eval.recall`).

It runs with a training config (model, parallel layout, rollout engine, probe, rewards), as one
process or under torchrun:

    oar analyze oracle --config examples/qwen2.5-7b_oar_g.yaml --model CKPT_OR_HF \\
        --trajectories 500 --out oracle_out
    torchrun --nproc-per-node 8 -m megatron_oar.eval.oracle --config ... parallel.tp=2

1. Sample completions with vLLM and keep the verified-correct ones.
2. Megatron, on each DP replica's share: top-2 tokens and entropy (at ``rollout.temperature``, as
   the ``entropy`` credit sees it) at every position (one forward),
   OAR-P and OAR-G importance (the trainer's attribution passes), a seeded random score.
3. vLLM, every rollout group a share: one greedy suffix per scored token, all in batched calls
   (shared prefixes hit vLLM's prefix cache); the verifier labels the flips.
4. Rank 0 writes ``records.jsonl`` (one :class:`~megatron_oar.eval.records.TokenRecord` per
   trajectory, for ``oar viz``), ``recall.{json,md,png}``.

Only the tokens the outcome probe scores (before the answer span) are labelled and ranked: the
answer's own tokens trivially flip it and no method reweights them.

``--control`` also decodes greedily after each scored token *itself* (no substitution) and
records whether that continuation verifies (``kept_correct``). The paper's label compares the
substituted continuation with the sampled trajectory, which was correct; where the model's own
greedy continuation from the same prefix is wrong too, a "flip" is not caused by the substitution
(:mod:`megatron_oar.eval.pivots` counts pivots with and without that control). It doubles the
decoding.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_oar.eval.recall import K_PERCENTS, recall_table, render_markdown, write_outputs
from megatron_oar.eval.records import METHODS, TokenRecord, write_records
from megatron_oar.log_setup import setup_logging
from megatron_oar.seeds import ORACLE, ORACLE_RANDOM, derive_seed

log = logging.getLogger(__name__)


@dataclass
class Trajectory:
    id: str
    prompt: str
    reference: str
    prompt_ids: list[int]
    response_ids: list[int]


# ------------------------------------------------------------------------------ 1. trajectories

def sample_correct(engine, scorer, tokenizer, examples, *, template: str, wanted: int,
                   per_prompt: int, temperature: float, seed: int, group) -> list[Trajectory]:
    """Collective: correct completions of ``examples`` in order, until ``wanted`` are found."""
    from megatron_oar.training.collect import generate_samples, score_samples

    found: list[Trajectory] = []
    chunk = max(8, math.ceil(wanted / per_prompt))
    for round_, start in enumerate(range(0, len(examples), chunk)):
        prompts = examples[start:start + chunk]
        seeds = [derive_seed(ORACLE, seed, round_, start + i) for i in range(len(prompts))]
        samples = generate_samples(engine, tokenizer, prompts, template, seeds, n=per_prompt,
                                   temperature=temperature)
        score_samples(samples, scorer, group)
        for j, s in enumerate(samples):
            if s.accuracy > 0 and s.finish_reason == "stop" and len(found) < wanted:
                found.append(Trajectory(f"{start + s.group}#{j % per_prompt}",
                                        prompts[s.group].prompt, s.reference, s.prompt_ids,
                                        s.response_ids))
        if len(found) >= wanted:
            break
    return found


# ------------------------------------------------------------------------------ 2. Megatron scores

def _micro_batch_size(rows: int, wanted: int) -> int:
    return max(d for d in range(1, min(rows, wanted) + 1) if rows % d == 0)


def score_tokens(model, trajs: list[Trajectory], ids: list[int], cfg, methods, tokenizer,
                 vocab_size: int, pad_id: int, seed: int) -> list[dict] | None:
    """Collective within a DP replica: per trajectory ``{"alt", "scores", "scored"}`` over its
    response tokens; on the last pipeline stage, else None. ``ids`` (the trajectories' global
    indices) seed OAR-G's noise, so the scores do not depend on the DP layout."""
    from megatron.core import parallel_state as ps

    from megatron_oar.attribution import (
        SequenceBatch,
        compute_importance,
        locate_probes,
        probe_teacher,
    )
    from megatron_oar.attribution.spans import SpanFinder
    from megatron_oar.models import vocab_parallel as vp
    from megatron_oar.models.forward import forward_map

    if not trajs:
        return [] if ps.is_pipeline_last_stage() else None
    rows = [t.prompt_ids + t.response_ids for t in trajs]
    length = max(map(len, rows))
    tokens = torch.full((len(rows), length), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = torch.tensor(r)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    if device is not None:
        tokens = tokens.to(device)
    batch = SequenceBatch(tokens, torch.tensor([len(t.prompt_ids) for t in trajs], device=tokens.device),
                          torch.tensor(list(map(len, rows)), device=tokens.device),
                          sample_ids=torch.tensor(ids))
    attribution = cfg.attribution_config()  # null batching keys: the training ones
    mbs = _micro_batch_size(len(rows), attribution.micro_batch_size)

    temperature = cfg.rollout.temperature  # the entropy credit's: the trainer's, at the rollout's

    def top2_entropy(logits, _):  # vocab-parallel: the full vocabulary is never gathered
        top = vp.top_k(logits, vocab_size, 2)[1].float()  # ids < 2**24 are exact in float32
        tempered = logits if temperature == 1.0 else logits.float() / temperature
        return torch.cat([top, vp.entropy(tempered, vocab_size).float().unsqueeze(-1)], dim=-1)

    chunk = cfg.train.logits_chunk_tokens  # the output layer over this many positions at a time
    if chunk:
        from megatron_oar.models.chunked_logits import map_logits
        from megatron_oar.models.parallel import unwrap

        gpt = unwrap(model)
        dense = forward_map(model, tokens, lambda hidden, _: map_logits(
            gpt, hidden, lambda logits: top2_entropy(logits, None), chunk), mbs, hidden=True)
    else:
        dense = forward_map(model, tokens, top2_entropy, mbs)  # [B, L, 3]; position p predicts p + 1
    step = cfg.attribution.probe.warmup_steps  # past the warm-up: the configured probe
    sites = locate_probes(batch, cfg.attribution.probe, step,
                       SpanFinder(tokenizer, cfg.attribution.probe.answer_pattern))
    importance, teacher = {}, None
    wanted = [m for m in ("oar_p", "oar_g") if m in methods]
    # the clean probe P0 once, for both methods (compute_importance would run it each time); it
    # runs outside FP8 like OAR-P (teacher_fp8=False; an FP8 OAR-G gets its own teacher)
    if wanted:
        scored = sites.scored_rows().nonzero().flatten().tolist()
        teacher = probe_teacher(model, batch, sites, scored, vocab_size, attribution.micro_batch_size,
                                batching=attribution.batching, max_tokens=attribution.max_tokens_per_micro_batch)
    for m in wanted:
        acfg = replace(attribution, method=m)
        importance[m] = compute_importance(model, batch, acfg, vocab_size=vocab_size, step=step,
                                           tokenizer=tokenizer, sites=sites, teacher=teacher,
                                           external_teacher=True, teacher_fp8=False).importance
    if not ps.is_pipeline_last_stage():
        return None
    out = []
    for i, t in enumerate(trajs):
        p, n = len(t.prompt_ids), len(rows[i])
        prev = dense[i, p - 1:n - 1].cpu()  # the distributions that chose each response token
        top1, top2 = prev[:, 0].long(), prev[:, 1].long()
        actual = torch.tensor(t.response_ids)
        scores = {}
        if "entropy" in methods:
            scores["entropy"] = prev[:, 2].tolist()
        if "random" in methods:
            gen = torch.Generator().manual_seed(derive_seed(ORACLE_RANDOM, seed, ids[i]))
            scores["random"] = torch.rand(n - p, generator=gen).tolist()
        for m, imp in importance.items():
            scores[m] = imp[i, p:n].float().cpu().tolist()
        out.append({"alt": torch.where(top1 == actual, top2, top1).tolist(), "scores": scores,
                    "scored": sites.score_mask[i, p:n].cpu().tolist()})
    return out


# ------------------------------------------------------------------------------ 3. oracle labels

def oracle_labels(engine, scorer, tokenizer, trajs: list[Trajectory], scored: list[dict], *,
                  max_new_tokens: int, group, control: bool = False
                  ) -> tuple[list[list[int]], list[bool], list[list[int]] | None]:
    """Collective: per trajectory, 1 where the substitution flips correctness (scored tokens
    only), whether the trajectory itself verifies as correct through the same decoding, and with
    ``control`` per trajectory 1 where greedy decoding after the token itself verifies (None
    without)."""
    from megatron_oar.training.collect import Sample, group_share, score_samples

    stop_ids = {i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None}
    requests = []  # (trajectory, position, prefix ids, budget, substituted)
    for k, (t, s) in enumerate(zip(trajs, scored)):
        for r, (on, alt) in enumerate(zip(s["scored"], s["alt"])):
            if on:
                for sub, last in ((True, alt), (False, t.response_ids[r]))[:2 if control else 1]:
                    prefix = t.response_ids[:r] + [last]
                    budget = 0 if last in stop_ids else max_new_tokens - r - 1
                    requests.append((k, r, prefix, budget, sub))
    gen = [q for q in requests if q[3] > 0]
    mine = [gen[i] for i in group_share(engine, len(gen))]
    batch = engine.gather(engine.generate([trajs[k].prompt_ids + pre for k, _, pre, *_ in mine], n=1,
                                          temperature=0.0, max_new_tokens=[q[3] for q in mine] or 1,
                                          seeds=[0] * len(mine)))
    suffix = {(k, r, sub): ids[0] for (k, r, _, _, sub), ids in zip(gen, batch.response_ids)}
    texts = [tokenizer.decode(t.response_ids, skip_special_tokens=True) for t in trajs]
    texts += [tokenizer.decode(pre + suffix.get((k, r, sub), []), skip_special_tokens=True)
              for k, r, pre, _, sub in requests]
    refs = [t.reference for t in trajs] + [trajs[k].reference for k, *_ in requests]
    samples = [Sample([], [], [], "stop", text, ref, 0) for text, ref in zip(texts, refs)]
    score_samples(samples, scorer, group)
    correct = [s.accuracy > 0 for s in samples[:len(trajs)]]
    labels = [[0] * len(t.response_ids) for t in trajs]
    kept = [[0] * len(t.response_ids) for t in trajs] if control else None
    for (k, r, _, _, sub), s in zip(requests, samples[len(trajs):]):
        if sub:
            labels[k][r] = int(correct[k] and s.accuracy <= 0)
        else:
            kept[k][r] = int(s.accuracy > 0)
    return labels, correct, kept


# ------------------------------------------------------------------------------ the command

def _examples(cfg, tokenizer, split: str):
    from megatron_oar.training.evaluate import load_eval_examples
    from megatron_oar.training.inputs import load_examples

    if split == "train":
        return load_examples(cfg, tokenizer)
    # the arithmetic task's held-out draw leaves out the training prompts, so it needs them
    train = load_examples(cfg, tokenizer) if cfg.data.synthetic is not None else []
    return load_eval_examples(cfg, tokenizer, train)


def run(cfg, *, trajectories: int, per_prompt: int, methods: list[str], k_percents: list[float],
        split: str, out: Path, seed: int, control_decode: bool = False) -> dict | None:
    """Collective: the whole analysis; rank 0 returns the recall table (others None)."""
    from megatron.core import parallel_state as ps

    from megatron_oar.models.equal_calls import equal_calls
    from megatron_oar.models.parallel import unwrap
    from megatron_oar.rewards import RewardScorer
    from megatron_oar.rollout import RolloutEngine
    from megatron_oar.training.policy import build_reference, init_checkpoint
    from megatron_oar.training.run_context import start_run

    ctx = start_run(cfg)
    rt, hf_config, arch, tok, pad_id, control = (ctx.rt, ctx.hf_config, ctx.arch, ctx.tokenizer,
                                                  ctx.pad_id, ctx.control)
    examples = _examples(cfg, tok, split)
    start = init_checkpoint(cfg.model.path, out, cfg.model.dtype,
                            timeout_minutes=cfg.checkpoint.convert_timeout_minutes)
    model = build_reference(hf_config, cfg.model, start)
    engine = RolloutEngine(cfg.model.hf_dir(), cfg.rollout, tokenizer=cfg.model.tokenizer_dir())
    scorer = RewardScorer(cfg.rewards)
    try:
        engine.sync_weights(model)
        trajs = sample_correct(engine, scorer, tok, examples, template=cfg.data.template,
                               wanted=trajectories, per_prompt=per_prompt,
                               temperature=cfg.rollout.temperature, seed=seed, group=control)
        log.info("%d correct trajectories", len(trajs))
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        mine = list(range(dp_rank, len(trajs), dp))
        # a rank without trajectories whose model calls pair other DP ranks' (models.equal_calls)
        # scores the first one as a filler and keeps nothing
        filler = not mine and bool(trajs) and equal_calls(unwrap(model).config,
                                                          forward_only=not cfg.attribution.allow_fp8)
        run = [0] if filler else mine
        part = score_tokens(model, [trajs[i] for i in run], run, cfg, methods, tok,
                            arch.vocab_size, pad_id, seed)
        holder = part is not None and ps.get_tensor_model_parallel_rank() == 0 and not filler
        parts: list = [None] * rt.world_size
        dist.all_gather_object(parts, (mine, part) if holder else None, group=control)
        scored: list = [None] * len(trajs)
        for p in parts:
            if p is not None:
                for i, s in zip(*p):
                    scored[i] = s
        labels, correct, kept = oracle_labels(engine, scorer, tok, trajs, scored,
                                              max_new_tokens=cfg.rollout.max_new_tokens, group=control,
                                              control=control_decode)
    finally:
        scorer.close()
        engine.shutdown()
    if rt.rank != 0:
        return None
    records = [TokenRecord(id=t.id, prompt=t.prompt, reference=t.reference, correct=c,
                           token_ids=t.response_ids,
                           tokens=[tok.decode([i]) for i in t.response_ids], scores=s["scores"],
                           scored=s["scored"], oracle=lab if c else None,
                           substitutes=s["alt"] if c else None,
                           kept_correct=kept[i] if kept is not None and c else None)
               for i, (t, s, lab, c) in enumerate(zip(trajs, scored, labels, correct))]
    write_records(records, out / "records.jsonl")
    table = recall_table(records, methods, k_percents)
    write_outputs(table, out)
    return table


def main(argv: list[str] | None = None) -> int:
    from megatron_oar.config import ConfigError, load_config, validate
    from megatron_oar.models import ModelConfigError, read_hf_config
    from megatron_oar.runtime import destroy_runtime

    p = argparse.ArgumentParser(prog="oar analyze oracle", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, type=Path, help="a training config (model, layout, "
                   "rollout, probe, rewards, data)")
    p.add_argument("--model", help="model.path: an HF dir or a Megatron checkpoint")
    p.add_argument("--trajectories", type=int, default=500, help="correct trajectories to label")
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--split", choices=["eval", "train"], default="eval",
                   help="eval: data.eval_files (or the held-out arithmetic); train: training data")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--k-percents", default=",".join(str(k) for k in K_PERCENTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("oracle_out"))
    p.add_argument("--control", action="store_true",
                   help="also decode greedily after each token itself (no substitution) and record "
                        "whether that verifies (kept_correct): flips it does not cause show up")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    try:
        if bad or not methods:
            raise ConfigError(f"--methods: unknown {bad}; choose from {list(METHODS)}")
        try:
            ks = [float(k) for k in args.k_percents.split(",")]
        except ValueError:
            raise ConfigError(f"--k-percents={args.k_percents!r}: expected numbers like 5,10,20") from None
        if not all(0 < k <= 100 for k in ks):
            raise ConfigError(f"--k-percents={args.k_percents!r}: each must be in (0, 100]")
        if args.trajectories < 1 or args.samples_per_prompt < 1:
            raise ConfigError("--trajectories and --samples-per-prompt must be >= 1")
        overrides = [*args.overrides, *([f"model.path={args.model}"] if args.model else [])]
        cfg = load_config(args.config, overrides)
        if args.split == "eval" and not cfg.data.has_eval_set:
            raise ConfigError(f"--split eval: {args.config} has no eval set (data.eval_files, or "
                              "data.synthetic.eval_n > 0); add one or use --split train")
        validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", 1)),
                 hf_config=read_hf_config(cfg.model.hf_dir() / "config.json"))
    except (ConfigError, ModelConfigError) as e:
        print(f"oar analyze oracle: {e}", file=sys.stderr)
        return 2
    setup_logging(int(os.environ.get("RANK", "0")), cfg.log.level)
    try:
        table = run(cfg, trajectories=args.trajectories, per_prompt=args.samples_per_prompt,
                    methods=methods, k_percents=ks, split=args.split, out=args.out, seed=args.seed,
                    control_decode=args.control)
    finally:
        destroy_runtime()
    if table is not None:
        print(render_markdown(table))
        print(f"\nwritten: {args.out}/records.jsonl, recall.json, recall.md, recall.png")
    return 0


if __name__ == "__main__":
    from megatron_oar.process_exit import exit_after

    exit_after(main)
