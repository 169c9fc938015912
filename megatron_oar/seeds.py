"""Every random stream of a run from one function: ``derive_seed(namespace, *parts)``.

    derive_seed(ROLLOUT, cfg.rollout.seed, step, round_, prompt)   # vLLM seed of one prompt

The seed is a hash (blake2b) of the namespace and the parts, so streams of different namespaces
never collide, a stream depends only on what identifies it (never on the process layout, the
order of calls or a resume), and no number has to act as a sentinel. The namespaces:

==================  ============================================  =====================================
namespace           parts                                         used by
==================  ============================================  =====================================
``rollout``         base, step, refill round, prompt index        training rollouts (vLLM seeds)
``eval``            base, prompt index                            the trainer's held-out evaluation
``benchmark``       base, benchmark name, problem index           ``oar eval``
``oracle``          base, round, prompt index                     ``oar analyze oracle``'s trajectories
``oracle_random``   base, trajectory id                           the oracle's random-score baseline
``engine``          base, rollout DP rank, call, request index    ``RolloutEngine.generate`` without seeds
``oar_g_noise``     base, step, sample id                         OAR-G's embedding noise
``random_credit``   base, step, DP rank                           the ``random`` credit baseline
``sampler``         base, epoch                                   the prompt sampler's shuffle
==================  ============================================  =====================================

Seeds are below ``SEED_SPACE``: vLLM seeds completion ``j`` of a request with ``seed + j``, and
torch and Python take anything smaller.
"""

from __future__ import annotations

import hashlib

SEED_SPACE = 2**31 - 2**20  # room for seed + j, j < n completions per request

ROLLOUT = "rollout"
EVAL = "eval"
BENCHMARK = "benchmark"
ORACLE = "oracle"
ORACLE_RANDOM = "oracle_random"
ENGINE = "engine"
OAR_G_NOISE = "oar_g_noise"
RANDOM_CREDIT = "random_credit"
SAMPLER = "sampler"
PARTIAL = "partial"
NAMESPACES = (ROLLOUT, EVAL, BENCHMARK, ORACLE, ORACLE_RANDOM, ENGINE, OAR_G_NOISE, RANDOM_CREDIT,
              SAMPLER, PARTIAL)


def derive_seed(namespace: str, *parts: int | str) -> int:
    """The seed of the stream ``namespace`` identified by ``parts`` (ints or strings)."""
    if namespace not in NAMESPACES:
        raise ValueError(f"derive_seed: unknown namespace {namespace!r}; known: {', '.join(NAMESPACES)}")
    key = "\x1f".join([namespace, *(str(p) for p in parts)])
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_SPACE
