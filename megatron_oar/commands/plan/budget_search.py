"""``oar plan``'s token budgets and lengths: the searches, free of the memory model.

The memory model (:mod:`megatron_oar.commands.plan.budgets`, :mod:`megatron_oar.commands.plan.planner`)
hands this module, per budget, the bytes of the phase the budget sizes as a function of the
budget, and per response length whether the whole plan fits. Both are monotone: more tokens per
micro-batch, or longer responses, never need less memory (``tests/test_plan.py`` checks the
searches against the plan at their boundary).

* :func:`choose_budgets`: each token budget left unset (null) in the config becomes the largest
  multiple of :data:`BUDGET_STEP` tokens, at least one full-length row and at most ``hi`` (the
  tokens one rank runs per pass and pipeline stage: no larger budget changes a micro-batch), whose
  phase fits :data:`BUDGET_FILL` of the GPU; a budget the config sets is kept, with a warning when
  its phase does not fit the GPU.
* :func:`longest_true`: the longest response length, in steps of :data:`LENGTH_STEP` tokens, at
  which a predicate (the plan fits) holds.
* :func:`at_length`: a config set to generate responses of a given length.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

BUDGET_STEP = 128   # chosen token budgets are multiples of this many tokens (or one full row)
# a chosen budget fills at most this share of the GPU: the plan's activation model is an estimate
# (no allocator fragmentation, no workspace of a kernel it does not know), and a budget that fills
# the GPU to the last GiB of an estimate fails where the estimate is short; a set budget is
# warned about only past the whole GPU
BUDGET_FILL = 0.9
LENGTH_STEP = 256   # the longest response that fits is searched in steps of this many tokens
GIB = 1024 ** 3

TRAIN_BUDGET = "train.max_tokens_per_micro_batch"
ATTRIBUTION_BUDGET = "attribution.max_tokens_per_micro_batch"
COPY_BUDGET = "attribution.max_tokens_per_copy_micro_batch"


@dataclass(frozen=True)
class BudgetSpec:
    """One token budget: what the config sets (None: unset, to be chosen), the phase it sizes,
    that phase's bytes per GPU at a budget of ``tokens``, and the range a chosen one may take."""

    key: str
    explicit: int | None
    phase: str
    phase_bytes: Callable[[int], float]
    lo: int   # one full-length row: a row longer than the budget runs alone anyway
    hi: int   # beyond this a larger budget changes no micro-batch


@dataclass
class BudgetChoice:
    tokens: dict[str, int] = field(default_factory=dict)    # key -> the budget the run uses
    chosen: list[str] = field(default_factory=list)         # keys chosen here (null in the config)
    phase_gib: dict[str, float] = field(default_factory=dict)  # key -> its phase's GiB at that budget
    warnings: list[str] = field(default_factory=list)


def _last_true(pred: Callable[[int], bool], k_lo: int, k_hi: int) -> int:
    """The largest ``k`` in ``[k_lo, k_hi]`` with ``pred(k)``, given ``pred`` monotone (true up to
    a point) and ``k_lo`` taken as true (the caller has checked it, or it is the floor)."""
    while k_lo < k_hi:
        mid = (k_lo + k_hi + 1) // 2
        if pred(mid):
            k_lo = mid
        else:
            k_hi = mid - 1
    return k_lo


def largest_fitting(fits: Callable[[int], bool], lo: int, hi: int, step: int = BUDGET_STEP) -> int:
    """The largest of ``lo`` and the multiples of ``step`` in ``(lo, hi]`` for which ``fits``
    (monotone: true up to a point) holds; ``lo`` when none does, or when ``lo`` itself does not."""
    k_lo, k_hi = lo // step + 1, hi // step  # candidates k * step above lo
    if k_lo > k_hi or not fits(lo) or not fits(k_lo * step):
        return lo
    return _last_true(lambda k: fits(k * step), k_lo, k_hi) * step


def choose_budgets(specs: list[BudgetSpec], cap_bytes: float, *, seq_len: int) -> BudgetChoice:
    """Chosen (unset) and kept (set) token budgets, each sized by its own phase: a chosen one's
    phase at most :data:`BUDGET_FILL` of ``cap_bytes`` (the GPU's memory), a set one warned about
    when its phase exceeds ``cap_bytes``."""
    out = BudgetChoice()
    fill = BUDGET_FILL * cap_bytes
    for sp in specs:
        best = largest_fitting(lambda b, sp=sp: sp.phase_bytes(b) <= fill, sp.lo, max(sp.lo, sp.hi))
        if sp.explicit is None:
            tokens = best
            out.chosen.append(sp.key)
        else:
            tokens = sp.explicit
        need = sp.phase_bytes(tokens)
        out.tokens[sp.key], out.phase_gib[sp.key] = tokens, need / GIB
        if need > cap_bytes:
            one_row = sp.phase_bytes(sp.lo)
            if sp.explicit is not None and one_row <= cap_bytes:
                out.warnings.append(
                    f"{sp.key}={tokens} does not fit: the {sp.phase} phase needs {need / GIB:.1f} GiB > "
                    f"{cap_bytes / GIB:g} GiB per GPU; {best} tokens would fit (unset it to have it chosen)")
            else:
                out.warnings.append(
                    f"{sp.key}: not even one {seq_len:,}-token row fits the {sp.phase} phase "
                    f"({one_row / GIB:.1f} GiB > {cap_bytes / GIB:g} GiB per GPU)")
    return out


def longest_true(pred: Callable[[int], bool], hi: int, step: int = LENGTH_STEP) -> int:
    """The largest multiple of ``step`` up to ``hi`` for which ``pred`` (monotone: true up to a
    point) holds; 0 when it fails at ``step``."""
    return _last_true(lambda k: pred(k * step), 0, hi // step) * step


def at_length(cfg, response_tokens: int):
    """A copy of ``cfg`` that generates responses of up to ``response_tokens`` tokens:
    ``rollout.max_new_tokens`` set to it and ``rollout.max_model_len`` raised (never lowered) to
    hold ``data.max_prompt_tokens`` + that."""
    out = copy.deepcopy(cfg)
    out.rollout.max_new_tokens = response_tokens
    out.rollout.max_model_len = max(out.rollout.max_model_len, out.data.max_prompt_tokens + response_tokens)
    return out


def with_budgets(cfg, tokens: dict[str, int]):
    """A copy of ``cfg`` with the token budgets ``tokens`` (key -> tokens) set."""
    out = copy.deepcopy(cfg)
    for key, value in tokens.items():
        section, name = key.split(".")
        setattr(getattr(out, section), name, value)
    return out
