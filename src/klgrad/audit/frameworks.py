r"""What each framework's KL differentiates to: its KL term written out as that framework computes it, audited by
exact enumeration against the reverse-KL and forward-KL gradients and against every klgrad head and level.

The presets (:mod:`klgrad.audit.presets`) are per-token rules re-written from each framework's released code
(value, what carries gradient, clamps, ratio handling, where the term enters, the default aggregation), each with
the versions it holds for and the file and commit it was read from (:class:`~klgrad.audit.framework_kl.FrameworkKL`).
A preset becomes a per-response loss the way the framework's loss sees it, KL weight β = 1, reduced by each
aggregation of :data:`~klgrad.audit.framework_kl.AGGREGATIONS`: the framework's default and the other family
(token sum or per-sequence token mean). KL-in-reward presets become a PPO-clipped policy-gradient term with
advantage −(the KL return), their KL computed once at rollout time from the behaviour log-probs, as the frameworks do.

Regimes: ``on_policy`` (responses from π, behaviour = current policy) and ``off_policy`` (responses from the
behaviour policy of :class:`~klgrad.audit.run.AuditProblem`, the framework's own ratio handling: most KL losses
then take no importance weight at all). Notation: l = log π (carries gradient), o = behaviour log-prob, r =
reference, u = l − r, δ = e^{−u}, ρ_t = e^{l_t − o_t}; docs/math.md, “Notation”.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import metadata
from pathlib import Path

import torch
from torch import Tensor

from klgrad.audit.framework_kl import SUM_FAMILY, FrameworkKL
from klgrad.audit.precision import preset_precision, with_precision
from klgrad.audit.presets import PACKAGES, PRESETS
from klgrad.audit.tabular import exact_gradient, expected_gradient, token_logps
from klgrad.choices import FRAMEWORKS
from klgrad.kl import KL_HEADS, kl_loss_per_sequence

# ----------------------------------------------------------------------------------------------------------
# the audit

KL_TARGETS: dict[str, tuple[str, str, str]] = {
    "token_sum": ("rkl", "fkl", "KL(π‖π_ref)"),
    "seq_mean": ("rkl_per_token", "fkl_per_token", "E_π[log(π/π_ref)(y)/|y|]"),
}
"""Per audited aggregation: the reverse and forward divergence a row is measured against, and its name. A
per-sequence token mean can at best reach the length-weighted divergences."""


def _rel_error_floored(a: Tensor, b: Tensor, floor: float) -> float:
    """‖a − b‖ / max(‖b‖, ``floor``): the error of ``a`` relative to ``b``, its denominator never below ``floor``
    (the callers pass the norm of the aggregation's reverse-divergence gradient, :data:`KL_TARGETS`), so a reference
    gradient smaller than that, or zero, does not magnify the error.
    (:mod:`klgrad.audit.run` divides by ‖b‖ itself unless b is exactly zero: ``_rel_error_zero_fallback``.)"""
    return float((a - b).norm()) / max(float(b.norm()), floor)


NAMED_FIRST: tuple[str, ...] = ("none", "k2_as_loss")
"""One name per gradient: where several heads have the same expected gradient, the first of these is named, then
the registry's order; at one head, the plainer level (sequence, token, token_to_go). ``none`` names a zero
gradient; ``k2_as_loss`` every gradient of the reverse-KL family: ``k2_as_loss@sequence (rkl)`` is the exact one,
``k2_as_loss@token (local_rkl)`` the per-step reverse KL (TRL ≥ 1.10's default, verl's ``mse``, DeepSeek's
unbiased KL), never ``k1_in_reward@token``, a name readers know as exact."""


LEVELS_IN_NAMING_ORDER: tuple[str, ...] = ("sequence", "token", "token_to_go")
"""On ties, the plainer level is named."""


def naming_order() -> list[str]:
    """The heads in the order their gradients are named (:data:`NAMED_FIRST`, then the registry's)."""
    return [*NAMED_FIRST, *(name for name in KL_HEADS if name not in NAMED_FIRST)]


def gradient_name(head: str, level: str) -> str:
    """The one name of the on-policy expected gradient of ``head`` at ``level`` under a token sum, as the audit
    prints it: ``head@level (target)`` of the first head and level in naming order with the same target
    (heads with one target have one expected gradient); ``head@level`` itself when it has no target."""
    target = KL_HEADS[head].targets.get(level)
    if target is None:
        return f"{head}@{level}"
    for name in naming_order():
        for lv in LEVELS_IN_NAMING_ORDER:
            if KL_HEADS[name].targets.get(lv) == target:
                return f"{name}@{lv} ({target})"
    raise AssertionError("unreachable: the head itself has the target")


def audited_aggregation(aggregation: str) -> str:
    """``token_sum`` for the sum family (token mean, constant: β rescaled), ``seq_mean`` for itself."""
    return "token_sum" if aggregation in SUM_FAMILY else aggregation


def klgrad_gradients(problem, aggregation: str = "token_sum") -> dict[str, Tensor]:
    """On-policy expected gradient of every klgrad head at every level (``head@level``), reduced by
    ``aggregation`` (``token_sum``: the heads as klgrad applies them; ``seq_mean``: each response's term
    divided by |y|, written ``head@level/|y|``, after the named length-weighted targets ∇E_π[log(π/π_ref)/|y|],
    ∇E_π[(log(π/π_ref) − 1)/|y|], ∇E_π[1/|y|] and ∇E_{π_ref}[log(π_ref/π)/|y|]):
    what a framework's gradient is compared with. klgrad's off-policy correction has the same expectation, so
    one table serves both regimes."""
    sp = problem.space
    ref_lp = token_logps(sp, problem.ref)
    length = sp.lengths.to(ref_lp.dtype)
    per_len = aggregation == "seq_mean"
    out = {}
    if per_len:  # the named length-weighted targets first: they say what a per-sequence mean reaches
        rkl = exact_gradient(sp, "rkl_per_token", problem.theta, problem.ref)
        inv = exact_gradient(sp, "inverse_length", problem.theta, problem.ref)
        out["E[log(π/π_ref)/|y|]"] = rkl
        out["E[(log(π/π_ref) − 1)/|y|]"] = rkl - inv
        out["E[1/|y|]"] = inv
        out["E_ref[log(π_ref/π)/|y|]"] = exact_gradient(sp, "fkl_per_token", problem.theta, problem.ref)
    for name in naming_order():  # on ties the first is named: one name per gradient
        head = KL_HEADS[name]
        for level in LEVELS_IN_NAMING_ORDER:

            def loss(logp: Tensor, behaviour: Tensor, head=head, level=level) -> Tensor:
                per_seq = kl_loss_per_sequence(head, logp, ref_lp, sp.mask, level=level)
                return per_seq / length if per_len else per_seq

            key = f"{name}@{level}/|y|" if per_len else f"{name}@{level}"
            out[key] = expected_gradient(sp, loss, problem.theta, problem.theta)[0]
    return out


def nearest_head(g: Tensor, table: dict[str, Tensor], scale: float, exact: float = 1e-9) -> str:
    """``head@level (target)`` of the first entry of ``table`` (klgrad heads in :func:`naming_order` then level
    order; under a per-sequence mean the named targets first) whose expected gradient ``g`` equals (relative error
    < ``exact``), else ``≈ key (error)`` of the nearest one: the first in ``table`` order among those within a
    relative 1e-9 of the smallest error, so that entries with the same expected gradient (``k1_as_loss@sequence``
    and ``none``) tie by order, not by float round-off."""
    errors = {key: _rel_error_floored(g, ref, scale) for key, ref in table.items()}
    for key, err in errors.items():
        if err < exact:
            if "@" not in key:
                return key
            name, level = key.split("@")
            target = KL_HEADS[name].targets.get(level.removesuffix("/|y|"))
            return f"{key} ({target})" if target and not level.endswith("/|y|") else key
    best = min(errors.values())
    key = next(k for k, err in errors.items() if err <= best * (1 + 1e-9))
    return f"≈ {key} ({errors[key]:.2g})"


def preset_aggregations(preset: FrameworkKL) -> tuple[str, ...]:
    """The framework's default aggregation first, then the other family's (``seq_mean`` or ``token_sum``)."""
    other = "seq_mean" if preset.aggregation in SUM_FAMILY else "token_sum"
    return (preset.aggregation, other)


def framework_rows(problem, presets: tuple[FrameworkKL, ...] | None = None, dtype: str = "float64") -> list[dict]:
    """One row per (preset, aggregation, regime): err_rkl, err_fkl (relative errors of its exact expected
    gradient against the aggregation's reverse and forward divergence, :data:`KL_TARGETS`), the klgrad head
    and level it equals or is nearest to, and the preset's versions, source and default. Presets whose
    reference is the behaviour policy (RPG's iterative reference, prime-rl) are audited on the problem with
    π_ref := π_old, off-policy only. The enumeration is float64; ``dtype`` is the precision axis: every row also
    carries ``dtype``, ``dtype_grad_err`` and the ranges of :func:`klgrad.audit.precision.precision_report`, the
    preset's per-token gradient computed from log-probs in ``dtype``."""
    contexts: dict[tuple[bool, str], tuple] = {}

    def context(reference_is_behaviour: bool, aggregation: str) -> tuple:
        key = (reference_is_behaviour, aggregation)
        if key not in contexts:
            prob = dataclasses.replace(problem, ref=problem.behaviour) if reference_is_behaviour else problem
            rkl, fkl, _ = KL_TARGETS[aggregation]
            g_rkl = exact_gradient(prob.space, rkl, prob.theta, prob.ref)
            g_fkl = exact_gradient(prob.space, fkl, prob.theta, prob.ref)
            table = klgrad_gradients(prob, aggregation)
            contexts[key] = (prob, token_logps(prob.space, prob.ref), g_rkl, g_fkl, table)
        return contexts[key]

    rows = []
    for preset in PRESETS if presets is None else presets:
        for aggregation in preset_aggregations(preset):
            audited = audited_aggregation(aggregation)
            prob, ref_lp, g_rkl, g_fkl, table = context(preset.reference_is_behaviour, audited)
            scale = float(g_rkl.norm())
            loss = preset.loss(ref_lp, prob.space.mask, audited)
            clamps = frozen_range(preset, "gradient"), frozen_range(preset, "value")  # of the per-token rule alone
            for regime in preset.regimes:
                sampler = prob.theta if regime == "on_policy" else prob.behaviour
                g, _ = expected_gradient(prob.space, loss, prob.theta, sampler)
                rows.append(
                    dict(
                        id=preset.id,
                        framework=preset.framework,
                        variant=preset.variant,
                        style=preset.style,
                        regime=regime,
                        aggregation=aggregation,
                        framework_default_aggregation=aggregation == preset.aggregation,
                        kl_target=KL_TARGETS[audited][2],
                        err_rkl=_rel_error_floored(g, g_rkl, scale),
                        err_fkl=_rel_error_floored(g, g_fkl, scale),
                        equals=nearest_head(g, table, scale),
                        zero_gradient=clamps[0],
                        clamped=clamps[1],
                        reference="behaviour (π_old)" if preset.reference_is_behaviour else "π_ref",
                        versions=preset.versions,
                        default=preset.default,
                        source=preset.source,
                        std_normalised=preset.std_normalised,
                        coef_default=list(preset.coef_default) if preset.coef_default else None,
                    )
                )
    chosen = PRESETS if presets is None else presets
    return with_precision(rows, "id", preset_precision(chosen, dtype))


def frozen_range(preset: FrameworkKL, what: str, limit: float = 30.0, steps: int = 6001) -> str | None:
    """Where a clamp acts, on-policy, over log-ratios u = l − r in [−limit, limit], as text (``u ≤ −a, u ≥ b``);
    None when nowhere, or when the term does not depend on u at all.

    ``what="value"``: where the per-token KL value stops changing with u (the clamp caps it: a reward's
    coefficient, or a loss term whose gradient then comes from elsewhere). ``what="gradient"``: where the value
    is capped *and* ∂(per-token loss term)/∂l is exactly 0, i.e. the term no longer depends on l (loss presets
    only; a zero gradient with a moving value is float64 cancellation, e.g. ∂(ρ·k3)/∂l = u computed as
    (1 − e^{−u}) + (e^{−u} − 1 + u) for u < −40, not a clamp). Each u is a one-token response, behaviour o = l.
    The range stops at |u| = 30 so that saturating terms (e^u → 0) still move by more than a float64 ulp per
    step; a clamp further out (Open-Instruct's ±40 on the log-ratio) is in the preset's label, not here."""
    u = torch.linspace(-limit, limit, steps, dtype=torch.float64)[:, None]  # (steps, 1)
    r = torch.zeros_like(u)
    mask = torch.ones_like(u, dtype=torch.bool)
    value = preset.token_kl(u, r, u, mask).detach()[:, 0]
    frozen = torch.zeros_like(value, dtype=torch.bool)
    same = value[1:] == value[:-1]
    frozen[1:] |= same
    frozen[:-1] |= same
    if bool(same.all()):
        return None  # a constant (an ignored flag, a term without the reference): no clamp to report
    if what == "gradient":
        if preset.style != "loss":
            return None
        l = u.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(preset.token_kl(l, r, l.detach(), mask).sum(), l)
        frozen &= (grad == 0)[:, 0]
    u = u[:, 0]
    frozen &= u.abs() > 1e-6  # u = 0 is a stationary point of every KL, not a clamp
    parts = []
    if bool(frozen[u < 0].any()):
        parts.append(f"u ≤ {float(u[(u < 0) & frozen].max()):.3g}")
    if bool(frozen[u > 0].any()):
        parts.append(f"u ≥ {float(u[(u > 0) & frozen].min()):.3g}")
    return ", ".join(parts) or None


# ----------------------------------------------------------------------------------------------------------
# versions


def is_release_range(versions: str) -> bool:
    """A PEP 440 specifier (``>=0.14,<1.10``), as opposed to ``main@DATE`` or a report: a code base without
    releases, which holds for any version asked."""
    return versions[:1] in ("<", ">", "=", "!", "~")


def _contains(spec: str, version: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version)
    except InvalidVersion as e:
        raise ValueError(f"--version {version!r} is not a version number (e.g. 1.9.0)") from e
    return SpecifierSet(spec).contains(v, prereleases=True)


def holds_for(preset: FrameworkKL, version: str | None) -> bool:
    """Whether ``preset`` describes release ``version`` (None: every release)."""
    return version is None or not is_release_range(preset.versions) or _contains(preset.versions, version)


def is_default(preset: FrameworkKL, version: str | None) -> bool:
    """Whether ``preset`` is its framework's default KL (what switching its KL on gives) in ``version``
    (None: in some release)."""
    if preset.default is None:
        return False
    return version is None or not is_release_range(preset.default) or _contains(preset.default, version)


def installed_version(framework: str) -> tuple[str, str] | None:
    """``(distribution, version)`` of ``framework``'s installed package (:data:`PACKAGES`), or None when it is
    not installed or has no distribution of its own."""
    for dist in PACKAGES.get(framework, ()):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def select(name: str, version: str | None = None) -> tuple[FrameworkKL, ...]:
    """The presets of framework ``name`` (``all``: every one) that hold for ``version`` (None: every
    version); a ValueError lists the names."""
    if name == "all":
        chosen = PRESETS
    else:
        chosen = tuple(p for p in PRESETS if p.framework == name)
        if not chosen:
            raise ValueError(f"--framework must be 'all' or one of {list(FRAMEWORKS)}, got {name!r}")
    held = tuple(p for p in chosen if holds_for(p, version))
    if not held:
        ranges = sorted({p.versions for p in chosen})
        raise ValueError(f"no {name} preset holds for version {version}; audited ranges: {ranges}")
    return held


def zero_weight_text(preset: FrameworkKL) -> str | None:
    """``"kl_loss_coef defaults to 0"`` when switching ``preset`` on alone adds nothing (its weight defaults to 0),
    else None."""
    if preset.coef_default is None or preset.coef_default[1] != 0:
        return None
    return f"{preset.coef_default[0]} defaults to 0"


def defaults_summary(framework: str) -> list[str]:
    """Which preset is ``framework``'s default KL in which versions, one line each."""
    lines = []
    for p in PRESETS:
        if p.framework == framework and p.default is not None:
            zero = zero_weight_text(p)
            lines.append(f"{p.id} ({p.variant}): default in {p.default}" + (f" ({zero}: set it)" if zero else ""))
    return lines


# ----------------------------------------------------------------------------------------------------------
# presentation


def fmt_error(x: float) -> str:
    """A relative error for the tables: 3 digits, scientific below 1e-2, "<1e-12" for float64 round-off."""
    from klgrad.fmt import fmt_num

    return fmt_num(x, 3, sci_digits=1, sci_below=1e-2, tiny=1e-12, tiny_text="<1e-12", zero="0")


def clamp_text(row: dict) -> str:
    if row["zero_gradient"]:
        return f"∇ = 0 at {row['zero_gradient']}"
    return f"value capped at {row['clamped']}" if row["clamped"] else ""


TABLE_COLUMNS: tuple[str, ...] = (
    "preset", "setting", "versions", "aggregation", "regime", "err vs ∇RKL", "err vs ∇FKL", "klgrad equivalent",
    "clamp",
)  # fmt: skip
"""The terminal table's columns."""
WHOLE = ("preset", "aggregation", "regime", "err vs ∇RKL", "err vs ∇FKL", "klgrad equivalent")
"""Columns whose cells are never broken: an id, a gradient's name or a number is pasted or read whole."""
FOLDED = 12
"""The narrowest the other columns (setting, versions, clamp) are folded to before the table gives way to records."""


def _table_cells(rows: list[dict], version: str | None) -> list[tuple[str, ...]]:
    by_id = {p.id: p for p in PRESETS}
    return [
        (
            ("★ " if is_default(by_id[r["id"]], version) else "") + r["id"],
            r["variant"],
            r["versions"],
            r["aggregation"],
            r["regime"].replace("_", "-"),
            fmt_error(r["err_rkl"]),
            fmt_error(r["err_fkl"]),
            r["equals"],
            clamp_text(r),
        )
        for r in rows
    ]


def print_framework_table(rows: list[dict], console=None, version: str | None = None) -> None:
    """Two tables: every preset at its framework's default aggregation (both regimes), then on-policy under the
    other aggregation; defaults marked ★ (in ``version`` when given). Preset ids and gradient names are printed
    whole at any width, so they can be pasted: in a rich table whose :data:`WHOLE` columns never wrap when the
    console is wide enough for them, else as one record per row, each ``column: value`` on its own line (the
    terminal may wrap a long line on screen; the text itself is never cut)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    for title, keep in (
        ("at the framework's default aggregation", lambda r: r["framework_default_aggregation"]),
        (
            "on-policy, at the other aggregation",
            lambda r: not r["framework_default_aggregation"] and r["regime"] == "on_policy",
        ),
    ):
        title = f"What each framework's KL differentiates to, {title} (exact enumeration, float64, β = 1)"
        cells = _table_cells([r for r in rows if keep(r)], version)
        widths = [max([len(c[i]) for c in cells] + [len(col)]) for i, col in enumerate(TABLE_COLUMNS)]
        table = Table(title=title)
        for col, width in zip(TABLE_COLUMNS, widths, strict=True):
            whole = col in WHOLE
            table.add_column(
                col,
                justify="right" if col.startswith("err") else "left",
                no_wrap=whole,
                overflow="ellipsis" if whole else "fold",  # never reached for a whole column: its width is its own
                min_width=width if whole else None,
            )
        for row in cells:
            table.add_row(*map(escape, row))
        # the whole columns at their widths, the others folded down to FOLDED characters; each column adds its
        # padding and one border (2 + 1), the table one more border
        shown = [w if col in WHOLE else min(w, FOLDED) for col, w in zip(TABLE_COLUMNS, widths, strict=True)]
        needed = 1 + sum(w + 3 for w in shown)
        if needed <= console.width:
            console.print(table)
            continue
        console.print(title, markup=False, soft_wrap=True)
        for row in cells:
            console.print(row[0], markup=False, soft_wrap=True, highlight=False)
            for col, cell in zip(TABLE_COLUMNS[1:], row[1:], strict=True):
                if cell:
                    console.print(f"    {col}: {cell}", markup=False, soft_wrap=True, highlight=False)
    console.print(
        "★ the framework's default KL when switched on"
        + (f" in version {version}" if version else "")
        + "; errors are against the aggregation's divergence (per-sequence mean: E_π[log(π/π_ref)/|y|]); "
        "klgrad equivalent: the gradient's one name, head@level (target) (klgrad audit --help)",
        markup=False,
    )


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
    rows = [r for r in rows if r["framework_default_aggregation"]]
    labels = list(dict.fromkeys(f"{r['id']} ({r['aggregation']})" for r in rows))
    by = {(f"{r['id']} ({r['aggregation']})", r["regime"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.3 * len(labels) + 1.8), sharey=True)
    y = torch.arange(len(labels)).tolist()
    for ax, key, title in (
        (axes[0], "err_rkl", "vs the reverse-KL gradient"),
        (axes[1], "err_fkl", "vs the forward-KL gradient"),
    ):
        for offset, regime, color in ((-0.18, "on_policy", "#1f5f8b"), (0.18, "off_policy", "#e08a1e")):
            at = [(v, by[(lab, regime)][key]) for v, lab in zip(y, labels, strict=True) if (lab, regime) in by]
            ax.barh(
                [v + offset for v, _ in at],
                [max(e, 1e-16) for _, e in at],
                height=0.34,
                color=color,
                label=regime.replace("_", "-"),
            )
        ax.set_xscale("log")
        ax.axvline(1e-12, color="black", lw=0.8, ls=":")
        ax.set_title(f"relative error {title}", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(y, labels, fontsize=7)
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(
        "What each framework's KL differentiates to, at its default aggregation (exact enumeration; dotted: "
        "float64 round-off;\nper-sequence means against the length-weighted divergences)",
        fontsize=11,
    )
    axes[0].set_ylim(len(labels) - 0.5, -0.5)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.9 / (0.3 * len(labels) + 1.8)))
    save(fig, path, dpi=110)
