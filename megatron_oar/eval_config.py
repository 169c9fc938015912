"""The ``eval`` section of the config schema (``Config.eval``): what only ``oar eval`` reads.

``oar eval`` (``megatron_oar.eval.run_eval``) takes the same ``--config X.yaml [key=value ...]``
as ``oar train``; a training config works as it is, plus ``eval.model=PATH``. The settings it
shares with training are read from their own sections, not repeated here:

==============================================  =====================================================
``rollout.max_new_tokens``                      response budget per completion
``rollout.max_model_len``                       upper bound on prompt + response (the model's
                                                ``max_position_embeddings`` when that is smaller)
``rollout.tp``, ``gpu_memory_utilization``,     the vLLM engines (``rollout.dtype`` also takes
``cpu_kv_cache_gib``, ``enforce_eager``,        ``auto`` here: the model's ``torch_dtype``)
``max_num_seqs``, ``enable_prefix_caching``,
``dtype``
``data.template``                               prompt template (also picks the verifier's answer
                                                extractors and format style, as before)
``model.tokenizer``                             tokenizer dir (null: the model's)
``rewards.*``                                   the verifier: ``num_workers`` processes per rank,
                                                ``timeout_s`` per answer, math-verify options
==============================================  =====================================================

The sampling of pass@k (``n``, ``k``, ``greedy``, ``temperature``, ``top_p``, ``seed``) is its own,
as the trainer's evaluation keeps ``train.eval_temperature`` apart from ``rollout.temperature``.
This module imports nothing from ``megatron_oar.eval`` (which imports ``megatron_oar.config``);
benchmark names are checked by ``run_eval.check_config``.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_N = 32  # samples per problem when eval.n is null and eval.greedy is false


@dataclass
class EvalConfig:
    model: str | None = None           # HF model dir, megatron-oar checkpoint, or training checkpoint root
    data_dir: str = "."                # where the benchmark files are (eval.benchmarks' file names)
    benchmarks: list[str] | None = None  # e.g. [aime24, math500=/data/m.jsonl]; null: the paper's five
    n: int | None = None               # samples per problem; null: 32 (greedy: 1)
    k: list[int] | None = None         # pass@k for these k; null: each benchmark's paper ks <= n
    greedy: bool = False               # temperature 0, one sample per problem (temperature/top_p unused)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0                      # base of derive_seed(BENCHMARK, seed, benchmark, problem index)
    max_prompts: int | None = None     # the first N problems per benchmark; null: all
    out: str = "eval_out"              # output directory (results, per-benchmark files, hf_model)
    name: str | None = None            # the model's row label; null: from eval.model
    overwrite: bool = False            # recompute results in `out` made with other settings

    def __post_init__(self) -> None:
        """Raises ``ValueError`` naming the key (``eval.n=0: must be >= 1``)."""
        def bad(key: str, why: str) -> ValueError:
            return ValueError(f"eval.{key}={getattr(self, key)!r}: {why}")

        if self.benchmarks is not None:
            if not self.benchmarks:
                raise bad("benchmarks", "no benchmark given (null: the paper's five)")
            if not all(isinstance(b, str) and b.strip() for b in self.benchmarks):
                raise bad("benchmarks", "expected benchmark names (NAME or NAME=PATH)")
        if self.n is not None and self.n < 1:
            raise bad("n", "must be >= 1")
        if self.greedy and self.n not in (None, 1):
            raise bad("n", "eval.greedy=true samples one completion per problem; drop eval.n")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not self.greedy and self.temperature == 0 and self.samples > 1:
            raise bad("temperature", f"greedy decoding would repeat one completion {self.samples} "
                                     "times (eval.n); use eval.greedy=true")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.k is not None:
            if not self.k or min(self.k) < 1:
                raise bad("k", "every k must be >= 1 (null: the paper's ks)")
            if max(self.k) > self.samples:
                raise bad("k", f"k={max(self.k)} is larger than the {self.samples} samples per "
                               "problem (eval.n)")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise bad("max_prompts", "must be >= 1 or null")
        if self.model is not None and not self.model.strip():
            raise bad("model", "empty (an HF model dir, a megatron-oar checkpoint or a training "
                               "checkpoint root)")

    @property
    def samples(self) -> int:
        """Completions per problem: ``n``, or 32 (1 with ``greedy``)."""
        return 1 if self.greedy else (self.n or DEFAULT_N)

    @property
    def sampling(self) -> tuple[float, float]:
        """``(temperature, top_p)`` as sampled: ``(0.0, 1.0)`` with ``greedy``."""
        return (0.0, 1.0) if self.greedy else (float(self.temperature), float(self.top_p))

    @property
    def ks(self) -> tuple[int, ...] | None:
        """``k`` sorted without repeats; None: each benchmark's paper ks."""
        return tuple(sorted(set(self.k))) if self.k is not None else None
