"""Validation during training: the policy's accuracy on a fixed held-out prompt set.

Every ``train.eval_interval`` steps (and once before the first update, as the baseline) each
rollout group generates its share of the eval prompts with the current weights, every rank
verifies a share of the completions, and the step's record gets ``eval/*`` metrics. This is
verl's ``test_freq`` validation: greedy by default (``train.eval_temperature=0``, one completion
per prompt); with ``train.eval_n > 1`` at a temperature, ``eval/accuracy`` is the mean over the
samples (pass@1) and ``eval/pass_at_n`` the fraction of prompts with any correct sample.

Sampling seeds depend only on the prompt's position in the eval set, so successive evaluations
differ only by the weights, and a resumed run evaluates exactly as the uninterrupted one.

Eval prompts come from ``data.eval_files`` (read with ``data.eval_fields``), or, for the
arithmetic task, ``data.synthetic.eval_n`` problems drawn with seed ``data.synthetic.seed + 1``
minus every prompt of the training set (so they are held out).
"""

from __future__ import annotations

from megatron_oar.data import Example
from megatron_oar.seeds import EVAL, derive_seed
from megatron_oar.training.collect import generate_samples, score_samples


def load_eval_examples(cfg, tokenizer, train_examples: list[Example]) -> list[Example]:
    """The eval prompt set of ``cfg`` (a :class:`megatron_oar.config.Config`); [] when unset."""
    from megatron_oar.config import ConfigError
    from megatron_oar.data import make_arithmetic, read_examples

    d = cfg.data
    if d.eval_files:
        examples, stats = read_examples(d.eval_files, d.eval_fields, strict=d.strict,
                                        tokenizer=tokenizer, max_prompt_tokens=d.max_prompt_tokens,
                                        template=d.template)
        if not examples:
            raise ConfigError(f"data.eval_files: no usable examples ({stats.malformed} malformed, "
                              f"{stats.too_long} too long)")
    elif d.synthetic is not None and d.synthetic.eval_n > 0 and d.synthetic.task == "chain":
        # the held-out side of the hash split: disjoint from every training prompt by construction
        examples = list(make_arithmetic(d.synthetic.eval_n, d.synthetic.seed + 1, d.synthetic,
                                        split="heldout"))
    elif d.synthetic is not None and d.synthetic.eval_n > 0:
        train_prompts = {ex.prompt for ex in train_examples}
        drawn = make_arithmetic(d.synthetic.eval_n, d.synthetic.seed + 1, d.synthetic)
        examples = [ex for ex in drawn if ex.prompt not in train_prompts]
        if not examples:
            raise ConfigError(f"data.synthetic.eval_n={d.synthetic.eval_n}: every drawn problem is "
                              "also a training problem; widen the task (max_value, operators)")
    else:
        return []
    limit = cfg.train.eval_max_prompts
    return examples[:limit] if limit else examples


def evaluate(engine, scorer, tokenizer, examples: list[Example], *, template: str, n: int,
             temperature: float, seed: int, group) -> dict[str, float]:
    """Collective: ``eval/*`` metrics of the engine's current weights on ``examples``."""
    seeds = [derive_seed(EVAL, seed, i) for i in range(len(examples))]
    samples = generate_samples(engine, tokenizer, examples, template, seeds, n=n,
                               temperature=temperature)
    score_samples(samples, scorer, group)
    total = max(len(samples), 1)
    solved = [any(s.accuracy > 0 for s in samples[i * n:(i + 1) * n]) for i in range(len(examples))]
    return {
        "eval/accuracy": sum(s.accuracy for s in samples) / total,
        "eval/reward": sum(s.reward for s in samples) / total,
        "eval/format": sum(s.format for s in samples) / total,
        "eval/pass_at_n": sum(solved) / max(len(examples), 1),
        "eval/length_mean": sum(len(s.response_ids) for s in samples) / total,
        "eval/truncated_fraction": sum(s.finish_reason == "length" for s in samples) / total,
        "eval/prompts": float(len(examples)),
    }
