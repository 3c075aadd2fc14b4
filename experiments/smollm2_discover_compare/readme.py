"""The numbers this study's README quotes, recomputed from the study's committed ``summary.json``.

    python experiments/smollm2_discover_compare/readme.py    # exit 1 naming each quote that is not the files'

No script writes the README; this one reads it. :func:`values` formats, from ``summary.json`` (written by
``klgrad compare``), the final KL to the reference of every method, each tested prediction's table row (mean
difference and 95% interval, seeds in the claimed direction, Holm-adjusted p, sign-flip p, verdict) and the
study's other quoted fields; :func:`check` asks every phrase (:data:`QUOTES`, this study's :data:`EXTRA`), rendered
with them, to occur exactly once in the README (whitespace runs compared as one space).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXTRA: list[str] = [
    "Greedy accuracy: {accs}.",
    "(the reference right {ref_acc} of the time greedily",
    "{steps} steps, 5 seeds ({seeds}),\none Holm family of {family}",
    "was below sampled k1's in {se_below} runs ({se})",
    "The one decided verdict has a sign-flip p of {row0_sf}",
]
"""This study's phrases beyond the final KLs and the predictions' rows."""
FINDINGS: list[str] = ["{d0}, {neg0}, Holm p {holm0}", "sign-flip p {row0_sf}: normality"]
"""This study's phrases in docs/findings.md (each must occur there)."""
ASSUMED: list[tuple[str, str]] = [("decided", "1"), ("all_decided_normal", "True")]
"""Words this study's README holds fixed, and the value of :func:`values` that keeps them true."""


_spec = importlib.util.spec_from_file_location("compare_readme", HERE.parent / "compare_readme.py")
shared = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shared)


def values(d: Path = HERE) -> dict[str, str]:
    return shared.values(d)


def check(readme: Path = HERE / "README.md", v: dict[str, str] | None = None) -> list[str]:
    return shared.check(HERE, EXTRA, FINDINGS, ASSUMED, readme=readme, v=v)


if __name__ == "__main__":
    problems = check()
    print("\n".join(problems) or "every quoted number is the committed files'")
    sys.exit(1 if problems else 0)
