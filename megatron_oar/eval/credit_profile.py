"""``oar analyze credit``: where a run's credit went, from its credit records
(``log.credit_records``, :mod:`megatron_oar.training.credit_records`).

    oar train --config X.yaml log.credit_records=1 train.steps=2
    oar analyze credit RUN_DIR [RUN_DIR ...] [--out DIR] [--kinds auto|chain|generic]

Over the rollouts with a non-zero sequence advantage (the ones the update sees):

- **By token kind and by position decile** (of the scored tokens, 0 = first tenth): how many
  tokens, the mean normalised importance ``I_hat`` (Eq. 14, recomputed from the recorded raw
  scores), the mean weight ``w`` and the kind's share of the ``|A_t|`` mass. Kinds: on the chain
  testbeds (``data/chain.py``) ``operator`` / ``operand`` / ``total`` (the start value and the
  running totals) / ``final_total`` (the last number before the answer tag) / ``filler`` /
  ``format`` / ``answer`` (the answer span, not scored); on other data ``digits`` /
  ``operators`` / ``words`` / ``punctuation`` / ``space`` / ``answer``.
- **The restated span**: the response tokens that the answer span restates (the last occurrence
  of the answer's text before the answer tag; on the chain task the final total): their share of
  the scored tokens (what GRPO's uniform credit gives them) and of the ``|A_t|`` mass, split by
  the sign of the sequence advantage.
- **The paper's Figure 6 measures** (Appendix A.3): ESS ratio of the weights and top-10%
  advantage mass, per rollout, averaged; the fractions of scored tokens boosted (``w > 1``) and
  suppressed (``w < 1``).
- **The raw-score scale at the gate's threshold**: per rollout, the raw importance (nats) at the
  gate's threshold (Eq. 14 inverted at the threshold of Eq. 16), the rollout's median and
  maximum raw score, and the share of suppressed tokens below ``--noise-floor`` nats; medians
  over rollouts.
- **Decision-locus recall** (chain testbeds only): for each wrong rollout, the first token where
  the response departs from the correct solution (:func:`first_wrong_char`); the share of those
  tokens among each signal's top k% of the scored tokens (the run's importance, the old-logprob
  pass's entropy and a seeded random score), and among its top 1 and top 5.

Writes ``credit.json`` and ``credit.md`` in ``--out`` (default: the records' directory).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from megatron_oar.fileio import atomic_write_text

CHAIN_KINDS = ("operator", "operand", "total", "final_total", "filler", "format", "answer")
GENERIC_KINDS = ("digits", "operators", "words", "punctuation", "space", "answer")
K_PERCENTS = (5, 10, 20)
TOP_N = (1, 5)
NOISE_FLOOR = 1e-5  # nats: about 100 float32 ulps of a log-probability near 1
ANSWER_TAG = "<answer>"
_CHAIN_PROMPT = re.compile(r"^\s*Compute \d+( (plus|minus) \d+)+\.\s*$")
_NUMBER_OR_OP = re.compile(r"\b(?:plus|minus)\b|\d+")
_OPERATOR_CHARS = set("+-*/=^<>×÷")


class CreditRecordError(ValueError):
    """Malformed credit records; the message names the file and line."""


# ------------------------------------------------------------------------------ reading

def record_files(path: str | Path) -> list[Path]:
    """The record files of a run dir, a ``credit_records`` dir or one ``.jsonl`` file."""
    p = Path(path)
    if p.is_file():
        return [p]
    for d in (p / "credit_records", p):
        files = sorted(d.glob("step_*.jsonl")) if d.is_dir() else []
        if files:
            return files
    raise CreditRecordError(f"{p}: no credit records (step_*.jsonl); train with log.credit_records=N")


def read_credit_records(path: str | Path) -> list[dict]:
    out = []
    for f in record_files(path):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                n = len(r["tokens"])
                for key in ("weights", "advantages", "loss_mask"):
                    if len(r[key]) != n:
                        raise ValueError(f"{key} has {len(r[key])} values for {n} tokens")
                for key in ("importance", "scored", "entropy"):
                    if r.get(key) is not None and len(r[key]) != n:
                        raise ValueError(f"{key} has {len(r[key])} values for {n} tokens")
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise CreditRecordError(f"{f}:{i}: not a credit record ({e})") from None
            out.append(r)
    return out


# ------------------------------------------------------------------------------ token kinds

def _char_ends(tokens: Sequence[str]) -> list[tuple[int, int]]:
    spans, pos = [], 0
    for t in tokens:
        spans.append((pos, pos + len(t)))
        pos += len(t)
    return spans


def is_chain_prompt(prompt: str) -> bool:
    return bool(_CHAIN_PROMPT.match(prompt))


def chain_char_kinds(text: str) -> list[str]:
    """A kind per character of a chain solution (a teacher's or a model's)."""
    cut = text.find(ANSWER_TAG)
    body_end = len(text) if cut < 0 else cut
    kinds = ["format" if not c.isalpha() else "filler" for c in text[:body_end]]
    kinds += ["answer"] * (len(text) - body_end)
    matches = list(_NUMBER_OR_OP.finditer(text[:body_end]))
    numbers = [m for m in matches if m.group().isdigit()]
    last = numbers[-1] if numbers else None
    prev_word = False
    for m in matches:
        if not m.group().isdigit():
            kind, prev_word = "operator", True
        else:
            kind = "final_total" if m is last else "operand" if prev_word else "total"
            prev_word = False
        kinds[m.start():m.end()] = [kind] * (m.end() - m.start())
    return kinds


def generic_char_kinds(text: str) -> list[str]:
    """digits / operators / words / punctuation / space per character; the answer span after
    ``<answer>`` (when there is one) is ``answer``."""
    cut = text.find(ANSWER_TAG)
    body_end = len(text) if cut < 0 else cut
    out = []
    for c in text[:body_end]:
        out.append("digits" if c.isdigit() else "operators" if c in _OPERATOR_CHARS else
                   "words" if c.isalpha() else "space" if c.isspace() else "punctuation")
    return out + ["answer"] * (len(text) - body_end)


def token_kinds(tokens: Sequence[str], scheme: str) -> list[str]:
    """One kind per token: the highest-priority kind among its characters (the kinds tuple's
    order for chain; digits > operators > words > punctuation > space for generic)."""
    text = "".join(tokens)
    chars = chain_char_kinds(text) if scheme == "chain" else generic_char_kinds(text)
    order = CHAIN_KINDS if scheme == "chain" else GENERIC_KINDS
    if scheme == "chain":  # pivots first, answer over filler
        priority = {"final_total": 0, "total": 1, "operand": 2, "operator": 3, "answer": 4,
                    "filler": 5, "format": 6}
    else:
        priority = {k: i for i, k in enumerate(("answer", "digits", "operators", "words",
                                                "punctuation", "space"))}
    out = []
    for s, e in _char_ends(tokens):
        inside = chars[s:e]
        out.append(min(inside, key=priority.__getitem__) if inside else order[-2])
    return out


# ------------------------------------------------------------------------------ restated span

def restated_tokens(tokens: Sequence[str]) -> list[bool]:
    """Per token, whether it overlaps the last occurrence before ``<answer>`` of the answer
    span's content (``<answer>X</answer>``): the text the answer copies. All False without an
    answer span or an earlier occurrence. A numeric answer must match a whole number."""
    text = "".join(tokens)
    m = re.search(re.escape(ANSWER_TAG) + r"(.*?)</answer>", text, re.S)
    flags = [False] * len(tokens)
    if m is None or not m.group(1).strip():
        return flags
    content = m.group(1).strip()
    body = text[:m.start()]
    guard = r"(?<![\d.])" if content[0].isdigit() else ""
    tail = r"(?![\d])" if content[-1].isdigit() else ""
    hits = list(re.finditer(guard + re.escape(content) + tail, body))
    if not hits:
        return flags
    s0, e0 = hits[-1].span()
    return [s < e0 and s0 < e for s, e in _char_ends(tokens)]


# ------------------------------------------------------------------------------ decision locus

def first_wrong_char(prompt: str, text: str) -> tuple[int | None, str]:
    """The character where a chain solution first departs from the correct one, and why:
    ``(pos, "pivot")`` at the first operator word, operand or running total that differs from
    what the prompt implies (the first differing character of it; just after it when the text
    written is a prefix of the right one), ``(None, "early_end")`` when every pivot is right but
    the chain stops early, ``(None, "answer")`` when every pivot is right and only the answer
    span is wrong, ``(None, "correct")`` when the pivots are all right and the answer too."""
    from megatron_oar.data.chain import WORD_OPS, ChainConfig, parse_prompt

    start, steps = parse_prompt(prompt.strip(), ChainConfig())
    expected, total = [str(start)], start
    for op, b in steps:
        total = total + b if op == "+" else total - b
        expected += [{v: k for k, v in WORD_OPS.items()}[op], str(b), str(total)]
    cut = text.find(ANSWER_TAG)
    body = text if cut < 0 else text[:cut]
    found = list(_NUMBER_OR_OP.finditer(body))
    for j, m in enumerate(found):
        if j >= len(expected):
            return m.start(), "pivot"
        want, got = expected[j], m.group()
        if got != want:
            same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            return m.start() + same, "pivot"
    if len(found) < len(expected):
        return None, "early_end"
    m = re.search(re.escape(ANSWER_TAG) + r"(.*?)</answer>", text, re.S)
    if m is None or m.group(1).strip() != expected[-1]:
        return None, "answer"
    return None, "correct"


def token_at(tokens: Sequence[str], pos: int) -> int | None:
    for i, (s, e) in enumerate(_char_ends(tokens)):
        if s <= pos < e:
            return i
    return None


def _rank_of(values: list[float], idx: int) -> int:
    """0-based rank of ``values[idx]`` in descending order; ties count against it (the
    pessimistic rank: a signal that cannot separate the token from others gets no credit)."""
    v = values[idx]
    return sum(1 for j, x in enumerate(values) if x > v or (x == v and j != idx))


def locus_recall(records: Iterable[dict], k_percents=K_PERCENTS, top_n=TOP_N, seed: int = 0) -> dict:
    """Decision-locus recall per signal over the wrong chain rollouts with scored tokens."""
    signals: dict[str, list[int]] = defaultdict(list)  # signal -> rank of the locus per rollout
    sizes: list[int] = []
    reasons: dict[str, int] = defaultdict(int)
    locus_kinds: dict[str, int] = defaultdict(int)
    deciles: dict[int, int] = defaultdict(int)
    gen = torch.Generator().manual_seed(seed)
    for r in records:
        if r["accuracy"] > 0 or not is_chain_prompt(r["prompt"]):
            continue
        text = "".join(r["tokens"])
        pos, why = first_wrong_char(r["prompt"], text)
        scored = [i for i, on in enumerate(r.get("scored") or []) if on]
        if pos is None:
            reasons[why] += 1
            continue
        if not scored:  # A = 0 (an all-wrong group): not scored, no credit to rank
            reasons["not_scored"] += 1
            continue
        t = token_at(r["tokens"], pos)
        if t is None or t not in scored:
            reasons["locus_outside_scored"] += 1
            continue
        reasons["pivot"] += 1
        where = scored.index(t)
        locus_kinds[token_kinds(r["tokens"], "chain")[t]] += 1
        deciles[min(9, where * 10 // len(scored))] += 1
        sizes.append(len(scored))
        if r.get("importance") is not None:
            signals[r["credit"]].append(_rank_of([r["importance"][i] for i in scored], where))
        if r.get("entropy") is not None:
            signals["entropy"].append(_rank_of([r["entropy"][i] for i in scored], where))
        signals["random"].append(_rank_of(torch.rand(len(scored), generator=gen).tolist(), where))
    table = {}
    for name, ranks in signals.items():
        row = {f"top{k}%": sum(rk < max(1, math.ceil(k / 100 * n)) for rk, n in zip(ranks, sizes)) / len(ranks)
               for k in k_percents}
        row |= {f"top{n}": sum(rk < n for rk in ranks) / len(ranks) for n in top_n}
        row["rollouts"] = len(ranks)
        table[name] = row
    return {"signals": table, "wrong_rollouts": dict(reasons), "locus_kinds": dict(locus_kinds),
            "locus_deciles": {str(d): deciles[d] for d in sorted(deciles)},
            "median_scored_tokens": float(torch.tensor(sizes, dtype=torch.float64).median()) if sizes else None}


# ------------------------------------------------------------------------------ the profile

def _normalized(imp: list[float], scored: list[int], eps: float) -> list[float]:
    from megatron_oar.algorithms.oar import normalize_importance

    x = torch.tensor([imp], dtype=torch.float64)
    m = torch.tensor([[bool(s) for s in scored]])
    return normalize_importance(x, m, eps)[0].tolist()


def _threshold_raw(imp: list[float], scored: list[int], shaping: dict) -> float | None:
    """The raw importance at the gate's threshold: Eq. 14 inverted at Eq. 16's threshold."""
    from megatron_oar.algorithms.oar import gate_threshold, normalize_importance

    x = torch.tensor([imp], dtype=torch.float64)
    m = torch.tensor([[bool(s) for s in scored]])
    if m.sum() < 2:
        return None
    eps = shaping.get("eps", 1e-6)
    thr = float(gate_threshold(normalize_importance(x, m, eps), m, shaping.get("tau", 0.4),
                               shaping.get("tau_mode", "quantile"))[0, 0])
    bar = torch.log1p(x[m].clamp_min(0))
    lo, hi = float(bar.min()), float(bar.max())
    return math.expm1(lo + thr * (hi - lo + eps))


def _median(xs: list[float]) -> float | None:
    return float(torch.tensor(xs, dtype=torch.float64).median()) if xs else None


def profile(records: list[dict], kinds: str = "auto", noise_floor: float = NOISE_FLOOR) -> dict:
    """The whole analysis (see the module docstring) as a JSON-able dict."""
    from megatron_oar.algorithms.metrics import ess_ratio, top_mass

    active = [r for r in records if r["seq_adv"] != 0 and any(r["loss_mask"])]
    if kinds == "auto":
        kinds = "chain" if records and all(is_chain_prompt(r["prompt"]) for r in records) else "generic"
    by_kind: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    by_decile: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    restated = {s: defaultdict(float) for s in ("positive", "negative")}
    ess, top10, boosted, suppressed, n_scored = [], [], 0, 0, 0
    thr_raw, med_raw, max_raw, below, n_supp = [], [], [], 0, 0
    total_mass = 0.0
    top_kind: dict[str, int] = defaultdict(int)
    for r in active:
        mask = r["loss_mask"]
        scored = r.get("scored") or [int(bool(v)) for v in mask]
        scored = [int(bool(s) and bool(v)) for s, v in zip(scored, mask)]
        w, adv = r["weights"], r["advantages"]
        wt = torch.tensor([w], dtype=torch.float64)
        mt = torch.tensor([[bool(v) for v in mask]])
        ess.append(float(ess_ratio(wt, mt)[0]))
        tm = float(top_mass(torch.tensor([adv], dtype=torch.float64), mt, 0.1)[0])
        if math.isfinite(tm):
            top10.append(tm)
        imp = r.get("importance")
        shaping = r.get("shaping") or {}
        norm = _normalized(imp, scored, shaping.get("eps", 1e-6)) if imp is not None and any(scored) else None
        kind = token_kinds(r["tokens"], kinds)
        idx = [i for i, s in enumerate(scored) if s]
        if imp is not None and idx:  # the kind of the rollout's top-scored token (first on ties)
            top_kind[kind[max(idx, key=lambda i: (imp[i], -i))]] += 1
        for rank, i in enumerate(idx):
            for bucket in (by_kind[kind[i]], by_decile[min(9, rank * 10 // len(idx))]):
                bucket["tokens"] += 1
                bucket["weight"] += w[i]
                bucket["abs_adv"] += abs(adv[i])
                if norm is not None:
                    bucket["norm_importance"] += norm[i]
                    bucket["scored_with_importance"] += 1
            total_mass += abs(adv[i])
            boosted += w[i] > 1 + 1e-6
            suppressed += w[i] < 1 - 1e-6
        n_scored += len(idx)
        flags = restated_tokens(r["tokens"])
        side = restated["positive" if r["seq_adv"] > 0 else "negative"]
        side["rollouts"] += 1
        side["with_restated"] += any(flags[i] for i in idx)
        side["tokens"] += len(idx)
        side["restated_tokens"] += sum(flags[i] for i in idx)
        side["abs_adv"] += sum(abs(adv[i]) for i in idx)
        side["restated_abs_adv"] += sum(abs(adv[i]) for i in idx if flags[i])
        if imp is not None and len(idx) >= 2:
            raw = [imp[i] for i in idx]
            t = _threshold_raw(imp, scored, shaping)
            if t is not None:
                thr_raw.append(t)
            med_raw.append(_median(raw))
            max_raw.append(max(raw))
            supp = [imp[i] for i in idx if w[i] < 1 - 1e-6]
            n_supp += len(supp)
            below += sum(v < noise_floor for v in supp)

    def finish(bucket: dict) -> dict:
        n = bucket["tokens"]
        out = {"tokens": int(n), "share_of_tokens": n / n_scored if n_scored else None,
               "mean_weight": bucket["weight"] / n if n else None,
               "share_of_abs_adv": bucket["abs_adv"] / total_mass if total_mass else None}
        m = bucket.get("scored_with_importance", 0)
        out["mean_norm_importance"] = bucket["norm_importance"] / m if m else None
        return out

    order = CHAIN_KINDS if kinds == "chain" else GENERIC_KINDS
    rest = {}
    for s, b in restated.items():
        rest[s] = {"rollouts": int(b["rollouts"]), "with_restated": int(b["with_restated"]),
                   "token_share": b["restated_tokens"] / b["tokens"] if b["tokens"] else None,
                   "abs_adv_share": b["restated_abs_adv"] / b["abs_adv"] if b["abs_adv"] else None}
    return {
        "rollouts": len(records), "active_rollouts": len(active), "scored_tokens": n_scored,
        "kinds_scheme": kinds, "methods": sorted({r["credit"] for r in records}),
        "by_kind": {k: finish(by_kind[k]) for k in order if k in by_kind},
        "by_decile": {str(d): finish(by_decile[d]) for d in sorted(by_decile)},
        "restated": rest,
        "top_scored_kind": {k: top_kind[k] for k in order if k in top_kind},
        "figure6": {"ess_ratio": sum(ess) / len(ess) if ess else None,
                    "top10_mass": sum(top10) / len(top10) if top10 else None,
                    "frac_boosted": boosted / n_scored if n_scored else None,
                    "frac_suppressed": suppressed / n_scored if n_scored else None},
        "threshold_scale": {"raw_at_threshold": _median(thr_raw), "raw_median": _median(med_raw),
                            "raw_max": _median(max_raw), "noise_floor": noise_floor,
                            "suppressed_below_floor": below / n_supp if n_supp else None,
                            "rollouts": len(thr_raw)},
        "locus": locus_recall(records) if kinds == "chain" else None,
    }


# ------------------------------------------------------------------------------ rendering

def _f(x, fmt="{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def render(p: dict) -> str:
    lines = [f"# Where the credit went: {', '.join(p['methods'])}", "",
             f"{p['rollouts']} rollouts, {p['active_rollouts']} with a non-zero advantage, "
             f"{p['scored_tokens']} scored tokens in those; token kinds: {p['kinds_scheme']}.", ""]
    head = ["| {} | tokens | share of tokens | mean I_hat | mean weight | share of abs(A) mass |",
            "|---|---:|---:|---:|---:|---:|"]
    for title, key in (("kind", "by_kind"), ("decile", "by_decile")):
        lines += [f"## By {title}", "", head[0].format(title), head[1]]
        for k, v in p[key].items():
            lines.append(f"| {k} | {v['tokens']} | {_pct(v['share_of_tokens'])} | "
                         f"{_f(v['mean_norm_importance'])} | {_f(v['mean_weight'], '{:.2f}')} | "
                         f"{_pct(v['share_of_abs_adv'])} |")
        lines.append("")
    lines += ["## The tokens the answer restates", "",
              "| sequence advantage | rollouts | with a restated span | share of scored tokens "
              "| share of abs(A) mass |",
              "|---|---:|---:|---:|---:|"]
    for s, v in p["restated"].items():
        lines.append(f"| {s} | {v['rollouts']} | {v['with_restated']} | {_pct(v['token_share'])} | "
                     f"{_pct(v['abs_adv_share'])} |")
    if p.get("top_scored_kind"):
        n = sum(p["top_scored_kind"].values())
        lines += ["", f"The kind of each rollout's top-scored token ({n} rollouts): " + ", ".join(
            f"{k} {v} ({100 * v / n:.0f}%)" for k, v in p["top_scored_kind"].items()) + "."]
    f6, ts = p["figure6"], p["threshold_scale"]
    lines += ["", "## Concentration (the paper's Figure 6) and the gate", "",
              "| ESS ratio | top-10% abs(A) mass | boosted | suppressed |", "|---:|---:|---:|---:|",
              f"| {_f(f6['ess_ratio'])} | {_pct(f6['top10_mass'])} | {_pct(f6['frac_boosted'])} | "
              f"{_pct(f6['frac_suppressed'])} |", "",
              "Raw importance (nats), medians over rollouts:", "",
              f"| at the gate's threshold | rollout median | rollout max | suppressed below {ts['noise_floor']:g} |",
              "|---:|---:|---:|---:|",
              f"| {_f(ts['raw_at_threshold'], '{:.2g}')} | {_f(ts['raw_median'], '{:.2g}')} | "
              f"{_f(ts['raw_max'], '{:.2g}')} | {_pct(ts['suppressed_below_floor'])} |", ""]
    loc = p.get("locus")
    if loc:
        ks = [c for c in next(iter(loc["signals"].values()), {}) if c != "rollouts"]
        lines += ["## Decision-locus recall (wrong rollouts: the first wrong token)", "",
                  f"Wrong rollouts by where they go wrong: {loc['wrong_rollouts']}; median scored "
                  f"tokens per rollout {_f(loc['median_scored_tokens'], '{:.0f}')}. The locus by token "
                  f"kind: {loc.get('locus_kinds')}; by position decile of the scored tokens: "
                  f"{loc.get('locus_deciles')}. Ties rank against the locus.", "",
                  "| signal | rollouts | " + " | ".join(ks) + " |", "|---|---:|" + "---:|" * len(ks)]
        for name, row in loc["signals"].items():
            lines.append(f"| {name} | {row['rollouts']} | " + " | ".join(_pct(row[c]) for c in ks) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="oar analyze credit", description=__doc__.split("\n\n")[0])
    ap.add_argument("records", type=Path, nargs="+",
                    help="run dirs, credit_records/ dirs or step_*.jsonl files (read together)")
    ap.add_argument("--kinds", choices=["auto", "chain", "generic"], default="auto")
    ap.add_argument("--noise-floor", type=float, default=NOISE_FLOOR, help="nats (default %(default)g)")
    ap.add_argument("--out", type=Path, help="where credit.json and credit.md go (default: the records' dir)")
    args = ap.parse_args(argv)
    try:
        records = [r for path in args.records for r in read_credit_records(path)]
    except CreditRecordError as e:
        print(f"oar analyze credit: {e}", file=sys.stderr)
        return 2
    p = profile(records, args.kinds, args.noise_floor)
    out = args.out or record_files(args.records[0])[0].parent
    atomic_write_text(out / "credit.json", json.dumps(p, indent=1))
    text = render(p)
    atomic_write_text(out / "credit.md", text)
    print(text)
    print(f"written: {out}/credit.json, credit.md")
    return 0
