"""Synthetic arithmetic tasks with exactly known answers (tests, the demo, smoke runs).

    make_arithmetic(3, seed=0)
    -> [Example(prompt='Compute 17 + 5 * 3.', answer='32', source='synthetic/arithmetic', index=0), ...]

``task: chain`` (``ArithmeticConfig(task="chain")``, knobs in ``chain``) is the OAR testbed of
``data/chain.py`` instead: an unbounded stream of add/subtract chains with a hash-split held-out
side, whose worked solutions mix pivots with filler.

Seeded and deterministic. The text keeps the style the tiny test tokenizer was trained on
(``models/tiny.py``: numbers and operators separated by single spaces). Expressions are built
and evaluated here with exact fractions (standard precedence; no ``eval``); an answer that is
not an integer is written ``p/q`` in lowest terms, which math-verify checks like any fraction.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from megatron_oar.data.chain import ChainConfig, chain_examples
from megatron_oar.data.readers import Example

SOURCE = "synthetic/arithmetic"
TASKS = ("expression", "chain")
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


@dataclass
class ArithmeticConfig:
    """Difficulty knobs (config section ``data.synthetic``). ``task``: ``expression`` (the knobs
    below) or ``chain`` (the OAR testbed, knobs in ``chain``; the expression knobs are unused)."""

    task: str = "expression"
    min_operands: int = 2
    max_operands: int = 3
    max_value: int = 20        # operands are drawn from [0, max_value] (divisors from [1, max_value])
    operators: str = "+-*"     # any of "+-*/"
    parentheses: bool = False  # wrap a random run of operands in parentheses
    prefix: str = "Compute "   # the prompt is prefix + expression + "."
    chain: ChainConfig = field(default_factory=ChainConfig)  # task: chain

    def validate(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"data.synthetic.task must be one of {TASKS}, got {self.task!r}")
        if self.task == "chain":
            self.chain.validate()
            return
        bad = set(self.operators) - set(_PRECEDENCE)
        if not self.operators or bad:
            raise ValueError(f"data.synthetic.operators must be made of '+-*/', got {self.operators!r}")
        if not 2 <= self.min_operands <= self.max_operands:
            raise ValueError("data.synthetic needs 2 <= min_operands <= max_operands, got "
                             f"{self.min_operands}, {self.max_operands}")
        if self.max_value < 1:
            raise ValueError(f"data.synthetic.max_value must be >= 1, got {self.max_value}")


def evaluate(tokens: list[str]) -> Fraction:
    """Exact value of a token list (integers, ``+-*/``, parentheses) with standard precedence."""
    values: list[Fraction] = []
    ops: list[str] = []

    def apply() -> None:
        op, b, a = ops.pop(), values.pop(), values.pop()
        if op == "/" and b == 0:
            raise ZeroDivisionError("division by zero")
        values.append({"+": a + b, "-": a - b, "*": a * b}[op] if op != "/" else a / b)

    for tok in tokens:
        if tok == "(":
            ops.append(tok)
        elif tok == ")":
            while ops[-1] != "(":
                apply()
            ops.pop()
        elif tok in _PRECEDENCE:
            while ops and ops[-1] != "(" and _PRECEDENCE[ops[-1]] >= _PRECEDENCE[tok]:
                apply()
            ops.append(tok)
        else:
            values.append(Fraction(int(tok)))
    while ops:
        apply()
    (result,) = values
    return result


def format_answer(value: Fraction) -> str:
    """``"32"`` for integers, ``"-7/2"`` otherwise."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _expression(rng: random.Random, cfg: ArithmeticConfig) -> list[str]:
    n = rng.randint(cfg.min_operands, cfg.max_operands)
    ops = [rng.choice(cfg.operators) for _ in range(n - 1)]
    nums = [str(rng.randint(1 if i and ops[i - 1] == "/" else 0, cfg.max_value)) for i in range(n)]
    tokens = [nums[0]]
    for op, num in zip(ops, nums[1:]):
        tokens += [op, num]
    if cfg.parentheses and n >= 3:
        first = rng.randrange(0, n - 1)
        last = rng.randrange(first + 1, n if first else n - 1)  # never wrap the whole expression
        tokens.insert(2 * last + 1, ")")
        tokens.insert(2 * first, "(")
    return tokens


def arithmetic_problem(rng: random.Random, cfg: ArithmeticConfig) -> tuple[str, str]:
    """One ``(prompt, answer)`` pair drawn with ``rng``."""
    while True:
        tokens = _expression(rng, cfg)
        try:
            value = evaluate(tokens)
        except ZeroDivisionError:  # e.g. "4 / (3 - 3)": draw again
            continue
        text = " ".join(tokens).replace("( ", "(").replace(" )", ")")
        return f"{cfg.prefix}{text}.", format_answer(value)


def make_arithmetic(n: int, seed: int = 0, cfg: ArithmeticConfig | None = None, *,
                    split: str | None = None) -> Sequence[Example]:
    """``n`` arithmetic examples; the same ``(n, seed, cfg)`` always gives the same list.

    ``cfg.task == "chain"``: a lazy ``ChainStream`` of ``n`` problems on ``split``'s side of the
    hash split (``train``, ``heldout``, ``all``). ``split=None`` follows the trainer's convention
    for ``data.synthetic`` (a ``SyntheticConfig`` with its ``seed``): training problems are drawn
    with ``seed``, held-out eval problems with ``seed + 1``, so ``seed == cfg.seed + 1`` means
    ``heldout`` and anything else ``train``. The expression task has no split (``split`` must be
    None): the trainer removes the training prompts from its eval draw instead."""
    cfg = cfg or ArithmeticConfig()
    cfg.validate()
    if cfg.task == "chain":
        if split is None:
            base = getattr(cfg, "seed", None)
            split = "heldout" if base is not None and seed == base + 1 else "train"
        return chain_examples(n, seed, cfg.chain, split)
    if split is not None:
        raise ValueError("make_arithmetic: split is for task 'chain'; the expression task has none")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt, answer = arithmetic_problem(rng, cfg)
        out.append(Example(prompt=prompt, answer=answer, source=SOURCE, index=i))
    return out
