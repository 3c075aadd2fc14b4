"""``summary.md``: a grid's :class:`~klgrad.compare.records.Summary` in words and tables, and
:func:`markdown_table`, the one table writer the summary and the studies' report scripts use."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from klgrad.compare.records import Summary, TestResult
from klgrad.compare.stats import FLIP_DRAWS

KL_LABELS = {
    "exact_kl": "exact",
    "stepwise_kl": "sampled, stepwise (exact next-token KLs summed along samples)",
    "sampled_k1": "sampled k1",
}


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """The lines of a Markdown table: ``| a | b |``, ``|---|---|``, then one line per row (cells as given)."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(str(c) for c in row) + " |" for row in rows),
    ]


def temperature_phrase(summary: Summary) -> str:
    """ "at τ = 0.7" (the sampling temperature every KL of the summary is taken at), or that it was not recorded."""
    t = summary.temperature
    return "at the sampling temperature (not recorded)" if t is None else f"at τ = {t:g}"


def holm_family_size(predictions: Sequence[TestResult]) -> int:
    """m of the summary's Holm family (:func:`klgrad.compare.stats.decide`): one hypothesis per ordering claim,
    two per equivalence claim (TOST and difference)."""
    return sum(2 if p.kind == "equivalent" else 1 for p in predictions)


def family_word(summary: Summary) -> str:
    """ "secondary " when the summary has a primary hypothesis (tested alone), else ""."""
    return "secondary " if summary.primary is not None else ""


def _num(x: float | None, fmt: str = ".4g") -> str:
    return "—" if x is None else format(x, fmt)


def _ci(p: TestResult) -> str:
    lo, hi = p.ci95
    return f"{p.mean_difference:+.4f} [{lo:+.4f}, {hi:+.4f}]"


def plain_answer(summary: Summary) -> list[str]:
    """A few plain sentences: how far each method ended from the reference, and what each prediction got."""
    b = summary.betas[0]
    key = summary.kl_metric
    label = f"KL(π‖π_ref) {temperature_phrase(summary)}, {KL_LABELS[key]}"
    kls, opt = [], []
    for name, row in summary.table.items():
        method, beta = name.rsplit("@", 1)
        if float(beta) == b and key in row:
            kls.append((row[key].mean, method))
    for name, row in summary.table.items():
        method, beta = name.rsplit("@", 1)
        if float(beta) == b and "kl_to_optimum" in row:
            opt.append((row["kl_to_optimum"].mean, method))
    out = []
    if kls:
        ranked = ", ".join(f"{m} {v:.3f}" for v, m in sorted(kls))
        out.append(
            f"**Distance to the reference** (final {label} on held-out prompts, mean over seeds, β = {b:g}, "
            f"closest first): {ranked}."
        )
    if opt:
        ranked = ", ".join(f"{m} {v:.3f}" for v, m in sorted(opt))
        out.append(
            f"**Distance to the optimum** π* ∝ π_ref·exp(R/β) of J_β = E[R] − β·KL (exact KL(π‖π*) "
            f"{temperature_phrase(summary)}, closest first): {ranked}."
        )
    out.append("")
    primary = [summary.primary] if summary.primary is not None and summary.primary.tested else []
    for p in primary + list(summary.predictions):
        d = (
            f"mean difference {_ci(p)}, {p.a} below {p.b} in {p.n_negative} of {p.n_pairs} seeds, paired p = "
            f"{p.p_adjusted:.3g} (Holm)"
        )
        if p.verdict == "opposite":
            what = (
                "**the opposite holds**: they differ"
                if p.kind == "equivalent"
                else f"**the opposite holds**: {p.b} ends lower than {p.a}"
            )
        elif p.verdict == "supported":
            what = "**supported**"
        else:
            what = "**not resolved at this sample size**"
        tag = "primary, tested alone" if p in primary else p.metric
        d = d.replace(" (Holm)", "") if p in primary else d
        out.append(f"- *{p.claim}* ({tag}): {what}; {d}.")
    return out


def margin_note(p: TestResult) -> str:
    """ " (margin ±δ; TOST's 90% CI [lo, hi])" for an equivalence record (the interval its verdict reads, where the
    record has it), "" for an ordering claim."""
    if p.margin is None:
        return ""
    ci = p.ci_tost
    tost = "" if ci is None else f"; TOST's {p.ci_tost_level:.0%} CI [{ci[0]:+.4f}, {ci[1]:+.4f}]"
    return f" (margin ±{p.margin:.3g}{tost})"


DISJOINT = ", which cannot both be true and so count once in the step-down's multiplier"
"""Said of a summary decided by :func:`klgrad.compare.stats.holm_disjoint` (its records carry ``adjustment``)."""


def sign_flip_phrase(preds: list[TestResult]) -> str:
    """How the summary's sign-flip p-values were computed: a summary.json written before the exact bracket
    (no ``sign_flip_method`` in its records) holds Monte Carlo estimates beyond 20 seeds."""
    if any(p.sign_flip_method is None for p in preds):
        return f"exact up to 20 seeds, beyond it from {FLIP_DRAWS} seeded random sign patterns"
    return (
        "exact: all 2^n sign patterns enumerated up to 20 seeds, beyond it the upper end of an exact bracket "
        "from a lattice count, the bracket in summary.json's p_sign_flip_bracket"
    )


def primary_markdown(summary: Summary) -> list[str]:
    """The pre-registered primary hypothesis and its verdict (decided alone), or nothing."""
    p = summary.primary
    if p is None:
        return []
    lines = [
        "## The primary hypothesis (pre-registered, tested alone)",
        "",
        f"Stated before any run ({summary.registered_at or 'time not recorded'}): *{p.claim}* "
        f"(`{p.text}`, metric `{p.metric}`). Decided by the paired test alone, not adjusted for the secondary "
        "claims below.",
        "",
    ]
    if not p.tested:
        return [*lines, f"**{p.verdict}**.", "", *amendments_markdown(summary)]
    rows = [("registered seeds" if summary.amendments else "all", p)]
    if summary.primary_all_seeds is not None and summary.primary_all_seeds.tested:
        rows.append(("every seed (not the verdict)", summary.primary_all_seeds))
    header = ("seeds", "claim", "metric", "mean d [95% CI]", "d < 0 in", "paired p", "sign-flip p", "verdict")
    table = markdown_table(
        header,
        [
            (
                label,
                q.claim + margin_note(q),
                q.metric,
                _ci(q),
                f"{q.n_negative}/{q.n_pairs}",
                f"{q.p_adjusted:.3g}",
                f"{q.p_sign_flip:.3g}",
                f"**{q.verdict}**",
            )
            for label, q in rows
        ],
    )
    return [*lines, *table, "", *amendments_markdown(summary)]


def amendments_markdown(summary: Summary) -> list[str]:
    """The grid's seed-count amendments (when, from how many seeds to how many, which had started, why)."""
    if not summary.amendments:
        return []
    lines = [
        f"**Amendments** (the primary hypothesis is decided on the {summary.registered_seeds} registered seeds):",
        "",
    ]
    for a in summary.amendments:
        started = ", ".join(str(s) for s in a["seeds_started"]) or "none"
        lines.append(
            f"- {a['at']} (klgrad {a['revision']}): seeds {a['seeds_from']} → {a['seeds_to']}, declared when seeds "
            f"{started} had started. {a['reason']}"
        )
    return [*lines, ""]


def convergence_markdown(summary: Summary) -> list[str]:
    """The convergence criterion and whether the grid met it, or nothing when the summary has no record."""
    c = summary.convergence
    if c is None:
        return []
    met = {True: "**met**", False: "**not met**", None: "not decided yet"}[c.met]
    if c.so_far:
        so_far = "passes" if c.so_far["met"] else "fails"
        met += (
            f" (decided once, at {c.decided_at_seeds} seeds, as the grid's amendment states; on the "
            f"{c.so_far['seeds']} seeds finished so far the test {so_far}, an interim look, not the verdict)"
        )
    lines = ["## Convergence", "", f"Criterion (stated before the runs): {c.criterion}. At {c.steps} steps: {met}.", ""]
    by = c.by_method or {}
    if by:
        rows = []
        for m, v in by.items():
            before = v.get("before_decay")
            early = (
                "—" if before is None else f"{before['met']} ({_num(before['moved'], '+.4g')}, {_num(before['se'])})"
            )
            need = _num(v.get("seeds_needed"), "d")
            if before is not None:
                need += f"; {_num(before.get('seeds_needed'), 'd')}"
            rows.append(
                (m, v["n"], _num(v["moved"], "+.4g"), _num(v["se"]), v["dense"], v["lr_decays"], early, v["met"], need)
            )
        header = (
            "method",
            "seeds",
            "moved",
            "se",
            "logged densely",
            "lr decays",
            "stopped before the decay (moved, se)",
            "met",
            "seeds the se bound needs (end; before the decay)",
        )
        lines += [
            *markdown_table(header, rows),
            "",
            "The last column projects the seeds at which the se would reach its bound if the seeds' spread stayed "
            "what these show (n·(se/bound)²; a planning figure, not a test). `convergence.png` shows each test.",
            "",
        ]
    return lines


def beta_scale_markdown(summary: Summary) -> list[str]:
    """The sentence under the table of a grid run with ``--beta-scale``: L̄ and what β' is, or nothing."""
    s = summary.beta_scale
    if s is None:
        return []
    how = (
        f"measured once as the reference's mean response length over {s['samples']} samples of each of the first "
        f"{s['prompts']} training prompts (seed {s['seed']}, on the CPU)"
        if s.get("measured", True)
        else "given on the command line"
    )
    return [
        f"Same nominal strength (`--beta-scale {s['mode']}`): β' (the `kl.beta` a method trained at) = β·n_kl/n_pg, "
        "n = 1 for a token sum (`seq_mean_token_sum`, klgrad's sequence-level heads) and L̄ for a token mean "
        f"(`token_mean`, `seq_mean_token_mean`); L̄ = {s['mean_length']:.3f} tokens, {how}. J_β and KL to optimum "
        "are at the nominal β.",
        "",
    ]


TABLE_COLUMNS = (
    "greedy_accuracy",
    "exact_kl",
    "stepwise_kl",
    "forward_kl",
    "sampled_k1",
    "sampled_k3",
    "logp_gap",
    "reward_std_in_group",
    "J",
    "kl_to_optimum",
)
TABLE_HEADER = (
    "greedy acc.",
    "exact KL",
    "stepwise KL",
    "forward KL",
    "sampled k1",
    "sampled k3",
    "log-prob gap",
    "reward std in group",
    "J_β",
    "KL to optimum",
)


def summary_markdown(summary: Summary) -> str:
    """``summary.md``: the plain answer, the table of final metrics, the primary hypothesis, the convergence
    record and the secondary predictions with their tests."""
    preds = summary.predictions
    n_min = min((p.n_pairs for p in preds), default=0)
    normality = (
        f" With {n_min} seeds the exact sign-flip p cannot go below 2/2^{n_min} = {2 / 2**n_min:.3g} ≥ α, so a "
        "verdict here rests on the t-test's normality."
        if preds and 2 / 2**n_min >= (preds[0].alpha if preds[0].alpha is not None else 0.05)
        else ""
    )
    scaled = summary.effective_betas
    header = ("method @ β", *(("β' (kl.beta)",) if scaled is not None else ()), *TABLE_HEADER)

    def cell(row, k: str) -> str:
        return "—" if k not in row else f"{row[k].mean:.4f} ± {row[k].ci95:.4f}"

    rows = []
    for name, row in summary.table.items():
        eff = () if scaled is None else ((f"{scaled[name]:.4g}" if name in scaled else "—"),)
        rows.append((name, *eff, *(cell(row, k) for k in TABLE_COLUMNS)))
    lines = [
        f"# klgrad compare — level `{summary.level}`, {summary.steps} steps, {summary.seeds} seeds",
        "",
        *plain_answer(summary),
        "",
        "## Final metrics",
        "",
        f"Mean ± 95% CI over seeds (t interval). Every KL (exact, stepwise, sampled k1 and k3, KL to optimum, the KL "
        f"in J_β) is between the full next-token distributions {temperature_phrase(summary)}, the sampling "
        "temperature of the runs.",
        "",
        *markdown_table(header, rows),
        "",
        "J_β = E_π[R] − β·KL(π‖π_ref) and KL to optimum = KL(π‖π*) = (J* − J_β)/β, exact on the held-out prompts "
        "(short answers; J* is the best J_β any policy reaches). Forward KL = KL(π_ref‖π) on the same prompts: exact "
        "where the exact KL is, else stepwise along reference samples.",
        "",
        *beta_scale_markdown(summary),
        *primary_markdown(summary),
        *convergence_markdown(summary),
        "## The predictions" + (" (secondary)" if summary.primary is not None else ""),
        "",
        "Paired by seed (runs of one seed share prompts and sampling uniforms): d = a − b per seed, paired t-test "
        f"(two-sided; TOST for an equivalence claim), p Holm-adjusted in one {family_word(summary)}family of the "
        f"{holm_family_size(preds)} "
        f"tested hypotheses of {len(preds)} claims (an equivalence claim brings two: TOST and difference"
        f"{DISJOINT if preds and all(p.adjustment is not None for p in preds) else ''}). Beside "
        f"it, for comparison only: the sign-flip p (two-sided, unadjusted; {sign_flip_phrase(preds)}) and the "
        "unpaired Welch p (one-sided, "
        "or Welch TOST; unadjusted, outside the Holm family, not used for any verdict)." + normality,
        "",
    ]
    header = (
        "claim",
        "metric",
        "mean d [95% CI]",
        "d < 0 in",
        "paired p (Holm)",
        "sign-flip p (unadj.)",
        "Welch p (unadj.)",
        "verdict",
    )
    rows = [
        (
            p.claim + margin_note(p),
            p.metric,
            _ci(p),
            f"{p.n_negative}/{p.n_pairs}",
            f"{p.p_adjusted:.3g}",
            f"{p.p_sign_flip:.3g}",
            f"{p.welch.p_value:.3g}",
            f"**{p.verdict}**",
        )
        for p in preds
    ]
    return "\n".join([*lines, *markdown_table(header, rows)]) + "\n"
