"""The numbers this study's README quotes, recomputed from the study's committed files.

    python experiments/smollm2_frameworks/readme.py    # exit 1 naming each quote that is not the files'

No script writes the README; this one reads it. :func:`values` computes each quoted field from ``summary.json``,
``grid.json``, ``headtohead.json`` and the runs' files; :func:`check` asks every phrase of :data:`QUOTES`, rendered
with them, to occur exactly once in the README (whitespace runs compared as one space, so the wrapping is free),
and the words the README holds fixed (:data:`ASSUMED`) to be what the values say.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

from klgrad.compare.stats import paired_t_p, sign_flip_p

HERE = Path(__file__).resolve().parent
FINDINGS_PAGE = HERE.parents[1] / "docs" / "findings.md"
MINUS = "\u2212"
TOKEN_MEAN = ("trl/grpo-k3", "trl/grpo-k3-bias-correction", "verl/kl-loss-low-var-kl", "openrlhf/k1-reward")
SUMS = ("k2_as_loss", "trl/rloo-k1-reward")


def sg(x: float, nd: int = 3) -> str:
    return f"{x:+.{nd}f}".replace("-", MINUS)


def f(x: float, nd: int = 3) -> str:
    return f"{x:.{nd}f}".replace("-", MINUS)


def pf(p: float) -> str:
    """Two significant figures under 0.1 (0.016, 0.063: halves rounded up), two places above (0.95)."""
    x = Decimal(p)
    step = Decimal("0.01") if p >= 0.1 else Decimal(1).scaleb(math.floor(math.log10(p)) - 1)
    return f"{x.quantize(step, ROUND_HALF_UP):f}"


def flat(text: str) -> str:
    return " ".join(text.split())


def threshold(d: list[float], exceeds, lo: float = -1.0, hi: float = 0.0) -> float:
    """The largest 8th difference x in [lo, hi] at which ``exceeds(d + [x])`` holds (bisection; true at lo)."""
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if exceeds([*d, mid]) else (lo, mid)
    return lo


def values(d: Path = HERE) -> dict[str, str]:
    s = json.loads((d / "summary.json").read_text())
    g = json.loads((d / "grid.json").read_text())
    h = json.loads((d / "headtohead.json").read_text())
    v: dict[str, str] = {}
    seeds = sorted({r["seed"] for r in s["runs"]})
    v["n"], v["registered"] = str(len(seeds)), str(g["seeds"])
    v["one_short"] = str(g["seeds"] - len(seeds) == 1)
    v["created"] = g["created"].replace("+00:00", "Z")
    p = s["primary"]
    v["prim"] = f"{sg(p['mean_difference'])} [{sg(p['ci95'][0])}, {sg(p['ci95'][1])}]"
    v["prim_below"], v["prim_p"], v["prim_sf"] = str(p["n_negative"]), f"{p['p_value']:.3f}", pf(p["p_sign_flip"])
    v["prim_verdict"] = p["verdict"]
    diffs = p["differences"]
    sf_at = threshold(diffs, lambda x: sign_flip_p(x) > 0.05)
    t_at = threshold(diffs, lambda x: paired_t_p(x) > 0.05)
    v["sf_at"], v["sf_p"] = sg(sf_at, 6), f"{sign_flip_p([*diffs, sf_at]):.3f}"
    v["t_at"], v["t_p_040"] = sg(t_at, 6), f"{paired_t_p([*diffs, -0.04]):.3f}"
    v["d_range"] = f"from {sg(min(diffs))} to {sg(max(diffs))}"
    # provenance
    rev = {}
    for x in g["sessions"]:
        for seed in x["seeds"]:
            rev.setdefault(seed, set()).add(x["revision"])
    v["rev01"] = " ".join(sorted(rev[0] | rev[1]))
    v["rev_rest"] = " ".join(sorted(set().union(*(rev[x] for x in seeds if x >= 2))))
    v["grid_rev"] = g["revision"]["commit"][:7]
    v["content"] = g["revision"]["content"][:8]
    no_prov = sorted(r.name for r in (d / "runs").iterdir() if not (r / "provenance.jsonl").is_file())
    v["no_prov"] = ", ".join(no_prov)
    lone = next(r for r in s["runs"] if r["method"] == "verl/kl-loss-low-var-kl" and r["seed"] == 5)
    v["lone_ran_on"] = str(lone["ran_on"])
    run_json = json.loads((d / "runs" / "verl+kl-loss-low-var-kl-beta0.5-seed5" / "run.json").read_text())
    v["lone_rev"] = run_json["git_revision"][:7]
    calls = [x["at"][11:19] for x in g["sessions"] if x["seeds"] == [5] and x["methods"] == ["verl/kl-loss-low-var-kl"]]
    v["lone_calls"] = " and ".join(calls)
    # the length factor
    v["lbar"] = f"{g['beta_scale']['mean_length']:g}"
    v["beta_eff"] = f"{0.5 * g['beta_scale']['mean_length']:.3f}"
    # the tables
    for m, row in h.items():
        beta = "—" if m == "none" else f"{row['effective_beta']:.3f}".rstrip("0").rstrip(".")
        kl = f"{f(row['stepwise_kl']['mean'])} [{f(row['stepwise_kl']['ci'][0])}, {f(row['stepwise_kl']['ci'][1])}]"
        cells = [beta, kl]
        for key in ("kl_vs_k2_as_loss", "reward_vs_k2_as_loss"):
            x = row.get(key)
            cell = "—" if x is None else f"{sg(x['mean'])} [{sg(x['ci'][0])}, {sg(x['ci'][1])}]"
            if key == "kl_vs_k2_as_loss" and x is not None and m != "none":
                cell += f", sign-flip p {pf(x['sign_flip_p'])}"
            cells.append(cell)
            if key == "kl_vs_k2_as_loss":
                cells.append(f(row["reward_mean"]["mean"]))
        v[f"row {m}"] = "| " + " | ".join(cells) + " |"
    kls = {(r["method"], r["seed"]): r["stepwise_kl"] for r in s["runs"]}
    for m in h:
        v[f"seeds {m}"] = f"| `{m}` | " + " | ".join(f(kls[m, x]) for x in seeds) + " |"
    # what the grid shows
    mean = {m: h[m]["stepwise_kl"]["mean"] for m in h}
    reward = {m: h[m]["reward_mean"]["mean"] for m in h}
    heads = [m for m in h if m != "none"]
    v["fold"] = f"{mean['none'] / max(mean[m] for m in heads):.0f}–{mean['none'] / min(mean[m] for m in heads):.0f}"
    v["kl_range"] = f"{f(min(mean[m] for m in heads), 2)}–{f(max(mean[m] for m in heads), 2)}"
    v["none_kl"] = f(mean["none"], 2)
    cost = [reward["none"] - reward[m] for m in heads]
    v["cost"] = f"{f(min(cost), 2)}–{f(max(cost), 2)}"
    acc = {r["greedy_accuracy"] for r in s["runs"] if r["method"] != "none"}
    v["acc_kl"] = str(len(acc) == 1 and round(acc.pop() * 22) == 19)
    v["none_acc"] = f(h["none"]["greedy_accuracy"]["mean"])
    tm = [mean[m] for m in TOKEN_MEAN]
    v["tm_within"] = str(max(tm) - min(tm) <= 0.02)
    gaps = [mean[a] - mean[b] for a in SUMS for b in TOKEN_MEAN]
    v["tm_below"] = f"{f(min(gaps), 2)}–{f(max(gaps), 2)}"
    rgaps = [reward[a] - reward[b] for a in SUMS for b in TOKEN_MEAN]
    v["tm_reward"] = f"{f(min(rgaps), 2)}–{f(max(rgaps), 2)}"
    v["gae"] = sg(h["verl/kl-reward-gae"]["kl_vs_k2_as_loss"]["mean"])
    rl = h["trl/rloo-k1-reward"]["kl_vs_k2_as_loss"]
    v["rloo"] = f"{sg(rl['mean'])} ± {f((rl['ci'][1] - rl['ci'][0]) / 2)}"
    k3 = [mean[m] for m in TOKEN_MEAN[:3]]
    v["k3_within"] = f(max(k3) - min(k3))
    lengths, norms = {}, {}
    for run in (d / "runs").iterdir():
        m = run.name.rsplit("-beta", 1)[0].replace("+", "/")
        rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "response/length" in r]
        lengths.setdefault(m, []).append(statistics.mean(r["response/length"] for r in rows[-10:]))
        norms.setdefault(m, []).append(statistics.mean(r["grad_norm"] for r in rows[-20:]))
    tml = [statistics.mean(lengths[m]) for m in TOKEN_MEAN]
    v["tm_len"] = f"{min(tml):.1f}–{max(tml):.1f}"
    v["lbar2"] = f"{g['beta_scale']['mean_length']:.2f}"
    v["tm_norm"] = f"{min(statistics.mean(norms[m]) for m in TOKEN_MEAN):.0f}–" + (
        f"{max(statistics.mean(norms[m]) for m in TOKEN_MEAN):.0f}"
    )
    v["sum_norm"] = "–".join(sorted({f"{statistics.mean(norms[m]):.0f}" for m in SUMS}))
    same = [x for x in seeds if f(kls["openrlhf/k1-reward", x]) == f(kls["verl/kl-reward-gae", x])]
    v["same"] = f"{len(same)} of {len(seeds)}"
    v["converged"] = str(s["convergence"]["met"])
    return v


QUOTES = [
    "Registered before any run (`grid.json`, {created}): {registered} seeds",
    "**Primary, decided at {n} seeds, one short of the {registered} registered: opposite.**",
    "d = k2 − TRL = {prim} nats, k2 below in {prim_below} of {n} seeds,",
    "paired t p {prim_p}, exact sign-flip p {prim_sf}",
    "an 8th difference of {sf_at_2} or below gives sign-flip p {sf_p_2}, and one of {t_at_2} or below lifts the paired "
    "t p, the registered test, above 0.05 ({t_p_040} at −0.040); the seven differences run {d_range}.",
    "their sessions record `{rev01}`",
    "pinned to {grid_rev}.",
    "their package content, {content}…, is 2bb9231's",
    "`verl+kl-loss-low-var-kl` seed 5, has no provenance",
    "(its `run.json` names {lone_rev} and `final_on` the H200 machine; `grid.json` lists two calls of it, at "
    "{lone_calls})",
    "L̄ = {lbar} tokens",
    "β' = 0.5 × {lbar} = {beta_eff}.",
    *(f"{{row {m}}}" for m in TOKEN_MEAN + SUMS[:1] + ("none", "trl/rloo-k1-reward", "verl/kl-reward-gae")),
    *(f"{{seeds {m}}}" for m in TOKEN_MEAN + SUMS[:1] + ("none", "trl/rloo-k1-reward", "verl/kl-reward-gae")),
    "**Every KL term holds the policy {fold}× closer to the reference than no KL** ({kl_range} against {none_kl} "
    "nats), for {cost} less training reward.",
    "end within 0.02 nats of each other, {tm_below} below the two whose KL is summed",
    "and with {tm_reward} less reward.",
    "`none` reaches {none_acc}.",
    "end with the k3 defaults, {gae} from k2;",
    "end on k2, {rloo}.",
    "responses shortened to {tm_len} tokens over the last 10 steps (L̄ = {lbar2})",
    "they are {tm_norm} for the token-mean methods and {sum_norm} for the two sums.",
    "TRL ≥ 1.10 and verl within {k3_within} of each other",
    "They give the same numbers to three decimals in {same} seeds.",
]

ASSUMED = (
    ("one_short", "True"),
    ("prim_verdict", "opposite"),
    ("no_prov", "verl+kl-loss-low-var-kl-beta0.5-seed5"),
    ("lone_ran_on", "[]"),
    ("rev01", "3076388fc0bb83f820acfe71431e7facb4d3947a-dirty-2c1ee645297a"),
    ("rev_rest", "2bb9231b9634dc596d96173ba0cd66bd3cfe6ddc"),
    ("acc_kl", "True"),
    ("tm_within", "True"),
    ("converged", "False"),
)


def derived(v: dict[str, str]) -> dict[str, str]:
    """The thresholds as the prose writes them: rounded away from zero, so "x or below" stays true."""
    for k in ("sf_at", "t_at"):
        v[f"{k}_2"] = f"{MINUS}{math.ceil(abs(float(v[k].replace(MINUS, '-'))) * 1000) / 1000:.3f}"
    v["sf_p_2"] = v["sf_p"]
    return v


FINDINGS = [
    "{prim}, {prim_below} of {n}, paired t p {prim_p}, sign-flip p {prim_sf}",
    "decided at {n} seeds, one short of the {registered} registered:",
    "an 8th difference of {sf_at_2} or below would give sign-flip p {sf_p_2}",
    "the token-mean defaults end {tm_below} nats below the two sequence sums",
    "descriptive: {rloo}",
]
"""This study's phrases in docs/findings.md (each must occur there)."""


def check(readme: Path = HERE / "README.md", v: dict[str, str] | None = None) -> list[str]:
    v = derived(dict(values() if v is None else v))
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
