"""The numbers the sharpening grid's prose quotes, kept equal to the grid's committed files.

    python experiments/smollm2_sharpen_converged/sharpen_prose.py check
        # every quoted number is the committed files' (exit 1 if not)
    python experiments/smollm2_sharpen_converged/sharpen_prose.py update OLD_GRID
        # after a merge: rewrite them from OLD_GRID's values to the grid's

The grid (experiments/smollm2_sharpen_converged) grows by merges, and its README, README.md and docs/reproduction.md
quote some sixty of its numbers: tests, intervals, counts, convergence standard errors, gradient norms, downstream
columns. Each quoting sentence is a template below; :func:`values` computes every field from the grid's committed
files (``summary.json``, ``noise.json``, ``prediction.json``, ``optimum_summary.json``, ``downstream.json``,
``primary.json``, the runs' ``metrics.jsonl``). ``check`` renders the templates with the committed values and asks
each to occur exactly once in its file; ``update`` renders them with OLD_GRID's values (a copy of the grid folder
taken before the merge), asks the same of those, and replaces each with the new rendering, appending the merge to
the two lists that grow (the held-out test's history, the seed counts at which the reward-spread claim was
supported). It refuses when a sentence's words would turn false with the new numbers (a verdict that flips, a bound
no longer met): those are edited by hand, and the template with them.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from klgrad.compare.stats import holm as holm_adjust

ROOT = Path(__file__).resolve().parents[2]
GRID = ROOT / "experiments" / "smollm2_sharpen_converged"
G, R, D = "experiments/smollm2_sharpen_converged/README.md", "README.md", "docs/reproduction.md"

MINUS = "\u2212"  # the prose's minus sign


def sg(x: float, nd: int = 3) -> str:
    """``x`` with its sign, ``nd`` places: +0.022, −0.012."""
    return f"{x:+.{nd}f}".replace("-", MINUS)


def f(x: float, nd: int = 3) -> str:
    return f"{x:.{nd}f}".replace("-", MINUS)


def pf(p: float) -> str:
    """A p-value as the prose writes it: 4.1e-05 under 0.001, else two significant figures (0.0022, 0.011, 0.33)."""
    if p < 1e-3:
        return f"{p:.1e}"
    return f"{float(f'{p:.2g}'):g}" if p < 0.1 else f"{p:.2f}"


def pfloor(p: float) -> str:
    """``p`` rounded down to two significant figures, for "p ≥ ..." (0.0698 → 0.069)."""
    e = math.floor(math.log10(p)) - 1
    return f"{math.floor(p / 10**e) * 10**e:.{max(0, -e)}f}"


def ranges(seeds: list[int]) -> list[str]:
    """Runs of consecutive seeds: [16, ..., 43, 45, 50, 51] → ["16–43", "45", "50, 51"]."""
    seeds = sorted(seeds)
    out, i = [], 0
    while i < len(seeds):
        j = i
        while j + 1 < len(seeds) and seeds[j + 1] == seeds[j] + 1:
            j += 1
        out.append(
            str(seeds[i]) if i == j else f"{seeds[i]}, {seeds[j]}" if j == i + 1 else f"{seeds[i]}\u2013{seeds[j]}"
        )
        i = j + 1
    return out


def and_join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def values(d: Path) -> dict[str, str]:
    """Every field the templates quote, formatted as the prose writes it, from the grid folder ``d``."""
    s = json.loads((d / "summary.json").read_text())
    v = {}
    N = s["seeds"]
    v["N"] = str(N)
    preds = {p["metric"]: p for p in s["predictions"]}
    ho = preds["stepwise_kl"]
    v["ho"] = f"{sg(ho['mean_difference'])} [{sg(ho['ci95'][0])}, {sg(ho['ci95'][1])}]"
    v["ho_holm"] = pf(ho["p_adjusted"])
    v["ho_below"] = str(ho["n_negative"])
    v["ho_sf"] = pf(ho["p_sign_flip"])
    v["ho_verdict"] = ho["verdict"]
    a = s["primary_all_seeds"]
    v["all"] = f"{sg(a['mean_difference'])} [{sg(a['ci95'][0])}, {sg(a['ci95'][1])}]"
    v["all_below"] = str(a["n_negative"])
    v["all_p"] = pf(a["p_value"])
    v["all_below_zero"] = str(a["ci95"][1] < 0)  # "k3 ends a little closer" (the interval excludes 0)
    predicted = json.loads((d / "primary.json").read_text())["k3_minus_k2"]["predicted"]  # the regime's −0.093
    v["all_frac"] = f"1/{round(predicted / a['mean_difference'])}" if a["mean_difference"] < 0 else "none"
    lg = preds["logp_gap"]
    v["lg"] = f"{sg(lg['mean_difference'], 4)} [{sg(lg['ci95'][0], 4)}, {sg(lg['ci95'][1], 4)}]"
    v["lg_holm"] = pf(lg["p_adjusted"])
    v["lg_verdict"] = lg["verdict"]
    rs = preds["reward_std_in_group"]
    v["rs_count"] = str(rs["n_negative"])
    v["rs_holm"] = pf(rs["p_adjusted"])
    v["rs_verdict"] = rs["verdict"]
    c = s["convergence"]
    v["conv_met"] = str(c["so_far"]["met"] if c["met"] is None else c["met"])  # the interim look, or the verdict
    for m, k in (("k3_as_loss", "k3"), ("k2_as_loss", "k2")):
        b = c["by_method"][m]
        v[f"{k}_moved"] = sg(b["moved"])
        v[f"{k}_se"] = f(b["se"])
        v[f"{k}_need"] = str(b["seeds_needed"])
        bd = b["before_decay"]
        v[f"{k}_bd_moved"] = sg(bd["moved"])
        v[f"{k}_bd_se"] = f(bd["se"])
        v[f"{k}_bd_need"] = str(bd["seeds_needed"])
        v[f"{k}_bd_within"] = "within the bound" if bd["se"] <= 0.02 else "NOT WITHIN"
        v[f"{k}_end_within"] = str(b["se"] <= 0.02 and abs(b["moved"]) <= 2 * b["se"])
    nz = json.loads((d / "noise.json").read_text())
    for m, k in (("k3_as_loss", "k3"), ("k2_as_loss", "k2")):
        t = nz["methods"][m]["tests"]
        v[f"{k}_nz_end_pred"] = f(t["end"]["sd_sampling_k1"])
        v[f"{k}_nz_end_obs"] = f(t["end"]["sd_observed"])
        v[f"{k}_nz_bd_pred"] = f(t["before_decay"]["sd_sampling_k1"])
        v[f"{k}_nz_bd_obs"] = f(t["before_decay"]["sd_observed"])
        v[f"{k}_nz_bd_k1"] = str(t["before_decay"]["seeds_needed_k1"])
        v[f"{k}_nz_bd_sw"] = str(t["before_decay"]["seeds_needed_stepwise"])
        ratios = [x["ratio"] for x in nz["methods"][m]["scan"]]
        v[f"{k}_ratios_above1"] = str(sum(r > 1 for r in ratios))
    pt = nz["paired"]["tests"]
    v["corr_end"] = f(pt["end"]["correlation"], 2)
    v["corr_bd"] = f(pt["before_decay"]["correlation"], 2)
    v["dsd_end"] = f(pt["end"]["sd"])
    v["dsd_bd"] = f(pt["before_decay"]["sd"])
    v["dneed_end"] = str(pt["end"]["seeds_needed"])
    v["dneed_bd"] = str(pt["before_decay"]["seeds_needed"])
    # gradient norms
    g = {"k3_as_loss": [], "k2_as_loss": []}
    for run in sorted((d / "runs").iterdir()):
        m = run.name.split("-")[0]
        if m not in g:
            continue
        for line in (run / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            if "grad_norm" in r:
                g[m].append(r["grad_norm"])
    k3, k2 = sorted(g["k3_as_loss"], reverse=True), sorted(g["k2_as_loss"], reverse=True)
    v["g_steps"] = f"{len(k3):,}"
    v["g_steps_k2"] = f"{len(k2):,}"
    v["g_k3_max"] = f"{round(k3[0]):,}"
    v["g_k3_med"] = f"{statistics.median(k3):.0f}"
    v["g_k3_next"] = ", ".join(f"{round(x):,}" for x in k3[1:4])
    v["g_k2_max"] = f"{round(k2[0]):,}"
    v["g_k2_med"] = f"{statistics.median(k2):.0f}"
    # prediction
    p = json.loads((d / "prediction.json").read_text())
    for m, k in (("k3_as_loss", "k3"), ("k2_as_loss", "k2")):
        q = p[m]
        v[f"{k}_pct"] = f"{round(100 * (1 - q['measured_mean'] / q['predicted_mean']))}"
        v[f"{k}_gap"] = f"{sg(q['gap_mean'])} [{sg(q['gap_ci'][0])}, {sg(q['gap_ci'][1])}]"
        v[f"{k}_r"] = f(q["pearson_r"], 2)
        v[f"{k}_other21"] = f(statistics.mean(q["per_prompt"]["measured"][1:]))
    v["k3_27"] = f(p["k3_as_loss"]["per_prompt"]["measured"][0])
    v["k3_below_k2_other21"] = str(
        statistics.mean(p["k3_as_loss"]["per_prompt"]["measured"][1:])
        < statistics.mean(p["k2_as_loss"]["per_prompt"]["measured"][1:])
    )
    # optimum
    o = json.loads((d / "optimum_summary.json").read_text())
    for m, k in (("k2_as_loss", "k2"), ("k3_as_loss", "k3"), ("none", "none")):
        b = o["by_method"][m]
        nd = 2 if k == "none" else 3
        v[f"opt_{k}"] = f"{f(b['mean'], nd)} \u00b1 {f((b['ci'][1] - b['ci'][0]) / 2, nd)}"
    km = o["k3_minus_k2"]
    v["opt_diff"] = f"{sg(km['mean'])} [{sg(km['ci'][0])}, {sg(km['ci'][1])}]"
    v["opt_p"] = pf(km["t_p"])
    # downstream
    ds = json.loads((d / "downstream.json").read_text())
    t = ds["table"]
    for m, k in (("k2_as_loss", "k2"), ("k3_as_loss", "k3")):
        for col, name in (
            ("heldout pass@1", "h1"),
            ("heldout pass@k", "hk"),
            ("harder greedy_accuracy", "hg"),
            ("harder pass@1", "d1"),
            ("harder pass@k", "dk"),
        ):
            v[f"ds_{k}_{name}"] = f(t[m][col]["mean"])
    pr = ds["paired"]["k2_as_loss - k3_as_loss"]
    cols = [
        "heldout greedy_accuracy",
        "heldout pass@1",
        "heldout pass@k",
        "harder greedy_accuracy",
        "harder pass@1",
        "harder pass@k",
    ]
    ps = sorted((pr[c]["t_p"], c) for c in cols)
    holm = dict(zip(cols, holm_adjust([pr[c]["t_p"] for c in cols]), strict=True))  # over the six columns
    for c, name in (("heldout pass@1", "h1"), ("harder greedy_accuracy", "hg")):
        v[f"dd_{name}"] = f"{sg(pr[c]['mean'])} [{sg(pr[c]['ci'][0])}, {sg(pr[c]['ci'][1])}]"
        v[f"dd_{name}_p"] = pf(pr[c]["t_p"])
        v[f"dd_{name}_holm"] = pf(holm[c])
        v[f"dd_{name}_lead"] = f(pr[c]["mean"])
    v["dd_two_smallest"] = str({ps[0][1], ps[1][1]} == {"heldout pass@1", "harder greedy_accuracy"})
    v["dd_others_min"] = pfloor(ps[2][0])
    # seeds
    seeds = sorted({r["seed"] for r in s["runs"] if r["method"] == "k3_as_loss"})
    added = [x for x in seeds if x >= 16]
    v["added"] = and_join(ranges(added))
    amd = sorted({r["seed"] for r in s["runs"] if any("AMD EPYC" in m for m in r["ran_on"])})
    v["amd"] = and_join(ranges(amd))
    return v


TEMPLATES = [
    (G, "and seeds {added} of the 40 added)"),
    (G, "Seeds {amd} trained on an AMD EPYC 2 vCPU"),
    (
        G,
        "On all {N} seeds (seeds {added} added for the convergence criterion; not the registered test, and looked\n"
        "at after every merge) the difference is {all} (k3 below k2 in {all_below} of {N}, paired t p {all_p},\n"
        "unadjusted): k3 ends a little closer, the predicted direction, at about {all_frac} of the predicted size",
    ),
    (
        G,
        "finished seed, Holm-adjusted, in `summary.md`: at {N} seeds the reward spread is lower for k2 "
        "in {rs_count} of {N}, Holm p\n"
        '{rs_holm}, **supported**; "k2 keeps the held-out stepwise KL below k3" is **opposite**: k2 − '
        "k3 = {ho_m} [{ho_lo},\n"
        "{ho_hi}], k2 below in {ho_below} of {N}, Holm p {ho_holm} (sign-flip p {ho_sf}), the direction",
    ),
    (G, '"k2 keeps the log-prob gap below k3" turned **opposite** at the\nlast merge, {lg}, Holm p {lg_holm}'),
    (G, "**Convergence: met** (`summary.json`'s `convergence`: `met: true`, decided once at {N} seeds"),
    (
        G,
        "At {N} seeds the criterion holds on every part. Over\nthe last quarter the batch KL moved by\n"
        "{k3_moved} (k3, standard error {k3_se}) and {k2_moved} (k2, {k2_se}): both within 2 SE",
    ),
    (
        G,
        "23–30) the movement is {k3_bd_moved} (k3) and {k2_bd_moved} (k2), SE {k3_bd_se} "
        "({k3_bd_within}) and {k2_bd_se} ({k2_bd_within}). At the spread these {N}\n"
        "seeds show, the SE bound needs about {k3_need} seeds (k3) and {k2_need} (k2) at the end, and "
        "{k3_bd_need} and {k2_bd_need} before the decay",
    ),
    (
        G,
        "for much of the end of the runs (predicted {k3_nz_end_pred} and {k2_nz_end_pred}, observed "
        "{k3_nz_end_obs} and {k2_nz_end_obs}). At the registered cut the\n"
        "spread is {k3_nz_bd_obs} and {k2_nz_bd_obs}, against {k3_nz_bd_pred} and {k2_nz_bd_pred} from "
        "sampling.",
    ),
    (G, "(a sample sd of {N} seeds is itself uncertain by"),
    (
        G,
        "the before-decay test needs about {k3_nz_bd_k1} and {k2_nz_bd_k1} seeds with k1, and "
        "{k3_nz_bd_sw} and {k2_nz_bd_sw}\n"
        "with the",
    ),
    (G, "correlated across seeds ({corr_end} at the end, {corr_bd} before the decay:"),
    (
        G,
        "sd {dsd_end} at the end ({dneed_end} seeds would meet the SE bound) and {dsd_bd} before the "
        "decay ({dneed_bd} seeds).",
    ),
    (
        G,
        "Its gradient norm before clipping is {g_k3_max} against a median of {g_k3_med} over the "
        "{g_steps} k3 steps of the {N} seeds\n"
        "(next largest {g_k3_next}); k2's largest of its {g_steps_k2} is {g_k2_max} (median "
        "{g_k2_med}), from",
    ),
    (
        G,
        "each head's final stepwise KL (mean over {N} seeds)\n"
        "  against its predicted fixed point. k2: Pearson r = {k2_r}, measured − predicted = {k2_gap};\n"
        "  k3: r = {k3_r}, {k3_gap}. Both heads end {k2_pct}% (k2) and {k3_pct}% (k3) below",
    ),
    (
        G,
        '"2 + 7" stays at {k3_27} against its predicted 2.10. Without that prompt k3 ends below k2 as '
        "well ({k3_other21} vs {k2_other21}\n"
        "  on the other 21",
    ),
    (
        G,
        "log Z's error in each run's SE (~0.06). Over {N} seeds\n"
        "  (`optimum_summary.json`): k2\n"
        "  {opt_k2}, k3 {opt_k3} (95% t), paired k3 − k2 {opt_diff} (p {opt_p}); `none` {opt_none} (3",
    ),
    (
        G,
        "- `downstream.md` ({N} seeds): the heads are close on every column (k2 vs k3: held-out pass@1 "
        "{ds_k2_h1} vs {ds_k3_h1},\n"
        "  pass@8 {ds_k2_hk} vs {ds_k3_hk}; two-digit problems greedy {ds_k2_hg} vs {ds_k3_hg}, pass@1 "
        "{ds_k2_d1} vs {ds_k3_d1}, pass@8 {ds_k2_dk} vs {ds_k3_dk}).\n"
        "  k2 − k3 is {dd_h1} in held-out pass@1 and {dd_hg} in two-digit greedy\n"
        "  accuracy (paired t p {dd_h1_p} and {dd_hg_p}, unadjusted, the two smallest of six columns; "
        "the others p ≥ {dd_others_min};\n"
        "  Holm over the six, {dd_h1_holm} and {dd_hg_holm});",
    ),
    (G, "The grid is complete: all {N} seeds (registered with 16"),
    (
        R,
        "decided once, at the {N} seeds of the grid's\namendment: `met: true`). Over all {N} seeds (not the "
        "registered test) k3 ends a little closer, {all_m}\n[{all_lo}, {all_hi}] (p {all_p}, unadjusted), about "
        "{all_frac} of the predicted gap.",
    ),
    (R, "**above** k3's ({ho} nats over {N} seeds, Holm p {ho_holm} in the secondary family"),
    (
        R,
        "(k2 ahead by {dd_h1_lead} on held-out pass@1 and {dd_hg_lead} on\n"
        "two-digit greedy accuracy, Holm p {dd_h1_holm} and {dd_hg_holm}",
    ),
    (
        R,
        "both end {opt_k2_2} (k2) and {opt_k3_2} (k3) nats from the optimum π* of J_β (the reference "
        "starts 0.38\n"
        "away, no KL ends {opt_none_m} away)",
    ),
    (
        D,
        "spread ({rs_count} of {N} seeds, Holm p {rs_holm} on every finished seed; it has sat near the "
        "threshold: supported at",
    ),
    (
        D,
        "has k2 − k3 in held-out stepwise KL {ho} over {N} seeds (k2 below\n"
        "in {ho_below}), Holm p {ho_holm} (opposite)",
    ),
    (D, "Seeds {added}, of the 40 added for the convergence criterion"),
    (
        D,
        "move it to {all_m}\n[{all_lo}, {all_hi}] over all {N} (k3 below in {all_below}, paired t p {all_p} "
        "unadjusted; not the registered test",
    ),
    (D, "at about {all_frac} of the predicted size."),
    (D, 'A third, "k2 keeps the log-prob gap below k3", turned opposite at the last merge: {lg},\nHolm p {lg_holm}'),
    (D, "At {N} seeds the test passes (`summary.json`'s `convergence`: `met`\ntrue):"),
    (
        D,
        "quarter the batch KL moved by {k3_moved} (k3, SE {k3_se}) and {k2_moved} (k2, SE {k2_se}): "
        "within 2 SE, both SEs within the\n"
        "0.02 the criterion asks; on the runs cut where the learning rate is last at least half its "
        "peak (steps 23–30) the\n"
        "SEs are {k3_bd_se} ({k3_bd_within}) and {k2_bd_se} ({k2_bd_within}). At the spread these seeds "
        "show, the bound needs about {k3_need} and {k2_need} seeds at the end\n"
        "and {k3_bd_need} and {k2_bd_need} before the decay",
    ),
    (
        D,
        "prompts × 4 samples gives at a still policy ({k3_nz_end_pred} and {k2_nz_end_pred} predicted, "
        "{k3_nz_end_obs} and {k2_nz_end_obs} observed); at the registered\n"
        "cut it is more ({k3_nz_bd_obs} and {k2_nz_bd_obs} against {k3_nz_bd_pred} and {k2_nz_bd_pred}).",
    ),
    (
        D,
        "the cut before the decay would need about {k3_nz_bd_k1} and {k2_nz_bd_k1} seeds with k1 and "
        "{k3_nz_bd_sw} and {k2_nz_bd_sw} with the",
    ),
    (D, "moves less than either head ({dneed_bd} seeds\nbefore the decay, {dneed_end} at the end)."),
    (
        D,
        "`prediction.png`, {N} seeds): both heads end {k2_pct}% (k2) and {k3_pct}% (k3) below their "
        "fixed points on these never-trained prompts\n"
        '(k2 {k2_gap}, r = {k2_r} over prompts; k3 {k3_gap}, r = {k3_r}; on "2 + 7" k3 stays at\n'
        "{k3_27}), and k3 ends below k2 with or without that prompt ({k3_other21} vs {k2_other21} on "
        "the other 21).",
    ),
    (
        D,
        "is {opt_k2}\n"
        "(k2) and {opt_k3} (k3), paired difference {opt_diff} ({N} seeds, `optimum_summary.json`); the\n"
        "reference starts 0.381 from π* and `none` ends {opt_none_m} from it. Downstream the heads are "
        "close (held-out pass@1 {ds_k2_h1}\n"
        "vs {ds_k3_h1}, paired {dd_h1}, p {dd_h1_p} unadjusted, {dd_h1_holm} Holm over six columns; "
        "two-digit greedy {ds_k2_hg} vs {ds_k3_hg}, {dd_hg},\n"
        "{dd_hg_holm} Holm, on columns neither registered nor corrected for the look at every merge; "
        "two-digit pass@8 {ds_k2_dk} vs {ds_k3_dk}),",
    ),
]


def derived(v: dict[str, str]) -> dict[str, str]:
    """The fields some sentences quote in pieces (an interval split across a line, the optimum rounded to 2 places)."""

    def split(key: str) -> None:
        m, rest = v[key].split(" [")
        lo, hi = rest.rstrip("]").split(", ")
        v[key + "_m"], v[key + "_lo"], v[key + "_hi"] = m, lo, hi

    split("all")
    split("ho")
    a, b = (round(float(v[k].split(" ")[0]), 2) for k in ("opt_k2", "opt_k3"))
    v["opt_k2_2"], v["opt_k3_2"] = f"{a:.2f}", f"{b:.2f}"
    v["opt_none_m"] = v["opt_none"].split(" ")[0]
    return v


ASSUMED = (  # words the templates hold fixed, and the value that keeps them true
    ("ho_verdict", "opposite"),
    ("rs_verdict", "supported"),
    ("conv_met", "True"),
    ("all_below_zero", "True"),
    ("all_frac", "1/6"),
    ("lg_verdict", "opposite"),
    ("k3_end_within", "True"),
    ("k2_end_within", "True"),
    ("k3_bd_within", "within the bound"),
    ("k2_bd_within", "within the bound"),
    ("k3_below_k2_other21", "True"),
    ("dd_two_smallest", "True"),
)


def stale_words(v: dict[str, str]) -> list[str]:
    """The sentences whose fixed words the values ``v`` would make false."""
    bad = [f"{k} = {v[k]} (the prose says {want}): edit by hand" for k, want in ASSUMED if v[k] != want]
    for k in ("k3_ratios_above1", "k2_ratios_above1"):
        if int(v[k]) < 5:
            bad.append(f"{k} = {v[k]} of 8: 'above 1 at most of them' no longer holds")
    return bad


HISTORY = "{N} seeds: {ho}, Holm p {ho_holm}, {ho_verdict}"  # the held-out test at each merge (grid README)


def check(root: Path = ROOT, grid: Path = GRID) -> list[str]:
    """The templates that do not occur exactly once, rendered with ``grid``'s committed values, and stale words."""
    v = derived(values(grid))
    texts = {p: (root / p).read_text() for p in (G, R, D)}
    missing = [
        f"{path}: {texts[path].count(t.format_map(v))} times:\n{t.format_map(v)}"
        for path, t in TEMPLATES
        if texts[path].count(t.format_map(v)) != 1
    ]
    if HISTORY.format_map(v) + "), and nothing corrects" not in texts[G]:
        missing.append(f"{G}: the held-out test's history does not end with {HISTORY.format_map(v)}")
    return missing + stale_words(v)


def update(old_grid: Path, root: Path = ROOT, grid: Path = GRID) -> list[str]:
    """Rewrite the quoted numbers from ``old_grid``'s values to ``grid``'s. Writes nothing and raises if a template
    rendered with the old values does not occur exactly once; returns the sentences left for a hand edit."""
    old, new = derived(values(old_grid)), derived(values(grid))
    bad = stale_words(new)
    texts = {p: (root / p).read_text() for p in (G, R, D)}
    errors = []
    for path, t in TEMPLATES:
        a, b = t.format_map(old), t.format_map(new)
        if texts[path].count(a) != 1:
            errors.append(f"{path}: {texts[path].count(a)} times:\n{a}")
            continue
        texts[path] = texts[path].replace(a, b)
    if old["N"] != new["N"]:
        a = HISTORY.format_map(old) + "), and nothing corrects"
        if texts[G].count(a) != 1:
            errors.append(f"{G}: the held-out test's history does not end with {HISTORY.format_map(old)}")
        else:
            texts[G] = texts[G].replace(
                a, f"{HISTORY.format_map(old)}; {HISTORY.format_map(new)}), and nothing corrects"
            )
        a = f", {old['N']} seeds, not at 10 (0.055)"
        if new["rs_verdict"] != "supported":
            bad.append("the reward spread is no longer supported: edit docs/reproduction.md's 'supported at' list")
        elif texts[D].count(a) != 1:
            errors.append(f"{D}: the 'supported at' list does not end with {old['N']}")
        else:
            texts[D] = texts[D].replace(a, f", {old['N']}, {new['N']} seeds, not at 10 (0.055)")
    if errors:
        raise ValueError("\n".join(errors))
    for p, s in texts.items():
        (root / p).write_text(s)
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="every quoted number is the committed grid's")
    up = sub.add_parser("update", help="rewrite the quoted numbers from OLD_GRID's values to the grid's")
    up.add_argument("old_grid", type=Path, help="a copy of the grid folder taken before the merge")
    args = ap.parse_args(argv)
    try:
        problems = check() if args.cmd == "check" else update(args.old_grid)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    print("\n".join(problems) or "every quoted number is the committed grid's")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
