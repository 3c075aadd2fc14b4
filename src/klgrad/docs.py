"""Generated documentation: ``python -m klgrad.docs`` writes docs/math.md and docs/configuration.md.

The tables come from the code itself (the head registry with each head's formulas, verdict and per-level
gradient targets; the level, form, ratio-level and aggregation choices), so a test can assert that the committed
files equal what this module generates: the docs cannot drift from the code.
"""

from __future__ import annotations

from pathlib import Path
from typing import get_args

from klgrad.kl import KL_HEADS, LEVELS, RATIO_LEVELS, KLHead, Target
from klgrad.objective import AGGREGATIONS, FORMS

STYLE_TEXT = {"in_reward": "in reward", "as_loss": "as loss", "none": "—"}

TARGET_TEXT: dict[str, str] = {
    "rkl": "∇KL(π‖π_ref) over whole responses: the exact reverse-KL gradient",
    "fkl": "∇KL(π_ref‖π) over whole responses: the *forward* KL, biased for the reverse KL",
    "mse": "∇ ½ Σ_y (π(y) - π_ref(y))²: an MSE distance, not a KL",
    "local_rkl": "Σ_t E_{y<t}[∇KL(π(·|y<t)‖π_ref(·|y<t))] with the prefix distribution held fixed: per-step reverse "
    "KL, biased (the effect of today's token on future prefixes is dropped)",
    "local_fkl": "per-step forward KL, prefix distribution held fixed",
    "local_mse": "per-step MSE distance, prefix distribution held fixed",
    "expected_length": "∇E_π[|y|]: pressure on response length, independent of π_ref",
    "zero": "no gradient in expectation (only zero-mean noise)",
}
"""What each expected-gradient target of :data:`klgrad.kl.Target` means (kl.py's module docstring)."""

LEVEL_TEXT: dict[str, str] = {
    "sequence": "the paper's bandit view: the head acts on the summed log-ratio U = Σ_t m_t u_t; every response "
    "token gets the same coefficient c(U) (as loss: ψ of the summed log-probs). Here k2_as_loss ≡ k1_in_reward "
    "exactly, per sample.",
    "token_to_go": "per-token KL in the reward, summed as a return (PPO / REINFORCE++): token t gets "
    "Σ_{t'≥t} m_t' c(u_t'). For k1 this is an unbiased, lower-variance estimate of the sequence reverse-KL "
    "gradient.",
    "token": "what GRPO, TRL and verl do: token t gets c(u_t) alone. For k2 this is NOT the sequence reverse-KL "
    "gradient (the future terms are missing); klgrad measures the difference.",
}
"""SPEC §5, one entry per level of :data:`klgrad.kl.LEVELS`."""

FORM_TEXT: dict[str, str] = {
    "combined": "A = shape(R - β·c): the coefficient is merged into the reward *before* baseline and "
    "normalisation, then one (clipped) policy-gradient head. Levels `sequence` and `token_to_go` (`token` is not "
    "a return).",
    "decoupled": "A = shape(R) drives the reward head; the KL head is a separate loss with β outside, never "
    "normalised. All levels.",
}
"""SPEC §6, one entry per form of :data:`klgrad.objective.FORMS`."""

COMBINED_TOKEN_TO_GO_TEXT = (
    "Combined at `token_to_go`: token t of response i gets A_{i,t} = shape(x)_i + s_{-i}·β·Σ_{t'<t} c_t', "
    "x_i = R_i - β Σ_t c_t. The first term is the sequence-level advantage; the prefix term takes back the KL "
    "paid before t. Its multiplier s_{-i} is the shaping's normalisation computed with sample i left out "
    "(group_norm: 1/clip(std) of the other G - 1 totals of the group; batch_norm: of the other B - 1 values, the "
    "chain's baselines recomputed without i; baseline-only shaping: 1). It does not depend on y_i, so the prefix "
    "term has zero expected gradient and the expected gradient equals the sequence level's exactly. Where the "
    "leave-one-out std is undefined (G = 2 under group_norm) or 0 after clipping, s_{-i} = 0: those tokens get "
    "the sequence-level advantage (any constant would be unbiased; 0 never adds variance, and 1/std_min raised "
    "E‖g‖² up to 12× in the check below). Scaling by the whole group's std, which contains sample i's own total, "
    "is biased. Exact enumeration of every group (T = 2, V = 2 fixed length, k1_in_reward, β = 0.5, three random "
    "policies and rewards; `tests/test_gradients_exact.py`), relative error of the expected gradient against the "
    "sequence level, and E‖g‖² over the sequence level's, own-std scale → leave-one-out scale: grpo G = 2: "
    "0.036–2.6 → ≤ 1e-15, 1.05–22 → 1; grpo G = 4: 0.022–0.70 → ≤ 4e-15, 1.03–11.5 → 1.0–9.1; grpo G = 4, "
    "std_min 0.1: 0.016–0.26 → ≤ 4e-15, 1.0–3.7 → 0.98–3.5; dr_grpo and rloo: exact (≤ 4e-15) before and after. "
    "Under a normalising shaper the per-token form is not guaranteed lower-variance than the sequence level."
)
"""The combined form's per-token return under shaping: what is exact and why."""

RATIO_LEVEL_TEXT: dict[str, str] = {
    "token": "ρ_t = exp(l_t - o_t), one ratio per token.",
    "sequence": "ρ = exp(Σ_t m_t (l_t - o_t)), one ratio per response (unbiased importance sampling of whole "
    "responses).",
}
"""SPEC §7, one entry per ratio level of :data:`klgrad.kl.RATIO_LEVELS`."""

AGGREGATION_TEXT: dict[str, str] = {
    "seq_mean_token_sum": "(1/B) Σ_i Σ_t m ℓ (the paper's sequence view; default)",
    "token_mean": "Σ_i Σ_t m ℓ / Σ_i Σ_t m",
    "seq_mean_token_mean": "(1/B) Σ_i (Σ_t m ℓ / Σ_t m)",
}
"""One entry per aggregation of :data:`klgrad.objective.AGGREGATIONS`."""


FIXED_POINTS_TEXT: tuple[str, ...] = (
    "## Where training ends: forward vs reverse KL",
    "",
    "With a fixed reward R(y) and KL weight β, training with a head's *expected* gradient ends where that gradient "
    "vanishes. `klgrad reproduce fixed-points` finds these fixed points exactly (tabular policies, every response "
    "enumerated) and checks the closed forms below.",
    "",
    "**k3 is a forward-KL gradient.** k3's coefficient is c = 1 - π_ref/π. At sequence level, on-policy, "
    "E_π[(1 - π_ref(y)/π(y)) ∇log π(y)] = Σ_y ∇π(y) - Σ_y π_ref(y) ∇log π(y) = 0 + ∇KL(π_ref‖π): exactly the "
    "forward KL. At token level the same algebra runs per step: in state s (a prefix), "
    "E_{v~π(·|s)}[(1 - π_ref(v|s)/π(v|s)) ∇log π(v|s)] = ∇KL(π_ref(·|s)‖π(·|s)), and summing over the steps with "
    "the prefix probabilities P(s) held fixed gives `local_fkl`, the per-step forward-KL gradient. At "
    "`token_to_go` the extra terms c_t' (t' > t) have zero mean given their own prefix (E_π[1 - π_ref/π | s'] = 0), "
    "so it has the same expectation as `token`. k1_in_reward and k2_as_loss at `sequence`/`token_to_go` give the "
    "exact reverse-KL gradient ∇KL(π‖π_ref).",
    "",
    "**The reverse-KL optimum.** Maximising E_π[R] - β·KL(π‖π_ref) over distributions gives "
    "π*(y) = π_ref(y)·exp(R(y)/β) / Z, and E_π[R] - β·KL(π‖π_ref) = β log Z - β·KL(π‖π*).",
    "",
    "**The forward-KL optimum.** Maximise E_π[R] - β·KL(π_ref‖π) = Σ_y π(y)R(y) + β Σ_y π_ref(y) log π(y) - "
    "β Σ_y π_ref(y) log π_ref(y) subject to Σ_y π(y) = 1. The objective is concave in π (log is concave), so its "
    "stationary point is the maximum. With a Lagrange multiplier λ for the constraint, ∂/∂π(y) gives "
    "R(y) + β π_ref(y)/π(y) - λ = 0, so",
    "",
    "    π_f(y) = β·π_ref(y) / (λ - R(y)),",
    "",
    "with λ > max_y R(y) (every π_f(y) > 0 where π_ref(y) > 0). f(λ) = Σ_y β π_ref(y)/(λ - R(y)) falls from +∞ "
    "at λ → max R to at most 1 at λ = max R + β, so Σ_y π_f = 1 has one root there, found by bisection. Summing "
    "π_f(y)(λ - R(y)) = β π_ref(y) over y gives λ = E_{π_f}[R] + β. The two optima tilt the reference "
    "differently: π*/π_ref = exp(R/β)/Z is the same factor for every rewarded response, while "
    "π_f/π_ref = β/(λ - R) becomes large when λ is close to max R, which happens when the rewarded responses hold "
    "little reference mass.",
    "",
    "**Removing mass vs creating mass.** Reverse KL, Σ_y π log(π/π_ref): the term of a response y vanishes as "
    "π(y) → 0, so removing mass from any response costs nothing extra however much the reference likes it; putting "
    "mass π(y) on a response the reference finds unlikely costs π(y) log(π(y)/π_ref(y)), large when π_ref(y) is "
    "small. Forward KL, Σ_y π_ref log(π_ref/π): removing mass from a response the reference likes costs "
    "π_ref(y) log(π_ref(y)/π(y)) → ∞ as π(y) → 0; creating mass on a response with small π_ref(y) costs little "
    "(its term is weighted by π_ref(y), and it even falls as π(y) grows). Forward KL is mass-covering, reverse "
    "KL mode-seeking. Hence a regime map for k2 (reverse) vs k3 (forward): in *sharpening* (the rewarded "
    "responses already hold most of the reference's mass; RL mostly removes mass from the wrong ones) k3 resists "
    "more and ends closer to the reference; in *discovery* (the rewarded responses hold little reference mass) k2 "
    "resists more. The measured fixed points are in [reproduction.md](reproduction.md) (`fixed-points`).",
    "",
    "**MSE.** mse_in_reward at sequence level maximises E_π[R] - (β/2)·Σ_y (π(y) - π_ref(y))²; its KKT solution is "
    "π_m(y) = max(0, π_ref(y) + (R(y) - λ)/β). The penalty is bounded, so the optimum drops responses entirely "
    "(it lies on the boundary of the simplex).",
    "",
)
"""docs/math.md's section on fixed points (checked by ``klgrad reproduce fixed-points`` and its tests)."""


def _code(x: str) -> str:
    return x if x in ("—", "") else f"`{x}`"


def head_table(heads: dict[str, KLHead] = KL_HEADS) -> str:
    """The “KL heads” table, one row per registry record (:class:`klgrad.kl.KLHead`): name, style, ψ, c, verdict."""
    rows = ["| name | style | penalty ψ(l, r) | coefficient c(l̄, r) | verdict |", "|---|---|---|---|---|"]
    for h in heads.values():
        rows.append(
            f"| `{h.name}` | {STYLE_TEXT[h.style]} | {_code(h.penalty_formula)} | {_code(h.coefficient_formula)} "
            f"| {h.verdict} |"
        )
    return "\n".join(rows)


def target_table(heads: dict[str, KLHead] = KL_HEADS) -> str:
    """Each head's expected on-policy gradient at each level (``head.targets``; the audit checks these)."""
    rows = ["| head | " + " | ".join(f"`{lv}`" for lv in LEVELS) + " |", "|---|" + "---|" * len(LEVELS)]
    for h in heads.values():
        cells = [f"`{h.targets[lv]}`" if h.targets.get(lv) else "no named divergence" for lv in LEVELS]
        rows.append(f"| `{h.name}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _bullets(text: dict[str, str], choices: tuple[str, ...]) -> str:
    missing = set(choices) ^ set(text)
    if missing:  # a new choice in the code without a description here fails loudly
        raise KeyError(f"docs text out of step with the code for {sorted(missing)}")
    return "\n".join(f"- `{c}`: {text[c]}" for c in choices)


def math_markdown() -> str:
    """The whole of docs/math.md."""
    return "\n".join(
        [
            "# The math: heads, levels, forms",
            "",
            "Generated from the code (`src/klgrad/kl.py`, `src/klgrad/objective.py`) by `python -m klgrad.docs`; "
            "a test fails when this file drifts. Notation (SPEC §2): per token, the policy's log-prob l (carries "
            "gradient), its detached copy l̄, the reference's r, the behaviour (rollout) policy's o, mask m; "
            "u = l̄ - r.",
            "",
            "## KL heads",
            "",
            "A head is a scalar rule on (logp, ref_logp). Each has an in-reward coefficient c, a detached weight on "
            "the score function ∇l. An *as loss* head also has a differentiable penalty ψ, and its coefficient is "
            "c = ∂ψ/∂l at the detached l̄ (paper eq. kn′). `klgrad.custom_kl_head(psi)` makes a head from any "
            "differentiable penalty, its coefficient by autograd.",
            "",
            head_table(),
            "",
            "Numerics: exponentials continue linearly above e^20 (`exp_linear_tail`), so every head is exact for "
            "|u| ≤ 20 and finite, with gradients of the right sign, far beyond; no clamp zeroes a gradient.",
            "",
            "## Where a head acts: level",
            "",
            _bullets(LEVEL_TEXT, LEVELS),
            "",
            "Expected on-policy gradient of every (head, level) pair, as documented on the head and checked "
            "by exact enumeration in `klgrad audit`:",
            "",
            target_table(),
            "",
            "Targets:",
            "",
            _bullets(TARGET_TEXT, get_args(Target)),
            "",
            "## How a head joins the reward: form",
            "",
            _bullets(FORM_TEXT, FORMS),
            "",
            COMBINED_TOKEN_TO_GO_TEXT,
            "",
            "## Off-policy: importance sampling and the clip side",
            "",
            "An as-loss head differentiated directly is correct only on-policy. Off-policy (several updates per "
            "rollout, or a rollout engine that differs from the trainer), klgrad converts every head to its "
            "coefficient c, recomputed from the *current* detached log-probs at every epoch, and applies it as a "
            "score-function head with importance sampling and clipping. A penalty is an advantage of -c, so the "
            "PPO-consistent KL loss (to minimise) is β·E[max(ρ·c, clip(ρ, 1-ε, 1+ε)·c)]; the paper's "
            "min(ρc, clip(ρ)c) clips the wrong side (SPEC §7). Ratio levels:",
            "",
            _bullets(RATIO_LEVEL_TEXT, RATIO_LEVELS),
            "",
            "Log-ratios are capped in value only (straight-through), so ρ never overflows and its gradient is "
            "never zeroed. `kl.is_correction: false` reproduces the common bug (as-loss head differentiated "
            "off-policy without IS), for comparisons only.",
            "",
            "## Aggregation",
            "",
            "Per-token losses ℓ (B, T) become a scalar in a separate, named step; the global normalisers are "
            "computed before micro-batching, so the result does not depend on the micro-batch size.",
            "",
            _bullets(AGGREGATION_TEXT, AGGREGATIONS),
            "",
            *FIXED_POINTS_TEXT,
        ]
    )


def write_all(root: str | Path = ".") -> list[Path]:
    """Regenerate docs/math.md and docs/configuration.md under ``root``; returns the paths written."""
    from klgrad.config import write_reference

    docs = Path(root) / "docs"
    math_path, config_path = docs / "math.md", docs / "configuration.md"
    math_path.write_text(math_markdown(), encoding="utf-8")
    write_reference(config_path)
    return [math_path, config_path]


if __name__ == "__main__":
    for p in write_all():
        print(f"wrote {p}")
