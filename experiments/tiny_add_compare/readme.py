"""The numbers this study's README quotes, recomputed from the study's committed ``summary.json``.

    python experiments/tiny_add_compare/readme.py    # exit 1 naming each quote that is not the files'

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
    "at τ = {tau} on the held-out prompts",
    "Exact KL(π‖π*) to the optimum of J_β = E[R] − β·KL: {opts}.",
    "fine-tuned to {ref_acc} held-out greedy accuracy",
    "{steps} steps, β = {beta}, 5 seeds",
    "one Holm family of {family}",
    "every decided verdict here ({normal_only} of the {decided}, of {rows} predictions)",
    "the policies are still {opt_range} nats from π*",
]
"""This study's phrases beyond the final KLs and the predictions' rows."""
FINDINGS: list[str] = [
    "{d0}, TOST Holm p {holm0} at ±0.1",
    "(0.434 vs 0.435 on tiny addition)",
    "k3 closer in {neg1_k3} seeds, {d1}, Holm p {holm1}",
    "sign-flip p {row1_sf} (5 seeds cannot go lower)",
    "{d7}, Holm p {holm7}",
    "still {opt_range} nats from π*",
]
"""This study's phrases in docs/findings.md (each must occur there)."""
ASSUMED: list[tuple[str, str]] = [("all_decided_normal", "True")]
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
