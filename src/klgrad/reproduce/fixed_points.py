r"""`klgrad reproduce fixed-points`: where each KL head's training *ends*, on enumerable tabular policies.

A tabular autoregressive policy (:mod:`klgrad.audit.tabular`: V tokens, token 0 = EOS, at most T tokens) is
trained with the EXACT expected gradient of klgrad's loss (every response enumerated once, weighted by its
probability; no sampling) until the gradient vanishes (:mod:`klgrad.reproduce.tabular_descent`). A fixed
reward R(y) ∈ {0, 1} marks some responses as correct. Two regimes differ only in which responses are rewarded:

- ``sharpening``: the reference's most likely responses, holding ≈ 70% of its mass (RL mostly removes mass
  from the reference's wrong answers);
- ``discovery``: its least likely responses, holding ≈ 3% (RL must create mass where the reference has little).

Closed-form endpoints (:mod:`klgrad.exact.optima`; derivations in docs/math.md, "Where training
ends: forward vs reverse KL"):

- reverse KL (k1_in_reward, k2_as_loss at ``sequence`` / ``token_to_go``): maximise E_π[R] - β·KL(π‖π_ref),
  π*(y) = π_ref(y)·exp(R(y)/β) / Z;
- forward KL (k3_as_loss, k3_in_reward at ``sequence``): maximise E_π[R] - β·KL(π_ref‖π),
  π_f(y) = β·π_ref(y) / (λ - R(y)) with λ > max R fixed by Σ_y π_f(y) = 1;
- no KL: maximise E_π[R]; k1_as_loss adds a zero expected gradient at ``sequence`` and ``token`` level.

In-reward heads run in the combined form (A = R - β·C) where :class:`klgrad.config.KLConfig` allows
it; at ``token``, where the combined form is refused (it is not a return), they run decoupled, which has the
same expected gradient on-policy. Runs stop at ‖g‖₂ < ``tol`` or ``max_steps``. The checks of the result
against the theory: :mod:`klgrad.reproduce.fixed_points_checks`; figure and verdict:
:mod:`klgrad.reproduce.fixed_points_report`. Results: docs/reproduction.md, section "8. Where training ends,
forward vs reverse KL".
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from klgrad.audit.tabular import TabularSpace, build_space, token_logps
from klgrad.choices import LEVELS
from klgrad.exact.optima import (
    forward_kl_optimum,
    kl_divergence,
    mse_optimum,
    reverse_kl_optimum,
    rewarded_set,
)
from klgrad.reproduce.fixed_points_checks import checks, closer_to_reference
from klgrad.reproduce.fixed_points_report import plot_fixed_points, verdict_markdown
from klgrad.reproduce.tabular_descent import descend, method_form, per_sequence_loss

REGIMES: tuple[str, ...] = ("sharpening", "discovery")
HEADS: tuple[str, ...] = (
    "none",
    "k1_as_loss",
    "k2_as_loss",
    "k3_as_loss",
    "k1_in_reward",
    "k3_in_reward",
    "mse_in_reward",
)


@dataclass(frozen=True)
class FixedPointConfig:
    """The tabular problem and the optimiser."""

    vocab: int = 3
    """Tokens per step, token 0 = EOS."""
    length: int = 4
    """Maximum response length T (several steps, so sequence and token level differ)."""
    seed: int = 0
    """Seed of the reference policy's logits."""
    ref_scale: float = 1.0
    """Std of the reference logits."""
    beta: float = 0.5
    """KL weight β."""
    sharpening_mass: float = 0.7
    """Reference mass of the rewarded responses in ``sharpening`` (its most likely responses)."""
    discovery_mass: float = 0.03
    """Reference mass of the rewarded responses in ``discovery`` (its least likely responses)."""
    step_size: float = 1.0
    """Natural-gradient step η (in logits per unit of natural gradient); η·β = 0.5 by default."""
    max_step: float = 2.0
    """Largest change of one logit in one step (a trust region far from a fixed point; inactive near it)."""
    tol: float = 1e-10
    """Stop when the exact gradient's Euclidean norm is below this."""
    max_steps: int = 2000
    """Step cap (reached only where the fixed point lies on the boundary, logits running to -∞, and slowly)."""

    def __post_init__(self) -> None:
        for name, ok in (
            ("vocab", self.vocab >= 2),
            ("length", self.length >= 1),
            ("beta", self.beta > 0),
            ("sharpening_mass", 0 < self.sharpening_mass < 1),
            ("discovery_mass", 0 < self.discovery_mass < 1),
            ("step_size", self.step_size > 0),
            ("max_step", self.max_step > 0),
            ("tol", self.tol >= 0),
            ("max_steps", self.max_steps >= 1),
        ):
            if not ok:
                raise ValueError(f"fixed-points {name} out of range: {getattr(self, name)!r}")


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def methods() -> list[tuple[str, str]]:
    """(head, level) pairs: ``none`` once (its level is immaterial), every other head at every level."""
    return [("none", "sequence")] + [(h, lv) for h in HEADS[1:] for lv in LEVELS]


def response_strings(space: TabularSpace) -> list[str]:
    """Each response as its token ids, EOS written as ``.``: e.g. ``"12."``, ``"2211"``."""
    out = []
    for toks, m in zip(space.tokens.tolist(), space.mask.tolist(), strict=True):
        out.append("".join("." if t == 0 else str(t) for t, keep in zip(toks, m, strict=True) if keep))
    return out


def run_regime(space: TabularSpace, ref_logits: Tensor, reward: Tensor, cfg: FixedPointConfig) -> dict[str, Any]:
    """Every method from θ = θ_ref to its fixed point; closed forms and distances, JSON-ready."""
    ref_lp = token_logps(space, ref_logits)  # (N, T)
    ref_prob = ref_lp.sum(-1).exp()  # (N,)
    pi_star = reverse_kl_optimum(ref_prob, reward, cfg.beta)
    pi_f, lam = forward_kl_optimum(ref_prob, reward, cfg.beta)
    pi_m, lam_m = mse_optimum(ref_prob, reward, cfg.beta)
    out: dict[str, Any] = {
        "beta": cfg.beta,
        "responses": response_strings(space),
        "reference_prob": ref_prob.tolist(),
        "reward": reward.tolist(),
        "rewarded_reference_mass": float((ref_prob * reward).sum()),
        "reverse_kl_optimum": {
            "prob": pi_star.tolist(),
            "rewarded_mass": float((pi_star * reward).sum()),
            "kl_to_reference": kl_divergence(pi_star, ref_prob),
        },
        "forward_kl_optimum": {
            "prob": pi_f.tolist(),
            "lambda": lam,
            "rewarded_mass": float((pi_f * reward).sum()),
            "kl_to_reference": kl_divergence(pi_f, ref_prob),
            "kl_to_optimum": kl_divergence(pi_f, pi_star),
        },
        "mse_optimum": {
            "prob": pi_m.tolist(),
            "lambda": lam_m,
            "support": int((pi_m > 0).sum()),
            "rewarded_mass": float((pi_m * reward).sum()),
            "kl_to_reference": kl_divergence(pi_m, ref_prob),
        },
        "methods": {},
    }
    for head, level in methods():
        form = method_form(head, level, cfg.beta)
        loss = per_sequence_loss(head, level, form, cfg.beta, reward, ref_lp, space.mask)
        t0 = time.perf_counter()
        traj = descend(space, loss, ref_logits, cfg)
        final = token_logps(space, traj.theta).sum(-1).exp()  # (N,)
        out["methods"][f"{head}/{level}"] = {
            "head": head,
            "level": level,
            "form": form,
            "final_prob": final.tolist(),
            "rewarded_mass": float((final * reward).sum()),
            "kl_to_optimum": kl_divergence(final, pi_star),
            "kl_to_forward_optimum": kl_divergence(final, pi_f),
            "max_abs_diff_mse_optimum": float((final - pi_m).abs().max()),
            "kl_to_reference": kl_divergence(final, ref_prob),
            "forward_kl_to_reference": _finite_or_none(kl_divergence(ref_prob, final)),  # inf once π(y) = 0
            "expected_reward": float((final * reward).sum()),
            "steps": traj.steps,
            "grad_norm": traj.grad_norm,
            "converged": traj.converged,
            "seconds": time.perf_counter() - t0,
        }
    return out


def build_problem(cfg: FixedPointConfig) -> tuple[TabularSpace, Tensor, dict[str, Tensor]]:
    """The tabular space, the reference logits (S, V), and per regime the reward R (N,) of every response."""
    space = build_space(cfg.vocab, cfg.length, eos=True)
    g = torch.Generator().manual_seed(cfg.seed)
    ref_logits = cfg.ref_scale * torch.randn(space.num_states, space.vocab, generator=g, dtype=torch.float64)
    ref_prob = token_logps(space, ref_logits).sum(-1).exp()  # (N,)
    rewards = {
        "sharpening": rewarded_set(ref_prob, cfg.sharpening_mass, most_likely=True),
        "discovery": rewarded_set(ref_prob, cfg.discovery_mass, most_likely=False),
    }
    return space, ref_logits, rewards


def run_fixed_points(cfg: FixedPointConfig = FixedPointConfig()) -> dict[str, Any]:
    """Both regimes on one reference policy; the JSON-ready result."""
    t0 = time.perf_counter()
    space, ref_logits, rewards = build_problem(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tensors of ~10² entries: a second thread only adds synchronisation
    try:
        regimes = {name: run_regime(space, ref_logits, rewards[name], cfg) for name in REGIMES}
    finally:
        torch.set_num_threads(threads)
    return {
        "config": asdict(cfg),
        "space": dict(
            num_states=space.num_states,
            num_responses=space.num_sequences,
            num_params=space.num_states * space.vocab,
        ),
        "regimes": regimes,
        "seconds": time.perf_counter() - t0,
    }


def write_fixed_points(out_dir: str | Path, cfg: FixedPointConfig = FixedPointConfig()) -> dict[str, Any]:
    """Run both regimes; write ``fixed_points.json``, ``fixed_points.png`` and ``verdict.md`` into ``out_dir``."""
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = run_fixed_points(cfg)
    for reg in result["regimes"].values():
        reg["closer_to_reference"] = closer_to_reference(reg)
    result["checks"] = checks(result)
    result["files"] = ["fixed_points.json", "fixed_points.png", "verdict.md"]
    (out / "fixed_points.json").write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    plot_fixed_points(out / "fixed_points.png", result)
    result["seconds_total"] = time.perf_counter() - t0
    (out / "verdict.md").write_text(verdict_markdown(result))
    return result
