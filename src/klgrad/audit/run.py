r"""The gradient audit: every (head, level, regime) against the exact reverse-KL gradient, by enumeration.

Policies are random tabular autoregressive policies (:mod:`klgrad.audit.tabular`): current θ ~ N(0, 1),
reference θ + d_ref·N(0, 1), behaviour θ + d_beh·N(0, 1). For each row the audit computes the exact expected
gradient of the library's own loss under the sampling distribution, and reports

- ``err_rkl``: ‖g - ∇KL(π‖π_ref)‖ / ‖∇KL‖ and ``cos_rkl``: cosine to the exact reverse-KL gradient;
- ``target``/``err_target``: the head's documented on-policy target at that level and the relative error
  against it (absolute norm normalised by ‖∇KL‖ when the target is zero);
- ``variance``: tr Cov[per-sample gradient] (how noisy one sample is).

Regimes: ``on_policy``; off-policy samples from the behaviour policy with ``is_seq`` (sequence IS, the
unbiased correction), ``is_tok`` (per-token IS, PPO-style), ``is_seq_clip`` (sequence IS + symmetric clip),
``no_is`` (the common bug: the on-policy loss applied to off-policy samples).

Stale rollouts (``rollout.staleness`` k, :mod:`klgrad.trainer.staleness`): the behaviour is the policy k updates
back, θ_{t−k}, where θ_t is reached from it by k exact gradient steps on −E[R] + β·KL(π‖π_ref)
(:func:`stale_trajectory`). For each k, head and level the audit enumerates the loss fed the behaviour log-probs
of θ_{t−k} (``is_seq``, ``is_tok``, ``is_seq_clip``) and the loss fed the current policy's log-probs as if they
were the behaviour's (``current_logp``, the bug a stale trainer makes when it reuses the current forward), and the
combined and decoupled forms with sequence IS (``result["staleness"]``).

The same problem also audits every framework's KL as that framework computes it (:mod:`klgrad.audit.frameworks`,
``frameworks.json``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from klgrad.audit.analytic import exact_heads_audit
from klgrad.audit.frameworks import framework_rows, print_framework_table, write_frameworks
from klgrad.audit.precision import head_precision, print_precision_table, with_precision
from klgrad.audit.tabular import (
    TabularSpace,
    build_space,
    exact_gradient,
    exact_objective,
    expected_gradient,
    random_logits,
    sequence_logps,
    token_logps,
)
from klgrad.choices import LEVELS
from klgrad.fmt import fmt_num
from klgrad.kl import KL_HEADS, KLHead, kl_loss_per_sequence, load_kl_head, masked_sum
from klgrad.objective import combined_advantages, policy_gradient_loss
from klgrad.plotting import pyplot, save

REGIMES: tuple[str, ...] = ("on_policy", "is_seq", "is_tok", "is_seq_clip", "no_is")
STALE_REGIMES: tuple[str, ...] = ("is_seq", "is_tok", "is_seq_clip", "current_logp")
"""The regimes audited for stale rollouts: the three corrections with θ_{t−k}'s log-probs, and the current
policy's log-probs in their place (``current_logp``)."""
AUDIT_HEADS: tuple[str, ...] = tuple(name for name in KL_HEADS if name != "none")
"""Every built-in head but ``none`` (whose gradient is zero by definition)."""


@dataclass(frozen=True)
class AuditConfig:
    """Sizes and distances of the audited policies."""

    vocab: int = 4
    """Tokens per step (token 0 is EOS when eos)."""
    length: int = 4
    """Maximum response length T."""
    eos: bool = True
    """Variable-length responses ending at token 0."""
    seed: int = 0
    """Seed of the random policies."""
    ref_distance: float = 0.5
    """Std of the logit perturbation from the current policy to the reference."""
    behaviour_distance: float = 0.3
    """Std of the logit perturbation from the current policy to the behaviour (rollout) policy."""
    clip_eps: float = 0.2
    """Symmetric clip of the KL head in the is_seq_clip regime."""
    beta: float = 0.5
    """KL weight in the combined-vs-decoupled form check."""
    sweep: tuple[float, ...] = (0.03, 0.1, 0.2, 0.5, 1.0, 2.0)
    """Reference distances for the bias-vs-distance sweep."""
    staleness: tuple[int, ...] = (1, 4)
    """Stale-rollout axis: the behaviour is the policy k exact gradient steps back, for each k here (() = off)."""
    stale_lr: float = 1.0
    """Step size of the exact gradient steps from θ_{t−k} to θ_t on −E[R] + β·KL(π‖π_ref)."""

    def __post_init__(self) -> None:
        for name, ok in (
            ("vocab", self.vocab >= 2),
            ("length", self.length >= 1),
            ("ref_distance", self.ref_distance > 0),
            ("behaviour_distance", self.behaviour_distance > 0),
            ("clip_eps", 0 < self.clip_eps < 1),
            ("beta", self.beta >= 0),
            ("staleness", all(k >= 1 for k in self.staleness)),
            ("stale_lr", self.stale_lr > 0),
        ):
            if not ok:
                raise ValueError(f"audit {name} out of range: {getattr(self, name)!r}")


@dataclass
class AuditProblem:
    space: TabularSpace
    theta: Tensor
    ref: Tensor
    behaviour: Tensor
    rewards: Tensor = field(default_factory=lambda: torch.zeros(0))


def make_problem(cfg: AuditConfig, ref_distance: float | None = None) -> AuditProblem:
    space = build_space(cfg.vocab, cfg.length, cfg.eos)
    g = torch.Generator().manual_seed(cfg.seed)
    theta = random_logits(space, g)
    noise_ref = random_logits(space, g)
    noise_beh = random_logits(space, g)
    rewards = torch.rand(space.num_sequences, generator=g, dtype=torch.float64)
    d = cfg.ref_distance if ref_distance is None else ref_distance
    return AuditProblem(space, theta, theta + d * noise_ref, theta + cfg.behaviour_distance * noise_beh, rewards)


def load_penalty(spec: str) -> KLHead:
    """The head ``klgrad audit --penalty package.module:name`` audits: what ``kl.head: package.module:name`` trains
    (:func:`klgrad.kl.load_kl_head`, imported by name, never eval'd), a penalty ψ(logp, ref_logp) made a head by
    :func:`~klgrad.kl.custom_kl_head` or a :class:`~klgrad.kl.KLHead` as it is, so the audit's rows are of the very
    head a run trains. Raises ValueError naming ``--penalty``."""
    try:
        return load_kl_head(spec)
    except ValueError as e:
        raise ValueError(f"--penalty: {e}") from None


def _rel_error_zero_fallback(a: Tensor, b: Tensor, scale_if_zero: float) -> float:
    """‖a − b‖ / ‖b‖, the error of ``a`` relative to ``b``; when b is exactly zero, ‖a‖ / ``scale_if_zero``.
    A small nonzero b is divided by as it is (:mod:`klgrad.audit.frameworks` floors the denominator instead:
    ``_rel_error_floored``)."""
    nb = float(b.norm())
    return float((a - b).norm()) / (nb if nb > 0 else scale_if_zero)


def _cos(a: Tensor, b: Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    return float((a * b).sum()) / (na * nb) if na > 0 and nb > 0 else 0.0


def _regime_loss(head: KLHead, level: str, regime: str, ref_lp: Tensor, mask: Tensor, clip_eps: float):
    def loss(logp: Tensor, sample_logp: Tensor) -> Tensor:
        kw: dict = dict(level=level)
        if regime in ("is_seq", "is_tok", "is_seq_clip", "no_is"):
            kw["old_logp"] = sample_logp
        if regime == "current_logp":  # the current policy's log-probs passed as the behaviour's
            kw["old_logp"] = logp.detach()
        if regime == "is_tok":
            kw["ratio_level"] = "token"
        if regime == "is_seq_clip":
            kw["clip_eps"] = clip_eps
        if regime == "no_is":
            kw["is_correction"] = False
        return kl_loss_per_sequence(head, logp, ref_lp, mask, **kw)

    return loss


def audit_rows(problem: AuditProblem, heads: dict[str, KLHead], clip_eps: float) -> list[dict]:
    """One row per (head, level, regime) with err_rkl, cos_rkl, target, err_target, variance."""
    sp, theta, ref = problem.space, problem.theta, problem.ref
    ref_lp = token_logps(sp, ref)
    g_rkl = exact_gradient(sp, "rkl", theta, ref)
    scale = float(g_rkl.norm())
    rows = []
    for name, head in heads.items():
        for level in LEVELS:
            target = head.targets.get(level)
            g_target = exact_gradient(sp, target, theta, ref) if target else None
            for regime in REGIMES:
                sampler = theta if regime == "on_policy" else problem.behaviour
                g, var = expected_gradient(
                    sp,
                    _regime_loss(head, level, regime, ref_lp, sp.mask, clip_eps),
                    theta,
                    sampler,
                    with_variance=True,
                )
                rows.append(
                    dict(
                        head=name,
                        level=level,
                        regime=regime,
                        err_rkl=_rel_error_zero_fallback(g, g_rkl, scale),
                        cos_rkl=_cos(g, g_rkl),
                        target=target,
                        err_target=None if g_target is None else _rel_error_zero_fallback(g, g_target, scale),
                        variance=var,
                        grad_norm=float(g.norm()),
                    )
                )
    return rows


def form_rows(problem: AuditProblem, beta: float) -> list[dict]:
    """Combined vs decoupled, off-policy with sequence IS and no clip, rewards R(y) random, no shaping.

    Both must equal the exact -∇E_π[R] + β·∇(target) (the KL head's own target at that level).
    """
    sp, theta, beh = problem.space, problem.theta, problem.behaviour
    ref_lp = token_logps(sp, problem.ref)
    rewards = problem.rewards
    # exact reward gradient: -∇ Σ π(y) R(y)
    th = theta.detach().clone().requires_grad_(True)
    (g_reward,) = torch.autograd.grad(-(token_logps(sp, th).sum(-1).exp() * rewards).sum(), th)
    rows = []
    wide = dict(clip_eps_low=0.999999, clip_eps_high=1e12, ratio_level="sequence")  # IS, effectively no clip
    for name in ("k1_in_reward", "k2_as_loss", "k3_as_loss"):
        head = KL_HEADS[name]
        for level in ("sequence", "token_to_go"):
            exact = g_reward + beta * exact_gradient(sp, head.targets[level], theta, problem.ref)

            def combined(logp: Tensor, old: Tensor, head=head, level=level) -> Tensor:
                adv = combined_advantages(
                    rewards,
                    head,
                    logp.detach(),
                    ref_lp,
                    sp.mask,
                    beta=beta,
                    level=level,
                    group_size=1,
                    method="none",
                )
                return masked_sum(policy_gradient_loss(logp, adv, sp.mask, old_logp=old, **wide), sp.mask)

            def decoupled(logp: Tensor, old: Tensor, head=head, level=level) -> Tensor:
                adv = torch.where(sp.mask, rewards[:, None], 0.0)
                pg = masked_sum(policy_gradient_loss(logp, adv, sp.mask, old_logp=old, **wide), sp.mask)
                return pg + beta * kl_loss_per_sequence(head, logp, ref_lp, sp.mask, old_logp=old, level=level)

            g_c, _ = expected_gradient(sp, combined, theta, beh)
            g_d, _ = expected_gradient(sp, decoupled, theta, beh)
            rows.append(
                dict(
                    head=name,
                    level=level,
                    err_combined=_rel_error_zero_fallback(g_c, exact, 1.0),
                    err_decoupled=_rel_error_zero_fallback(g_d, exact, 1.0),
                    combined_vs_decoupled=_rel_error_zero_fallback(g_c, g_d, 1.0),
                )
            )
    return rows


def regularised_objective(space: TabularSpace, logits: Tensor, ref: Tensor, rewards: Tensor, beta: float) -> Tensor:
    """J(θ) = −Σ_y π_θ(y) R(y) + β·KL(π_θ‖π_ref), exactly (what :func:`stale_trajectory` descends)."""
    p = sequence_logps(space, logits).exp()  # (N,)
    return -(p * rewards).sum() + beta * exact_objective(space, "rkl", logits, ref)


def stale_trajectory(problem: AuditProblem, k: int, lr: float, beta: float) -> list[Tensor]:
    """θ_0 = ``problem.theta`` and k exact gradient steps θ_{j+1} = θ_j − lr·∇J(θ_j) on
    :func:`regularised_objective`: [θ_0, …, θ_k]. Stale by k, step k samples with θ_0 while the loss is at θ_k."""
    thetas = [problem.theta.detach()]
    for _ in range(k):
        th = thetas[-1].clone().requires_grad_(True)
        (g,) = torch.autograd.grad(regularised_objective(problem.space, th, problem.ref, problem.rewards, beta), th)
        thetas.append((th - lr * g).detach())
    return thetas


def staleness_audit(cfg: AuditConfig, heads: dict[str, KLHead]) -> dict:
    """For each k of ``cfg.staleness``: the problem whose current policy is θ_k of :func:`stale_trajectory` and
    whose behaviour is θ_0 (k updates back); rows (k, head, level, regime) of :data:`STALE_REGIMES` with the error
    against the head's on-policy target at θ_k, the forms' rows (:func:`form_rows`) with sequence IS, and how far
    the behaviour is: KL(π_{t−k}‖π_t) and the largest |log π_t(y) − log π_{t−k}(y)| over responses."""
    base = make_problem(cfg)
    sp = base.space
    rows, forms, distances = [], [], {}
    for k in cfg.staleness:
        thetas = stale_trajectory(base, k, cfg.stale_lr, cfg.beta)
        problem = AuditProblem(sp, thetas[-1], base.ref, thetas[0], base.rewards)
        lb, lt = sequence_logps(sp, problem.behaviour), sequence_logps(sp, problem.theta)  # (N,)
        distances[str(k)] = dict(
            behaviour_kl=float((lb.exp() * (lb - lt)).sum()), max_abs_seq_log_ratio=float((lt - lb).abs().max())
        )
        ref_lp = token_logps(sp, problem.ref)
        g_rkl = exact_gradient(sp, "rkl", problem.theta, problem.ref)
        scale = float(g_rkl.norm())
        for name, head in heads.items():
            for level in LEVELS:
                target = head.targets.get(level)
                if target is None:
                    continue
                g_target = exact_gradient(sp, target, problem.theta, problem.ref)
                for regime in STALE_REGIMES:
                    loss = _regime_loss(head, level, regime, ref_lp, sp.mask, cfg.clip_eps)
                    g, _ = expected_gradient(sp, loss, problem.theta, problem.behaviour)
                    err = _rel_error_zero_fallback(g, g_target, scale)
                    rows.append(dict(staleness=k, head=name, level=level, regime=regime, target=target, err_target=err))
        forms += [{"staleness": k, **r} for r in form_rows(problem, cfg.beta)]
    return dict(lr=cfg.stale_lr, beta=cfg.beta, distances=distances, rows=rows, forms=forms)


def distance_sweep(cfg: AuditConfig, heads: dict[str, KLHead]) -> dict[str, list[float]]:
    """On-policy sequence-level err_rkl of each head as the reference moves away from the policy."""
    out: dict[str, list[float]] = {name: [] for name in heads}
    for d in cfg.sweep:
        problem = make_problem(cfg, ref_distance=d)
        sp = problem.space
        ref_lp = token_logps(sp, problem.ref)
        g_rkl = exact_gradient(sp, "rkl", problem.theta, problem.ref)
        for name, head in heads.items():
            g, _ = expected_gradient(
                sp,
                _regime_loss(head, "sequence", "on_policy", ref_lp, sp.mask, 0.2),
                problem.theta,
                problem.theta,
            )
            out[name].append(_rel_error_zero_fallback(g, g_rkl, float(g_rkl.norm())))
    return out


def run_audit(cfg: AuditConfig, penalty: str | None = None, dtype: str = "float64") -> dict:
    """Everything the audit reports, as a JSON-ready dict. The enumeration is float64; ``dtype`` is the precision
    axis: every head and framework row also carries ``dtype``, ``dtype_grad_err`` and the ranges of
    :func:`klgrad.audit.precision.precision_report` (the per-token gradient from log-probs in ``dtype``)."""
    heads: dict[str, KLHead] = {n: KL_HEADS[n] for n in AUDIT_HEADS}
    if penalty is not None:
        heads[f"custom:{penalty}"] = load_penalty(penalty)
    problem = make_problem(cfg)
    sp = problem.space
    return dict(
        config={**asdict(cfg), "sweep": list(cfg.sweep), "staleness": list(cfg.staleness)},
        space=dict(num_states=sp.num_states, num_sequences=sp.num_sequences, num_params=sp.num_states * sp.vocab),
        dtype=dtype,
        rows=with_precision(audit_rows(problem, heads, cfg.clip_eps), "head", head_precision(heads, dtype)),
        forms=form_rows(problem, cfg.beta),
        sweep=dict(distances=list(cfg.sweep), err_rkl=distance_sweep(cfg, heads)),
        frameworks=framework_rows(problem, dtype=dtype),
        staleness=staleness_audit(cfg, heads),
        exact_heads=_exact_heads(cfg, problem),
    )


def _exact_heads(cfg: AuditConfig, problem: AuditProblem) -> dict:
    """The analytic head's and the per-decision ratio's rows (:mod:`klgrad.audit.analytic`), the stale behaviour
    θ_{t−k} at the largest k of ``cfg.staleness`` (4 steps back if none)."""
    thetas = stale_trajectory(problem, max(cfg.staleness, default=4), cfg.stale_lr, cfg.beta)
    at_k = AuditProblem(problem.space, thetas[-1], problem.ref, problem.behaviour, problem.rewards)
    return exact_heads_audit(at_k, thetas[0])


# ----------------------------------------------------------------------------------------------------------
# presentation


def _fmt(x: float | None) -> str:
    """A relative error or variance for the tables: "0", "<1e-12" (float64 round-off), 3 decimals or 2e."""
    return fmt_num(x, 3, sci_digits=2, sci_below=1e-2, sci_from=1e3, tiny=1e-12, tiny_text="<1e-12", zero="0")


def print_tables(result: dict, console=None) -> None:
    """Rich tables: on-policy (all levels) and off-policy regimes."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    rows = result["rows"]
    t = Table(title="On-policy expected gradient vs exact ∇KL(π‖π_ref) (exact enumeration, float64)")
    for col in (
        "head",
        "level",
        "rel. err vs ∇RKL",
        "cos",
        "documented target",
        "rel. err vs target",
        "per-sample var",
    ):
        t.add_column(col, justify="left" if col in ("head", "level", "documented target") else "right")
    for r in rows:
        if r["regime"] != "on_policy":
            continue
        t.add_row(
            r["head"],
            r["level"],
            _fmt(r["err_rkl"]),
            f"{r['cos_rkl']:+.3f}",
            str(r["target"] or "—"),
            _fmt(r["err_target"]),
            _fmt(r["variance"]),
        )
    console.print(t)
    t2 = Table(title="Off-policy (samples from the behaviour policy): rel. err vs the head's on-policy target")
    t2.add_column("head")
    t2.add_column("level")
    for _reg, label in (
        ("is_seq", "seq IS"),
        ("is_tok", "token IS"),
        ("is_seq_clip", "seq IS + clip"),
        ("no_is", "no IS (bug)"),
    ):
        t2.add_column(label, justify="right")
    by_key: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        by_key.setdefault((r["head"], r["level"]), {})[r["regime"]] = r
    for (head, level), regs in by_key.items():
        if regs["on_policy"]["target"] is None:
            continue
        t2.add_row(head, level, *(_fmt(regs[k]["err_target"]) for k in ("is_seq", "is_tok", "is_seq_clip", "no_is")))
    console.print(t2)
    t3 = Table(
        title=f"Forms, off-policy with sequence IS: rel. err vs exact -∇E[R] + β∇target (β={result['config']['beta']})"
    )
    for col in ("head", "level", "combined", "decoupled", "combined vs decoupled"):
        t3.add_column(col, justify="right" if col not in ("head", "level") else "left")
    for r in result["forms"]:
        t3.add_row(
            r["head"],
            r["level"],
            _fmt(r["err_combined"]),
            _fmt(r["err_decoupled"]),
            _fmt(r["combined_vs_decoupled"]),
        )
    console.print(t3)
    if result.get("staleness", {}).get("rows"):
        print_staleness_table(result["staleness"], console)
    if result.get("dtype", "float64") != "float64":
        print_precision_table(rows, "head", console)
    if "frameworks" in result:
        print_framework_table(result["frameworks"], console)


def print_staleness_table(stale: dict, console) -> None:
    """Stale rollouts: rel. err vs the on-policy target per (k, head, level) and regime."""
    from rich.table import Table

    dist = ", ".join(
        f"k={k}: KL(π_(t−k)‖π_t) {d['behaviour_kl']:.3g}, max |log-ratio| {d['max_abs_seq_log_ratio']:.3g}"
        for k, d in stale["distances"].items()
    )
    t = Table(title=f"Stale rollouts (behaviour = the policy k exact steps of lr {stale['lr']} back; {dist}): "
              "rel. err vs the head's on-policy target")  # fmt: skip
    for col in ("k", "head", "level", "seq IS", "token IS", "seq IS + clip", "current log-probs (bug)"):
        t.add_column(col, justify="left" if col in ("head", "level") else "right")
    by_key: dict[tuple[int, str, str], dict[str, float]] = {}
    for r in stale["rows"]:
        by_key.setdefault((r["staleness"], r["head"], r["level"]), {})[r["regime"]] = r["err_target"]
    for (k, head, level), errs in by_key.items():
        t.add_row(str(k), head, level, *(_fmt(errs[reg]) for reg in STALE_REGIMES))
    console.print(t)


def plot_audit(result: dict, path: Path) -> None:
    """Two panels: on-policy bias vs reference distance; off-policy regimes per head (log scale)."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.2))
    sweep = result["sweep"]
    styles = {
        "k1_in_reward": ("#808000", "-", 3.0),
        "k2_as_loss": ("#b5b500", "--", 1.5),
        "k3_as_loss": ("firebrick", "-", 2.0),
        "k3_in_reward": ("salmon", "--", 1.5),
        "k1_as_loss": ("gray", ":", 2.0),
        "mse_in_reward": ("royalblue", "-.", 2.0),
        "fkl_as_loss": ("darkorange", ":", 2.5),  # same expected gradient as k3_as_loss: dotted over its line
        "js_in_reward": ("teal", "-", 2.0),
        "js_as_loss": ("mediumpurple", "--", 2.0),
    }
    floor = 1e-17
    for name, errs in sweep["err_rkl"].items():
        color, ls, lw = styles.get(name, ("purple", "-", 1.5))
        ax1.plot(
            sweep["distances"],
            [max(e, floor) for e in errs],
            ls,
            color=color,
            lw=lw,
            marker="o",
            ms=4,
            label=name,
        )
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("distance of π_ref from π (std of logit perturbation)")
    ax1.set_ylabel("‖E[g] - ∇KL(π‖π_ref)‖ / ‖∇KL‖")
    ax1.set_title("On-policy, sequence level: bias against the reverse-KL gradient")
    ax1.axhline(1e-12, color="black", lw=0.8, ls=":")
    ax1.text(sweep["distances"][0], 2e-12, "float64 round-off", fontsize=8, va="bottom")
    ax1.text(
        sweep["distances"][-1],
        0.35,
        "k1_as_loss and mse_in_reward overlap at ≈1:\nno reverse-KL signal",
        fontsize=8,
        ha="right",
        va="top",
    )
    ax1.legend(fontsize=9, loc="center right")
    ax1.grid(True, which="both", alpha=0.3)

    regimes = ("on_policy", "is_seq", "is_tok", "is_seq_clip", "no_is")
    labels = ("on-policy", "seq IS", "token IS", "seq IS+clip", "no IS (bug)")
    heads = ("k1_in_reward", "k2_as_loss", "k3_as_loss")
    levels = ("sequence", "token_to_go")
    groups = [(h, lv) for h in heads for lv in levels]
    idx = {(r["head"], r["level"], r["regime"]): r for r in result["rows"]}
    width = 0.8 / len(regimes)
    colors = ("#333333", "#2e7d32", "#f9a825", "#1565c0", "#c62828")
    for k, (reg, lab) in enumerate(zip(regimes, labels, strict=True)):
        vals = [max(idx[(h, lv, reg)]["err_target"] or floor, floor) for h, lv in groups]
        ax2.bar([i + (k - 2) * width for i in range(len(groups))], vals, width, label=lab, color=colors[k])
    ax2.set_yscale("log")
    ax2.set_xticks(range(len(groups)), [f"{h}\n{lv}" for h, lv in groups], fontsize=8)
    ax2.set_ylabel("rel. error vs the head's on-policy target")
    ax2.set_title("Off-policy corrections (samples from the behaviour policy)")
    ax2.axhline(1e-12, color="black", lw=0.8, ls=":")
    ax2.legend(fontsize=8, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    ax2.grid(True, axis="y", which="both", alpha=0.3)
    cfg = result["config"]
    fig.suptitle(
        f"klgrad gradient audit — tabular policy V={cfg['vocab']}, T={cfg['length']}, "
        f"eos={cfg['eos']}, {result['space']['num_sequences']} responses enumerated exactly",
        fontsize=12,
    )
    fig.tight_layout()
    save(fig, path, dpi=130, bbox_inches="tight")


def write_audit(result: dict, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "audit.json", "png": out_dir / "audit.png"}
    clean = json.loads(json.dumps(result, default=float), parse_constant=lambda c: None)
    tmp = paths["json"].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(clean, indent=2, allow_nan=False, default=lambda x: None))
    tmp.replace(paths["json"])
    plot_audit(result, paths["png"])
    if "frameworks" in result:
        paths["frameworks"] = write_frameworks(result["frameworks"], out_dir)
    return paths


def headline(result: dict) -> dict[str, float]:
    """A few numbers for notes and READMEs."""
    idx = {(r["head"], r["level"], r["regime"]): r for r in result["rows"]}
    on = lambda h, lv: idx[(h, lv, "on_policy")]  # noqa: E731
    return {
        "k1_in_reward/sequence err_rkl": on("k1_in_reward", "sequence")["err_rkl"],
        "k2_as_loss/sequence err_rkl": on("k2_as_loss", "sequence")["err_rkl"],
        "k2_as_loss/token_to_go err_rkl": on("k2_as_loss", "token_to_go")["err_rkl"],
        "k2_as_loss/token err_rkl": on("k2_as_loss", "token")["err_rkl"],
        "k3_as_loss/sequence err_rkl": on("k3_as_loss", "sequence")["err_rkl"],
        "k1_as_loss/sequence grad_norm": on("k1_as_loss", "sequence")["grad_norm"],
        "k2_as_loss/sequence off-policy no_is err": idx[("k2_as_loss", "sequence", "no_is")]["err_target"],
        "k2_as_loss/sequence off-policy is_seq err": idx[("k2_as_loss", "sequence", "is_seq")]["err_target"],
        "k2_as_loss/sequence off-policy is_seq_clip err": idx[("k2_as_loss", "sequence", "is_seq_clip")]["err_target"],
        "k2_as_loss/token_to_go off-policy is_tok err": idx[("k2_as_loss", "token_to_go", "is_tok")]["err_target"],
        **stale_headline(result),
    }


def stale_headline(result: dict) -> dict[str, float]:
    """The worst stale-rollout error of each regime over heads and levels, per k (empty without the axis)."""
    out: dict[str, float] = {}
    for r in result.get("staleness", {}).get("rows", []):
        key = f"staleness {r['staleness']} max err {r['regime']}"
        out[key] = max(out.get(key, 0.0), r["err_target"])
    return out
