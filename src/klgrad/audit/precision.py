r"""The audit's precision axis: a KL term's per-token gradient computed in a low-precision dtype against float64.

A KL term is a function of one token's log-probs (l, r): the policy's l (carries gradient) and the reference's r,
log-ratio u = l − r. Its *gradient coefficient* g is what multiplies the score function ∇l on that token,
on-policy (behaviour o = l̄):

- a loss term (klgrad's as-loss heads, the frameworks' KL losses): g = ∂(term)/∂l by autograd;
- a reward term (klgrad's in-reward heads, the frameworks' KL rewards): g = the detached per-token penalty, the
  weight the policy loss puts on ∇l (klgrad's heads: the same autograd through :func:`klgrad.kl.kl_loss`).

:func:`precision_report` evaluates g with l and r stored in a dtype (float32, bfloat16, float16) and every
operation of the term's code in the dtype it computes in (a framework's code in the dtype of its inputs; klgrad's
heads promote to float32 first, their rule, and round the gradient back to the inputs' dtype), and compares it
with float64 arithmetic on the *same* rounded log-probs, over u ∈ [−30, 30] (:func:`log_ratio_grid`). So the
error is the term's arithmetic alone, not the rounding of the log-probs (no KL formula can undo that).

Where the float64 value does not fit the dtype the point is left out of the relative error and reported as a
range of u, never hidden: above the dtype's largest number (``dtype_overflow``; float16's 65504 is e^{11.09}) or
below its smallest normal number (``dtype_underflow``; float16's 6.1e-5: tiny gradients lose relative accuracy,
not their size). So are points where the dtype's value is inf or nan although float64's fits
(``dtype_nonfinite``), where it is exactly zero although float64's is not (``dtype_zero``), and where it is off by
more than :data:`WRONG` (``dtype_wrong``). A reward term's g is a per-token value: near u = 0 k3's is u²/2, so its
relative error there is that of a small number (an absolute error of about the dtype's unit roundoff).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from klgrad.audit.framework_kl import FrameworkKL
from klgrad.choices import AUDIT_DTYPES
from klgrad.fmt import fmt_num
from klgrad.kl import KLHead, kl_loss_per_sequence

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in AUDIT_DTYPES}
"""The dtypes of ``klgrad audit --dtype`` (:data:`klgrad.choices.AUDIT_DTYPES`), by name."""

U_LIMIT = 30.0
"""The audited log-ratios: u ∈ [−U_LIMIT, U_LIMIT]."""

BASE_LOG_PROBS: tuple[float, ...] = (0.0, -math.log(2.0), -math.log(10.0))
"""The larger of each token's two log-probs (:func:`log_prob_pairs`): a sure token, a coin flip, one in ten."""

WRONG = 0.1
"""A gradient whose relative error exceeds this is reported as wrong (``dtype_wrong``)."""

GradientFn = Callable[[Tensor, Tensor], Tensor]
"""(l, r) -> g: per-token gradient coefficient, shapes (N,) -> (N,), in the dtype of ``l``."""


def log_ratio_grid(limit: float = U_LIMIT, step: float = 0.01, near_zero: int = 25) -> Tensor:
    """u ∈ [−limit, limit], (M,) float64 sorted: multiples of ``step`` (0 exactly among them) and ±10^k for
    ``near_zero`` values of k in [−6, −2], where a cancelling form loses its relative accuracy."""
    n = round(limit / step)
    even = torch.arange(-n, n + 1, dtype=torch.float64) * step
    small = torch.logspace(-6.0, -2.0, near_zero, dtype=torch.float64)
    return torch.unique(torch.cat([even, small, -small]))  # sorted


def log_prob_pairs(u: Tensor, bases: tuple[float, ...] = BASE_LOG_PROBS) -> tuple[Tensor, Tensor]:
    """Log-prob pairs (l, r) with l − r = u, both ≤ 0: l = b + min(u, 0), r = b − max(u, 0) for each base b;
    (M,) -> (K·M,), (K·M,) float64 (base-major)."""
    b = torch.tensor(bases, dtype=u.dtype)[:, None]  # (K, 1)
    l = b + u.clamp(max=0.0)  # (K, M)
    r = b - u.clamp(min=0.0)  # (K, M)
    return l.reshape(-1), r.reshape(-1)


def head_gradient(head: KLHead) -> GradientFn:
    """g of a klgrad head at one token: d(:func:`~klgrad.kl.kl_loss_per_sequence` at ``token`` level)/dl by
    autograd (as-loss: ∂ψ/∂l; in-reward: c), on-policy; the gradient has the dtype of ``l``."""

    def gradient(l: Tensor, r: Tensor) -> Tensor:
        with torch.enable_grad():
            leaf = l.detach()[:, None].requires_grad_(True)  # (N, 1) one-token responses
            mask = torch.ones_like(leaf, dtype=torch.bool)
            loss = kl_loss_per_sequence(head, leaf, r.detach()[:, None], mask, level="token").sum()
            (grad,) = torch.autograd.grad(loss, leaf, allow_unused=True)
        return torch.zeros_like(l) if grad is None else grad[:, 0].detach()

    return gradient


def preset_gradient(preset: FrameworkKL) -> GradientFn:
    """g of a framework's per-token rule, on-policy (behaviour o = l̄), in the dtype of its inputs: a loss
    preset's ∂(term)/∂l by autograd, a reward preset's penalty computed from o (the weight on ∇l)."""

    def gradient(l: Tensor, r: Tensor) -> Tensor:
        l2, r2 = l.detach()[:, None], r.detach()[:, None]  # (N, 1)
        mask = torch.ones_like(l2, dtype=torch.bool)
        if preset.style == "reward":
            return preset.token_kl(l2, r2, l2, mask)[:, 0].detach()
        with torch.enable_grad():
            leaf = l2.clone().requires_grad_(True)
            term = preset.token_kl(leaf, r2, leaf.detach(), mask).sum()
            if not term.requires_grad:  # a constant (an ignored flag)
                return torch.zeros_like(l)
            (grad,) = torch.autograd.grad(term, leaf, allow_unused=True)
        return torch.zeros_like(l) if grad is None else grad[:, 0].detach()

    return gradient


def u_ranges(u: Tensor, flagged: Tensor, max_runs: int = 2) -> str | None:
    """The log-ratios where ``flagged`` holds, as text; None when nowhere. Shapes (M,), (M,) bool.

    Runs of consecutive points of the sorted ``u``: the run that reaches −30 (``u ≤ a``) and the one that reaches
    30 (``u ≥ b``) first, then up to ``max_runs`` others (``a ≤ u ≤ b``); beyond that, the count of the remaining
    points and their hull (``k points in [a, b]``)."""
    if not bool(flagged.any()):
        return None
    order = torch.argsort(u, stable=True)
    u, flagged = u[order], flagged[order]
    if bool(flagged.all()):
        return "everywhere"
    steps = torch.diff(flagged.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8))
    starts = torch.nonzero(steps == 1)[:, 0].tolist()
    ends = [i - 1 for i in torch.nonzero(steps == -1)[:, 0].tolist()]
    if len(ends) < len(starts):
        ends.append(len(u) - 1)
    runs = list(zip(starts, ends, strict=True))
    edge = [(a, b) for a, b in runs if a == 0 or b == len(u) - 1]
    inner = [(a, b) for a, b in runs if (a, b) not in edge]
    parts = [f"u ≤ {float(u[b]):.3g}" if a == 0 else f"u ≥ {float(u[a]):.3g}" for a, b in edge]
    if len(inner) <= max_runs:
        for a, b in inner:
            ua, ub = float(u[a]), float(u[b])
            parts.append(f"u = {ua:.3g}" if f"{ua:.3g}" == f"{ub:.3g}" else f"{ua:.3g} ≤ u ≤ {ub:.3g}")
    else:
        points = torch.cat([u[a : b + 1] for a, b in inner])
        parts.append(f"{len(points)} points in [{float(points.min()):.3g}, {float(points.max()):.3g}]")
    return ", ".join(parts)


def bridge(u: Tensor, flagged: Tensor, neutral: Tensor) -> Tensor:
    """``flagged`` with each run of ``neutral`` points (in the order of ``u``) also flagged when the points on both
    sides of it are: a range of u is not broken by points where nothing can go wrong (u = 0, where every KL
    gradient is 0 in any dtype). Shapes (M,) -> (M,) bool."""
    order = torch.argsort(u, stable=True)
    f, n = flagged[order].tolist(), neutral[order].tolist()
    out = list(f)
    i = 0
    while i < len(f):
        if not n[i]:
            i += 1
            continue
        j = i
        while j < len(f) and n[j]:
            j += 1
        if i > 0 and j < len(f) and f[i - 1] and f[j]:
            out[i:j] = [True] * (j - i)
        i = j
    result = torch.zeros_like(flagged)
    result[order] = torch.tensor(out, dtype=torch.bool)
    return result


@dataclass(frozen=True)
class PrecisionReport:
    """One term's gradient in one dtype against float64 (:func:`precision_report`); ranges are text of u."""

    dtype: str
    grad_err: float
    """Largest |g − g64| / |g64| where g64 ≠ 0 fits the dtype and g is finite (a nonzero g where g64 = 0, at
    a clamp's edge, is in ``wrong``)."""
    worst_u: float | None
    """The log-ratio of that largest error."""
    overflow: str | None
    """Where |g64| is above the dtype's largest number (left out of ``grad_err``)."""
    underflow: str | None
    """Where 0 < |g64| is below the dtype's smallest normal number (left out of ``grad_err``)."""
    nonfinite: str | None
    """Where g is inf or nan although g64 fits the dtype."""
    zero: str | None
    """Where g is exactly 0 although g64 fits the dtype and is not 0."""
    wrong: str | None
    """Where the relative error exceeds :data:`WRONG`, g is not finite, or g ≠ 0 = g64 (zeros included)."""

    def fields(self) -> dict:
        """The JSON row fields: ``dtype``, ``dtype_grad_err``, ``dtype_grad_err_at`` and the five ranges."""
        return dict(
            dtype=self.dtype,
            dtype_grad_err=self.grad_err,
            dtype_grad_err_at=self.worst_u,
            dtype_overflow=self.overflow,
            dtype_underflow=self.underflow,
            dtype_nonfinite=self.nonfinite,
            dtype_zero=self.zero,
            dtype_wrong=self.wrong,
        )


def precision_report(gradient: GradientFn, dtype: str, u: Tensor | None = None) -> PrecisionReport:
    """g computed from log-probs in ``dtype`` against float64 on the same rounded log-probs, over the log-ratios
    ``u`` (default :func:`log_ratio_grid`) at every base of :func:`log_prob_pairs`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    l, r = log_prob_pairs(log_ratio_grid() if u is None else u)
    low = DTYPES[dtype]
    l_low, r_low = l.to(low), r.to(low)
    l64, r64 = l_low.double(), r_low.double()
    u64 = l64 - r64  # the log-ratios actually evaluated (exact in float64)
    g64 = gradient(l64, r64)  # (K·M,)
    g = gradient(l_low, r_low).double()
    info = torch.finfo(low)
    mag = g64.abs()
    over = mag > info.max
    under = (mag > 0) & (mag < info.tiny)
    fits = ~over & ~under
    finite = torch.isfinite(g)
    err = (g - g64).abs() / mag.clamp(min=info.tiny)  # relative where g64 ≠ 0
    ok = fits & finite & (mag > 0)
    err_ok = torch.where(ok, err, torch.zeros_like(err))
    both_zero = (g64 == 0) & (g == 0)
    worst = int(torch.argmax(err_ok))
    return PrecisionReport(
        dtype=dtype,
        grad_err=float(err_ok[worst]),
        worst_u=float(u64[worst]) if float(err_ok[worst]) > 0 else None,
        overflow=u_ranges(u64, over),
        underflow=u_ranges(u64, under),
        nonfinite=u_ranges(u64, fits & ~finite),
        zero=u_ranges(u64, bridge(u64, fits & (g == 0) & (g64 != 0), both_zero)),
        wrong=u_ranges(u64, bridge(u64, fits & (~finite | (err > WRONG) | ((g64 == 0) & (g != 0))), both_zero)),
    )


def head_precision(heads: dict[str, KLHead], dtype: str) -> dict[str, PrecisionReport]:
    """:func:`precision_report` of every head in ``heads`` (by its key) in ``dtype``."""
    return {name: precision_report(head_gradient(head), dtype) for name, head in heads.items()}


def preset_precision(presets: tuple[FrameworkKL, ...], dtype: str) -> dict[str, PrecisionReport]:
    """:func:`precision_report` of every preset's per-token rule in ``dtype``, by preset id."""
    return {p.id: precision_report(preset_gradient(p), dtype) for p in presets}


def with_precision(rows: list[dict], key: str, reports: dict[str, PrecisionReport]) -> list[dict]:
    """``rows`` with the fields of ``reports[row[key]]`` added to each (new dicts)."""
    return [{**row, **reports[row[key]].fields()} for row in rows]


def fmt_relative_error(x: float) -> str:
    """A relative error for the tables: 3 digits, scientific below 1e-2 and from 1e3, "0" for 0."""
    return fmt_num(x, 3, sci_digits=1, sci_below=1e-2, sci_from=1e3, tiny=1e-12, tiny_text="<1e-12", zero="0")


def fmt_precision(report: PrecisionReport) -> str:
    """One table cell: the largest relative error, then the ranges where the gradient is zero, wrong, not finite
    or overflows the dtype (underflow, which costs tiny gradients their relative accuracy only, is left to the
    JSON)."""
    parts = [fmt_relative_error(report.grad_err)]
    if report.zero:
        parts.append(f"0 at {report.zero}")
    if report.wrong and report.wrong != report.zero:
        parts.append(f"wrong at {report.wrong}")
    if report.nonfinite:
        parts.append(f"inf/nan at {report.nonfinite}")
    if report.overflow:
        parts.append(f"overflows at {report.overflow}")
    return "; ".join(parts)


def print_precision_table(rows: list[dict], key: str, console=None) -> None:
    """A rich table of the precision fields of ``rows`` (one line per distinct ``row[key]``)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    seen: dict[str, dict] = {}
    for row in rows:
        seen.setdefault(row[key], row)
    if not seen:
        return
    dtype = next(iter(seen.values()))["dtype"]
    table = Table(
        title=f"Per-token KL gradient computed from {dtype} log-probs vs float64, u = l − r ∈ [−30, 30] "
        f"(relative error; ranges of u where it is 0, off by > {WRONG:g}, inf/nan, or over/underflows {dtype})"
    )
    table.add_column(key)
    table.add_column("max rel. err", justify="right")
    table.add_column("at u", justify="right")
    for col in ("zero", "wrong", "inf/nan", "overflow", "underflow"):
        table.add_column(col)
    for name, row in seen.items():
        at = row["dtype_grad_err_at"]
        cells = (
            name,
            f"{row['dtype_grad_err']:.2g}",
            "" if at is None else f"{at:.3g}",
            row["dtype_zero"] or "",
            row["dtype_wrong"] or "",
            row["dtype_nonfinite"] or "",
            row["dtype_overflow"] or "",
            row["dtype_underflow"] or "",
        )
        table.add_row(*map(escape, cells))
    console.print(table)
