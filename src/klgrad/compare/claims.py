"""A grid's primary hypothesis, stated before any run: ``klgrad compare --primary "A<B:METRIC"``.

Syntax: ``A<B[:METRIC]`` claims mean(A) < mean(B) on METRIC at the grid's first β (a paired test on per-seed
differences, two-sided p); ``A~B[:METRIC]`` claims A ≈ B within the grid's equivalence margin (paired TOST, with
the test of a difference beside it). A and B are methods of the grid; METRIC is ``kl`` (the summary's KL to
the reference, the default) or a final metric (``logp_gap``, ``kl_to_optimum``, ...). The primary hypothesis is
written into grid.json and summary.json before the first run and decided alone (its own family: one hypothesis,
or two for an equivalence, whose nulls cannot both be true, so neither is adjusted: the TOST is at α, i.e.
equivalence iff the 90% interval lies inside ±margin at α = 0.05, :func:`klgrad.compare.stats.holm_disjoint`);
every other prediction is secondary, Holm-adjusted in a family of its own.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Claim:
    """One pre-registered claim: ``kind`` "less" (mean a < mean b) or "equivalent" (a ≈ b) on ``metric``."""

    a: str
    b: str
    kind: str
    metric: str = "kl"

    @property
    def text(self) -> str:
        return f"{self.a}{'<' if self.kind == 'less' else '~'}{self.b}:{self.metric}"

    def sentence(self) -> str:
        if self.kind == "less":
            return f"{self.a} ends below {self.b} on {self.metric}"
        return f"{self.a} ≈ {self.b} on {self.metric}"

    def as_dict(self) -> dict:
        return {**asdict(self), "text": self.text, "claim": self.sentence()}


def parse_claim(text: str) -> Claim:
    """``A<B[:METRIC]`` or ``A~B[:METRIC]`` → :class:`Claim` (metric ``kl`` when omitted). A method named by an
    import path (``pkg.mod:head``, a dotted module) keeps its colon: ``k2_as_loss<pkg.mod:head`` has metric
    ``kl``, ``k2_as_loss<pkg.mod:head:logp_gap`` names one. Raises ValueError naming the expected form."""
    form = f"--primary {text!r}: expected 'A<B[:METRIC]' or 'A~B[:METRIC]', e.g. 'k2_as_loss<k3_as_loss:kl'"
    ops = [op for op in ("<", "~") if op in text]
    if len(ops) != 1 or text.count(ops[0]) != 1:
        raise ValueError(form)
    op = ops[0]
    a, rest = (s.strip() for s in text.split(op))
    parts = [p.strip() for p in rest.split(":")]
    if len(parts) == 1 or (len(parts) == 2 and "." in parts[0]):
        b, metric = rest, "kl"
    elif len(parts) in (2, 3):
        b, metric = ":".join(parts[:-1]), parts[-1]
    else:
        raise ValueError(form)
    if not a or not b or not re.fullmatch(r"[\w/]+", metric):
        raise ValueError(form)
    return Claim(a, b, "less" if op == "<" else "equivalent", metric)


def same_claim(claim: Claim, kind: str, a: str, b: str, key: str, kl_key: str) -> bool:
    """True when a prediction (kind, a, b, final metric ``key``) is the primary claim itself (then it is not
    secondary); the claim's metric ``kl`` is the summary's KL, ``kl_key``."""
    metric = kl_key if claim.metric == "kl" else claim.metric
    return (claim.kind, claim.a, claim.b, metric) == (kind, a, b, key)
