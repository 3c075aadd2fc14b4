"""The numbers this study's README quotes, recomputed from the committed ``*/regime.json``.

    python experiments/regime/readme.py    # exit 1 naming each quote that is not the files'

No script writes the README; this one reads it: each folder's table row and the other quoted fields, rendered by
:func:`values`, must occur once in the README (whitespace runs compared as one space).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FINDINGS_PAGE = HERE.parents[1] / "docs" / "findings.md"
MINUS = "\u2212"


def f(x: float, nd: int = 3) -> str:
    return f"{x:.{nd}f}".replace("-", MINUS)


def flat(text: str) -> str:
    return " ".join(text.split())


def regimes(d: Path = HERE) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(d.glob("*/regime.json"))}


def values(d: Path = HERE) -> dict[str, str]:
    v: dict[str, str] = {}
    outside = []
    for name, r in regimes(d).items():
        pk, iv = r["predicted_kl"], r["interval_95"]
        lo, hi = iv["forward_minus_reverse"]
        v[f"row {name.replace('.', '_')}"] = (
            f"| `{name}` | {r['beta']:g} | {r['samples_per_prompt']} × {r['n_prompts']} ({r.get('split', 'train')}) | "
            f"{f(r['success_rate'])} | {r['prompts_never_rewarded']} | {f(pk['reverse'])} / {f(pk['forward'])} | "
            f"[{f(lo)}, {f(hi)}] | {r['closer']} |"
        )
        for head in ("reverse", "forward"):
            a, b = iv[head]
            if not a <= pk[head] <= b:
                outside.append(f"`{name}` {head} {f(pk[head])} [{f(a)}, {f(b)}]")
    v["outside"] = "; ".join(outside)
    v["outside_n"] = str(len(outside))
    v["outside_words"] = {5: "five"}.get(len(outside), str(len(outside)))
    rs = regimes(d)
    for cfg in ("sharpen", "discover"):
        pk = rs[f"smollm2_{cfg}_beta0.5"]["predicted_kl"]
        v[f"{cfg}_rev"], v[f"{cfg}_fwd"] = f(pk["reverse"]), f(pk["forward"])
    v["cross_05"] = f(rs["tiny_add"]["crossover_success_rate"])
    v["cross_01"] = f"{rs['smollm2_sharpen']['crossover_success_rate']:.4f}"
    h = rs["smollm2_sharpen_beta0.5_heldout_k256"]
    hard = min(h["prompts"], key=lambda e: e["success_rate"])
    rest = [e for e in h["prompts"] if e is not hard]
    v["hard_id"] = hard["id"]
    v["hard_hits"] = f"{round(hard['success_rate'] * h['samples_per_prompt'])} in {h['samples_per_prompt']}"
    v["hard_fwd"], v["hard_rev"] = f(hard["kl_forward"], 2), f(hard["kl_reverse"], 2)
    v["rest_fwd"] = f(statistics.mean(e["kl_forward"] for e in rest))
    v["rest_rev"] = f(statistics.mean(e["kl_reverse"] for e in rest))
    v["rest_below"] = f"{sum(e['kl_forward'] < e['kl_reverse'] for e in rest)} of {len(rest)}"
    t = rs["smollm2_sharpen_beta0.5_train_k256"]
    v["train_min_rate"] = f(min(e["success_rate"] for e in t["prompts"]))
    return v


QUOTES = [
    *(f"{{row {name.replace('.', '_')}}}" for name in regimes()),
    "{outside}",
    "the success rate at which the two optima are equally far from the reference is {cross_05} at β = 0.5 and "
    "{cross_01} at β = 0.1",
    "`{hard_id}`, which the reference gets right {hard_hits} samples",
    "k3's forward-KL fixed point is {hard_fwd} nats from the reference (π*'s {hard_rev})",
    "on the other 21 prompts k3's fixed point is {rest_fwd} against π*'s {rest_rev} (below it on {rest_below})",
    "every prompt rewarded at least once, the lowest success rate {train_min_rate}",
]

FINDINGS = [
    "(π* {sharpen_rev}, π_f {sharpen_fwd})",
    "({discover_rev} / {discover_fwd})",
    "{cross_05} at β = 0.5 and {cross_01} at β = 0.1",
    "{outside_words} of the bootstrap intervals do not contain",
]
"""This study's phrases in docs/findings.md (each must occur there)."""


def check(readme: Path = HERE / "README.md", v: dict[str, str] | None = None) -> list[str]:
    v = values() if v is None else v
    text = flat(readme.read_text())
    problems = [
        f"{readme.name}: not once:\n{t.format_map(v)}" for t in QUOTES if text.count(flat(t.format_map(v))) != 1
    ]
    page = flat(FINDINGS_PAGE.read_text())
    return problems + [
        f"docs/findings.md: missing:\n{t.format_map(v)}" for t in FINDINGS if flat(t.format_map(v)) not in page
    ]


if __name__ == "__main__":
    problems = check()
    print("\n".join(problems) or "every quoted number is the committed files'")
    sys.exit(1 if problems else 0)
