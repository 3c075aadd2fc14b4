r"""Where each KL head's training *ends*: fixed points of klgrad's own loss on enumerable tabular policies.

A tabular autoregressive policy (:mod:`klgrad.audit.tabular`: V tokens, token 0 = EOS, at most T tokens) is
trained with the EXACT expected gradient of klgrad's loss (every response enumerated once, weighted by its
probability; no sampling) until the gradient vanishes. A fixed reward R(y) ∈ {0, 1} marks some responses as
correct. Two regimes differ only in which responses are rewarded:

- ``sharpening``: the reference's most likely responses, holding ≈ 70% of its mass (RL mostly removes mass
  from the reference's wrong answers);
- ``discovery``: its least likely responses, holding ≈ 3% (RL must create mass where the reference has little).

Closed-form endpoints (derivations in docs/math.md, "Fixed points"):

- reverse KL (k1_in_reward, k2_as_loss at ``sequence`` / ``token_to_go``): maximise E_π[R] - β·KL(π‖π_ref),
  π*(y) = π_ref(y)·exp(R(y)/β) / Z;
- forward KL (k3_as_loss, k3_in_reward at ``sequence``): maximise E_π[R] - β·KL(π_ref‖π),
  π_f(y) = β·π_ref(y) / (λ - R(y)) with λ > max R fixed by Σ_y π_f(y) = 1;
- no KL: maximise E_π[R]; k1_as_loss adds a zero expected gradient at ``sequence`` and ``token`` level.

Every per-response loss is built from klgrad's functions: in-reward heads in the combined form
(:func:`klgrad.objective.combined_advantages`, A = R - β·C, then :func:`klgrad.objective.policy_gradient_loss`);
as-loss heads in the decoupled form (policy-gradient loss with A = R plus β·:func:`klgrad.kl.kl_loss_per_sequence`).
Which (head, level, form) combinations exist is asked of :class:`klgrad.objective.ObjectiveSpec`; where the
combined form refuses ``token`` (it is not a return), the in-reward head runs in the decoupled form, which
klgrad allows at every level and which has the same expected gradient on-policy.

The optimiser is natural-gradient descent for tabular softmax policies: the exact gradient g of state s's logits
is divided by the Fisher diagonal P(reach s)·π(v|s) (the softmax Fisher's pseudo-inverse applied to g, up to a
per-state shift). The preconditioner is positive, so its fixed points are exactly the zeros of g; it only makes
states the policy rarely reaches converge as fast as the others. Runs stop at ‖g‖₂ < ``tol`` or ``max_steps``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from klgrad.audit.tabular import TabularSpace, build_space, expected_gradient, state_log_reach, token_logps
from klgrad.kl import KL_HEADS, LEVELS, kl_loss_per_sequence, masked_sum
from klgrad.objective import ObjectiveSpec, combined_advantages, policy_gradient_loss

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
PerSequenceLoss = Callable[[Tensor, Tensor], Tensor]
NO_CLIP = dict(clip_eps_low=0.999999, clip_eps_high=1e12)  # on-policy ρ ≡ 1: the clip never acts anyway


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


# ----------------------------------------------------------------------------------------------------------
# closed forms (pure functions of the response distribution; all shapes (N,) over the N enumerated responses)


def kl_divergence(p: Tensor, q: Tensor) -> float:
    r"""KL(p‖q) = Σ_y p(y) log(p(y)/q(y)) with 0·log 0 = 0; p, q: (N,) probabilities."""
    safe_p = torch.where(p > 0, p, torch.ones_like(p))
    return float(torch.where(p > 0, p * (safe_p.log() - q.log()), torch.zeros_like(p)).sum())


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def reverse_kl_optimum(ref_prob: Tensor, reward: Tensor, beta: float) -> Tensor:
    r"""π*(y) = π_ref(y)·exp(R(y)/β) / Σ_y' π_ref(y')·exp(R(y')/β), the maximiser of E_π[R] - β·KL(π‖π_ref).

    Shapes: ref_prob (N,), reward (N,) -> (N,).
    """
    logits = ref_prob.log() + reward / beta  # (N,)
    return torch.softmax(logits, dim=0)


def forward_kl_optimum(ref_prob: Tensor, reward: Tensor, beta: float, iters: int = 200) -> tuple[Tensor, float]:
    r"""π_f(y) = β·π_ref(y) / (λ - R(y)), the maximiser of E_π[R] - β·KL(π_ref‖π); returns (π_f (N,), λ).

    λ > max R is the Lagrange multiplier of Σ π = 1. f(λ) = Σ_y β·π_ref(y)/(λ - R(y)) decreases from +∞ at
    λ → max R⁺ to ≤ 1 at λ = max R + β (each term ≤ π_ref there), so the root is bracketed in (max R, max R + β]
    and found by bisection (``iters`` halvings of a width-β bracket: far below float64 resolution).
    """
    r_max = float(reward.max())
    lo, hi = r_max, r_max + beta
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        total = float((beta * ref_prob / (mid - reward)).sum())
        lo, hi = (mid, hi) if total > 1.0 else (lo, mid)
    lam = hi
    pf = beta * ref_prob / (lam - reward)  # (N,)
    return pf / pf.sum(), lam  # the division absorbs the last bisection step's ≤ 1 ulp residue


def mse_optimum(ref_prob: Tensor, reward: Tensor, beta: float, iters: int = 200) -> tuple[Tensor, float]:
    r"""π_m(y) = max(0, π_ref(y) + (R(y) - λ)/β), the maximiser of E_π[R] - (β/2)·Σ_y (π(y) - π_ref(y))²; (N,).

    KKT on the simplex: R(y) - β(π(y) - π_ref(y)) = λ where π(y) > 0, ≤ λ where π(y) = 0. Σ_y π_m is decreasing in
    λ, ≥ 1 at λ = min R and 0 at λ = max R + β, so bisection on [min R, max R + β] finds λ. Unlike the two KLs,
    this penalty is bounded, so the optimum can put zero mass on responses: it lies on the boundary.
    """
    lo, hi = float(reward.min()), float(reward.max()) + beta
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        total = float((ref_prob + (reward - mid) / beta).clamp(min=0).sum())
        lo, hi = (mid, hi) if total > 1.0 else (lo, mid)
    pm = (ref_prob + (reward - hi) / beta).clamp(min=0)  # (N,)
    return pm / pm.sum(), hi


def rewarded_set(ref_prob: Tensor, target_mass: float, most_likely: bool) -> Tensor:
    """R(y) ∈ {0, 1}, (N,) -> (N,): the reference's most (or least) likely responses, added in order of π_ref
    until their mass reaches ``target_mass``."""
    order = torch.argsort(ref_prob, descending=most_likely, stable=True)  # (N,)
    reward = torch.zeros_like(ref_prob)
    mass = 0.0
    for i in order.tolist():
        if mass >= target_mass:
            break
        reward[i] = 1.0
        mass += float(ref_prob[i])
    return reward


# ----------------------------------------------------------------------------------------------------------
# klgrad's loss per response, for one (head, level)


def method_form(head: str, level: str, beta: float) -> str:
    """The form klgrad runs the head in: combined for in-reward heads where ObjectiveSpec allows it, else
    decoupled. Raises ValueError where klgrad refuses both."""
    style = KL_HEADS[head].style
    if style == "in_reward":
        try:
            ObjectiveSpec(kl_head=head, beta=beta, kl_level=level, form="combined")
            return "combined"
        except ValueError:
            pass
    ObjectiveSpec(kl_head=head, beta=beta, kl_level=level, form="decoupled")
    return "decoupled"


def per_sequence_loss(
    head: str, level: str, form: str, beta: float, reward: Tensor, ref_logp: Tensor, mask: Tensor
) -> PerSequenceLoss:
    """klgrad's on-policy loss of every response, (logp (N, T), sample_logp (N, T)) -> (N,), to minimise.

    combined: Σ_t policy_gradient_loss(A) with A = combined_advantages(R, head, ..., β, level) = R - β·C;
    decoupled: Σ_t policy_gradient_loss(A = R) + β·kl_loss_per_sequence(head, ..., level).
    """
    kl_head = KL_HEADS[head]  # the registry object (get_kl_head would warn once for k1_as_loss)

    def combined(logp: Tensor, sample_logp: Tensor) -> Tensor:
        adv = combined_advantages(
            reward, kl_head, logp.detach(), ref_logp, mask, beta=beta, level=level, group_size=1, method="none"
        )  # (N, T)
        return masked_sum(policy_gradient_loss(logp, adv, mask, **NO_CLIP), mask)  # (N,)

    def decoupled(logp: Tensor, sample_logp: Tensor) -> Tensor:
        adv = torch.where(mask, reward[:, None], 0.0)  # (N, T)
        pg = masked_sum(policy_gradient_loss(logp, adv, mask, **NO_CLIP), mask)  # (N,)
        if kl_head.style == "none":
            return pg
        return pg + beta * kl_loss_per_sequence(kl_head, logp, ref_logp, mask, level=level)  # (N,)

    return combined if form == "combined" else decoupled


# ----------------------------------------------------------------------------------------------------------
# the optimiser


def exact_loss_gradient(space: TabularSpace, loss: PerSequenceLoss, theta: Tensor) -> Tensor:
    r"""g = ∇_θ Σ_y π_θ(y)·ℓ(y; θ) with π_θ detached (the on-policy expected gradient), (S, V) -> (S, V)."""
    g, _ = expected_gradient(space, loss, theta, theta)
    return g


def natural_direction(space: TabularSpace, theta: Tensor, grad: Tensor) -> Tensor:
    r"""F⁺g for a tabular softmax policy, (S, V) -> (S, V): d[s, v] = g[s, v] / (P(reach s)·π(v|s)).

    The Fisher of state s's logits is P(reach s)·(diag p - p pᵀ); for a gradient with Σ_v g[s, v] = 0 (every
    softmax gradient), x = g / (P(s)·p) solves F x = g exactly. Entries whose Fisher weight underflowed to 0
    (then g is 0 too) get 0.
    """
    weight = state_log_reach(space, theta).exp()[:, None] * torch.softmax(theta, -1)  # (S, V)
    return torch.where(weight > 0, grad / torch.where(weight > 0, weight, 1.0), torch.zeros_like(grad))


@dataclass
class Trajectory:
    theta: Tensor
    """(S, V) final logits."""
    steps: int
    grad_norm: float
    converged: bool


def descend(space: TabularSpace, loss: PerSequenceLoss, theta0: Tensor, cfg: FixedPointConfig) -> Trajectory:
    """Natural-gradient descent on klgrad's exact expected loss gradient from ``theta0`` until ‖g‖ < tol."""
    theta = theta0.detach().clone()
    steps, gnorm = 0, math.inf
    while True:
        g = exact_loss_gradient(space, loss, theta)
        gnorm = float(g.norm())
        if gnorm < cfg.tol or steps >= cfg.max_steps or not math.isfinite(gnorm):
            break
        step = cfg.step_size * natural_direction(space, theta, g)  # (S, V)
        theta = theta - step.clamp(-cfg.max_step, cfg.max_step)
        steps += 1
    return Trajectory(theta, steps, gnorm, gnorm < cfg.tol)


# ----------------------------------------------------------------------------------------------------------
# the experiment


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


def run_fixed_points(cfg: FixedPointConfig = FixedPointConfig()) -> dict[str, Any]:
    """Both regimes on one reference policy; the JSON-ready result."""
    t0 = time.perf_counter()
    space = build_space(cfg.vocab, cfg.length, eos=True)
    g = torch.Generator().manual_seed(cfg.seed)
    ref_logits = cfg.ref_scale * torch.randn(space.num_states, space.vocab, generator=g, dtype=torch.float64)
    ref_prob = token_logps(space, ref_logits).sum(-1).exp()  # (N,)
    rewards = {
        "sharpening": rewarded_set(ref_prob, cfg.sharpening_mass, most_likely=True),
        "discovery": rewarded_set(ref_prob, cfg.discovery_mass, most_likely=False),
    }
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


# ----------------------------------------------------------------------------------------------------------
# checks, files, figure, verdict

EXACT_RKL: tuple[str, ...] = (
    "k1_in_reward/sequence",
    "k1_in_reward/token_to_go",
    "k2_as_loss/sequence",
    "k2_as_loss/token_to_go",
)
"""Methods whose expected gradient is the exact reverse-KL gradient: they must end at π*."""
EXACT_FKL: tuple[str, ...] = ("k3_as_loss/sequence", "k3_in_reward/sequence")
"""Methods whose expected gradient is the exact forward-KL gradient: they must end at π_f."""
ZERO_KL: tuple[str, ...] = ("k1_as_loss/sequence", "k1_as_loss/token")
"""k1_as_loss levels with zero expected gradient: they must end where ``none`` ends."""
CLOSED_FORM_KL_TOL = 1e-6
"""The acceptance threshold on KL(final‖closed form) (measured values are at float64 round-off, ~1e-16)."""


def closer_to_reference(regime: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per level: KL(π‖π_ref) of k2_as_loss and k3_as_loss at their fixed points, and which is smaller."""
    out = {}
    for level in LEVELS:
        k2 = regime["methods"][f"k2_as_loss/{level}"]["kl_to_reference"]
        k3 = regime["methods"][f"k3_as_loss/{level}"]["kl_to_reference"]
        out[level] = {"k2_as_loss": k2, "k3_as_loss": k3, "closer": "k2_as_loss" if k2 < k3 else "k3_as_loss"}
    return out


def checks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The theory's statements, each with its measured number and pass/fail."""
    rows = []
    for name, reg in result["regimes"].items():
        m = reg["methods"]
        worst = max(EXACT_RKL, key=lambda k: m[k]["kl_to_optimum"])
        rows.append(
            dict(
                regime=name,
                claim="k1_in_reward, k2_as_loss (sequence, token_to_go) end at π* ∝ π_ref·exp(R/β)",
                measured=f"max KL(final‖π*) = {m[worst]['kl_to_optimum']:.1e} ({worst})",
                ok=all(m[k]["kl_to_optimum"] <= CLOSED_FORM_KL_TOL and m[k]["converged"] for k in EXACT_RKL),
            )
        )
        worst = max(EXACT_FKL, key=lambda k: m[k]["kl_to_forward_optimum"])
        rows.append(
            dict(
                regime=name,
                claim="k3_as_loss, k3_in_reward (sequence) end at π_f = β·π_ref/(λ − R)",
                measured=f"max KL(final‖π_f) = {m[worst]['kl_to_forward_optimum']:.1e} ({worst}); "
                f"λ = {reg['forward_kl_optimum']['lambda']:.6f}",
                ok=all(m[k]["kl_to_forward_optimum"] <= CLOSED_FORM_KL_TOL and m[k]["converged"] for k in EXACT_FKL),
            )
        )
        none = torch.tensor(m["none/sequence"]["final_prob"], dtype=torch.float64)
        diffs = {k: float((torch.tensor(m[k]["final_prob"], dtype=torch.float64) - none).abs().max()) for k in ZERO_KL}
        same_steps = all(m[k]["steps"] == m["none/sequence"]["steps"] for k in ZERO_KL)
        rows.append(
            dict(
                regime=name,
                claim="k1_as_loss (sequence, token) ends where none ends, in the same number of steps",
                measured=f"max |π − π_none| = {max(diffs.values()):.1e}; steps "
                + ", ".join(str(m[k]["steps"]) for k in ("none/sequence", *ZERO_KL)),
                # k1's zero gradient, computed, is ≤ N·T roundings per logit per step: ≤ 1e-12 over ~10² steps
                ok=max(diffs.values()) <= 1e-12 and same_steps,
            )
        )
        mse = m["mse_in_reward/sequence"]
        rows.append(
            dict(
                regime=name,
                claim="mse_in_reward (sequence) ends at its KKT optimum max(0, π_ref + (R − λ)/β)",
                measured=f"max |π − π_m| = {mse['max_abs_diff_mse_optimum']:.1e}; π_m has "
                f"{reg['mse_optimum']['support']} of {len(reg['responses'])} responses in its support",
                # boundary optimum: the excluded responses' mass decays only like their gradient (≈ ‖g‖ / an
                # advantage gap of order 0.1-1), ≈ 1e-9 at the stop; 1e-6 is the acceptance level
                ok=mse["max_abs_diff_mse_optimum"] <= 1e-6,
            )
        )
    return rows


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
    _plot(out / "fixed_points.png", result)
    result["seconds_total"] = time.perf_counter() - t0
    (out / "verdict.md").write_text(verdict_markdown(result))
    return result


def _pyplot():
    """matplotlib.pyplot, switching to the Agg backend only if pyplot was not imported yet."""
    if "matplotlib.pyplot" not in sys.modules:
        import matplotlib

        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


HEAD_COLORS = {
    "none": "0.55",
    "k1_as_loss": "#b07aa1",
    "k2_as_loss": "#4e79a7",
    "k1_in_reward": "#76b7b2",
    "k3_as_loss": "#e15759",
    "k3_in_reward": "#ff9d9a",
    "mse_in_reward": "#59a14f",
}


def _bars(ax, y: np.ndarray, values: list[float], colors: list, converged: list[bool]) -> None:
    """Horizontal bars with their values written at the end; hatched where the step cap was reached."""
    drawn = ax.barh(y, values, color=colors)
    for b, ok in zip(drawn, converged, strict=True):
        if not ok:
            b.set_hatch("//")
    for yy, v in zip(y, values, strict=True):
        ax.text(v, yy, f" {v:.3f}", va="center", fontsize=7)


def _plot(path: Path, result: dict[str, Any]) -> None:
    plt = _pyplot()
    names = list(result["regimes"])
    fig, axes = plt.subplots(3, len(names), figsize=(7.4 * len(names), 17), sharey=True)
    below = dict(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=3, frameon=False)
    for j, name in enumerate(names):
        reg = result["regimes"][name]
        keys = list(reg["methods"])
        ms = [reg["methods"][k] for k in keys]
        y = np.arange(len(keys))[::-1]
        colors = [HEAD_COLORS[m["head"]] for m in ms]
        star, fwd = reg["reverse_kl_optimum"], reg["forward_kl_optimum"]

        ax = axes[0, j]
        _bars(ax, y, [m["rewarded_mass"] for m in ms], colors, [m["converged"] for m in ms])
        for x, lab, ls in (
            (reg["rewarded_reference_mass"], "π_ref", ":"),
            (star["rewarded_mass"], "π* (reverse KL)", "--"),
            (fwd["rewarded_mass"], "π_f (forward KL)", "-."),
        ):
            ax.axvline(x, color="k", ls=ls, lw=1.1, label=f"{lab}: {x:.3f}")
        ax.set_xlim(0, 1.12)
        ax.set_xlabel("rewarded mass Σ_y π(y)·R(y) at the fixed point")
        ax.set_title(
            f"{name}: rewarded responses hold {reg['rewarded_reference_mass']:.1%} of π_ref's mass "
            f"(β = {reg['beta']:g})"
        )
        ax.legend(**below)

        ax = axes[1, j]
        kls = [m["kl_to_reference"] for m in ms]
        _bars(ax, y, kls, colors, [m["converged"] for m in ms])
        for x, lab, ls in (
            (star["kl_to_reference"], "KL(π*‖π_ref)", "--"),
            (fwd["kl_to_reference"], "KL(π_f‖π_ref)", "-."),
        ):
            ax.axvline(x, color="k", ls=ls, lw=1.1, label=f"{lab} = {x:.3f}")
        ax.set_xlim(0, 1.15 * max(kls))
        ax.set_xlabel("KL(π‖π_ref) at the fixed point: distance to the reference")
        ax.legend(**below)

        ax = axes[2, j]
        floor = 1e-17
        ax.barh(y, [max(m["kl_to_optimum"], floor) for m in ms], color=colors, label="bar: KL(π‖π*)")
        ax.plot([max(m["kl_to_forward_optimum"], floor) for m in ms], y, "kD", ms=4, label="KL(π‖π_f)")
        ax.axvline(CLOSED_FORM_KL_TOL, color="0.3", ls=":", lw=1, label=f"acceptance {CLOSED_FORM_KL_TOL:g}")
        ax.set_xscale("log")
        ax.set_xlim(floor / 3, 30)
        ax.set_xlabel(f"distance to the closed-form optima (log; values below {floor:g} drawn at {floor:g})")
        ax.legend(**below)
        for ax in axes[:, j]:
            ax.set_yticks(y, keys, fontsize=8)
            ax.grid(axis="x", alpha=0.3)
    fig.suptitle(
        "Fixed points of klgrad's loss, exact expected gradients on a tabular policy "
        f"(V = {result['config']['vocab']} with EOS, T = {result['config']['length']}, "
        f"{result['space']['num_responses']} responses); hatched = step cap reached",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.985), h_pad=3.0)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _num(x: float) -> str:
    if abs(x) < 1e-15:
        return "< 1e-15"
    return f"{x:.1e}" if abs(x) < 1e-3 else f"{x:.4f}"


def method_table(regime: dict[str, Any]) -> str:
    """Markdown: one row per method with its form, steps, rewarded mass and the three KLs."""
    rows = [
        "| head/level | form | steps | rewarded mass | KL(π‖π*) | KL(π‖π_f) | KL(π‖π_ref) |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, m in regime["methods"].items():
        steps = f"{m['steps']}" if m["converged"] else f"{m['steps']} (cap, ‖g‖ = {m['grad_norm']:.0e})"
        rows.append(
            f"| {key} | {m['form']} | {steps} | {m['rewarded_mass']:.4f} | {_num(m['kl_to_optimum'])} "
            f"| {_num(m['kl_to_forward_optimum'])} | {m['kl_to_reference']:.4f} |"
        )
    return "\n".join(rows)


def verdict_markdown(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        "# Fixed points of the KL heads: where exact-gradient training ends",
        "",
        f"Tabular autoregressive policy, V = {cfg['vocab']} tokens (token 0 = EOS), T = {cfg['length']}: "
        f"{result['space']['num_responses']} responses, {result['space']['num_params']} logits; reference logits "
        f"N(0, {cfg['ref_scale']:g}²) (seed {cfg['seed']}); reward R ∈ {{0, 1}}; β = {cfg['beta']:g}. Each method "
        "starts at the reference and follows the exact expected gradient of klgrad's own loss (every response "
        f"enumerated; natural-gradient steps η = {cfg['step_size']:g}) until ‖g‖ < {cfg['tol']:g} or "
        f"{cfg['max_steps']} steps. In-reward heads run in the combined form A = R − β·C where klgrad allows it "
        "(not at `token`, where they run decoupled: same expected gradient on-policy).",
        "",
    ]
    for name, reg in result["regimes"].items():
        star, fwd, mse = reg["reverse_kl_optimum"], reg["forward_kl_optimum"], reg["mse_optimum"]
        lines += [
            f"## {name}",
            "",
            f"Rewarded responses: {int(sum(reg['reward']))} of {len(reg['responses'])}, holding "
            f"{reg['rewarded_reference_mass']:.1%} of π_ref's mass. Closed forms: π* (reverse KL) puts "
            f"{star['rewarded_mass']:.3f} on them at KL(π*‖π_ref) = {star['kl_to_reference']:.4f}; π_f (forward KL, "
            f"λ = {fwd['lambda']:.6f}) {fwd['rewarded_mass']:.3f} at KL(π_f‖π_ref) = {fwd['kl_to_reference']:.4f}; "
            f"the MSE optimum keeps {mse['support']} responses, KL {mse['kl_to_reference']:.4f}.",
            "",
            method_table(reg),
            "",
            "Which of k2_as_loss / k3_as_loss ends closer to the reference, KL(π‖π_ref):",
            "",
            "| level | k2_as_loss | k3_as_loss | closer |",
            "|---|---|---|---|",
        ]
        for level, c in reg["closer_to_reference"].items():
            lines.append(f"| {level} | {c['k2_as_loss']:.4f} | {c['k3_as_loss']:.4f} | {c['closer']} |")
        lines.append("")
    lines += ["## Checks against the theory", "", "| regime | claim | measured | holds |", "|---|---|---|---|"]
    for c in result["checks"]:
        lines.append(f"| {c['regime']} | {c['claim']} | {c['measured']} | {'yes' if c['ok'] else '**no**'} |")
    sharp = result["regimes"].get("sharpening", {}).get("closer_to_reference", {})
    disc = result["regimes"].get("discovery", {}).get("closer_to_reference", {})
    lines += [
        "",
        "## Verdict",
        "",
        "- Every closed form is reached: the exact reverse-KL heads end at π*, sequence-level k3 ends at the "
        "forward-KL optimum π_f, k1_as_loss at sequence and token level ends exactly where `none` ends."
        if all(c["ok"] for c in result["checks"])
        else "- **Some closed-form checks fail** (table above).",
        "- k2 vs k3, distance to the reference: sharpening: "
        + ", ".join(f"{lv} → {c['closer']}" for lv, c in sharp.items())
        + "; discovery: "
        + ", ".join(f"{lv} → {c['closer']}" for lv, c in disc.items())
        + ".",
        "- Forward KL (k3) resists *removing* reference mass and barely resists *creating* mass where π_ref is "
        "small; reverse KL (k2, k1_in_reward) the other way round. So which head regularises more depends on the "
        "regime, not on the head alone.",
        "- k1_as_loss at token_to_go is not zero: its expected gradient is β·∇E_π[|y|], a length penalty that "
        "drives the policy to the shortest response whatever the reward.",
        "- mse_in_reward's penalty is bounded (probabilities differ by at most 1), so its optimum sits on the "
        "boundary: it drops most responses entirely and ends far from the reference.",
        "",
        f"Runtime: {result.get('seconds_total', result['seconds']):.1f} s.",
        "",
    ]
    return "\n".join(lines)
