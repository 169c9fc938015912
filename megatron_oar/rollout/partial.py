"""Partial rollouts (``rollout.partial_tokens``, the separate placement): a batch generated in
segments of at most ``partial_tokens`` new tokens, so that new weights can arrive between two
segments; the completions still running then continue under them, and every token records the
policy version that sampled it.

Segment 1 is the request itself (``n`` completions per prompt, each prompt's seed). A completion
that stopped (EOS, a stop token) or reached ``max_new_tokens`` is done; every other one continues
in the next segment as a request of its own: its prompt and the tokens so far, one completion,
a seed derived from the prompt's seed, the completion and the segment (``seeds.PARTIAL``). Between
segments ``at_boundary()`` may load new weights (returning their version). Log-probs are each
token's under the weights that sampled it, which is what ``loss.rollout_correction`` weighs per
token. Stop *strings* are matched by vLLM within a segment only (one split over a boundary is
missed): use stop token ids with partial rollouts.
"""

from __future__ import annotations

from collections.abc import Callable

from megatron_oar.rollout.batch import RolloutBatch
from megatron_oar.seeds import PARTIAL, derive_seed


def generate_in_segments(engine, prompts: list[list[int]], seeds: list[int], sampling: dict, *,
                         segment_tokens: int, version: int | None,
                         at_boundary: Callable[[], int | None]) -> tuple[RolloutBatch, list[list[list]]]:
    """The batch ``engine.generate(prompts, seeds=seeds, **sampling)`` would give, made in
    segments (module docstring), and each token's policy version ``[prompt][completion][token]``.
    Collective as ``engine.generate`` is (every rank of the rollout world calls it, and
    ``at_boundary`` must decide the same on all of them)."""
    n = sampling.get("n") or engine.config.n
    budget = sampling.get("max_new_tokens") or engine.config.max_new_tokens
    rest = {k: v for k, v in sampling.items() if k not in ("n", "max_new_tokens")}
    first = engine.generate(prompts, seeds=seeds, n=n, max_new_tokens=min(segment_tokens, budget), **rest)
    resp = [[list(r) for r in g] for g in first.response_ids]
    lps = [[list(x) for x in g] for g in first.logprobs]
    finish = [list(g) for g in first.finish_reasons]
    stops = [list(g) for g in first.stop_reasons]
    versions = [[[version] * len(r) for r in g] for g in resp]
    segment = 1
    while True:
        todo = [(i, j) for i in range(len(prompts)) for j in range(n)
                if finish[i][j] == "length" and len(resp[i][j]) < budget]
        if not todo:
            break
        new = at_boundary()
        if new is not None:
            version = new
        segment += 1
        cont = engine.generate([prompts[i] + resp[i][j] for i, j in todo],
                               seeds=[derive_seed(PARTIAL, seeds[i], j, segment) for i, j in todo], n=1,
                               max_new_tokens=[min(segment_tokens, budget - len(resp[i][j])) for i, j in todo],
                               **rest)
        for k, (i, j) in enumerate(todo):
            more = cont.response_ids[k][0]
            resp[i][j] += more
            lps[i][j] += cont.logprobs[k][0]
            versions[i][j] += [version] * len(more)
            finish[i][j], stops[i][j] = cont.finish_reasons[k][0], cont.stop_reasons[k][0]
    tokenizer = engine.llm.get_tokenizer()
    texts = [[tokenizer.decode(r, skip_special_tokens=True) for r in g] for g in resp]
    batch = RolloutBatch(prompt_ids=prompts, response_ids=resp, logprobs=lps, finish_reasons=finish,
                         stop_reasons=stops, texts=texts, seeds=list(seeds), n=n, temperature=first.temperature,
                         top_p=first.top_p, top_k=first.top_k, logprobs_mode=first.logprobs_mode,
                         meta={"segments": segment})
    return batch, versions
