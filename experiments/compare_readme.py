"""The shared check of the compare-grid studies' READMEs (tiny_add_compare, tiny_add_sequence,
tiny_discovery_compare, smollm2_discover_compare, smollm2_sharpen_compare): :func:`values` formats, from a grid's
committed ``summary.json`` (written by ``klgrad compare``), the final KL to the reference of every method, each
tested prediction's table row (mean difference and 95% interval, seeds in the claimed direction, Holm-adjusted p,
sign-flip p, verdict) and the other quoted fields; :func:`check` asks every phrase, rendered with them, to occur
exactly once in the study's README. Each study's ``readme.py`` holds only its own phrases."""

from __future__ import annotations

import json
import math
import statistics
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

FINDINGS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "findings.md"
MINUS = "\u2212"


def sg(x: float, nd: int = 3) -> str:
    return f"{x:+.{nd}f}".replace("-", MINUS)


def f(x: float, nd: int = 3) -> str:
    return f"{x:.{nd}f}".replace("-", MINUS)


def pf(p: float) -> str:
    """Two significant figures (0.038, 0.010, 5.6e-06; halves rounded up), 1 for p = 1."""
    if p >= 1:
        return "1"
    if p < 1e-3:
        return f"{p:.1e}"
    step = Decimal(1).scaleb(math.floor(math.log10(p)) - 1)
    return f"{Decimal(p).quantize(step, ROUND_HALF_UP):f}"


def flat(text: str) -> str:
    return " ".join(text.split())


def values(d: Path) -> dict[str, str]:
    s = json.loads((d / "summary.json").read_text())
    v: dict[str, str] = {}
    seeds = sorted({r["seed"] for r in s["runs"]})
    v["n"], v["seeds"] = str(len(seeds)), f"{seeds[0]}\u2013{seeds[-1]}"
    v["steps"], v["level"], v["tau"] = str(s["steps"]), s["level"], f"{s['temperature']:g}"
    v["beta"] = ", ".join(f"{b:g}" for b in s["betas"])
    v["ref_acc"] = f(s["runs"][0]["reference_greedy_accuracy"])
    table = {k.split("@")[0]: row for k, row in s["table"].items()}
    kl = s["kl_metric"]
    v["kls"] = ", ".join(f"{m} {f(row[kl]['mean'])}" for m, row in table.items())
    v["accs"] = ", ".join(f"{m} {f(row['greedy_accuracy']['mean'])}" for m, row in table.items())
    if all("kl_to_optimum" in row for row in table.values()):
        v["opts"] = ", ".join(f"{m} {f(row['kl_to_optimum']['mean'])}" for m, row in table.items())
        opt = [row["kl_to_optimum"]["mean"] for row in table.values()]
        v["opt_range"] = f"{f(min(opt), 2)}–{f(max(opt), 2)}"
    for m, row in table.items():
        for key in (kl, "greedy_accuracy", "logp_gap", "kl_to_optimum"):
            if key in row:
                v[f"{m} {key}"] = f"{f(row[key]['mean'])} ± {f(row[key]['ci95'])}"
    for i, p in enumerate(s["predictions"]):
        nd = 3 if p["metric"] in ("exact_kl", "stepwise_kl", "kl_to_optimum") else 4
        lo, hi = p["ci95"]
        verdict = p["verdict"].replace(" at this sample size", "")
        verdict = verdict if verdict == "not resolved" else f"**{verdict}**"
        v[f"row{i}"] = (
            f"| {p['claim']} | {sg(p['mean_difference'], nd)} [{sg(lo, nd)}, {sg(hi, nd)}] | "
            f"{p['n_negative']}/{p['n_pairs']} | {pf(p['p_adjusted'])} | {pf(p['p_sign_flip'])} | {verdict} |"
        )
        v[f"row{i}_sf"] = pf(p["p_sign_flip"])
        v[f"d{i}"] = f"{sg(p['mean_difference'], nd)} [{sg(lo, nd)}, {sg(hi, nd)}]"
        v[f"holm{i}"], v[f"neg{i}"] = pf(p["p_adjusted"]), f"{p['n_negative']} of {p['n_pairs']}"
    v["rows"] = str(len(s["predictions"]))
    v["family"] = str(len(s["predictions"]) + sum(p["kind"] == "equivalent" for p in s["predictions"]))
    v["min_sign_flip"] = f"{2 / 2 ** len(seeds):.4f}"
    v["normal_only"] = str(sum(p["p_adjusted"] < 0.05 and p["p_sign_flip"] > 0.05 for p in s["predictions"]))
    v["decided"] = str(sum(p["p_adjusted"] < 0.05 for p in s["predictions"]))
    v["all_decided_normal"] = str(v["normal_only"] == v["decided"])
    k = s["predictions"][1]
    v["neg1_k3"] = f"{k['n_pairs'] - k['n_negative']} of {k['n_pairs']}"
    if "stepwise_kl_se" in s["runs"][0]:
        se = [r["stepwise_kl_se"] for r in s["runs"]]
        k1 = [r["sampled_k1_se"] for r in s["runs"]]
        v["se"] = f"{f(min(se))}–{f(max(se))} against {f(min(k1))}–{f(max(k1))}"
        v["se_below"] = f"{sum(a < b for a, b in zip(se, k1, strict=True))} of {len(se)}"
    for m in table:
        for key in ("stepwise_kl", "exact_kl"):
            xs = [r[key] for r in s["runs"] if r["method"] == m and key in r]
            if xs:
                v[f"{m} {key} range"] = f"{f(min(xs), 2)}–{f(max(xs), 2)}"
    v["runs"] = str(len(s["runs"]))
    v["methods"] = ", ".join(f"`{m}`" for m in table)
    v["mean_kl_heads"] = f(statistics.mean(row[kl]["mean"] for m, row in table.items() if m != "none"))
    return v


QUOTES = [
    "{kls}",
    "{n} seeds ({seeds})",
    *(f"{{row{i}}}" for i in range(20)),
]


def check(
    here: Path, extra: list[str], findings: list[str], assumed: list[tuple[str, str]],
    readme: Path | None = None, v: dict[str, str] | None = None,
) -> list[str]:
    """Every phrase of :data:`QUOTES` and the study's ``extra``, rendered with :func:`values` of ``here``, occurs
    exactly once in its README (whitespace runs as one space); each of ``findings`` is on docs/findings.md; each
    (key, value) of ``assumed`` is what the files hold."""
    readme = here / "README.md" if readme is None else readme
    v = values(here) if v is None else v
    rows = int(v["rows"])
    phrases = [q for q in QUOTES if not q.startswith("{row") or int(q[4:-1]) < rows] + extra
    text = flat(readme.read_text())
    problems = [
        f"{readme.name}: not once:\n{t.format_map(v)}" for t in phrases if text.count(flat(t.format_map(v))) != 1
    ]
    page = flat(FINDINGS_PAGE.read_text())
    problems += [
        f"docs/findings.md: missing:\n{t.format_map(v)}" for t in findings if flat(t.format_map(v)) not in page
    ]
    return problems + [f"{k} = {v[k]} (the README says {want})" for k, want in assumed if v[k] != want]
