r"""What each framework's KL differentiates to: its KL term written out as that framework computes it, audited by
exact enumeration against the reverse-KL and forward-KL gradients and against every klgrad head and level.

Each preset is a per-token rule re-written from the framework's released code (value, what carries gradient,
clamps, ratio handling; the file and version are in its docstring) and turned into a per-response loss the way
the framework's loss sees it: per-token terms summed over the response's tokens, KL weight β = 1. (A token-mean
aggregation divides by the batch's token count, a constant that rescales β and leaves the gradient's
direction; per-sequence token means reweight responses by 1/|y| and are not audited here.) KL-in-reward presets
become a PPO-clipped policy-gradient term with advantage −(the KL return), their KL computed once at rollout time
from the behaviour log-probs, as the frameworks do.

Regimes: ``on_policy`` (responses from π, behaviour = current policy) and ``off_policy`` (responses from the
behaviour policy of :class:`~klgrad.audit.run.AuditProblem`, the framework's own ratio handling: most KL losses
then take no importance weight at all). Notation: l = log π (carries gradient), o = behaviour log-prob, r =
reference, u = l − r, δ = e^{−u}, ρ_t = e^{l_t − o_t}; docs/math.md, “Notation”.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from klgrad.audit.tabular import exact_gradient, expected_gradient, token_logps
from klgrad.kl import KL_HEADS, kl_loss_per_sequence, masked_sum

TokenKL = Callable[[Tensor, Tensor, Tensor], Tensor]
"""(l, r, o) -> per-token term (N, T): what the framework adds to its per-token loss (β = 1)."""

PPO_EPS = 0.2
"""The PPO clip ε of every KL-in-reward preset's policy loss (all frameworks' default)."""


# ----------------------------------------------------------------------------------------------------------
# the frameworks' per-token KL values, as written in their code


def k1_value(l: Tensor, r: Tensor) -> Tensor:
    """k1 = l − r."""
    return l - r


def k2_value(l: Tensor, r: Tensor) -> Tensor:
    """k2 = ½(l − r)² (verl "mse"/"k2", OpenRLHF "k2")."""
    return 0.5 * (l - r) ** 2


def k3_value(l: Tensor, r: Tensor) -> Tensor:
    """k3 = e^{r − l} − (r − l) − 1 (TRL, OpenRLHF "k3", NeMo-RL's Joschu 2020), unclamped."""
    return torch.exp(r - l) - (r - l) - 1


def low_var_kl(l: Tensor, r: Tensor) -> Tensor:
    """verl/slime ``low_var_kl``: x = clamp(r − l, −20, 20); k3 = e^x − x − 1, then clamped to [−10, 10]."""
    x = (r - l).clamp(-20.0, 20.0)
    return (torch.exp(x) - x - 1).clamp(-10.0, 10.0)


def straight_through(value: Tensor, gradient: Tensor) -> Tensor:
    """The value of ``value`` with the gradient of ``gradient`` (verl's "+" suffix)."""
    return gradient - gradient.detach() + value.detach()


def nemo_kl(l: Tensor, r: Tensor, weight: Tensor) -> Tensor:
    """NeMo-RL's ``calculate_kl`` (k3): log-ratio x = r − l clamped to [−20, 20], the weight detached where that
    clamp acts, weight·(e^x − 1 − x), then clamped to [−10, 10]."""
    x = r - l
    clamped = x.clamp(-20.0, 20.0)
    weight = torch.where(x == clamped, weight, weight.detach())
    return (weight * (torch.exp(clamped) - 1 - clamped)).clamp(-10.0, 10.0)


# ----------------------------------------------------------------------------------------------------------
# presets


@dataclass(frozen=True)
class FrameworkKL:
    """One framework's KL term: as a per-token loss (``style="loss"``) or as a reward (``style="reward"``)."""

    framework: str
    variant: str
    style: str
    """``loss``: ``token_kl`` is added to the per-token loss. ``reward``: ``token_kl`` (computed from the
    behaviour log-probs, no gradient) is a per-token penalty in the reward, ``returns`` turns it into each
    token's KL return, and the PPO-clipped policy loss applies it."""
    token_kl: TokenKL
    source: str
    """The framework's file and version this preset is written from."""
    reference_is_behaviour: bool = False
    """True for RPG's own setting (``use_iterative_ref_model``): the reference is the behaviour policy π_old, so
    the audit's reference is replaced by its behaviour policy (targets ∇KL(π‖π_old), ∇KL(π_old‖π))."""
    returns: str = "sequence"
    """Reward presets: ``sequence`` (the response's summed KL on every token: GRPO-style outcome advantage) or
    ``to_go`` (Σ_{t'≥t}: PPO/GAE with γ = λ = 1, REINFORCE++)."""

    def loss(self, ref_lp: Tensor, mask: Tensor) -> Callable[[Tensor, Tensor], Tensor]:
        """``per_sequence(logp (N, T), behaviour_logp (N, T)) -> (N,)`` for :func:`expected_gradient`."""

        def per_sequence(logp: Tensor, behaviour: Tensor) -> Tensor:
            if self.style == "loss":
                return masked_sum(self.token_kl(logp, ref_lp, behaviour), mask)
            penalty = torch.where(mask, self.token_kl(behaviour, ref_lp, behaviour), 0.0).detach()  # (N, T)
            if self.returns == "sequence":
                ret = penalty.sum(-1, keepdim=True).expand_as(penalty)
            else:
                ret = penalty.flip(-1).cumsum(-1).flip(-1)  # Σ_{t'≥t}
            ratio = torch.exp(logp - behaviour)  # (N, T) per-token PPO ratio
            clipped = ratio.clamp(1 - PPO_EPS, 1 + PPO_EPS)
            return masked_sum(torch.maximum(ret * ratio, ret * clipped), mask)  # advantage A = −ret

        return per_sequence


def _ratio(l: Tensor, o: Tensor) -> Tensor:
    return torch.exp(l - o)  # carries gradient through l


PRESETS: tuple[FrameworkKL, ...] = (
    FrameworkKL(
        "trl",
        "k3 loss (GRPOTrainer, beta > 0)",
        "loss",
        lambda l, r, o: k3_value(l, r),
        "trl/trainer/grpo_trainer.py (TRL 0.2x–1.x): per_token_kl = exp(ref − logp) − (ref − logp) − 1",
    ),
    FrameworkKL(
        "trl",
        "k3 loss, use_bias_correction_kl",
        "loss",
        lambda l, r, o: k3_value(l, r) * _ratio(l, o),
        "trl/trainer/grpo_trainer.py: per_token_kl * coef_1, coef_1 = exp(logp − old_logp) unclipped, not detached",
    ),
    FrameworkKL(
        "verl",
        "kl_loss_type=k1 (kl)",
        "loss",
        lambda l, r, o: k1_value(l, r),
        "verl/trainer/ppo/core_algos.py kl_penalty_forward: logprob − ref_logprob",
    ),
    FrameworkKL(
        "verl",
        "kl_loss_type=abs",
        "loss",
        lambda l, r, o: (l - r).abs(),
        "verl/trainer/ppo/core_algos.py kl_penalty_forward: (logprob − ref_logprob).abs()",
    ),
    FrameworkKL(
        "verl",
        "kl_loss_type=mse (k2)",
        "loss",
        lambda l, r, o: k2_value(l, r),
        "verl/trainer/ppo/core_algos.py kl_penalty_forward: 0.5 * (logprob − ref_logprob).square()",
    ),
    FrameworkKL(
        "verl",
        "kl_loss_type=low_var_kl (k3)",
        "loss",
        lambda l, r, o: low_var_kl(l, r),
        "verl/trainer/ppo/core_algos.py kl_penalty_forward: clamp(r − l, ±20), k3, clamp(k3, ±10)",
    ),
    FrameworkKL(
        "verl",
        "kl_loss_type=low_var_kl+ (k3 value, k2 gradient)",
        "loss",
        lambda l, r, o: straight_through(low_var_kl(l, r), k2_value(l, r)),
        "verl/trainer/ppo/core_algos.py kl_penalty: '+' suffix, backward k2 − k2.detach() + forward.detach()",
    ),
    FrameworkKL(
        "verl",
        "use_kl_in_reward (k1, GRPO outcome advantage)",
        "reward",
        lambda l, r, o: k1_value(l, r),
        "verl/trainer/ppo/ray_trainer.py apply_kl_penalty: token_level_rewards = scores − β·kl(old, ref); "
        "GRPO sums the token rewards",
        returns="sequence",
    ),
    FrameworkKL(
        "verl",
        "use_kl_in_reward (k1, GAE γ = λ = 1)",
        "reward",
        lambda l, r, o: k1_value(l, r),
        "verl/trainer/ppo/ray_trainer.py apply_kl_penalty + core_algos.compute_gae_advantage_return",
        returns="to_go",
    ),
    FrameworkKL(
        "openrlhf",
        "k1 in reward (reward-to-go)",
        "reward",
        lambda l, r, o: k1_value(l, r).clamp(-10.0, 10.0),
        "openrlhf/models/utils.py compute_approx_kl (clamp ±10) + compute_reward; returns to go",
        returns="to_go",
    ),
    FrameworkKL(
        "openrlhf",
        "k2 loss (use_kl_loss)",
        "loss",
        lambda l, r, o: k2_value(l, r).clamp(-10.0, 10.0),
        "openrlhf/models/utils.py compute_approx_kl(kl_estimator='k2'): (l − r)²/2, clamp ±10",
    ),
    FrameworkKL(
        "openrlhf",
        "k3 loss (use_kl_loss)",
        "loss",
        lambda l, r, o: k3_value(l, r).clamp(-10.0, 10.0),
        "openrlhf/models/utils.py compute_approx_kl(kl_estimator='k3'): e^{r−l} − 1 − (r − l), clamp ±10",
    ),
    FrameworkKL(
        "slime",
        "kl_loss_type=low_var_kl, use-unbiased-kl",
        "loss",
        lambda l, r, o: (_ratio(l, o) * k3_value(l, r)).clamp(-10.0, 10.0),
        "THUDM/slime@624b824 (2026-08-21) slime/utils/ppo_utils.py compute_approx_kl + megatron_utils/loss.py: "
        "kl = exp(logp − old)·k3 (ratio not detached, not clipped), then clamp ±10 (low_var_kl only)",
    ),
    FrameworkKL(
        "nemo-rl",
        "k3, weight exp(x − sg(x)) (default since 2026-06)",
        "loss",
        lambda l, r, o: nemo_kl(l, r, torch.exp(l - l.detach())),
        "NVIDIA-NeMo/RL@7ea279a (2026-08-22) nemo_rl/algorithms/utils.py calculate_kl + loss_functions.py "
        "ClippedPGLossFn (PR #2506, #2958)",
    ),
    FrameworkKL(
        "nemo-rl",
        "k3, use_on_policy_kl_approximation",
        "loss",
        lambda l, r, o: nemo_kl(l, r, _ratio(l, o)),
        "NVIDIA-NeMo/RL@7ea279a: weight exp(logp − generation_logprobs), differentiable, unclipped",
    ),
    FrameworkKL(
        "deepseek-v3.2",
        "unbiased KL: k3 × π/π_old",
        "loss",
        lambda l, r, o: k3_value(l, r) * _ratio(l, o),
        "DeepSeek-V3.2 report (arXiv 2512.02556, eq. 7, as quoted in TRL #4637 and slime #1004): "
        "(π/π_old)(π_ref/π − log(π_ref/π) − 1), the ratio differentiable as in every public implementation",
    ),
)
"""Every framework preset of ``klgrad audit --framework`` but RPG's (:data:`RPG_PRESETS`)."""

_RPG_SOURCE = (
    "complex-reasoning/RPG@ec8e30b (2026-06-14) verl/trainer/ppo/core_algos.py kl_penalty('{}'), with a separate "
    "reference (use_iterative_ref_model=False; RPG's scripts set it True, regularising towards π_old instead)"
)
RPG_PRESETS: tuple[FrameworkKL, ...] = (
    FrameworkKL("rpg", "rpg_fkl: −log w", "loss", lambda l, r, o: -(l - r), _RPG_SOURCE.format("rpg_fkl")),
    FrameworkKL(
        "rpg",
        "rpg_rkl: w log w",
        "loss",
        lambda l, r, o: (torch.exp(l - r) * (l - r)).clamp(-10.0, 10.0),
        _RPG_SOURCE.format("rpg_rkl"),
    ),
    FrameworkKL(
        "rpg",
        "rpg_ufkl: w − log w − 1",
        "loss",
        lambda l, r, o: (torch.exp(l - r) - (l - r) - 1).clamp(-10.0, 10.0),
        _RPG_SOURCE.format("rpg_ufkl"),
    ),
    FrameworkKL(
        "rpg",
        "rpg_urkl: w(log w − 1) + 1",
        "loss",
        lambda l, r, o: (torch.exp(l - r) * (l - r - 1) + 1).clamp(-10.0, 10.0),
        _RPG_SOURCE.format("rpg_urkl"),
    ),
)
"""RPG's KL terms as its code computes them, w = π/π_ref (``kl_penalty`` with ``ref_logprob`` = the reference).
The paper's own estimators weight samples of π_old by w = π/π_old to reach KL(π_old‖π), KL(π‖π_old) and their
unnormalised forms; with π_ref in place of π_old, each is a klgrad head with IS: normalised forward KL =
``fkl_as_loss``, unnormalised forward KL = ``k3_as_loss`` (its coefficient 1 − δ), both reverse forms =
``k1_in_reward`` / ``k2_as_loss`` (docs/frameworks.md)."""
RPG_PRESETS += tuple(
    dataclasses.replace(
        p,
        variant=p.variant + ", reference = π_old",
        reference_is_behaviour=True,
        source=p.source.replace(
            "with a separate reference (use_iterative_ref_model=False",
            "as RPG's scripts run it (use_iterative_ref_model=True",
        ).replace("; RPG's scripts set it True, regularising towards π_old instead)", ")"),
    )
    for p in RPG_PRESETS
)


ALL_PRESETS: tuple[FrameworkKL, ...] = PRESETS + RPG_PRESETS
FRAMEWORKS: tuple[str, ...] = tuple(dict.fromkeys(p.framework for p in ALL_PRESETS))
"""Framework names, in table order: trl, verl, openrlhf, slime, nemo-rl, deepseek-v3.2, rpg."""


# ----------------------------------------------------------------------------------------------------------
# the audit


def _rel(a: Tensor, b: Tensor, scale: float) -> float:
    nb = float(b.norm())
    return float((a - b).norm()) / max(nb, scale)


def klgrad_gradients(problem) -> dict[str, Tensor]:
    """On-policy expected gradient of every klgrad head at every level (``head@level``): what a framework's
    gradient is compared with. klgrad's off-policy correction has the same expectation, so one table serves
    both regimes."""
    sp = problem.space
    ref_lp = token_logps(sp, problem.ref)
    out = {}
    for name, head in KL_HEADS.items():
        for level in ("sequence", "token", "token_to_go"):  # on ties, the plainer level is named

            def loss(logp: Tensor, behaviour: Tensor, head=head, level=level) -> Tensor:
                return kl_loss_per_sequence(head, logp, ref_lp, sp.mask, level=level)

            out[f"{name}@{level}"] = expected_gradient(sp, loss, problem.theta, problem.theta)[0]
    return out


def nearest_head(g: Tensor, table: dict[str, Tensor], scale: float, exact: float = 1e-9) -> str:
    """``head@level (target)`` of the first klgrad head and level (registry, then level order) whose expected
    gradient ``g`` equals (relative error < ``exact``), else ``≈ head@level (error)`` of the nearest one."""
    errors = {key: _rel(g, ref, scale) for key, ref in table.items()}
    for key, err in errors.items():
        if err < exact:
            name, level = key.split("@")
            target = KL_HEADS[name].targets.get(level)
            return f"{key} ({target})" if target else key
    key = min(errors, key=errors.__getitem__)
    return f"≈ {key} ({errors[key]:.2g})"


def framework_rows(problem, presets: tuple[FrameworkKL, ...] | None = None) -> list[dict]:
    """One row per (preset, regime): err_rkl, err_fkl (relative errors of its exact expected gradient) and the
    klgrad head and level it equals or is nearest to. Presets whose reference is the behaviour policy (RPG's
    setting) are audited on the problem with π_ref := π_old."""
    contexts: dict[bool, tuple] = {}

    def context(reference_is_behaviour: bool) -> tuple:
        if reference_is_behaviour not in contexts:
            prob = dataclasses.replace(problem, ref=problem.behaviour) if reference_is_behaviour else problem
            g_rkl = exact_gradient(prob.space, "rkl", prob.theta, prob.ref)
            g_fkl = exact_gradient(prob.space, "fkl", prob.theta, prob.ref)
            table = klgrad_gradients(prob)
            contexts[reference_is_behaviour] = (prob, token_logps(prob.space, prob.ref), g_rkl, g_fkl, table)
        return contexts[reference_is_behaviour]

    rows = []
    for preset in ALL_PRESETS if presets is None else presets:
        prob, ref_lp, g_rkl, g_fkl, table = context(preset.reference_is_behaviour)
        scale = float(g_rkl.norm())
        for regime, sampler in (("on_policy", prob.theta), ("off_policy", prob.behaviour)):
            g, _ = expected_gradient(prob.space, preset.loss(ref_lp, prob.space.mask), prob.theta, sampler)
            rows.append(
                dict(
                    framework=preset.framework,
                    variant=preset.variant,
                    regime=regime,
                    err_rkl=_rel(g, g_rkl, scale),
                    err_fkl=_rel(g, g_fkl, scale),
                    equals=nearest_head(g, table, scale),
                    zero_gradient=frozen_range(preset, "gradient"),
                    clamped=frozen_range(preset, "value"),
                    reference="behaviour (π_old)" if preset.reference_is_behaviour else "π_ref",
                    source=preset.source,
                )
            )
    return rows


def frozen_range(preset: FrameworkKL, what: str, limit: float = 40.0, steps: int = 8001) -> str | None:
    """Where a clamp acts, on-policy, over log-ratios u = l − r in [−limit, limit], as text (``u ≤ −a, u ≥ b``);
    None when nowhere. ``what="gradient"``: where ∂(per-token loss term)/∂l is exactly 0 (the clamp zeroes the
    gradient; loss presets only). ``what="value"``: where the per-token KL value stops changing with u (the
    clamp caps it: a reward's coefficient, or a loss term whose gradient then comes from elsewhere)."""
    u = torch.linspace(-limit, limit, steps, dtype=torch.float64)
    r = torch.zeros_like(u)
    if what == "gradient":
        if preset.style != "loss":
            return None
        l = u.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(preset.token_kl(l, r, l.detach()).sum(), l)
        frozen = grad == 0
    else:
        value = preset.token_kl(u, r, u).detach()
        frozen = torch.zeros_like(u, dtype=torch.bool)
        frozen[1:] = value[1:] == value[:-1]
    frozen &= u.abs() > 1e-6  # u = 0 is a stationary point of every KL, not a clamp
    parts = []
    if bool(frozen[u < 0].any()):
        parts.append(f"u ≤ {float(u[(u < 0) & frozen].max()):.3g}")
    if bool(frozen[u > 0].any()):
        parts.append(f"u ≥ {float(u[(u > 0) & frozen].min()):.3g}")
    return ", ".join(parts) or None


# ----------------------------------------------------------------------------------------------------------
# presentation


def select(name: str) -> tuple[FrameworkKL, ...]:
    """The presets of framework ``name`` (``all``: every one); a ValueError lists the names."""
    presets = ALL_PRESETS
    if name == "all":
        return presets
    chosen = tuple(p for p in presets if p.framework == name)
    if not chosen:
        raise ValueError(f"--framework must be 'all' or one of {list(FRAMEWORKS)}, got {name!r}")
    return chosen


def print_framework_table(rows: list[dict], console=None) -> None:
    """The rich table: framework × variant × regime, errors against ∇RKL and ∇FKL, the klgrad equivalent."""
    from rich.console import Console
    from rich.table import Table

    from klgrad.fmt import fmt_num

    console = console or Console()
    table = Table(title="What each framework's KL differentiates to (exact enumeration, float64, β = 1)")
    for col in ("framework", "variant", "regime", "rel. err vs ∇RKL", "rel. err vs ∇FKL", "klgrad equivalent", "clamp"):
        table.add_column(col, justify="right" if col.startswith("rel.") else "left")

    def fmt(x: float) -> str:
        return fmt_num(x, 3, sci_digits=1, sci_below=1e-2, tiny=1e-12, tiny_text="<1e-12", zero="0")

    for r in rows:
        if r["zero_gradient"]:
            clamp = f"∇ = 0 at {r['zero_gradient']}"
        else:
            clamp = f"capped at {r['clamped']}" if r["clamped"] else ""
        table.add_row(
            r["framework"], r["variant"], r["regime"], fmt(r["err_rkl"]), fmt(r["err_fkl"]), r["equals"], clamp
        )
    console.print(table)


def write_frameworks(rows: list[dict], out_dir) -> Path:
    """``frameworks.json`` = ``{"rows": [...]}`` in ``out_dir`` (atomic), and its figure ``frameworks.png``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "frameworks.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"rows": rows}, indent=1, ensure_ascii=False, allow_nan=False))
    tmp.replace(path)
    plot_frameworks(rows, out_dir / "frameworks.png")
    return path


def plot_frameworks(rows: list[dict], path) -> None:
    """frameworks.png: each preset's relative error against ∇KL(π‖π_ref) (reverse) and ∇KL(π_ref‖π) (forward),
    on- and off-policy, log scale (errors below float64 round-off drawn at 1e-16)."""
    from klgrad.plotting import pyplot, save

    plt = pyplot()
    labels = list(dict.fromkeys(f"{r['framework']}: {r['variant']}" for r in rows))
    by = {(f"{r['framework']}: {r['variant']}", r["regime"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(15, 0.34 * len(labels) + 1.6), sharey=True)
    y = torch.arange(len(labels)).tolist()
    for ax, key, title in (
        (axes[0], "err_rkl", "vs the reverse-KL gradient"),
        (axes[1], "err_fkl", "vs the forward-KL gradient"),
    ):
        for offset, regime, color in ((-0.18, "on_policy", "#1f5f8b"), (0.18, "off_policy", "#e08a1e")):
            values = [max(by[(lab, regime)][key], 1e-16) for lab in labels]
            ax.barh([v + offset for v in y], values, height=0.34, color=color, label=regime.replace("_", "-"))
        ax.set_xscale("log")
        ax.axvline(1e-12, color="black", lw=0.8, ls=":")
        ax.set_title(f"relative error {title}", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(y, labels, fontsize=7)
    axes[0].invert_yaxis()
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(
        "What each framework's KL differentiates to (exact enumeration; dotted: float64 round-off)", fontsize=11
    )
    fig.tight_layout()
    save(fig, path, dpi=110)
