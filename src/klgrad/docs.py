"""Generated documentation: ``python -m klgrad.docs`` writes docs/math.md and docs/configuration.md.

The tables come from the code itself (the head registry with each head's formulas, verdict and per-level
gradient targets; the level, form, ratio-level, shaping and aggregation choices), so a test can assert that the
committed files equal what this module generates: the docs cannot drift from the code. The prose sections
(notation, value estimators, fixed points) live here as text, next to the code they describe.
"""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path
from typing import get_args

from klgrad.choices import AGGREGATIONS, FORMS, LEVELS, RATIO_LEVELS, SHAPING_METHODS, SHAPING_PRESETS
from klgrad.config import Config, json_schema, to_dict
from klgrad.kl import KL_HEADS, KLHead, Target

NOTATION_TEXT: tuple[str, ...] = (
    "## Notation",
    "",
    "A prompt x is answered by a response y = (y_1, …, y_T). A batch holds B responses, the G responses of one "
    "prompt contiguous (a *group*); per-token tensors are (B, T), one row per response. Per response token t:",
    "",
    "- l_t = log π_θ(y_t | x, y_<t): the trainable policy's log-prob; gradients flow through it (code: `logp`).",
    "- l̄_t: the same number detached (no gradient). Coefficients are always computed from l̄.",
    "- r_t = log π_ref(y_t | x, y_<t): the reference policy's log-prob, never differentiated (`ref_logp`).",
    "- o_t: the behaviour policy's log-prob, the policy that sampled y: the policy as it was before this rollout's "
    "updates, or a separate rollout engine (`old_logp`; None in the code means on-policy).",
    "- m_t: the mask, 1 on response tokens and 0 on padding (`mask`). Every sum over t carries m_t; masked entries "
    "never matter, whatever they hold.",
    "- u_t = l̄_t − r_t: the per-token log-ratio; δ_t = e^{−u_t} = π_ref/π.",
    "- U = Σ_t m_t u_t = log π(y|x) − log π_ref(y|x): the sequence log-ratio.",
    "- ρ: the importance ratio, per token ρ_t = exp(l_t − o_t) or per sequence ρ = exp(Σ_t m_t (l_t − o_t)). It "
    "carries gradient through l only.",
    "- On-policy means o = l̄: then ρ = 1 in value, and its gradient ρ·∇l is ∇l.",
    "",
    "KL(π‖π_ref) = E_{y~π}[log π(y|x) − log π_ref(y|x)] = E_π[U] is the *reverse* KL over whole responses, the "
    "quantity an RLHF KL term means to regularise; KL(π_ref‖π) is the *forward* KL. Further symbols: R(y) the "
    "reward of a response (the weighted sum of the configured reward functions), A the advantage, shape(·) the "
    "reward shaping (“Reward shaping: baselines and normalisation”), β ≥ 0 the KL weight, c a head's coefficient "
    "and ψ its penalty (“KL heads”), ε a clip range.",
    "",
)
"""docs/math.md's “Notation”: the symbols every other section, docstring and test uses."""

VALUE_ESTIMATORS_TEXT: tuple[str, ...] = (
    "## Value estimators",
    "",
    "Three estimates of the *value* KL(π‖π_ref) from responses sampled from π (Schulman's k1, k2, k3), computed "
    "elementwise from the log-ratio u by `klgrad.kl_estimate(logp, ref_logp, kind)` with kind `k1`, `k2` or "
    "`k3` (δ = e^{−u} = π_ref/π):",
    "",
    "| estimator | formula | mean under π | sign | spread |",
    "|---|---|---|---|---|",
    "| k1 | u | KL(π‖π_ref): unbiased | either | per-sample std ≈ √(2·KL) near π_ref: large against a small KL |",
    "| k2 | ½u² | KL + ⅙E_π[u³] − …: biased | ≥ 0 | low |",
    "| k3 | δ − 1 + u = e^{−u} − 1 + u | KL(π‖π_ref): unbiased, if π > 0 wherever π_ref > 0 | ≥ 0 | about the "
    "KL itself near π_ref; heavy-tailed where π_ref ≫ π |",
    "",
    "**k1 = u** is unbiased by definition: E_π[u] = KL(π‖π_ref). A single sample can be negative, and near π_ref "
    "(where KL ≈ ½E_π[u²] and Var_π[u] ≈ E_π[u²]) its per-sample standard deviation is about √(2·KL), large "
    "against a small KL.",
    "",
    "**k2 = ½u²** is never negative and has low variance, but it is biased. E_π[δ] = 1 expands to "
    "E_π[u] = ½E_π[u²] − ⅙E_π[u³] + …, so E_π[k2] = KL(π‖π_ref) + ⅙E_π[u³] − …: right to second order near "
    "π_ref, off by more as π moves away (on the Gaussians of [reproduction.md](reproduction.md), section 4: 0.874 "
    "against a KL of 1.134).",
    "",
    "**k3 = δ − 1 + u** adds to k1 the control variate δ − 1, whose mean is E_π[π_ref/π] − 1 = Σ_y π_ref(y) − 1 "
    "= 0, so it is unbiased too; and since e^{−u} ≥ 1 − u it is never negative. Near π_ref, k3 = ½u² + O(u³) per "
    "sample, so its spread is of the order of the KL itself. Two caveats. Its variance is finite only when "
    "E_π[δ²] = 1 + χ²(π_ref‖π) is: where π_ref puts mass on responses π finds unlikely, δ is huge on rare samples "
    "(on the Gaussians of [reproduction.md](reproduction.md), section 4, the per-sample standard deviation ranged "
    "from 3.4 to 3708 across runs, and the median batch mean was 0.79 against a KL of 1.13). And the sum "
    "Σ_y π_ref(y) runs only over responses π can produce: where π_ref has mass that π has not, E_π[δ] < 1 and k3 "
    "is biased low (reproduction.md, section 5: log 2 − 0.5 instead of log 2).",
    "",
    "These are values, for logging and evaluation: every run records k1, k2 and k3 of the sequence log-ratio U "
    "(`kl/k1`, `kl/k2`, `kl/k3`; held out, `eval/kl_k1`, `eval/kl_k3`; see [metrics.md](metrics.md)). What a KL "
    "term does to the *gradient* is a separate question, answered per head below. The heads are named after these "
    "estimators, but the names mislead: k2, the biased value estimate, gives the exact reverse-KL gradient as a "
    "loss (`k2_as_loss`), and k3, an unbiased one, gives a biased gradient (`k3_as_loss`).",
    "",
)
"""docs/math.md's “Value estimators”: k1, k2, k3 (:func:`klgrad.kl.kl_estimate`) as estimates of the KL's value."""

STYLE_TEXT = {"in_reward": "in reward", "as_loss": "as loss", "none": "—"}

TARGET_TEXT: dict[str, str] = {
    "rkl": "∇KL(π‖π_ref) over whole responses: the exact reverse-KL gradient",
    "fkl": "∇KL(π_ref‖π) over whole responses: the *forward* KL, biased for the reverse KL",
    "mse": "∇ ½ Σ_y (π(y) - π_ref(y))²: an MSE distance, not a KL",
    "js": "∇JS(π‖π_ref) over whole responses: the Jensen–Shannon divergence to the mixture (π + π_ref)/2",
    "local_rkl": "Σ_t E_{y<t}[∇KL(π(·|y<t)‖π_ref(·|y<t))] with the prefix distribution held fixed: per-step reverse "
    "KL, biased (the effect of today's token on future prefixes is dropped)",
    "local_fkl": "per-step forward KL, prefix distribution held fixed",
    "local_mse": "per-step MSE distance, prefix distribution held fixed",
    "local_js": "per-step Jensen–Shannon divergence, prefix distribution held fixed",
    "expected_length": "∇E_π[|y|]: pressure on response length, independent of π_ref",
    "zero": "no gradient in expectation (only zero-mean noise)",
}
"""What each expected-gradient target of :data:`klgrad.kl.Target` means (the module docstring of klgrad.kl)."""

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
"""docs/math.md, “Where a head acts: level”: one entry per level of :data:`klgrad.kl.LEVELS`."""

FORM_TEXT: dict[str, str] = {
    "combined": "A = shape(R - β·c): the coefficient is merged into the reward *before* baseline and "
    "normalisation, then one (clipped) policy-gradient head. Levels `sequence` and `token_to_go` (`token` is not "
    "a return).",
    "decoupled": "A = shape(R) drives the reward head; the KL head is a separate loss with β outside, never "
    "normalised. All levels.",
}
"""docs/math.md, “How a head joins the reward: form”: one entry per form of :data:`klgrad.choices.FORMS`."""

COMBINED_TOKEN_TO_GO_TEXT = (
    "Combined at `token_to_go`: token t of response i gets A_{i,t} = shape(x)_i + s_{-i}·β·Σ_{t'<t} c_t', "
    "x_i = R_i - β Σ_t c_t. The first term is the advantage of the summed per-token coefficients Σ_t c(u_t); "
    "the prefix term takes back the KL paid before t. Its multiplier s_{-i} is the shaping's normalisation "
    "computed with sample i left out (group_norm: 1/clip(std) of the other G - 1 totals of the group; "
    "batch_norm: of the other B - 1 values, the chain's baselines recomputed without i; baseline-only shaping: "
    "1). It does not depend on y_i, so the prefix term has zero expected gradient and the expected gradient is "
    "that of shape(x)_i on every token. That is the sequence level's exactly only when the per-token "
    "coefficients add up to the sequence's, Σ_t c(u_t) = c(Σ_t u_t): for k1_in_reward and k2_as_loss (c(u) = "
    "u). For k3 (c(u) = 1 - e^(-u)) they do not: the k3 heads' expected gradients at token_to_go and at sequence "
    "level differ by 0.087–0.34 relative (exact enumeration, 9 small problems, `tests/kl/test_gradients_exact.py`). "
    "Where the "
    "leave-one-out std is undefined (G = 2 under group_norm) or 0 after clipping, s_{-i} = 0: those tokens get "
    "shape(x)_i alone (any constant would be unbiased; 0 never adds variance, and 1/std_min raised "
    "E‖g‖² up to 12× in the check below). Scaling by the whole group's std, which contains sample i's own total, "
    "is biased. Exact enumeration of every group (T = 2, V = 2 fixed length, k1_in_reward, β = 0.5, three random "
    "policies and rewards; `tests/kl/test_gradients_exact.py`), relative error of the expected gradient against the "
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
    "per_decision": "ρ_{1:t} = exp(Σ_{t'≤t} m_t' (l_t' - o_t')): each term c_t of the KL return weighted by the "
    "ratio of its own prefix (per-decision importance sampling; unbiased; at `sequence` level the sequence ratio).",
}
"""docs/math.md, “Off-policy: importance sampling and the clip side”: one entry per ratio level of
:data:`klgrad.kl.RATIO_LEVELS`."""

AGGREGATION_TEXT: dict[str, str] = {
    "seq_mean_token_sum": "(1/B) Σ_i Σ_t m ℓ (the paper's sequence view; default)",
    "token_mean": "Σ_i Σ_t m ℓ / Σ_i Σ_t m",
    "seq_mean_token_mean": "(1/B) Σ_i (Σ_t m ℓ / Σ_t m)",
}
"""One entry per aggregation of :data:`klgrad.choices.AGGREGATIONS`."""


SHAPING_TEXT: dict[str, str] = {
    "none": "A = R",
    "group_baseline": "A = R − mean_group(R)",
    "batch_baseline": "A = R − mean_batch(R)",
    "batch_norm": "A = (R − mean_batch(R)) / clip(std_batch(R))",
    "group_norm": "A = (R − mean_group(R)) / clip(std_group(R))",
    "rloo": "A_i = R_i − mean of the other G − 1 rewards of its group (leave-one-out) = G/(G − 1)·(R_i − "
    "mean_group(R))",
}
"""One entry per shaping operator of :data:`klgrad.choices.SHAPING_METHODS` (presets excluded)."""

PRESET_TEXT: dict[str, str] = {
    "reinforce": "REINFORCE",
    "reinforce_pp": "PPO / REINFORCE++",
    "grpo": "GRPO",
    "dr_grpo": "Dr. GRPO",
    "reinforce_pp_baseline": "REINFORCE++-baseline",
}
"""The algorithm each preset of :data:`klgrad.choices.SHAPING_PRESETS` is named after."""


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


SHAPING_OPERATORS: tuple[str, ...] = tuple(m for m in SHAPING_METHODS if m not in SHAPING_PRESETS)
"""The shaping operators; the other shaping methods are presets, chains of these."""


def preset_bullets() -> str:
    """One line per preset of :data:`klgrad.choices.SHAPING_PRESETS`: the algorithm's name and its operator chain."""
    text = {
        name: f"{algo}: " + " then ".join(f"`{op}`" for op in SHAPING_PRESETS.get(name, ()))
        for name, algo in PRESET_TEXT.items()
    }
    return _bullets(text, tuple(SHAPING_PRESETS))


def math_markdown() -> str:
    """The whole of docs/math.md."""
    return "\n".join(
        [
            "# The math: heads, levels, forms",
            "",
            "Generated from the code (`src/klgrad/kl/`, `src/klgrad/objective.py`, `src/klgrad/advantages.py`, "
            "and the prose in `src/klgrad/docs.py`) by `python -m klgrad.docs`; a test fails when this file "
            "drifts. Symbols are defined in “Notation”. What a run records is in [metrics.md](metrics.md), the "
            "Python API in [api.md](api.md).",
            "",
            *NOTATION_TEXT,
            *VALUE_ESTIMATORS_TEXT,
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
            "|u| ≤ 20 and finite, with gradients of the right sign, far beyond; no clamp zeroes a gradient. "
            "Precision: heads compute in float32 at least (bfloat16 and float16 log-probs are promoted before "
            "the log-ratio is taken, so it is exact), and every coefficient and gradient is written in a form "
            "that does not cancel (k3's 1 − e^{−u} as −expm1(−u), a penalty's derivative in closed form rather "
            "than autograd through its value), so it stays within a few units of roundoff of the dtype for "
            "|u| ≤ 30 (`klgrad audit --dtype bfloat16` measures it; [frameworks.md](frameworks.md), "
            "“Precision”, for the frameworks' KL terms).",
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
            "## Reward shaping: baselines and normalisation",
            "",
            "shape(·) turns the B rewards of a batch (groups of G contiguous) into advantages: "
            "`klgrad.shape_rewards(rewards, group_size, method, std_min, std_max)`, config `algo.shaping` (the "
            "paper's appendix A). Means and standard deviations are over the response's group (G values) or the "
            "whole batch (B values); every std is the unbiased sample std (as `torch.std`), clipped to "
            "[std_min, std_max] when those are given (clip(·) below). A group or batch whose values are all equal "
            "gets advantages of exactly 0. Operators:",
            "",
            _bullets(SHAPING_TEXT, SHAPING_OPERATORS),
            "",
            "Presets, the algorithms' names for chains of operators (applied left to right):",
            "",
            preset_bullets(),
            "",
            "Why std_min: a normalising operator scales any spread to unit size, so rewards that differ by noise "
            "alone get full-size advantages. The paper's example [0.99999, 1.00001, 0.99999, 1.00001] gives "
            "±0.866 under `group_norm` without a floor ([reproduction.md](reproduction.md), section 6, also "
            "measures what a floor does in training); the paper suggests std_min ≈ 0.1 for rewards in [0, 1].",
            "",
            "## Off-policy: importance sampling and the clip side",
            "",
            "An as-loss head differentiated directly is correct only on-policy. Off-policy (several updates per "
            "rollout, or a rollout engine that differs from the trainer), klgrad converts every head to its "
            "coefficient c, recomputed from the *current* detached log-probs at every epoch, and applies it as a "
            "score-function head with importance sampling and clipping. A penalty is an advantage of -c, so the "
            "PPO-consistent KL loss (to minimise) is β·E[max(ρ·c, clip(ρ, 1-ε, 1+ε)·c)]: for c > 0 it keeps "
            "pushing log π down while ρ > 1-ε and stops once ρ < 1-ε (for c < 0 the mirror image). Here klgrad "
            "differs from the paper, which writes the KL head as J_KL = E[min(ρc, clip(ρ)c)] and subtracts "
            "β·J_KL: that clips the wrong side, for c > 0 pushing ρ down below 1-ε without limit and not pushing "
            "at all once ρ > 1+ε. Check (`tests/test_objective.py`): with R = 0, no shaping, one clip ε and "
            "sequence ratios for both heads, the decoupled KL head's gradient equals the combined form's for every "
            "ρ, at `sequence` and `token_to_go`. Ratio levels:",
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


# ----------------------------------------------------------------------------------------------------------
# docs/configuration.md and the shipped JSON schema, from the config's JSON schema


def config_reference() -> str:
    """Markdown table of every field (dotted name, schema, default, doc) from the JSON schema: it cannot drift."""
    schema, defaults = json_schema(), to_dict(Config())
    rows = ["| field | JSON schema | default | meaning |", "|" + "---|" * 4]
    for section, ref in schema["properties"].items():
        for name, node in schema["$defs"][ref["$ref"].rsplit("/", 1)[1]]["properties"].items():
            kind = json.dumps({k: v for k, v in node.items() if k not in ("default", "description", "title")})
            cells = f"`{section}.{name}`", f"`{kind}`", f"`{defaults[section][name]!r}`", node["description"]
            rows.append("| " + " | ".join(" ".join(c.split()).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


SCHEMA_FILE = "klgrad.schema.json"  # beside the shipped configs, each naming it on its first line for YAML editors
CONFIG_INTRO = (
    "# Configuration reference\n\nGenerated from `src/klgrad/config/sections.py` by `python -m klgrad.docs` (a\n"
    "test fails when it drifts); set fields in YAML sections or with dotted flags (`klgrad train --kl.beta 0.1`); "
    "what a\nresume may change: "
    "[reliability.md](reliability.md#1-a-killed-run-resumes-to-exactly-the-run-it-would-have-been).\n"
)


def schema_text() -> str:
    """The JSON schema as written to ``klgrad/configs/klgrad.schema.json``."""
    return json.dumps(json_schema(), indent=1, ensure_ascii=False) + "\n"


def write_config_reference(path: str | Path = "docs/configuration.md") -> None:
    """Regenerate docs/configuration.md and the configs' JSON schema (by ``python -m klgrad.docs``)."""
    Path(path).write_text(f"{CONFIG_INTRO}\n{config_reference()}\n", encoding="utf-8")
    (Path(str(importlib.resources.files("klgrad"))) / "configs" / SCHEMA_FILE).write_text(schema_text(), "utf-8")


def write_all(root: str | Path = ".") -> list[Path]:
    """Regenerate docs/math.md, docs/configuration.md and docs/frameworks.md under ``root``; returns the paths."""
    from klgrad.audit.frameworks_doc import frameworks_markdown

    docs = Path(root) / "docs"
    math_path, config_path, frameworks_path = docs / "math.md", docs / "configuration.md", docs / "frameworks.md"
    math_path.write_text(math_markdown(), encoding="utf-8")
    write_config_reference(config_path)
    frameworks_path.write_text(frameworks_markdown(), encoding="utf-8")
    return [math_path, config_path, frameworks_path]


if __name__ == "__main__":
    for p in write_all():
        print(f"wrote {p}")
