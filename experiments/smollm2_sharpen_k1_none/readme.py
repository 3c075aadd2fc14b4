"""The numbers this study's README quotes, recomputed from the study's committed files.

    python experiments/smollm2_sharpen_k1_none/readme.py    # exit 1 naming each quote that is not the files'

No script writes the README; this one reads it: every phrase of :data:`QUOTES`, rendered with :func:`values`
(from ``grid.json``, ``summary.json``, the runs' ``metrics.jsonl`` and, for the KL head it is compared with,
``experiments/smollm2_sharpen_compare/summary.json``), must occur once in the README (whitespace runs compared as
one space).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from klgrad.compare.stats import mean_ci

HERE = Path(__file__).resolve().parent
FINDINGS_PAGE = HERE.parents[1] / "docs" / "findings.md"
OTHER = HERE.parent / "smollm2_sharpen_compare" / "summary.json"
MINUS = "\u2212"


def f(x: float, nd: int = 3) -> str:
    return f"{x:.{nd}f}".replace("-", MINUS)


def sg(x: float, nd: int = 3) -> str:
    return f"{x:+.{nd}f}".replace("-", MINUS)


def flat(text: str) -> str:
    return " ".join(text.split())


def values(d: Path = HERE) -> dict[str, str]:
    g = json.loads((d / "grid.json").read_text())
    s = json.loads((d / "summary.json").read_text())
    p = s["primary"]
    v = {"created": g["created"].replace("+00:00", "Z"), "rev": g["revision"]["commit"][:7]}
    v["seeds"], v["margin"] = str(g["seeds"]), f"{g['margin']:g}"
    v["merged"] = g["merged_from"][-1]["at"][11:16]
    diffs = p["differences"]
    for level, key in ((0.90, "ci90"), (0.95, "ci95")):
        m, half = mean_ci(diffs, level)
        v[key] = f"[{sg(m - half, 2)}, {sg(m + half, 2)}]"
    m, half = mean_ci(diffs)
    v["d"] = f"{sg(m)} [{sg(m - half)}, {sg(m + half)}]"
    v["below"] = f"{p['n_negative']} of {p['n_pairs']}"
    v["tost"], v["tost_holm"] = f"{p['p_value']:.2f}", f"{p['p_adjusted']:.2f}"
    v["p_diff"], v["p_sf"] = f"{p['p_difference']:.2f}", f"{p['p_sign_flip']:.2f}"
    v["sd"] = f"{statistics.stdev(diffs):.2f}"
    v["verdict"] = p["verdict"]
    v["ci90_out"] = str(mean_ci(diffs, 0.90)[0] - mean_ci(diffs, 0.90)[1] < -g["margin"])
    v["ci95_holds_0"] = str(m - half < 0 < m + half)
    v["converged"] = str(s["convergence"]["met"])
    runs = {m: [r for r in s["runs"] if r["method"] == m] for m in ("none", "k1_as_loss")}
    for m, k in (("none", "none"), ("k1_as_loss", "k1")):
        for key, nd in (("stepwise_kl", 3), ("forward_kl", 2)):
            mm, hh = mean_ci([r[key] for r in runs[m]])
            v[f"{k}_{key}"] = f"{f(mm, nd)} ± {f(hh, nd)}"
        v[f"{k}_acc"] = f(statistics.mean(r["greedy_accuracy"] for r in runs[m]))
        v[f"{k}_kl2"] = f(statistics.mean(r["stepwise_kl"] for r in runs[m]))
        rewards, spreads = [], []
        for r in runs[m]:
            rows = (d / "runs" / f"{m}-beta0.5-seed{r['seed']}" / "metrics.jsonl").read_text().splitlines()
            steps = [x for x in map(json.loads, rows) if "reward/mean" in x]
            rewards.append(statistics.mean(x["reward/mean"] for x in steps))
            spreads.append(statistics.mean(x["reward/std_in_group"] for x in steps))
        v[f"{k}_reward"], v[f"{k}_spread"] = f(statistics.mean(rewards)), f(statistics.mean(spreads))
    v["ref_acc"] = f(runs["none"][0]["reference_greedy_accuracy"])
    o = json.loads(OTHER.read_text())["table"]
    none_o, k2_o = o["none@0.5"]["stepwise_kl"]["mean"], o["k2_as_loss@0.5"]["stepwise_kl"]["mean"]
    v["other_none"], v["other_k2"], v["other_removed"] = f(none_o, 2), f(k2_o, 2), f(none_o - k2_o, 2)
    return v


QUOTES = [
    "**Design, stated before the runs** (`grid.json`, {created})",
    "pinned to commit {rev}.",
    "within ±{margin} nats of no KL's\", tested alone, on {seeds} seeds.",
    "(none {other_none} vs k2_as_loss {other_k2} nats in `experiments/smollm2_sharpen_compare`",
    "| held-out stepwise KL(π‖π_ref) (primary) | {none_stepwise_kl} | {k1_stepwise_kl} | {d}, k1 below in {below} |",
    "| held-out forward KL(π_ref‖π) | {none_forward_kl} | {k1_forward_kl} | |",
    "| held-out greedy accuracy (reference {ref_acc}) | {none_acc} | {k1_acc} | |",
    "| training reward, mean over the 10 steps | {none_reward} | {k1_reward} | |",
    "| reward std within groups, mean over the 10 steps | {none_spread} | {k1_spread} | |",
    "here it is {ci90}, which reaches past −0.5",
    "TOST p {tost} ({tost_holm} after Holm over the primary's two tests",
    "The 95% interval {ci95} holds 0, so no difference is shown either (p {p_diff}, sign-flip p {p_sf}, exact by full "
    "enumeration; the paired differences' sd is {sd}). k1_as_loss ends a little lower in {below} seeds",
    "where a KL head at this β removed {other_removed}",
    "{k1_kl2} (k1_as_loss) and {none_kl2} (none) nats from the reference",
    "seeds 3 and 7 at {merged} when their lanes finished",
]
ASSUMED = (
    ("verdict", "not resolved at this sample size"),
    ("ci90_out", "True"),
    ("ci95_holds_0", "True"),
    ("converged", "False"),
)

FINDINGS = ["90% interval {ci90}, past the ±{margin} margin, TOST p {tost}"]
"""This study's phrases in docs/findings.md (each must occur there)."""


def check(readme: Path = HERE / "README.md", v: dict[str, str] | None = None) -> list[str]:
    v = values() if v is None else v
    text = flat(readme.read_text())
    problems = [
        f"{readme.name}: not once:\n{t.format_map(v)}" for t in QUOTES if text.count(flat(t.format_map(v))) != 1
    ]
    page = flat(FINDINGS_PAGE.read_text())
    problems += [
        f"docs/findings.md: missing:\n{t.format_map(v)}" for t in FINDINGS if flat(t.format_map(v)) not in page
    ]
    return problems + [f"{k} = {v[k]} (the README says {want})" for k, want in ASSUMED if v[k] != want]


if __name__ == "__main__":
    problems = check()
    print("\n".join(problems) or "every quoted number is the committed files'")
    sys.exit(1 if problems else 0)
