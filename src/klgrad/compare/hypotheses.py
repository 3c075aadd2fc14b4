"""What a grid decides: the paper's predictions (and ours on the distance to the optimum), the pre-registered
primary hypothesis tested alone, the secondary Holm family, and the convergence record, from the finished runs'
rows (:class:`~klgrad.compare.records.RunRow`).

Runs of one seed share prompts and sampling uniforms, so every prediction is decided on per-seed differences by a
paired test (:mod:`klgrad.compare.stats`); a primary hypothesis (``--primary``, :mod:`klgrad.compare.claims`) is
decided alone, the other predictions then form a secondary family.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from klgrad.compare.claims import Claim, same_claim
from klgrad.compare.convergence import ConvergenceCriterion, MethodRuns, converged, metric_series
from klgrad.compare.design import EQUIVALENCE_MARGIN, run_name
from klgrad.compare.records import ConvergenceResult, GridRecord, MetricStat, RunRow, Summary, TestResult
from klgrad.compare.runs import read_jsonl
from klgrad.compare.stats import (
    decide,
    mean_ci,
    paired_equivalent,
    paired_less,
    welch_equivalent,
    welch_less,
)

FINAL_KEYS = (
    "greedy_accuracy",
    "sampled_accuracy",
    "exact_kl",
    "stepwise_kl",
    "sampled_k1",
    "sampled_k2",
    "sampled_k3",
    "logp_gap",
    "logp_gap_abs",
    "reward_std_in_group",
    "batch_kl_k1",
    "reward_mean",
    "J",
    "J_star",
    "kl_to_optimum",
    "forward_kl",
    "kl_to_optimum_sampled",
    "forgetting_reverse_kl",
    "forgetting_forward_kl",
)
"""The final metrics the summary's table gives mean ± 95% CI of (those every run of a (method, β) has)."""

PREDICTIONS: tuple[tuple[str, str, str, str, str], ...] = (
    # (claim, kind, a, b, metric): "less" claims mean(a) < mean(b); "equivalent" claims a ≈ b. Metric "kl" is
    # the summary's KL (exact when the tree can be enumerated, else the stepwise sampled estimate).
    ("k1_as_loss ≈ none (no regularisation) on final KL", "equivalent", "k1_as_loss", "none", "kl"),
    ("k2_as_loss keeps KL below k3_as_loss", "less", "k2_as_loss", "k3_as_loss", "kl"),
    ("k2_as_loss keeps the log-prob gap below k3_as_loss", "less", "k2_as_loss", "k3_as_loss", "logp_gap"),
    (
        "k2_as_loss has lower reward std within groups than k3_as_loss",
        "less",
        "k2_as_loss",
        "k3_as_loss",
        "reward_std_in_group",
    ),
    # beyond the paper: heads with the exact reverse-KL gradient end closer to the optimum π* ∝ π_ref·e^{R/β} of
    # J_β than the biased k3 surrogate and than no KL (exact KL(π‖π*) on held-out prompts)
    ("k1_in_reward ends closer to π* than k3_as_loss", "less", "k1_in_reward", "k3_as_loss", "kl_to_optimum"),
    ("k1_in_reward ends closer to π* than none", "less", "k1_in_reward", "none", "kl_to_optimum"),
    ("k2_as_loss ends closer to π* than k3_as_loss", "less", "k2_as_loss", "k3_as_loss", "kl_to_optimum"),
    ("k2_as_loss ends closer to π* than none", "less", "k2_as_loss", "none", "kl_to_optimum"),
)
"""The predictions ``klgrad compare`` decides: the paper's four, then ours on the distance to the optimum (for
k2_as_loss the exact reverse-KL gradient holds at sequence and token_to_go level only; at token level, GRPO's,
it is a per-step surrogate, so that claim is tested there too but is not the theory's)."""


def rows_of(results: Iterable[RunRow | Mapping]) -> list[RunRow]:
    """The runs' rows as :class:`RunRow`, from rows or from summary.json's row dicts."""
    return [r if isinstance(r, RunRow) else RunRow.from_json(r) for r in results]


def final_value(run: RunRow | Mapping, key: str) -> Any:
    """A run's final metric ``key`` (:meth:`RunRow.value`; a summary.json row dict is read the same way)."""
    return rows_of([run])[0].value(key)


def paired_values(results: Sequence[RunRow], a: str, b: str, beta: float, key: str) -> tuple[list, list]:
    """Values of ``key`` for methods ``a`` and ``b`` at ``beta``, paired by seed (seeds where both have one)."""

    def by_seed(m: str) -> dict[int, float]:
        return {r.seed: r.value(key) for r in results if r.method == m and r.beta == beta and r.value(key) is not None}

    va, vb = by_seed(a), by_seed(b)
    seeds = sorted(va.keys() & vb.keys())
    return [va[s] for s in seeds], [vb[s] for s in seeds]


def claim_test(
    results: Iterable[RunRow | Mapping], claim: str, kind: str, a: str, b: str, key: str, beta: float, margin: float
) -> dict | None:
    """The paired test of one claim on final metric ``key`` (the unpaired Welch test beside it, unadjusted), or
    None when fewer than 2 seeds pair up."""
    xa, xb = paired_values(rows_of(results), a, b, beta, key)
    if len(xa) < 2:
        return None
    if kind == "equivalent":
        test = paired_equivalent(xa, xb, margin)
        welch = welch_equivalent(xa, xb, margin)
    else:
        test = paired_less(xa, xb)
        welch = welch_less(xa, xb)
    return {
        "claim": claim,
        "metric": key,
        "a": a,
        "b": b,
        **test,
        "welch": {
            "test": welch["test"],
            "p_value": welch["p_value"],
            "verdict": welch["verdict"],
            "adjusted": False,  # its own p at α: outside the Holm family, never the verdict
        },
    }


def prediction_tests(
    results: Iterable[RunRow | Mapping],
    methods: Sequence[str],
    beta: float,
    kl_key: str,
    margin: float = EQUIVALENCE_MARGIN,
    exclude: Claim | None = None,
) -> list[dict]:
    """The paired test of each prediction whose methods are in the grid, with the unpaired Welch test beside it;
    ``exclude`` (the grid's primary hypothesis) is left out when it is one of them.

    The equivalence claim "k1_as_loss ≈ none" is a paired TOST with the stated ``margin`` δ (nats of KL):
    "k1_as_loss's final KL is within ±δ of no KL's".
    """
    rows = rows_of(results)
    tests = []
    for claim, kind, a, b, metric in PREDICTIONS:
        if not {a, b} <= set(methods):
            continue
        key = kl_key if metric == "kl" else metric
        if exclude is not None and same_claim(exclude, kind, a, b, key, kl_key):
            continue
        test = claim_test(rows, claim, kind, a, b, key, beta, margin)
        if test is not None:
            tests.append(test)
    return tests


def primary_result(results: Iterable[RunRow | Mapping], claim: Claim, beta: float, kl_key: str, margin: float) -> dict:
    """The primary hypothesis decided alone (:func:`~klgrad.compare.stats.decide` on a family of its own: one
    hypothesis, two for an equivalence), with its statement; ``verdict`` says so when it could not be tested."""
    key = kl_key if claim.metric == "kl" else claim.metric
    test = claim_test(results, claim.sentence(), claim.kind, claim.a, claim.b, key, beta, margin)
    stated = {**claim.as_dict(), "family": "primary (tested alone)"}
    if test is None:
        return {**stated, "metric": key, "verdict": "not tested: fewer than 2 seeds with both methods"}
    return {**stated, **decide([test])[0]}


def kl_metric(results: Iterable[RunRow | Mapping]) -> str:
    """The summary's KL(π‖π_ref): ``exact_kl`` (tree enumeration) when every run has it, else ``stepwise_kl``
    (exact next-token KLs summed along samples) when every run has it, else the sampled k1."""
    rows = rows_of(results)
    for key in ("exact_kl", "stepwise_kl"):
        if rows and all(r.value(key) is not None for r in rows):
            return key
    return "sampled_k1"


def check_claim(claim: Claim, methods: Sequence[str]) -> None:
    """A primary hypothesis must compare two of the grid's methods on ``kl`` or a final metric."""
    missing = [m for m in (claim.a, claim.b) if m not in methods]
    if missing or claim.a == claim.b:
        raise ValueError(f"--primary {claim.text}: needs two different methods of the grid {list(methods)}")
    if claim.metric != "kl" and claim.metric not in FINAL_KEYS:
        raise ValueError(f"--primary {claim.text}: metric {claim.metric!r} is not 'kl' or one of {list(FINAL_KEYS)}")


def summarize(
    results: Iterable[RunRow | Mapping],
    methods: Sequence[str],
    betas: Sequence[float],
    level: str,
    steps: int,
    seeds: int,
    margin: float = EQUIVALENCE_MARGIN,
    temperature: float | None = None,
    primary: Claim | None = None,
) -> Summary:
    """Per (method, β): mean ± 95% CI of every final metric; the paper's predictions at the first β.
    ``temperature`` is the sampling temperature τ every KL is taken at (None: not recorded). With a ``primary``
    hypothesis, it is decided alone (``primary``) and the other predictions form the secondary Holm family
    (each marked ``"family": "secondary"``); without one every prediction is in one family."""
    rows = rows_of(results)
    table: dict = {}
    for b in betas:
        for m in methods:
            mine = [r for r in rows if r.method == m and r.beta == b]
            table[f"{m}@{b:g}"] = {
                k: MetricStat(*mean_ci([r.value(k) for r in mine]))
                for k in FINAL_KEYS
                if mine and all(r.value(k) is not None for r in mine)
            }
    b = betas[0]
    kl_key = kl_metric(rows)
    preds = decide(prediction_tests(rows, methods, b, kl_key, margin, exclude=primary))
    decided = None
    if primary is not None:
        decided = TestResult.from_json(primary_result(rows, primary, b, kl_key, margin))
        preds = [{**p, "family": "secondary"} for p in preds]
    return Summary(
        level=level,
        steps=steps,
        seeds=seeds,
        betas=tuple(betas),
        kl_metric=kl_key,
        temperature=temperature,
        table=table,
        predictions=tuple(TestResult.from_json(p) for p in preds),
        primary=decided,
    )


def amended_primary(summary: Summary, results: Iterable[RunRow | Mapping], record: GridRecord) -> dict[str, Any]:
    """For a grid whose seed count was amended (:func:`klgrad.compare.design.amend_seeds`): the summary's fields
    ``amendments``, ``registered_seeds``, the ``primary`` decided on the registered seeds only (the registered
    test) and, as ``primary_all_seeds``, the same test on every seed (reported, not the verdict: it saw the seeds
    added after the registration), once an added seed has finished."""
    out: dict[str, Any] = {"amendments": record.amendments, "registered_seeds": record.registered_seeds}
    results = rows_of(results)
    claim = record.claim
    if claim is None or summary.primary is None:
        return out
    registered = [r for r in results if r.seed < record.registered_seeds]
    if len(registered) == len(results):  # no added seed has finished: the summary's primary is the registered test
        return out
    b, margin = record.betas[0], record.margin
    out["primary"] = TestResult.from_json(primary_result(registered, claim, b, summary.kl_metric, margin))
    every = primary_result(results, claim, b, summary.kl_metric, margin)
    every["family"] = "every seed, after the amendments (reported; the verdict is the registered seeds')"
    out["primary_all_seeds"] = TestResult.from_json(every)
    return out


def convergence_series(out_dir: Path, record: GridRecord, results: Sequence[RunRow]) -> dict[str, MethodRuns]:
    """Method → its finished runs' series of the criterion's metric and of ``lr``, with their seeds, at the first
    β, for the primary hypothesis' two methods (every method without one)."""
    crit = record.criterion
    b = record.betas[0]
    claim = record.claim
    data = {}
    for m in [claim.a, claim.b] if claim else list(record.methods):
        seeds = sorted(r.seed for r in results if r.method == m and r.beta == b)
        runs = [read_jsonl(out_dir / "runs" / run_name(m, b, s) / "metrics.jsonl") for s in seeds]
        data[m] = MethodRuns(
            [metric_series(rs, crit.metric) for rs in runs], [metric_series(rs, "lr") for rs in runs], seeds
        )
    return data


def grid_convergence(data: Mapping[str, MethodRuns], record: GridRecord) -> ConvergenceResult:
    """``summary.json``'s ``convergence``: the recorded criterion on :func:`convergence_series`'s runs (each
    method's record with its ``seeds``, the order of its ``deltas``); met when every method meets it.

    A grid whose seed count was amended decides the criterion once, at the amended count (``decided_at_seeds``):
    until every method has that many seeds ``met`` is None (not decided) and ``so_far`` holds the test on the
    seeds finished, ``{"met", "seeds"}``, an interim look that must not be read as the verdict (a criterion
    checked after every merge and declared met the first time it passes would be met by noise sooner or later).
    """
    crit = record.criterion
    by_method = {m: {**converged(d.series, d.lrs, crit), "seeds": d.seeds} for m, d in data.items()}
    met = bool(by_method) and all(v["met"] for v in by_method.values())
    decided_at = so_far = None
    if record.amendments:
        decided_at = record.allowed_seeds
        seeds = min((len(d.seeds) for d in data.values()), default=0)
        if seeds < decided_at:
            met, so_far = None, {"met": met, "seeds": seeds}
    return ConvergenceResult(crit.text(), met, record.steps, crit.as_dict(), by_method, decided_at, so_far)


LOGGED_BY = {"kl/stepwise": "train.log_stepwise_kl"}
"""Metrics a run logs only when a setting asks for it: the convergence criterion can be stated on them only then."""


def check_logged(convergence: ConvergenceCriterion | None, cfgs: Sequence) -> None:
    """Refuse (before anything is written) a convergence criterion on a metric the runs will not log."""
    setting = None if convergence is None else LOGGED_BY.get(convergence.metric)
    if setting is None:
        return
    section, field = setting.split(".")
    if not all(getattr(getattr(c, section), field) for c in cfgs):
        raise ValueError(
            f"--convergence-metric {convergence.metric} is logged only with {setting}: true; pass --{setting} true"
        )


def effective_betas(record: GridRecord, results: Sequence[RunRow]) -> dict[str, float]:
    """``{"method@β": β'}``: the ``kl.beta`` each (method, β) trained at, from its runs' final.json
    (``kl_beta``), else from grid.json's ``effective_betas`` (:mod:`klgrad.compare.beta_scale`)."""
    out = {f"{r['method']}@{r['beta']:g}": r["effective_beta"] for r in record.effective_betas or ()}
    for r in results:
        if r.final.get("kl_beta") is not None:
            out[f"{r.method}@{r.beta:g}"] = r.final["kl_beta"]
    return out
