"""The numbers this study's README quotes, recomputed from ``runs.json`` and the grids' ``grid.json``.

    python experiments/tiny_add_staleness/readme.py    # exit 1 naming each quote that is not the files'

No script writes the README; this one reads it: every phrase of :data:`QUOTES`, rendered by :func:`values`, must
occur once in the README (whitespace runs compared as one space), and the words it holds fixed (:data:`ASSUMED`)
must be what the values say.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FINDINGS_PAGE = HERE.parents[1] / "docs" / "findings.md"
HEADS = ("none", "k1_in_reward", "k2_as_loss", "k3_as_loss")
MINUS = "\u2212"


def sg(x: float, nd: int = 3) -> str:
    return f"{x:+.{nd}f}".replace("-", MINUS)


def flat(text: str) -> str:
    return " ".join(text.split())


def values(d: Path = HERE) -> dict[str, str]:
    rows = json.loads((d / "runs.json").read_text())
    by = {(r["method"], r["staleness"], r["seed"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    v = {"runs": str(len(rows)), "seeds": f"{seeds[0]}–{seeds[-1]}"}

    def mean(m: str, k: int, key: str) -> float:
        return statistics.mean(by[m, k, s][key] for s in seeds)

    for m in HEADS:
        cells = []
        for k in (1, 4):
            d_ = [by[m, k, s]["exact_kl"] - by[m, 0, s]["exact_kl"] for s in seeds]
            cells.append(f"{sg(statistics.mean(d_))} ({sum(x > 0 for x in d_)}/{len(seeds)})")
        cells.append(" / ".join(f"{100 * mean(m, k, 'clip/frac'):.1f}%" for k in (1, 4)))
        cells.append(" / ".join(f"{100 * mean(m, k, 'clip/kl_frac'):.1f}%" for k in (1, 4)))
        cells.append(" / ".join(f"{mean(m, k, 'ratio/max'):.2f}" for k in (1, 4)))
        v[f"row {m}"] = f"| {m} | " + " | ".join(cells) + " |"
    sds = [statistics.stdev(by[m, k, s]["exact_kl"] for s in seeds) for m in HEADS for k in (0, 1, 4)]
    v["max_sd"] = f"{max(sds):.3f}"
    clip4 = [100 * mean(m, 4, "clip/frac") for m in HEADS]
    v["clip4"] = f"{min(clip4):.1f}–{max(clip4):.1f}%"
    kl4 = sorted({f"{100 * mean(m, 4, 'clip/kl_frac'):.1f}%" for m in ("k2_as_loss", "k3_as_loss")})
    v["kl4"] = " and ".join(kl4)
    r4 = [mean(m, 4, "ratio/max") for m in HEADS]
    v["ratio4"] = f"{min(r4):.2f}–{max(r4):.2f}"
    v["none_closer"] = str(
        all(by["none", k, s]["exact_kl"] < by["none", 0, s]["exact_kl"] for k in (1, 4) for s in seeds)
    )
    v["k2_up4"] = str(all(by["k2_as_loss", 4, s]["exact_kl"] > by["k2_as_loss", 0, s]["exact_kl"] for s in seeds))
    v["within"] = str(
        all(
            abs(statistics.mean(by[m, k, s][key] - by[m, 0, s][key] for s in seeds))
            <= max(statistics.stdev(by[m, j, s][key] for s in seeds) for j in (0, k))
            for m in HEADS
            for k in (1, 4)
            for key in ("exact_kl", "greedy_accuracy")
        )
    )
    v["machine"] = " ".join(sorted({m for r in rows for m in r["ran_on"]}))
    revs, contents, split = {}, {}, []
    for g in sorted(d.glob("*/grid.json")):
        rec = json.loads(g.read_text())
        revs[g.parent.name] = rec["revision"]["revision"]
        contents[g.parent.name] = rec["revision"]["content"][:8]
        if "_" in g.parent.name:
            split += [(m, s) for x in rec["sessions"] for m in x["methods"] for s in x["seeds"]]
    v["main_rev"] = " ".join(sorted({revs[k] for k in ("k0", "k1", "k4")}))[:7]
    v["main_content"] = contents["k0"]
    v["split_revs"] = " and ".join(
        f"`{r[:7]}…-dirty-{r.rsplit('-', 1)[1]}`" for r in sorted({revs[k] for k in revs if "_" in k})
    )
    v["split_content"] = " ".join(sorted({contents[k] for k in contents if "_" in k}))
    v["split_k3_all"] = str(all(("k3_as_loss", s) in split for s in seeds))
    return v


QUOTES = [
    "seeds {seeds}, {runs} runs",
    "the three main grids ran commit {main_rev}",
    "uncommitted changes ({split_revs}, one package content between them,",
    "{split_content}…, not df10ad9's {main_content}…)",
    "{row none}",
    "{row k1_in_reward}",
    "{row k2_as_loss}",
    "{row k3_as_loss}",
    "(the seeds' sd of the final KL is up to {max_sd})",
    "at k = 4 the reward head clips {clip4} of the response tokens and the KL heads {kl4}, with the largest ratio of "
    "a step {ratio4} on average",
]
ASSUMED = (
    ("none_closer", "True"),
    ("k2_up4", "True"),
    ("within", "True"),
    ("split_k3_all", "True"),
    ("machine", "vm: Intel(R) Xeon(R) Processor (avx512)"),
)

FINDINGS = ["the largest seed sd of the final KL is {max_sd}"]
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
