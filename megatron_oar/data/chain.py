"""The OAR testbed: a chain of additions and subtractions whose worked solutions mix the tokens
the answer depends on (**pivots**) with paraphrased **filler**.

    cfg = ChainConfig()
    stream = chain_examples(1_000_000, seed=0, cfg=cfg)          # lazy: problem i made on demand
    stream[5]  -> Example(prompt='Compute 12 plus 7 plus 3 plus 5.', answer='27', ...)
    chain_solution(stream[5].prompt, random.Random(0), cfg)
    -> ' First we have 12, again plus 7 = 19, and plus 3 makes 22, next plus 5 makes us 27.'
       ' <answer>27</answer>'

The prompt spells the chain with the words the solution uses (``Compute 14 plus 7 minus 3.``, so
the solution can copy each operation from the prompt); ``expression_of`` gives it as ``14 + 7 - 3``,
which ``synthetic.evaluate`` checks (with ``+`` and ``-`` only, left to right is standard
precedence). The worked solution
keeps a running total; each step writes the operator word, the operand and the new total
(pivots: substitute any of them and the final answer changes) between phrases drawn at random
from sets of synonyms (filler: "then" / "so" / "next", "gives" / "makes" / "leaves", optional
"we get", "that is all"...), so substituting a filler phrase by another leaves the answer
unchanged. ``chain_segments`` returns the solution as labelled pieces; ``answer_from_solution``
recomputes the answer from a solution's pivots alone.

**Unbounded, with a held-out side.** Problem ``i`` of ``chain_examples(n, seed, cfg, split)`` is
drawn from its own generator, seeded by ``(seed, i)``, so a stream of any length costs nothing
until it is indexed and never repeats a fixed small set (3 to 4 steps with the defaults: about
2 million distinct prompts). Prompts are split by a fixed hash (``is_heldout``: crc32 of the
prompt, one in ``heldout_every``): ``split="train"`` keeps the rest, ``"heldout"`` only those,
``"all"`` both; the two sides are disjoint whatever the seeds.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_oar.data.readers import Example

SOURCE = "synthetic/chain"
SPLITS = ("train", "heldout", "all")

# filler: each slot draws one phrase; any choice reads as the same solution
OPENERS = ("Step by step.", "Let us compute.", "In order.", "Left to right.")
STARTS = ("Start with", "Begin with", "We start at", "First we have", "Take")
CONNECTIVES = (",", ", then", ", so", ", next", ", and", ". Then", ". Next", ". Now")
CONNECTIVE_EXTRAS = (" we do", " we take", " after that", " again")          # optional, filler_rate
VERBS = (" gives", " is", " makes", " =", " equals", " leaves", " comes to")
VERB_EXTRAS = (" us", " now", " in all", " a total of")                     # optional, filler_rate
CLOSINGS = (" Done.", " That is all.", " We are done.", " Finished.")       # optional, filler_rate
# the credit testbed's filler (asides_min..asides_max after each step): sentences with no digit
# and no operator word, so ``answer_from_solution`` and ``pivot_spans`` never read them
ASIDES = (" This step only uses numbers from the prompt.", " Nothing else changes here.",
          " We keep the running total in mind.", " It is good to go slowly and carefully.",
          " Let us check that this step is right.", " Yes, that looks right to me.",
          " We move on to the next part of the sum.", " There is no need to rush this.",
          " The order of the steps is kept as given.", " So far the work is simple.",
          " We write the new total down and go on.", " Each step changes the total once.")
OP_WORDS = {"+": "plus", "-": "minus"}
WORD_OPS = {w: op for op, w in OP_WORDS.items()}


@dataclass
class ChainConfig:
    """Difficulty knobs of the chain task (config section ``data.synthetic.chain``)."""

    min_steps: int = 3          # operations after the start value
    max_steps: int = 4
    max_start: int = 20         # the start value is drawn from [0, max_start]
    max_operand: int = 9        # operands are drawn from [1, max_operand]
    max_total: int = 99         # running totals stay in [0, max_total] (the other operator otherwise)
    operators: str = "+-"       # any of "+-"
    filler_rate: float = 0.5    # chance of each optional filler phrase (opener, extras, closing)
    asides_min: int = 0         # filler sentences (ASIDES) after each step: the credit testbed
    asides_max: int = 0         # draws asides_min..asides_max of them (0, 0: none)
    heldout_every: int = 4      # one prompt in heldout_every (by crc32) is on the held-out side
    prefix: str = "Compute "    # the prompt is prefix + "a + b - c ..." + "."

    def validate(self) -> None:
        if not self.operators or set(self.operators) - set(OP_WORDS):
            raise ValueError(f"data.synthetic.chain.operators must be made of '+-', got {self.operators!r}")
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError("data.synthetic.chain needs 1 <= min_steps <= max_steps, got "
                             f"{self.min_steps}, {self.max_steps}")
        if not (0 <= self.max_start <= self.max_total and 1 <= self.max_operand <= self.max_total):
            raise ValueError("data.synthetic.chain needs 0 <= max_start <= max_total and "
                             f"1 <= max_operand <= max_total, got {self.max_start}, "
                             f"{self.max_operand}, {self.max_total}")
        if not 0.0 <= self.filler_rate <= 1.0:
            raise ValueError(f"data.synthetic.chain.filler_rate must be in [0, 1], got {self.filler_rate}")
        if not 0 <= self.asides_min <= self.asides_max:
            raise ValueError("data.synthetic.chain needs 0 <= asides_min <= asides_max, got "
                             f"{self.asides_min}, {self.asides_max}")
        if self.heldout_every < 2:
            raise ValueError(f"data.synthetic.chain.heldout_every must be >= 2, got {self.heldout_every}")


def is_heldout(prompt: str, every: int = 4) -> bool:
    """True for the prompts on the held-out side (crc32, the same in every process and run)."""
    return zlib.crc32(prompt.encode()) % every == 0


def _apply(total: int, op: str, b: int) -> int:
    return total + b if op == "+" else total - b


def _steps(rng: random.Random, cfg: ChainConfig) -> tuple[int, list[tuple[str, int]]] | None:
    """A start value and the steps, each drawn uniformly from the (operator, operand) pairs that
    keep the total in range; None when no pair does (possible with a single operator)."""
    total = start = rng.randint(0, cfg.max_start)
    steps = []
    for _ in range(rng.randint(cfg.min_steps, cfg.max_steps)):
        pairs = [(op, b) for op in cfg.operators for b in range(1, cfg.max_operand + 1)
                 if 0 <= _apply(total, op, b) <= cfg.max_total]
        if not pairs:
            return None
        op, b = rng.choice(pairs)
        total = _apply(total, op, b)
        steps.append((op, b))
    return start, steps


def prompt_of(start: int, steps: list[tuple[str, int]], cfg: ChainConfig) -> str:
    """``"Compute 14 minus 5 plus 8."``: the operators as the words the solution uses."""
    return cfg.prefix + " ".join([str(start), *(f"{OP_WORDS[op]} {b}" for op, b in steps)]) + "."


def parse_prompt(prompt: str, cfg: ChainConfig) -> tuple[int, list[tuple[str, int]]]:
    """``(start, [(op, operand), ...])`` of a chain prompt (``op`` as ``+`` / ``-``)."""
    body = prompt[len(cfg.prefix):].rstrip(".").split()
    return int(body[0]), [(WORD_OPS[body[i]], int(body[i + 1])) for i in range(1, len(body), 2)]


def expression_of(prompt: str, cfg: ChainConfig) -> str:
    """``"14 - 5 + 8"``: the prompt's chain as an arithmetic expression (left to right)."""
    start, steps = parse_prompt(prompt, cfg)
    return " ".join([str(start), *(f"{op} {b}" for op, b in steps)])


def chain_problem(rng: random.Random, cfg: ChainConfig) -> tuple[str, str]:
    """One ``(prompt, answer)`` drawn with ``rng``."""
    for _ in range(1000):
        if (drawn := _steps(rng, cfg)) is not None:
            break
    else:
        raise ValueError(f"chain task: {cfg} cannot keep the total in [0, max_total]")
    start, steps = drawn
    total = start
    for op, b in steps:
        total = _apply(total, op, b)
    return prompt_of(start, steps, cfg), str(total)


def chain_segments(prompt: str, rng: random.Random, cfg: ChainConfig, *,
                   carry_slip: float = 0.0) -> list[tuple[str, str]]:
    """The worked solution of ``prompt`` as ``(text, kind)`` pieces, kind one of ``pivot`` (an
    operator word, an operand, a running total), ``filler`` (a phrase drawn from a synonym set)
    and ``format`` (spaces before numbers, the final period and the answer tag). The text of the
    solution is the pieces joined; the filler is drawn with ``rng``.

    ``carry_slip``: a sloppy teacher. Each addition that carries into the tens (``17 plus 5``)
    is, with this probability, written without the carry (``12``); the solution goes on from the
    written total, so its answer is wrong. 0 (default): every solution is correct."""
    start, steps = parse_prompt(prompt, cfg)
    seg: list[tuple[str, str]] = []

    def maybe(options: Sequence[str]) -> None:
        if rng.random() < cfg.filler_rate:
            seg.append((rng.choice(options), "filler"))

    def number(value: int) -> None:
        seg.extend([(" ", "format"), (str(value), "pivot")])

    if rng.random() < cfg.filler_rate:
        seg.append((" " + rng.choice(OPENERS), "filler"))
    seg.append((" " + rng.choice(STARTS), "filler"))
    number(start)
    total = start
    for op, b in steps:
        slip = op == "+" and total % 10 + b >= 10 and carry_slip > 0 and rng.random() < carry_slip
        total = _apply(total, op, b) - (10 if slip else 0)
        seg.append((rng.choice(CONNECTIVES), "filler"))
        maybe(CONNECTIVE_EXTRAS)
        seg.append((" " + OP_WORDS[op], "pivot"))
        number(b)
        seg.append((rng.choice(VERBS), "filler"))
        maybe(VERB_EXTRAS)
        number(total)
        for _ in range(rng.randint(cfg.asides_min, cfg.asides_max) if cfg.asides_max else 0):
            seg.append((".", "format"))
            seg.append((rng.choice(ASIDES).rstrip("."), "filler"))
    seg.append((".", "format"))
    maybe(CLOSINGS)
    seg.append((f" <answer>{total}</answer>", "format"))
    return seg


def chain_solution(prompt: str, rng: random.Random, cfg: ChainConfig, *, carry_slip: float = 0.0) -> str:
    """The worked solution (the SFT target, EOS not included): ``chain_segments`` joined."""
    return "".join(text for text, _ in chain_segments(prompt, rng, cfg, carry_slip=carry_slip))


_STEP = re.compile(r"\b(plus|minus) (\d+)\b")
_START = re.compile(r"\d+")


def answer_from_solution(solution: str) -> int | None:
    """The final total that a worked solution's pivots imply: its first number, then every
    ``plus N`` / ``minus N`` in order; the filler (and the totals it writes) are ignored."""
    body = solution.split("<answer>")[0]
    first = _START.search(body)
    if first is None:
        return None
    total = int(first.group())
    for word, num in _STEP.findall(body[first.end():]):
        total = _apply(total, WORD_OPS[word], int(num))
    return total


_PIVOT = re.compile(r"\b(?:plus|minus)\b|\d+")


def pivot_spans(solution: str) -> list[tuple[int, int]]:
    """``[start, end)`` character spans of the pivots of any chain solution (a teacher's or a
    model's): every operator word and every number before the ``<answer>`` tag. On a teacher's
    solution these are exactly the ``pivot`` pieces of ``chain_segments`` (no filler phrase or
    aside holds a digit or an operator word)."""
    body = solution.split("<answer>")[0]
    return [m.span() for m in _PIVOT.finditer(body)]


def token_pivots(tokens: Sequence[str]) -> list[bool]:
    """Per token (the decoded pieces of a response, in order), whether it overlaps a pivot span
    of their concatenation (``pivot_spans``): the pivots by construction, token by token."""
    spans = pivot_spans("".join(tokens))
    out, pos, k = [], 0, 0
    for tok in tokens:
        start, end = pos, pos + len(tok)
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        out.append(k < len(spans) and spans[k][0] < end and start < end)
        pos = end
    return out


class ChainStream(Sequence):
    """``n`` chain problems on one side of the split, each generated when indexed (nothing is
    stored): item ``i`` is the first draw on ``split``'s side of a generator seeded by
    ``(seed, i, attempt)``. Equal arguments give equal items in every process."""

    def __init__(self, n: int, seed: int, cfg: ChainConfig, split: str = "train"):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        cfg.validate()
        self.n, self.seed, self.cfg, self.split = n, seed, cfg, split

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        for attempt in range(10_000):
            prompt, answer = chain_problem(random.Random(f"{self.seed}/{i}/{attempt}"), self.cfg)
            if self.split == "all" or is_heldout(prompt, self.cfg.heldout_every) == (self.split == "heldout"):
                return Example(prompt=prompt, answer=answer, source=SOURCE, index=i)
        raise RuntimeError("chain task: no problem on this side of the split in 10000 draws")

    def __repr__(self) -> str:
        return f"ChainStream(n={self.n}, seed={self.seed}, split={self.split!r}, cfg={self.cfg})"


def chain_examples(n: int, seed: int = 0, cfg: ChainConfig | None = None,
                   split: str = "train") -> ChainStream:
    """``n`` chain problems (lazy) on ``split``'s side; the same arguments give the same items."""
    return ChainStream(n, seed, cfg or ChainConfig(), split)
