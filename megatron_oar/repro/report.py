"""The paper's tables and figures from the runs of ``oar repro``: JSON, markdown and PNG.

Reads what the runs wrote (``runs/<name>/spec.json``, ``result.json``, ``logs/metrics.jsonl``)
and the oracle's ``recall.json``; computes nothing that a run did not measure:

* **Table 1**: final held-out greedy accuracy (the last ``eval/accuracy``) and pass@k per method,
  mean and 95% t-interval over seeds, and each method's paired difference to GRPO (same seeds).
* **Learning curve** (:func:`learning`): the area under the held-out accuracy curve, as the mean
  accuracy over the run (trapezoids between evaluations, divided by the steps they span), and the
  steps to a threshold accuracy (the first evaluation at or above it; a run that never reaches it
  counts as its last evaluated step, a lower bound), with paired differences to GRPO.
* **Oracle confirmation** (:func:`megatron_oar.eval.pivots.confirmation`): per probe, how the
  oracle's pivots fall on the pivots built into the task (the chain tasks' operator words and
  numbers).
* **Figures 3 / 6**: reward, held-out accuracy, policy entropy, ESS ratio and top-10% mass over
  steps; mean line and 95% band over seeds.
* **Figure 5a / 5b**: oracle recall at top-K% per signal, per probe; the pivot share.
* **Tables 3 / 4**: the tau and probe ablations (and the suppression floor).
* **Loss axis**: GRPO and OAR-G under each policy loss and rollout correction, with each row's
  paired difference to the same method under ``ppo_clip`` without correction (same seeds).
* **Figure 7**: per method, the Megatron sweep's seconds per action token (old-logprob +
  attribution + update, the paper's definition) and a whole step's, as ratios to GRPO's.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from megatron_oar.fileio import atomic_write_text
from megatron_oar.repro.stats import Interval, fmt, mean_ci, paired_diff_ci

CURVES = (("reward/mean", "training reward"), ("eval/accuracy", "held-out greedy accuracy"),
          ("policy/entropy", "policy entropy"), ("credit/ess_ratio", "ESS ratio"),
          ("credit/top10_mass", "top-10% advantage mass"))
SWEEP = ("time/logprob", "time/attribution", "time/update")
BASE_LOSS = "ppo_clip"  # what the main runs train with (the testbed config's loss.policy_loss)


def loss_label(method: str, loss: str = BASE_LOSS, correction: str = "none") -> str:
    """The loss axis's row: ``grpo / cispo``, ``oar_g / ppo_clip + tis``."""
    return f"{method} / {loss}" + (f" + {correction}" if correction != "none" else "")


def load_runs(out: Path, aliases: list[dict] = (), names: set[str] | None = None) -> list[dict]:
    """Every finished run (of those named ``names``, where given): its spec, result and metric
    records (step order). ``aliases`` are specs of runs that also stand in another group (a main
    run is the ablations' default setting); each is added again under its alias spec."""
    from megatron_oar.training.logger import read_metrics

    runs = []
    for d in sorted((out / "runs").glob("*")):
        if not (d / "result.json").is_file() or (names is not None and d.name not in names):
            continue
        runs.append({"spec": json.loads((d / "spec.json").read_text()),
                     "result": json.loads((d / "result.json").read_text()),
                     "records": read_metrics(d)})
    by_name = {r["spec"]["name"]: r for r in runs}
    runs += [{**by_name[a["name"]], "spec": a} for a in aliases if a["name"] in by_name]
    return runs


def _passk(seeds: dict[int, dict]) -> dict[int, float]:
    """``{seed: pass@k}`` of the runs that measured it (a grid with ``pass_k`` 0 does not)."""
    return {s: r["result"]["pass_at_k"] for s, r in seeds.items() if r["result"].get("pass_at_k") is not None}


def _ci_or_none(vals: dict[int, float]) -> dict | None:
    return _interval_dict(mean_ci(list(vals.values()))) if vals else None


def _final(records: list[dict], key: str) -> float:
    vals = [r[key] for r in records if r.get(key) is not None]
    if not vals:
        raise ValueError(f"no {key} in the run's metrics")
    return vals[-1]


def _by(runs: list[dict], group: str) -> dict[str, dict[int, dict]]:
    """``{label: {seed: run}}`` of one group of the grid."""
    out: dict[str, dict[int, dict]] = defaultdict(dict)
    for r in runs:
        if r["spec"]["group"] == group:
            out[r["spec"]["label"]][r["spec"]["seed"]] = r
    return out


def _interval_dict(iv: Interval) -> dict:
    return {"mean": iv.mean, "half95": None if math.isnan(iv.half) else iv.half, "n": iv.n}


def table1(runs: list[dict], baseline: str = "grpo") -> dict:
    main = _by(runs, "main")
    acc = {m: {s: _final(r["records"], "eval/accuracy") for s, r in seeds.items()}
           for m, seeds in main.items()}
    passk = {m: _passk(seeds) for m, seeds in main.items()}
    start = {m: {s: r["records"][0].get("eval/accuracy") for s, r in seeds.items()}
             for m, seeds in main.items()}
    rows = {}
    for m in main:
        row = {"seeds": sorted(main[m]), "accuracy": _interval_dict(mean_ci(list(acc[m].values()))),
               "pass_at_k": _ci_or_none(passk[m]),
               "start_accuracy": _interval_dict(mean_ci([v for v in start[m].values() if v is not None]))}
        if m != baseline and baseline in main:
            row["accuracy_vs_grpo"] = _interval_dict(paired_diff_ci(acc[m], acc[baseline]))
            if passk[m] and passk[baseline]:
                row["pass_at_k_vs_grpo"] = _interval_dict(paired_diff_ci(passk[m], passk[baseline]))
        rows[m] = row
    return rows


def _evals(records: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["eval/accuracy"]) for r in records if r.get("eval/accuracy") is not None]


def area_under_curve(points: list[tuple[int, float]]) -> float:
    """Mean held-out accuracy over the run: the trapezoid area under ``(step, accuracy)`` divided
    by the steps it spans (one evaluation: its accuracy)."""
    if not points:
        raise ValueError("no eval/accuracy in the run's metrics")
    if len(points) == 1:
        return points[0][1]
    area = sum((s1 - s0) * (a0 + a1) / 2 for (s0, a0), (s1, a1) in zip(points, points[1:]))
    return area / (points[-1][0] - points[0][0])


def steps_to(points: list[tuple[int, float]], threshold: float) -> tuple[int, bool]:
    """``(step, reached)``: the first evaluated step at or above ``threshold``; the last evaluated
    step and False when none is."""
    for step, acc in points:
        if acc >= threshold:
            return step, True
    return points[-1][0], False


def learning(runs: list[dict], threshold: float, baseline: str = "grpo") -> dict:
    """Per method of the main runs: the area under the held-out curve and the steps to
    ``threshold`` (see the module's docstring), means with 95% intervals and paired
    differences to ``baseline``; ``reached``: how many seeds reached the threshold."""
    main = _by(runs, "main")
    auc = {m: {s: area_under_curve(_evals(r["records"])) for s, r in seeds.items()} for m, seeds in main.items()}
    to = {m: {s: steps_to(_evals(r["records"]), threshold) for s, r in seeds.items()} for m, seeds in main.items()}
    rows = {}
    for m in main:
        steps = {s: float(v[0]) for s, v in to[m].items()}
        row = {"seeds": sorted(main[m]), "auc": _interval_dict(mean_ci(list(auc[m].values()))),
               "steps_to_threshold": _interval_dict(mean_ci(list(steps.values()))),
               "reached": sum(v[1] for v in to[m].values())}
        if m != baseline and baseline in main:
            row["auc_vs_grpo"] = _interval_dict(paired_diff_ci(auc[m], auc[baseline]))
            row["steps_vs_grpo"] = _interval_dict(paired_diff_ci(
                steps, {s: float(v[0]) for s, v in to[baseline].items()}))
        rows[m] = row
    return {"threshold": threshold, "rows": rows}


def ablation(runs: list[dict], group: str) -> dict:
    return {label: {"seeds": sorted(seeds), "accuracy": _interval_dict(mean_ci(
        [_final(r["records"], "eval/accuracy") for r in seeds.values()])),
        "pass_at_k": _ci_or_none(_passk(seeds))}
        for label, seeds in _by(runs, group).items()}


def arm_table(runs: list[dict], paper: str = "paper", baseline: str = "grpo") -> dict:
    """The ``arm`` group (``Grid.arms``): per arm, the final held-out accuracy, the area under
    the curve, and both paired by seed against the arm ``paper`` (the ablation method's main run)
    and against GRPO's main runs."""
    arms = _by(runs, "arm")
    grpo = _by(runs, "main").get(baseline, {})

    def final(seeds):
        return {s: _final(r["records"], "eval/accuracy") for s, r in seeds.items()}

    def auc(seeds):
        return {s: area_under_curve(_evals(r["records"])) for s, r in seeds.items()}

    out = {}
    for label, seeds in arms.items():
        row = {"seeds": sorted(seeds), "accuracy": _interval_dict(mean_ci(list(final(seeds).values()))),
               "auc": _interval_dict(mean_ci(list(auc(seeds).values())))}
        for name, other in ((paper, arms.get(paper)), (baseline, grpo)):
            if other and label != name:
                row[f"accuracy_vs_{name}"] = _interval_dict(paired_diff_ci(final(seeds), final(other)))
                row[f"auc_vs_{name}"] = _interval_dict(paired_diff_ci(auc(seeds), auc(other)))
        out[label] = row
    return out


def loss_table(runs: list[dict]) -> dict:
    """``{label: {"method", "seeds", "accuracy", "pass_at_k", "accuracy_vs_ppo_clip",
    "pass_at_k_vs_ppo_clip"}}`` of the loss axis; the baseline of ``m / loss [+ correction]``
    is ``m / ppo_clip`` (the main run, an alias), paired by seed."""
    rows = _by(runs, "loss")
    acc = {label: {s: _final(r["records"], "eval/accuracy") for s, r in seeds.items()}
           for label, seeds in rows.items()}
    passk = {label: _passk(seeds) for label, seeds in rows.items()}
    out = {}
    for label, seeds in sorted(rows.items()):
        method = next(iter(seeds.values()))["spec"]["method"]
        base = loss_label(method)
        row = {"method": method, "seeds": sorted(seeds),
               "accuracy": _interval_dict(mean_ci(list(acc[label].values()))),
               "pass_at_k": _ci_or_none(passk[label])}
        if label != base and base in rows:
            row["accuracy_vs_ppo_clip"] = _interval_dict(paired_diff_ci(acc[label], acc[base]))
            if passk[label] and passk[base]:
                row["pass_at_k_vs_ppo_clip"] = _interval_dict(paired_diff_ci(passk[label], passk[base]))
        out[label] = row
    return out


def _per_action_token(records: list[dict], keys: tuple[str, ...]) -> list[float]:
    """Seconds per action token of each trained step (steps with an evaluation included: the
    evaluation has its own phase and is not in these keys)."""
    out = []
    for r in records:
        if r.get("tokens/action"):
            out.append(sum(r.get(k, 0.0) for k in keys) / r["tokens/action"])
    return out


def cost(runs: list[dict], baseline: str = "grpo") -> dict:
    """Median seconds per action token over every step of every seed, and the ratio to GRPO."""
    main = _by(runs, "main")

    def median(xs):
        xs = sorted(xs)
        return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2

    out = {}
    for m, seeds in main.items():
        recs = [rec for r in seeds.values() for rec in r["records"]]
        out[m] = {"sweep_s_per_token": median(_per_action_token(recs, SWEEP)),
                  "step_s_per_token": median(_per_action_token(recs, ("time/step",)))}
    if baseline in out:
        for m in out:
            out[m]["sweep_ratio"] = out[m]["sweep_s_per_token"] / out[baseline]["sweep_s_per_token"]
            out[m]["step_ratio"] = out[m]["step_s_per_token"] / out[baseline]["step_s_per_token"]
    return out


def curves(runs: list[dict], group: str = "main") -> dict:
    """``{key: {label: {"steps", "mean", "lo", "hi"}}}``: the mean over seeds at each step that
    every seed logged, with the 95% band (none with one seed)."""
    out: dict = {}
    for key, _ in CURVES:
        out[key] = {}
        for label, seeds in _by(runs, group).items():
            per_seed = [{r["step"]: r[key] for r in run["records"] if r.get(key) is not None}
                        for run in seeds.values()]
            steps = sorted(set.intersection(*(set(p) for p in per_seed))) if per_seed else []
            ivs = [mean_ci([p[s] for p in per_seed]) for s in steps]
            out[key][label] = {"steps": steps, "mean": [iv.mean for iv in ivs],
                               "lo": [iv.mean - iv.half for iv in ivs],
                               "hi": [iv.mean + iv.half for iv in ivs]}
    return out


def _save(fig, path: Path) -> Path:
    """The figure to ``path`` as PNG (temp file, then rename), and closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def plot_curves(data: dict, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(4 * len(CURVES), 3.4))
    for ax, (key, name) in zip(axes, CURVES):
        for label, c in sorted(data[key].items()):
            if not c["steps"]:
                continue
            ax.plot(c["steps"], c["mean"], label=label, lw=1.4)
            if not any(math.isnan(v) for v in c["lo"]):
                ax.fill_between(c["steps"], c["lo"], c["hi"], alpha=0.15)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)


def plot_recall(tables: dict[str, dict], path: Path) -> Path:
    """Figure 5a (signals, first probe) and 5b (OAR-P per probe) side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    first = next(iter(tables.values()))
    for method, rec in first["recall"].items():
        a.plot(first["k_percents"], rec["micro"], marker="o", ms=3, label=method)
    a.plot(first["k_percents"], [k / 100 for k in first["k_percents"]], "k:", lw=0.8, label="chance")
    a.set_title(f"5a: oracle recall at top-K% (probe {next(iter(tables))})", fontsize=10)
    for probe, t in tables.items():
        if "oar_p" in t["recall"]:
            b.plot(t["k_percents"], t["recall"]["oar_p"]["micro"], marker="o", ms=3, label=probe)
    b.set_title("5b: OAR-P recall per outcome probe", fontsize=10)
    for ax in (a, b):
        ax.set_xlabel("top K% of scored tokens")
        ax.set_ylabel("recall of causal pivots")
        ax.legend(fontsize=7)
    return _save(fig, path)


def _cell(d: dict | None, digits: int = 1, scale: float = 100.0) -> str:
    if d is None:
        return "-"
    return fmt(Interval(d["mean"], float("nan") if d["half95"] is None else d["half95"], d["n"]),
               scale=scale, digits=digits)


def render(report: dict) -> str:
    """``docs/repro.md``'s tables from the report dict."""
    k = report["settings"]["pass_k"] or "k (not measured)"
    lines = ["## Table 1: held-out accuracy (%), mean ± 95% t-interval over seeds", "",
             f"| method | seeds | greedy accuracy at step 0 | greedy accuracy, last step | "
             f"vs GRPO (paired) | pass@{k} | vs GRPO (paired) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for m, row in report["table1"].items():
        lines.append(f"| {m} | {len(row['seeds'])} | {_cell(row['start_accuracy'])} | "
                     f"{_cell(row['accuracy'])} | {_cell(row.get('accuracy_vs_grpo'))} | "
                     f"{_cell(row['pass_at_k'])} | {_cell(row.get('pass_at_k_vs_grpo'))} |")
    if report.get("learning", {}).get("rows"):
        thr = report["learning"]["threshold"]
        lines += ["", "## Learning curve: area under the held-out curve, steps to "
                  f"{thr * 100:g}% held-out accuracy", "",
                  "Area: the mean held-out greedy accuracy over the run (%, trapezoids between "
                  "evaluations). Steps: the first evaluation at or above the threshold; a seed "
                  "that never reaches it counts as its last evaluated step (a lower bound).", "",
                  "| method | seeds | area under the curve | vs GRPO (paired) | steps to threshold | "
                  "seeds that reached it | vs GRPO (paired) |", "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {m} | {len(r['seeds'])} | {_cell(r['auc'])} | {_cell(r.get('auc_vs_grpo'))} | "
                  f"{_cell(r['steps_to_threshold'], scale=1.0)} | {r['reached']} | "
                  f"{_cell(r.get('steps_vs_grpo'), scale=1.0)} |"
                  for m, r in report["learning"]["rows"].items()]
    for group, title in (("tau", "Table 3: tau (OAR-G)"), ("probe", "Table 4: outcome probe (OAR-G)"),
                         ("floor", "Suppression floor (OAR-G)")):
        rows = report["ablations"].get(group) or {}
        if not rows:
            continue
        lines += ["", f"## {title}", "", f"| setting | seeds | greedy accuracy | pass@{k} |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {label} | {len(r['seeds'])} | {_cell(r['accuracy'])} | {_cell(r['pass_at_k'])} |"
                  for label, r in rows.items()]
    if report.get("arms"):
        lines += ["", "## Ablation arms (paired by seed against the arm `paper` and against GRPO)", "",
                  "| arm | seeds | greedy accuracy, last step | vs paper | vs GRPO | area under the curve | "
                  "vs paper | vs GRPO |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {label} | {len(r['seeds'])} | {_cell(r['accuracy'])} | "
                  f"{_cell(r.get('accuracy_vs_paper'))} | {_cell(r.get('accuracy_vs_grpo'))} | "
                  f"{_cell(r['auc'])} | {_cell(r.get('auc_vs_paper'))} | {_cell(r.get('auc_vs_grpo'))} |"
                  for label, r in report["arms"].items()]
    if report.get("losses"):
        lines += ["", "## Policy losses and rollout correction (GRPO and OAR-G)", "",
                  f"| method / loss | seeds | greedy accuracy | vs ppo_clip (paired) | pass@{k} | "
                  "vs ppo_clip (paired) |", "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {label} | {len(r['seeds'])} | {_cell(r['accuracy'])} | "
                  f"{_cell(r.get('accuracy_vs_ppo_clip'))} | {_cell(r['pass_at_k'])} | "
                  f"{_cell(r.get('pass_at_k_vs_ppo_clip'))} |" for label, r in report["losses"].items()]
    if report.get("oracle"):
        lines += ["", "## Figure 5: oracle recall of causal pivots (%, micro over tokens)", ""]
        for probe, t in report["oracle"].items():
            ks = t["k_percents"]
            share = t["pivots"] / t["scored_tokens"] if t["scored_tokens"] else float("nan")
            lines += [f"probe `{probe}`: {t['trajectories']} correct trajectories, {t['pivots']} "
                      f"pivots among {t['scored_tokens']} scored tokens (pivot share "
                      f"{share:.1%})", "", "| signal | " + " | ".join(f"top {k:g}%" for k in ks) + " |",
                      "|---|" + "---:|" * len(ks)]
            lines += [f"| {m} | " + " | ".join(f"{v * 100:.1f}" for v in rec["micro"]) + " |"
                      for m, rec in t["recall"].items()]
            lines.append("")
    if report.get("oracle_confirmation"):
        lines += ["## The oracle against the pivots built into the task", "",
                  "Scored tokens of the oracle's correct trajectories; built-in pivots: operator "
                  "words and numbers before the answer tag (`data/chain.py: token_pivots`).", "",
                  "| probe | trajectories | scored tokens | built-in pivot share | oracle pivot share | "
                  "oracle flips on built-in pivots | on other tokens | oracle pivots that are built-in |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {p} | {c['trajectories']} | {c['scored_tokens']} | {_pct(c['pivot_share'])} | "
                  f"{_pct(c['oracle_share'])} | {_pct(c['flip_rate_pivots'])} | {_pct(c['flip_rate_other'])} | "
                  f"{_pct(c['oracle_on_pivots'])} |" for p, c in report["oracle_confirmation"].items()]
        controlled = {p: c for p, c in report["oracle_confirmation"].items() if c.get("controlled_tokens")}
        if controlled:
            lines += ["", "With the control decode (`--control`): a label counts as caused only where "
                      "greedy decoding after the token itself, unsubstituted, still verifies.", "",
                      "| probe | control verifies | caused pivot share | caused flips on built-in pivots | "
                      "on other tokens | caused pivots that are built-in |", "|---|---:|---:|---:|---:|---:|"]
            lines += [f"| {p} | {_pct(c['kept_share'])} | {_pct(c['caused_share'])} | "
                      f"{_pct(c['caused_flip_rate_pivots'])} | {_pct(c['caused_flip_rate_other'])} | "
                      f"{_pct(c['caused_on_pivots'])} |" for p, c in controlled.items()]
        lines.append("")
    if report.get("cost"):
        lines += ["## Figure 7: cost per action token, ratio to GRPO (median over steps and seeds)",
                  "", "| method | sweep s/token | sweep ratio | step s/token | step ratio |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {m} | {c['sweep_s_per_token'] * 1e3:.3f} ms | {c.get('sweep_ratio', float('nan')):.2f} | "
                  f"{c['step_s_per_token'] * 1e3:.3f} ms | {c.get('step_ratio', float('nan')):.2f} |"
                  for m, c in report["cost"].items()]
    return "\n".join(lines) + "\n"


def _pct(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * 100:.1f}%"


def build(out: Path, settings: dict, aliases: list[dict] = (), names: set[str] | None = None) -> dict:
    """Everything above from ``out`` (its finished runs named ``names``, where given); writes
    ``report.json`` and the PNGs, returns the dict."""
    from megatron_oar.eval.pivots import confirmation
    from megatron_oar.eval.records import read_records

    runs = load_runs(out, aliases, names)
    report = {"settings": settings, "runs": len({r["spec"]["name"] for r in runs}),
              "table1": table1(runs),
              "learning": learning(runs, settings.get("threshold", 0.6)),
              "ablations": {g: ablation(runs, g) for g in ("tau", "probe", "floor")},
              "arms": arm_table(runs),
              "losses": loss_table(runs),
              "cost": cost(runs), "curves": curves(runs), "oracle": {}}
    for d in sorted((out / "oracle").glob("*/recall.json")):
        report["oracle"][d.parent.name] = json.loads(d.read_text())
    report["oracle_confirmation"] = {
        d.parent.name: confirmation(read_records(d)) for d in sorted((out / "oracle").glob("*/records.jsonl"))}
    report["figures"] = {"curves": str(plot_curves(report["curves"], out / "curves.png",
                                                   "mean and 95% band over seeds"))}
    if report["oracle"]:
        report["figures"]["recall"] = str(plot_recall(report["oracle"], out / "recall.png"))
    atomic_write_text(out / "report.json", json.dumps(report, indent=1))
    return report
