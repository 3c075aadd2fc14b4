"""Prediction against measurement, distance to the optimum and the downstream table of a ``klgrad compare`` grid
on a real model (the converged SmolLM2 sharpening grid, experiments/smollm2_sharpen_converged/):

    python experiments/smollm2_sharpen_converged/sharpen_report.py GRID_DIR [REGIME_JSON] \
        [--train-regime TRAIN_REGIME_JSON] [--out DIR]

``REGIME_JSON`` (without it, only the per-run, downstream and forgetting tables are written) is ``klgrad regime
--split heldout`` on the grid's config and β: the reference sampled K times on the same held-out prompts the grid's
final KL is measured on (``--kl-prompts``, in the same order; the downstream evaluation's are matched by prompt
text, the regime's example ids resolved through the run's task). Reads each finished run's ``final.json``
(``stepwise_kl_per_prompt``; the ``downstream`` measurement's ``klgrad eval`` of the final policy and its
per-problem completions, in final.json or, measured afterwards, ``downstream.json``) and writes into ``--out``
(default: GRID_DIR):

- ``runs.md``: one row per finished run, as its ``final.json`` has it: the primary metric (``batch_kl_k1``, the
  training batches' sequence k1 over the last 10 steps), the held-out stepwise KL(π‖π_ref) ± its SE, the
  held-out forward KL(π_ref‖π) ± SE, greedy accuracy, the steps run and the machine;
- ``prediction.png`` / ``prediction.json``: per held-out prompt, each head's measured KL(π‖π_ref) (mean over
  seeds) against ``klgrad regime``'s fixed-point KL for that head (k2_as_loss and k1_in_reward: the reverse-KL
  optimum π* ∝ π_ref·e^{R/β}; k3_as_loss: the forward-KL fixed point), with the Pearson correlation over prompts
  and the mean gap measured − predicted (t interval over seeds);
- ``primary.png`` / ``primary.json`` (with ``--train-regime``, a ``klgrad regime --split train``): the primary
  metric (``batch_kl_k1``) of each head against its fixed point on the training prompts, and the paired
  k3 − k2 difference against the predicted one (with the paired t-test of "the difference is the prediction");
- ``optimum.json``: each run's KL(π‖π*) on the held-out prompts,

      KL(π‖π*) = mean_x [ KL_x(π‖π_ref) − p_x/β + log Z_x ],   Z_x = Σ_r m_x(r)·e^{r/β},

  KL_x the run's stepwise KL (16 policy samples), p_x the mean reward of the downstream evaluation's samples
  (8 per prompt, at the run's temperature: the task's 0/1 reward), m_x the regime's reward masses (K reference
  samples). The three pieces come from independent samples, so the estimate is unbiased up to log Ẑ's Jensen
  bias and its variance is the sum of theirs: SE² = se_KL² + Σ_x p̂_x(1 − p̂_x)/(n_x·β²)/P² +
  Σ_x Var(W)/(K·Ẑ_x²)/P² (W = e^{R/β} over the reference samples; the delta method for log Ẑ). Prompts the
  reference never rewarded in K samples are counted (their log Z is then only bounded, see
  klgrad.exact.estimators);
- ``downstream.md`` / ``downstream.json``: per method, mean ± 95% t interval over seeds of greedy accuracy,
  pass@1 and pass@8 on the held-out prompts and on the harder variant, and each paired difference between two
  methods (per-seed differences, t interval, paired t-test p and exact sign-flip p);
- ``forgetting.md`` / ``forgetting.json`` (when ``klgrad compare measure`` has measured runs' forgetting): the
  same for KL(π‖π_ref) and KL(π_ref‖π) on the shipped general chat prompts;
- ``noise.md`` / ``noise.json`` (when the grid's summary has a convergence record with a gap): how much of each
  convergence test's per-seed movement sampling alone explains, and the seeds a stepwise-KL metric would need
  (:func:`window_noise`; exploratory, not the stated criterion).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import numpy as np
from scipy import stats as st

from klgrad.compare.convergence import cut_before_decay, metric_series, seeds_for_sd, window_deltas, window_spans
from klgrad.compare.design import read_grid, registered_seeds
from klgrad.compare.render import markdown_table
from klgrad.compare.stats import holm, mean_ci, paired_by_seed, paired_t_p, sign_flip
from klgrad.exact.estimators import log_z_of_masses
from klgrad.plotting import pyplot, save
from klgrad.trainer import read_jsonl

PREDICTED = {"k2_as_loss": "kl_reverse", "k1_in_reward": "kl_reverse", "k3_as_loss": "kl_forward"}
"""Which of the regime's fixed points each head is predicted to reach."""
COLORS = {"k2_as_loss": "#808000", "k3_as_loss": "firebrick", "k1_in_reward": "royalblue", "none": "#555555"}


def ci(xs: list[float]) -> tuple[float, float, float]:
    """Mean and its 95% t interval (NaN bounds for fewer than 2 values)."""
    m, half = mean_ci(xs)
    return m, m - half, m + half


def runs(grid: Path) -> list[dict]:
    """Every finished run: method, seed and final.json, with its ``downstream`` from ``downstream.json`` when the
    run was measured afterwards (``klgrad compare measure GRID downstream``) rather than by the hook before its
    final.json was written."""
    out = []
    for d in sorted((grid / "runs").glob("*")):
        f = d / "final.json"
        if f.is_file():
            method, _, seed = d.name.partition("-beta")
            final = json.loads(f.read_text())
            later = d / "downstream.json"
            if "downstream" not in final and later.is_file():
                final["downstream"] = json.loads(later.read_text())["downstream"]
            out.append({"method": method, "seed": int(seed.rsplit("seed", 1)[1]), "dir": d, "final": final})
    return out


def per_problem_rewards(run_dir: Path, bench: str) -> dict[str, list[bool]]:
    """The downstream evaluation's per-sample correctness on one benchmark, by prompt text (``klgrad eval`` names
    the problems of a file without ids by position, ``heldout-1``…, not by the task's example ids)."""
    path = run_dir / "downstream" / "eval" / "completions" / "policy" / f"{bench}.jsonl"
    return {r["prompt"]: r["correct"] for r in map(json.loads, path.read_text().splitlines())}


def heldout_prompts(run_dir: Path) -> dict[str, str]:
    """Example id → prompt text of the run's held-out split, the task regenerated from the run's config.yaml
    (``klgrad regime`` records each prompt's id, not its text)."""
    from klgrad.config import load_config
    from klgrad.data.tasks import make_splits

    d = load_config(str(run_dir / "config.yaml")).data
    _, heldout = make_splits(d.task, d.n_train, d.n_eval, d.seed, d.digits)
    return {e.id: e.prompt for e in heldout}


def kl_to_optimum(run: dict, regime: dict, beta: float) -> dict:
    """KL(π‖π*) of one run on the held-out prompts (module docstring) with its SE."""
    f = run["final"]
    kls = f["stepwise_kl_per_prompt"]
    prompts = regime["prompts"][: len(kls)]
    by_prompt = per_problem_rewards(run["dir"], "heldout")
    texts = [e["prompt"] for e in prompts] if all("prompt" in e for e in prompts) else None
    if texts is None:  # the regime names its prompts by example id: their texts from the run's task
        ids = heldout_prompts(run["dir"])
        missing = sorted({e["id"] for e in prompts} - ids.keys())
        if missing:
            raise ValueError(f"{run['dir']}: the regime's prompts {missing[:3]} are not in the run's held-out split")
        texts = [ids[e["id"]] for e in prompts]
    correct = [by_prompt[x] for x in texts]  # the same held-out prompts, matched by their text
    k = regime["samples_per_prompt"]
    terms, var_p, var_z = [], 0.0, 0.0
    for kl, entry, c in zip(kls, prompts, correct, strict=True):
        masses = [tuple(m) for m in entry["masses"]]
        p = sum(c) / len(c)
        log_z, log_z_var = log_z_of_masses(masses, beta, k)
        terms.append(kl - p / beta + log_z)
        var_p += p * (1 - p) / len(c) / beta**2
        var_z += log_z_var
    n = len(terms)
    se = math.sqrt(f["stepwise_kl_se"] ** 2 + (var_p + var_z) / n**2)
    never = sum(e["success_rate"] == 0 for e in prompts)
    return {"kl_to_optimum": sum(terms) / n, "se": se, "prompts": n, "prompts_never_rewarded": never}


def prediction(rs: list[dict], regime: dict, out: Path) -> dict:
    """The per-prompt scatter and its numbers (module docstring)."""
    fig, ax = pyplot().subplots(figsize=(6.2, 5.2))
    result = {}
    top = 0.0
    for method, key in PREDICTED.items():
        mine = [r for r in rs if r["method"] == method and "stepwise_kl_per_prompt" in r["final"]]
        if not mine:
            continue
        per_seed = np.array([r["final"]["stepwise_kl_per_prompt"] for r in mine])  # (seeds, P)
        pred = np.array([e[key] for e in regime["prompts"][: per_seed.shape[1]]])
        meas = per_seed.mean(0)
        gaps = (per_seed - pred).mean(1)  # per seed: mean over prompts of measured − predicted
        m, lo, hi = ci([float(g) for g in gaps])
        r_corr = float(np.corrcoef(pred, meas)[0, 1]) if pred.std() > 0 and meas.std() > 0 else math.nan
        result[method] = {
            "seeds": len(mine),
            "predicted_mean": float(pred.mean()),
            "measured_mean": float(meas.mean()),
            "gap_mean": m,
            "gap_ci": [lo, hi],
            "pearson_r": r_corr,
            "per_prompt": {"predicted": pred.tolist(), "measured": meas.tolist()},
        }
        ax.scatter(
            pred, meas, s=22, alpha=0.8, color=COLORS[method], label=f"{method} (r = {r_corr:.2f}, gap {m:+.3f})"
        )
        top = max(top, float(pred.max()), float(meas.max()))
    ax.plot([0, top * 1.05], [0, top * 1.05], color="#999999", lw=1, ls="--", label="measured = predicted")
    ax.set_xlabel("predicted fixed-point KL(π‖π_ref) per prompt (klgrad regime)")
    ax.set_ylabel("measured final KL(π‖π_ref) per prompt, mean over seeds")
    ax.set_title("held-out prompts: prediction against measurement", fontsize=10)
    ax.legend(fontsize=8)
    save(fig, out / "prediction.png", 150)
    (out / "prediction.json").write_text(json.dumps(result, indent=1))
    return result


def primary(rs: list[dict], regime: dict, out: Path, registered: int | None = None) -> dict:
    """``primary.png`` / ``primary.json``: the grid's primary metric (``batch_kl_k1``, the training batches'
    sequence k1) of each head, mean and 95% t interval over seeds, against its fixed point on the training prompts
    (a ``klgrad regime --split train``: its mean and bootstrap interval), and the paired k3 − k2 difference against
    the predicted forward − reverse one. ``registered``: a grid whose seed count was amended is drawn and tested on
    its first ``registered`` seeds (the registered test); the difference on every seed is recorded beside it
    (``k3_minus_k2_all_seeds``)."""

    def by_method(rows: list[dict]) -> dict[str, dict[int, float]]:
        by = {m: {r["seed"]: r["final"]["batch_kl_k1"] for r in rows if r["method"] == m} for m in PREDICTED}
        return {m: v for m, v in by.items() if v}

    every = by_method(rs)
    by = by_method([r for r in rs if registered is None or r["seed"] < registered])
    result: dict = {"heads": {}, "prompts": regime["n_prompts"], "samples_per_prompt": regime["samples_per_prompt"]}
    if registered is not None:
        result["registered_seeds"] = registered
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    for i, (m, vals) in enumerate(by.items()):
        side = PREDICTED[m].removeprefix("kl_")  # "reverse" (π*) or "forward" (π_f)
        pred, (plo, phi) = regime["predicted_kl"][side], regime["interval_95"][side]
        mean, lo, hi = ci(list(vals.values()))
        result["heads"][m] = {"predicted": pred, "predicted_ci": [plo, phi], "measured": mean, "measured_ci": [lo, hi],
                              "seeds": len(vals)}  # fmt: skip
        left.bar(i - 0.2, pred, 0.4, color=COLORS[m], alpha=0.35, hatch="//", yerr=[[pred - plo], [phi - pred]],
                 capsize=4, label="predicted fixed point" if i == 0 else None)  # fmt: skip
        left.bar(i + 0.2, mean, 0.4, color=COLORS[m], yerr=[[mean - lo], [hi - mean]], capsize=4,
                 label="measured, mean over seeds" if i == 0 else None)  # fmt: skip
    left.set_xticks(range(len(by)), [f"{m}\n({'π*' if PREDICTED[m] == 'kl_reverse' else 'π_f'})" for m in by])
    left.set_ylabel("KL(π‖π_ref), training batches\n(sequence k1, last 10 steps)")
    left.set_ylim(0, 1.35 * max(max(h["predicted_ci"][1], h["measured_ci"][1]) for h in result["heads"].values()))
    left.legend(fontsize=8, loc="upper right")
    if {"k3_as_loss", "k2_as_loss"} <= by.keys():
        d = paired_by_seed(by["k3_as_loss"], by["k2_as_loss"])
        want = regime["predicted_kl"]["forward"] - regime["predicted_kl"]["reverse"]
        wlo, whi = regime["interval_95"]["forward_minus_reverse"]
        seeds = sorted(by["k3_as_loss"].keys() & by["k2_as_loss"].keys())
        diffs = [by["k3_as_loss"][s] - by["k2_as_loss"][s] for s in seeds]
        result["k3_minus_k2"] = {
            "predicted": want,
            "predicted_ci": [wlo, whi],
            "measured": d,
            "p_vs_predicted": paired_t_p(diffs, shift=want),  # two-sided paired t of "the difference is the prediction"
        }
        if every != by:
            result["k3_minus_k2_all_seeds"] = paired_by_seed(every["k3_as_loss"], every["k2_as_loss"])
        right.errorbar([0], [want], yerr=[[want - wlo], [whi - want]], fmt="s", color="#777777", capsize=5)
        right.errorbar([1], [d["mean"]], yerr=[[d["mean"] - d["ci"][0]], [d["ci"][1] - d["mean"]]], fmt="o",
                       color="black", capsize=5)  # fmt: skip
        right.axhline(0, color="#999999", lw=1)
        right.set_xticks([0, 1], ["predicted", f"measured\n({d['n']} paired seeds)"])
        right.set_xlim(-0.6, 1.6)
        right.set_ylabel("k3_as_loss − k2_as_loss (nats)")
    else:
        right.set_axis_off()
    fig.suptitle(f"the primary metric against klgrad regime's fixed points ({regime['n_prompts']} training prompts × "
                 f"{regime['samples_per_prompt']} reference samples)", fontsize=10)  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    save(fig, out / "primary.png", 150)
    (out / "primary.json").write_text(json.dumps(result, indent=1))
    return result


def optimum_summary(opt: dict[str, dict]) -> dict:
    """Over seeds, from :func:`kl_to_optimum`'s per-run numbers (keys ``METHOD/seedS``): each method's mean KL(π‖π*)
    with its 95% t interval and seed count, and the paired k3_as_loss − k2_as_loss difference (seeds with both)."""
    by: dict[str, dict[int, float]] = {}
    for key, v in opt.items():
        method, seed = key.split("/seed")
        by.setdefault(method, {})[int(seed)] = v["kl_to_optimum"]
    out: dict = {"by_method": {}}
    for m, vals in sorted(by.items()):
        mean, lo, hi = ci(list(vals.values()))
        out["by_method"][m] = {"n": len(vals), "mean": mean, "ci": [lo, hi]}
    if {"k3_as_loss", "k2_as_loss"} <= by.keys():
        out["k3_minus_k2"] = paired_by_seed(by["k3_as_loss"], by["k2_as_loss"])
    return out


def cell(v: dict, signed: bool = False) -> str:
    """``mean [lo, hi]`` of a table entry."""
    f = "+.3f" if signed else ".3f"
    return f"{v['mean']:{f}} [{v['ci'][0]:{f}}, {v['ci'][1]:{f}}]"


def paired_tables(by: dict[str, dict[str, dict[int, float]]], cols: list[str]) -> tuple[dict, dict, list[str]]:
    """Per method and column, mean ± 95% t interval over seeds (``by[method][column][seed]``), each paired
    difference between two methods over their common seeds, and both as markdown lines."""
    methods = sorted(by)
    table: dict = {}
    for m in methods:
        table[m] = {}
        for col in cols:
            vals = by[m][col]
            mean, lo, hi = ci(list(vals.values()))
            table[m][col] = {"mean": mean, "ci": [lo, hi], "seeds": len(vals), "by_seed": vals}
    pairs = {
        f"{a} - {b}": {col: paired_by_seed(table[a][col]["by_seed"], table[b][col]["by_seed"]) for col in cols}
        for i, a in enumerate(methods)
        for b in methods[i + 1 :]
    }
    rows = [(m, table[m][cols[0]]["seeds"], *(cell(table[m][c]) for c in cols)) for m in methods]
    lines = markdown_table(("method", "seeds", *cols), rows)
    lines += [
        "",
        "Paired differences (per-seed, mean [95% t interval], paired t-test p and exact sign-flip p, "
        "two-sided, unadjusted):",
        "",
    ]

    def paired(t: dict | None) -> str:
        if t is None:
            return "–"
        return (f"{t['mean']:+.3f} [{t['ci'][0]:+.3f}, {t['ci'][1]:+.3f}] t p={t['t_p']:.3f}, "
                f"sign-flip p={t['sign_flip_p']:.3f}")  # fmt: skip

    lines += markdown_table(
        ("difference", *cols), [(name, *(paired(by[c]) for c in cols)) for name, by in pairs.items()]
    )
    return table, pairs, lines


def downstream(rs: list[dict], out: Path) -> dict:
    """The downstream table (module docstring)."""
    keys = [("heldout", "greedy_accuracy"), ("heldout", "pass@1"), ("heldout", "pass@k"), ("harder", "greedy_accuracy"),
            ("harder", "pass@1"), ("harder", "pass@k")]  # fmt: skip
    done = [r for r in rs if "downstream" in r["final"]]
    by: dict = {}
    for r in done:
        benches = r["final"]["downstream"]["eval"]["benchmarks"]
        for bench, key in keys:
            by.setdefault(r["method"], {}).setdefault(f"{bench} {key}", {})[r["seed"]] = benches[bench][key]
    table, pairs, lines = paired_tables(by, [f"{b} {k}" for b, k in keys])
    (out / "downstream.md").write_text("\n".join(lines) + "\n")
    (out / "downstream.json").write_text(json.dumps({"table": table, "paired": pairs}, indent=1, default=str))
    return {"table": table, "paired": pairs}


def forgetting(rs: list[dict], out: Path) -> dict:
    """The forgetting table (module docstring): both KLs on the general chat prompts, from the runs'
    ``forgetting.json`` (``klgrad compare measure GRID forgetting:samples=4``, its KLs under ``forgetting``; the
    files of the script that did this before hold them at the top level); empty when no run has one."""
    cols = {"reverse_kl": "chat KL(π‖π_ref)", "forward_kl": "chat KL(π_ref‖π)"}
    by: dict = {}
    for r in rs:
        f = r["dir"] / "forgetting.json"
        if f.is_file():
            rec = json.loads(f.read_text())
            rec = rec.get("forgetting", rec)
            for key, col in cols.items():
                by.setdefault(r["method"], {}).setdefault(col, {})[r["seed"]] = rec[key]
    if not by:
        return {}
    table, pairs, lines = paired_tables(by, list(cols.values()))
    (out / "forgetting.md").write_text("\n".join(lines) + "\n")
    (out / "forgetting.json").write_text(json.dumps({"table": table, "paired": pairs}, indent=1, default=str))
    return {"table": table, "paired": pairs}


def half_steps(last: int, window: float) -> tuple[int, int]:
    """Integer steps in each half of the last ``window`` of a run logged at steps 1..``last`` (the criterion's
    halves, :func:`klgrad.compare.convergence.window_spans`)."""
    first, second = window_spans(last, window)
    return tuple(sum(a < t <= b for t in range(1, last + 1)) for a, b in (first, second))  # type: ignore[return-value]


def paired_movement(conv: dict, bound: float) -> dict:
    """The convergence tests on the per-seed difference δ_a − δ_b of the primary hypothesis' two methods (the first
    two of the record), paired by seed: the correlation of their movements, the difference's sd and the seeds at
    which its standard error would meet ``bound``. Empty without two methods with seeds in common."""
    by = conv["by_method"]
    if len(by) < 2:
        return {}
    a, b = list(by)[:2]
    if "seeds" not in by[a] or "seeds" not in by[b]:
        return {}
    common = sorted(set(by[a]["seeds"]) & set(by[b]["seeds"]))
    tests = {}
    for name in ("end", "before_decay"):
        ra, rb = (by[m] if name == "end" else by[m].get(name) for m in (a, b))
        if not ra or not rb or not ra.get("deltas") or not rb.get("deltas") or len(common) < 3:
            continue
        da = dict(zip(by[a]["seeds"], ra["deltas"], strict=True))
        db = dict(zip(by[b]["seeds"], rb["deltas"], strict=True))
        x, y = np.array([da[s] for s in common]), np.array([db[s] for s in common])
        sd = float(np.std(x - y, ddof=1))
        tests[name] = {"correlation": float(np.corrcoef(x, y)[0, 1]), "sd": sd, "seeds_needed": seeds_for_sd(sd, bound)}
    return {"a": a, "b": b, "seeds": len(common), "tests": tests} if tests else {}


SCAN = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
"""Cut points (fractions of the run) at which noise.md repeats the movement test."""


def sampling_var(halves: tuple[int, int], between: float, within: float, group: int, per_step: int) -> float:
    """var(δ) at a policy that no longer moves: Σ over the two halves of (σ_b² + σ_w²/G)/(h·P), h the half's steps,
    P prompts a step, G samples a prompt, σ_b² the prompts' spread and σ_w² the within-prompt one."""
    return sum((between + within / group) / (h * per_step) for h in halves)


def window_noise(rs: list[dict], grid: Path, out: Path) -> dict:
    r"""``noise.json`` / ``noise.md``: how much of the convergence tests' per-seed movement δ_s sampling alone
    explains, and what the stepwise KL as the logged metric would change. Exploratory: not the stated criterion.

    Model: at a policy that no longer moves, a window half of h steps averages h·P prompts (P per step), G samples
    each, so its mean has variance σ_b²/(hP) + σ_w²/(hPG), and δ (second half minus first) the sum over the two
    halves. σ_w² is the within-prompt variance of the per-sequence estimate, from each final policy's held-out
    measurement on the same samples (clustered SE² × prompts × samples, for k1 and for the stepwise KL); σ_b² the
    variance of the per-prompt KLs (the stepwise per-prompt means, less their own sampling variance). Held-out
    prompts stand in for the training prompts, and drawing prompts without replacement would make the σ_b² term
    smaller. The excess, observed var(δ) − predicted, is movement the model does not explain (the seeds moving
    differently, or a wrong model); the projection for a stepwise metric keeps it and swaps the sampling term."""
    if not (grid / "summary.json").is_file():
        return {}
    summary = json.loads((grid / "summary.json").read_text())
    record = json.loads((grid / "grid.json").read_text())
    conv = summary.get("convergence") or {}
    par = conv.get("parameters") or {}
    if not conv.get("by_method") or par.get("gap") is None:
        return {}
    roll = record["resolved_config"]["rollout"]
    per_step, group = roll["prompts_per_step"], roll["group_size"]
    bound = par["se_fraction"] * par["gap"]
    samples = record["estimate_samples"]
    result: dict = {"bound": bound, "prompts_per_step": per_step, "group_size": group, "methods": {}}
    for m, v in conv["by_method"].items():
        finals = [r for r in rs if r["method"] == m and "stepwise_kl_per_prompt" in r["final"]]
        if len(finals) < 2:
            continue
        sig: dict[str, float] = {}
        for key, se_key in (("k1", "sampled_k1_se"), ("stepwise", "stepwise_kl_se")):
            sig[key] = float(np.mean([
                r["final"][se_key] ** 2 * len(r["final"]["stepwise_kl_per_prompt"]) * samples for r in finals
            ]))  # fmt: skip
        between = float(np.mean([np.var(r["final"]["stepwise_kl_per_prompt"], ddof=1) for r in finals]))
        sig["between"] = max(0.0, between - sig["stepwise"] / samples)
        records = [read_jsonl(r["dir"] / "metrics.jsonl") for r in finals]
        series = [metric_series(rec, par.get("metric", "kl/k1")) for rec in records]
        lr = metric_series(records[0], "lr")  # one schedule for every run of the grid
        top = max(x for _, x in lr)
        cut = cut_before_decay(lr, lr)[-1][0]  # where the lr is last at least half its peak, as the criterion cuts
        tests = {}
        for name, rec, last in (("end", v, lr[-1][0]), ("before_decay", v.get("before_decay"), cut)):
            if rec is None or not rec.get("deltas"):
                continue
            hs = half_steps(last, par["window"])
            var_k1, var_sw = (sampling_var(hs, sig["between"], sig[k], group, per_step) for k in ("k1", "stepwise"))
            observed = float(np.var(rec["deltas"], ddof=1))
            excess = max(0.0, observed - var_k1)
            projected = math.sqrt(excess + var_sw)
            tests[name] = {
                "steps_per_half": list(hs),
                "sd_observed": math.sqrt(observed),
                "sd_sampling_k1": math.sqrt(var_k1),
                "sd_sampling_stepwise": math.sqrt(var_sw),
                "sd_excess": math.sqrt(excess),
                "sd_projected_stepwise": projected,
                "seeds_needed_k1": seeds_for_sd(math.sqrt(observed), bound),
                "seeds_needed_stepwise": seeds_for_sd(projected, bound),
                "seeds_needed_sampling_only": [seeds_for_sd(math.sqrt(x), bound) for x in (var_k1, var_sw)],
            }
        scan = []
        for frac in SCAN:  # the same test at other cut points: is the spread at the registered cut typical?
            h = round(frac * lr[-1][0])
            cut_runs = [[(t, x) for t, x in s if t <= h] for s in series]
            d = window_deltas(cut_runs, par["window"])
            if d is None or len(d) < 2:
                continue
            var_k1 = sampling_var(half_steps(h, par["window"]), sig["between"], sig["k1"], group, per_step)
            sd = float(np.std(d, ddof=1))
            scan.append({"cut": h, "lr_fraction": dict(lr).get(h, float("nan")) / top, "sd_observed": sd,
                         "sd_sampling_k1": math.sqrt(var_k1), "ratio": sd / math.sqrt(var_k1)})  # fmt: skip
        result["methods"][m] = {
            "seeds": len(finals),
            "sd_within_k1": math.sqrt(sig["k1"]),
            "sd_within_stepwise": math.sqrt(sig["stepwise"]),
            "sd_between_prompts": math.sqrt(sig["between"]),
            "tests": tests,
            "scan": scan,
        }
    result["paired"] = paired_movement(conv, bound)
    lines = [
        "| method | test | steps per half | sd(δ) observed | sampling alone, k1 | excess | sampling alone, stepwise "
        "| projected, stepwise | seeds for the SE bound: k1; stepwise |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m, mv in result["methods"].items():
        for name, t in mv["tests"].items():
            lines.append(
                f"| {m} | {name.replace('_', ' ')} | {t['steps_per_half'][0]}, {t['steps_per_half'][1]} "
                f"| {t['sd_observed']:.3f} | {t['sd_sampling_k1']:.3f} | {t['sd_excess']:.3f} "
                f"| {t['sd_sampling_stepwise']:.3f} | {t['sd_projected_stepwise']:.3f} "
                f"| {t['seeds_needed_k1']}; {t['seeds_needed_stepwise']} |"
            )
    cuts = [x["cut"] for x in next(iter(result["methods"].values()), {}).get("scan", [])]
    lines += [
        "",
        "The same test at other cut points (the run cut at step H, the halves of its last quarter; sampling alone as "
        "above):",
        "",
        "| method | " + " | ".join(f"H = {h}" for h in cuts) + " |",
        "|---|" + "---|" * len(cuts),
    ]
    for m, mv in result["methods"].items():
        cells = [f"{x['sd_observed']:.3f} / {x['sd_sampling_k1']:.3f} ({x['ratio']:.2f})" for x in mv["scan"]]
        lines.append(f"| {m}: sd(δ) observed / sampling (ratio) | " + " | ".join(cells) + " |")
    pr = result["paired"]
    if pr:
        lines += [
            "",
            f"Paired by seed, {pr['a']} − {pr['b']} ({pr['seeds']} seeds): the movement of the difference the primary "
            "hypothesis tests, whose draws both heads share.",
            "",
            "| test | correlation of the two heads' δ | sd(δ_a − δ_b) | seeds for the SE bound |",
            "|---|---|---|---|",
        ]
        for name, t in pr["tests"].items():
            lines.append(f"| {name.replace('_', ' ')} | {t['correlation']:.2f} | {t['sd']:.3f} | {t['seeds_needed']} |")
    (out / "noise.md").write_text("\n".join(lines) + "\n")
    (out / "noise.json").write_text(json.dumps(result, indent=1))
    return result


def per_run(rs: list[dict], out: Path) -> list[str]:
    """``runs.md`` (module docstring): every finished run's final numbers, by method then seed."""
    header = ("method", "seed", "batch KL k1 (last 10 steps)", "held-out KL(π‖π_ref)", "held-out KL(π_ref‖π)",
              "greedy acc.", "steps", "machine")  # fmt: skip
    rows = []
    for r in sorted(rs, key=lambda r: (r["method"], r["seed"])):
        f = r["final"]
        fwd = f"{f['forward_kl']:.3f} ± {f['forward_kl_se']:.3f}" if "forward_kl" in f else "–"
        rows.append((r["method"], r["seed"], f"{f['batch_kl_k1']:.3f}", f"{f['stepwise_kl']:.3f} ± "
                     f"{f['stepwise_kl_se']:.3f}", fwd, f"{f['greedy_accuracy']:.3f}", f["steps"],
                     f.get("final_on", "?")))  # fmt: skip
    lines = markdown_table(header, rows)
    (out / "runs.md").write_text("\n".join(lines) + "\n")
    return lines


def sign_flip_p_exact(d: list[float]) -> dict:
    """The exact two-sided sign-flip p of the library (:func:`klgrad.compare.stats.sign_flip`): full enumeration up
    to 20 differences (``p_lo`` = ``p`` = ``p_hi``), beyond that a lattice programme whose bracket [``p_lo``,
    ``p_hi``] holds the exact value, ``p`` its upper end; ``method`` says which."""
    flip = sign_flip(list(d), "two-sided")
    return {"p": flip.p, "p_lo": flip.p_lo, "p_hi": flip.p_hi, "n": len(d), "method": flip.method}


SECONDARY = ("stepwise_kl", "logp_gap", "reward_std_in_group")
"""The secondary family of the sharpening grid, each claim "k2_as_loss below k3_as_loss" (``summary.json``)."""


def interim_looks(grid: Path, a: str = "k2_as_loss", b: str = "k3_as_loss", alpha: float = 0.05) -> list[dict]:
    """Every look the grid's merges gave at its secondary claims and at the primary over all seeds, recomputed
    from the committed files: ``grid.json``'s ``merged_from`` (which runs each merge copied, in order) and the
    runs' final numbers in ``summary.json``. A look is a merge after which the set of seeds with both ``a`` and
    ``b`` finished changed (from 2 seeds on). Each look: ``at``, ``seeds``, ``n``, per claim of :data:`SECONDARY`
    the mean of d = a − b, its two-sided paired t p, the Holm-adjusted p over the family and the verdict (as
    :func:`klgrad.compare.stats.decide` gives it for a "less" claim), and ``primary_all`` (the primary's
    d = b − a on batch_kl_k1, here k3 − k2, over the look's seeds: mean and paired t p)."""
    record = json.loads((grid / "grid.json").read_text())
    rows = {(r["method"], r["seed"]): r for r in json.loads((grid / "summary.json").read_text())["runs"]}
    have: set[tuple[str, int]] = set()
    looks: list[dict] = []
    for merge in record["merged_from"]:
        for names in merge["copied"].values():
            for name in names:
                m = re.match(r"(.+)-beta[^-]+-seed(\d+)", name)
                if m:
                    have.add((m.group(1), int(m.group(2))))
        seeds = sorted(s for (method, s) in have if method == a and (b, s) in have)
        if len(seeds) < 2 or (looks and looks[-1]["seeds"] == seeds):
            continue
        tests = {}
        for metric in SECONDARY:
            d = [rows[a, s][metric] - rows[b, s][metric] for s in seeds]
            tests[metric] = {"mean": sum(d) / len(d), "p": paired_t_p(d)}
        for metric, p_adj in zip(SECONDARY, holm([t["p"] for t in tests.values()]), strict=True):
            t = tests[metric]
            t["p_adjusted"] = p_adj
            t["verdict"] = ("supported" if t["mean"] < 0 else "opposite") if p_adj < alpha else "not resolved"
        d = [rows[b, s]["batch_kl_k1"] - rows[a, s]["batch_kl_k1"] for s in seeds]
        looks.append(
            {
                "at": merge["at"],
                "seeds": seeds,
                "n": len(seeds),
                "tests": tests,
                "primary_all": {"mean": sum(d) / len(d), "p": paired_t_p(d)},
            }
        )
    return looks


def lr_mass(run_dir: Path, first: int) -> dict:
    """How much of a run's learning rate its steps from ``first`` on carry: ``share`` = Σ_{t ≥ first} lr_t / Σ_t lr_t
    over the logged ``lr`` of every step, and ``ratio`` = lr at ``first`` over the largest lr (``metrics.jsonl``)."""
    lrs = {r["step"]: r["lr"] for r in read_jsonl(run_dir / "metrics.jsonl") if "lr" in r}
    total = sum(lrs.values())
    return {"share": sum(v for t, v in lrs.items() if t >= first) / total, "ratio": lrs[first] / max(lrs.values())}


def frozen_pass_rate(n: int, z: float = 2.0) -> float:
    """P(|m| ≤ z·se) for n seeds whose movements δ_s are independent draws about 0 (normal): the chance that a
    policy that does not move at all passes the "stopped moving" test, P(|T_{n−1}| ≤ z)."""
    return float(1 - 2 * st.t.sf(z, n - 1))


def movement_power(drift: float, sd: float, n: int, z: float = 2.0) -> float:
    """Power of the "stopped moving" test: P(|m| > z·se) when the seed-mean truly moves by ``drift`` between the
    window's halves and the per-seed movement has sd ``sd`` (normal): P(|T'| > z), T' noncentral t with n − 1
    degrees of freedom and noncentrality drift·√n/sd."""
    nc = drift * math.sqrt(n) / sd
    return float(st.nct.sf(z, n - 1, nc) + st.nct.cdf(-z, n - 1, nc))


def eval_drift(grid: Path, method: str, seeds: list[int], start: int, end: int, key: str = "eval/kl_k1") -> dict:
    """The held-out metric ``key`` measured during training (``metrics.jsonl``'s evaluations) at steps ``start``
    and ``end``: the seed means at both and the paired change end − start (mean, 95% t interval, paired t p)."""
    at: dict[int, dict[int, float]] = {start: {}, end: {}}
    for s in seeds:
        for r in read_jsonl(grid / "runs" / f"{method}-beta0.5-seed{s}" / "metrics.jsonl"):
            if key in r and r["step"] in at:
                at[r["step"]][s] = r[key]
    d = [at[end][s] - at[start][s] for s in seeds]
    m, half = mean_ci(d)
    return {
        "start": sum(at[start].values()) / len(seeds),
        "end": sum(at[end].values()) / len(seeds),
        "change": m,
        "ci": [m - half, m + half],
        "p": paired_t_p(d),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("grid", type=Path)
    ap.add_argument("regime", type=Path, nargs="?", default=None)
    ap.add_argument("--train-regime", type=Path, default=None, help="klgrad regime --split train: primary.png")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    out = args.out or args.grid
    out.mkdir(parents=True, exist_ok=True)
    rs = runs(args.grid)
    per_run(rs, out)
    pred, opt = {}, {}
    if args.regime is not None:
        regime = json.loads(args.regime.read_text())
        pred = prediction(rs, regime, out)
        done = [r for r in rs if "downstream" in r["final"]]
        opt = {f"{r['method']}/seed{r['seed']}": kl_to_optimum(r, regime, regime["beta"]) for r in done}
        (out / "optimum.json").write_text(json.dumps(opt, indent=1))
        (out / "optimum_summary.json").write_text(json.dumps(optimum_summary(opt), indent=1))
    record = read_grid(args.grid) or {}
    registered = registered_seeds(record) if record.get("amendments") else None
    prim = primary(rs, json.loads(args.train_regime.read_text()), out, registered) if args.train_regime else {}
    down = downstream(rs, out)
    forgot = forgetting(rs, out)
    noise = window_noise(rs, args.grid, out)
    for m, v in pred.items():
        print(f"{m}: predicted {v['predicted_mean']:.3f}, measured {v['measured_mean']:.3f}, gap {v['gap_mean']:+.3f} "
              f"{v['gap_ci']}, r = {v['pearson_r']:.2f} ({v['seeds']} seeds)")  # fmt: skip
    for k, v in opt.items():
        print(f"{k}: KL(π‖π*) = {v['kl_to_optimum']:.3f} ± {v['se']:.3f}")
    wrote = [
        "runs.md",
        *(["prediction.png", "prediction.json", "optimum.json", "optimum_summary.json"] if pred else []),
    ]
    wrote += ["primary.png", "primary.json"] if prim else []
    wrote.append(f"downstream.md ({len(down['table'])} methods)")
    wrote += [f"forgetting.md ({len(forgot['table'])} methods)"] if forgot else []
    wrote += ["noise.md", "noise.json"] if noise else []
    print(f"wrote into {out}: " + ", ".join(wrote))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
