r"""The paper's Figure 1: each head's score-function coefficient against the actor log-prob.

Every KL head acts on the policy through a detached coefficient c on the score function ∇log π (docs/math.md,
“KL heads”). At a single response with π = π(y) and a fixed reference π_ref = π_ref(y), u = log π - log π_ref
and:

- ``k1_in_reward`` and ``k2_as_loss``:  c = u = log π - log π_ref  (the exact reverse-KL coefficient; the two
  heads are identical per sample, so they share one curve);
- ``k3_as_loss`` (and ``k3_in_reward``):  c = 1 - π_ref/π = 1 - e^{-u}  (a first-order surrogate of u: it
  saturates at 1 when π ≫ π_ref and explodes like -π_ref/π when π ≪ π_ref);
- ``mse_in_reward``:  c = π - π_ref  (bounded in [-1, 1]);
- ``k1_as_loss``:  c = 1  (independent of π_ref: zero expected gradient, E_π[∇log π] = 0);
- ``none``:  c = 0.

All but ``k1_as_loss`` vanish at log π = log π_ref. The curves are computed with the library's own heads
(:meth:`klgrad.kl.KLHead.coefficient`) in float64: the figure shows what the code does, not a re-derivation.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from klgrad.kl import KL_HEADS
from klgrad.plotting import pyplot, save

DEFAULT_HEADS: tuple[str, ...] = ("k1_in_reward", "k2_as_loss", "k3_as_loss", "mse_in_reward", "k1_as_loss")
"""The heads of the paper's Figure 1."""


def coefficient_curves(
    pi_ref: float = 0.25,
    lo: float = -5.0,
    hi: float = 0.0,
    n: int = 401,
    heads: tuple[str, ...] = DEFAULT_HEADS,
) -> dict:
    r"""Coefficients c(log π, log π_ref) of each head on a grid of actor log-probs, float64.

    Args:
        pi_ref: reference probability π_ref of the response, in (0, 1].
        lo, hi: the log π range (lo < hi).
        n: number of grid points (>= 2), ``torch.linspace(lo, hi, n)``.
        heads: registry names (:data:`klgrad.kl.KL_HEADS`).

    Returns:
        ``{"pi_ref", "log_pi_ref", "lo", "hi", "log_pi": [n floats], "curves": {head: [n floats]}}`` where
        ``curves[h][i] = KL_HEADS[h].coefficient(log_pi[i], log π_ref)``; e.g. k1/k2: log π - log π_ref,
        k3: 1 - π_ref/π, MSE: π - π_ref, k1 as loss: 1. JSON-serialisable.
    """
    if not (0.0 < pi_ref <= 1.0):
        raise ValueError(f"pi_ref must be in (0, 1], got {pi_ref!r}")
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"need finite lo < hi, got lo={lo!r}, hi={hi!r}")
    if n < 2:
        raise ValueError(f"n must be >= 2, got {n!r}")
    unknown = [h for h in heads if h not in KL_HEADS]
    if unknown:
        raise ValueError(f"unknown KL head(s) {unknown}; choose from {sorted(KL_HEADS)}")
    log_pi = torch.linspace(lo, hi, n, dtype=torch.float64)  # (n,)
    log_ref = torch.full_like(log_pi, math.log(pi_ref))  # (n,)
    curves = {h: KL_HEADS[h].coefficient(log_pi, log_ref).tolist() for h in heads}  # registry: no warning
    return {
        "pi_ref": float(pi_ref),
        "log_pi_ref": math.log(pi_ref),
        "lo": float(lo),
        "hi": float(hi),
        "log_pi": log_pi.tolist(),
        "curves": curves,
    }


@dataclass(frozen=True)
class CurveStyle:
    """One line of the figure: the heads it stands for (identical curves), its legend label and look."""

    heads: tuple[str, ...]
    label: str
    color: str
    linestyle: str
    linewidth: float


# Heads whose coefficients are identical per sample share one line and one legend entry.
_GROUPS: tuple[tuple[tuple[str, ...], str, str, str, str, float], ...] = (
    (("k1_in_reward", "k2_as_loss"), "c = log π − log π_ref", "principled", "olive", "-", 3.5),
    (("k3_as_loss", "k3_in_reward"), "c = 1 − π_ref/π", "biased first-order", "firebrick", "--", 2.5),
    (("mse_in_reward",), "c = π − π_ref", "bounded, not a KL", "royalblue", "-.", 2.5),
    (("k1_as_loss",), "c = 1", "zero expected gradient", "gray", ":", 2.5),
    (("none",), "c = 0", "no KL", "black", "-", 1.0),
)
_PRETTY = {
    "k1_in_reward": "k1 in reward",
    "k2_as_loss": "k2 as loss",
    "k3_as_loss": "k3 as loss",
    "k3_in_reward": "k3 in reward",
    "mse_in_reward": "MSE in reward",
    "k1_as_loss": "k1 as loss",
    "none": "no KL",
}


def curve_styles(curves: dict) -> list[CurveStyle]:
    """The lines to draw for ``curves`` (a :func:`coefficient_curves` result), in legend order.

    Heads of one group (k1_in_reward/k2_as_loss; k3_as_loss/k3_in_reward) share a line and a legend entry
    when their curves are identical, as they are for the built-in heads.
    """
    present = curves["curves"]
    out: list[CurveStyle] = []
    grouped: set[str] = set()
    for members, formula, verdict, color, ls, lw in _GROUPS:
        names = [h for h in members if h in present]
        grouped.update(names)
        if not names:
            continue
        same = all(present[h] == present[names[0]] for h in names)
        for chunk in [names] if same else [[h] for h in names]:
            label = " = ".join(_PRETTY[h] for h in chunk) + f": {formula} ({verdict})"
            out.append(CurveStyle(tuple(chunk), label, color, ls, lw))
    for h in present:  # anything else in the registry
        if h not in grouped:
            out.append(CurveStyle((h,), _PRETTY.get(h, h), "purple", "-", 1.5))
    return out


def plot_coefficient_curves(curves: dict, path: str | os.PathLike[str]) -> None:
    """Draw :func:`coefficient_curves` output as a PNG at ``path`` (matplotlib, Agg; the paper's look).

    Solid olive thick: k1 in reward = k2 as loss (principled); dashed firebrick: k3 (biased first-order);
    dash-dot royal blue: MSE; dotted gray: k1 as loss (zero expected gradient); a dashed vertical line at
    log π_ref. y is clipped to (-4, 4): k3 leaves the frame below, as in the paper.
    """
    plt = pyplot()
    x = curves["log_pi"]
    lo, hi = curves.get("lo", x[0]), curves.get("hi", x[-1])
    fig, ax = plt.subplots(figsize=(9.0, 5.5))
    ax.axhline(0.0, color="0.75", lw=0.8, zorder=0)
    for style in curve_styles(curves):
        ax.plot(
            x,
            curves["curves"][style.heads[0]],
            linestyle=style.linestyle,
            color=style.color,
            linewidth=style.linewidth,
            label=style.label,
        )
    ax.axvline(
        curves["log_pi_ref"],
        color="black",
        linestyle="--",
        linewidth=1.0,
        label=f"log π_ref = log {curves['pi_ref']:g}",
    )
    ax.set_xlim(lo, hi)
    ax.set_ylim(-4.0, 4.0)
    ax.set_xlabel("log π (actor log-probability of the sampled response)")
    ax.set_ylabel("score-function coefficient c")
    ax.set_title(f"Score-function coefficient vs log π (π_ref = {curves['pi_ref']:g})")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=9, framealpha=0.92)
    fig.tight_layout()
    save(fig, Path(path), dpi=150)


def write_coefficient_figure(out_dir: str | os.PathLike[str]) -> dict:
    """Write ``coefficients.json`` and ``coefficients.png`` (π_ref = 0.25, log π in [-5, 0]) into ``out_dir``.

    The folder is created if needed. Returns the :func:`coefficient_curves` dict that was written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    curves = coefficient_curves()
    tmp = out / "coefficients.json.tmp"
    tmp.write_text(json.dumps(curves, indent=1, allow_nan=False))
    tmp.replace(out / "coefficients.json")
    plot_coefficient_curves(curves, out / "coefficients.png")
    return curves
