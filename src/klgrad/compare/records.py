"""The typed records of a ``klgrad compare`` grid: its design (the flags of ``klgrad compare run``), its record
(``grid.json``) and its summary (``summary.json``), each with the JSON it is stored as.

Every reader of a grid gets these records, not the files' dicts; each ``from_json`` refuses a key it does not know
(a new key is added here first) and ``to_json`` writes the keys of today's files in today's order, so a summary
regenerated from the same runs is the same file byte for byte.

One migration: a ``summary.json`` written before grids had a ``grid.json`` (its runs' rows inside it, no folders
left) loads as a :class:`Summary` whose ``convergence``, ``revision``, ``registered_at`` and ``machines`` are None
and absent from its JSON, as in the file; ``klgrad compare report`` then re-renders it from those rows.

``grid.json``'s sub-records (``revision``, ``machine``, ``primary``, ``convergence``, ``beta_scale``, sessions,
amendments) stay the JSON they were written as, with typed views (:attr:`GridRecord.claim`,
:attr:`GridRecord.criterion`, :attr:`GridRecord.scale`): a continuation pinned to the grid's own older commit
reads the same file and compares those fields as JSON (:func:`klgrad.compare.design.settle_design`), so a default
this revision knows must not be written into a record an older one wrote.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from klgrad.compare.beta_scale import BetaScale
from klgrad.compare.claims import Claim
from klgrad.compare.convergence import ConvergenceCriterion

OBJECTIVE_KEYS = ("J", "J_star", "kl_to_optimum")
"""Final metrics read from a run's ``objective`` dict."""


def _json(value: Any) -> Any:
    """A record, tuple or mapping as plain JSON values (records by their ``to_json``)."""
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, tuple | list):
        return [_json(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _json(v) for k, v in value.items()}
    return value


def _fields_json(record: Any, order: tuple[str, ...] | None = None) -> dict:
    """A record's fields in ``order`` (default: declaration order) as JSON, leaving out the optional ones that
    are None (``metadata={"omit": True}``, absent from the file) and the ``extra`` mapping's keys appended."""
    names = order or tuple(f.name for f in dataclasses.fields(record))
    meta = {f.name: f.metadata for f in dataclasses.fields(record)}
    out = {}
    for name in names:
        if name == "extra":
            continue
        value = getattr(record, name)
        if value is None and meta[name].get("omit"):
            continue
        out[name] = _json(value)
    out.update(getattr(record, "extra", None) or {})
    return out


def _known(cls: type, data: Mapping, what: str) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{what}: unknown keys {unknown}; klgrad.compare.records.{cls.__name__} does not know them")


def omit(default: Any = None) -> Any:
    """An optional field absent from the JSON when None."""
    return field(default=default, metadata={"omit": True})


@dataclass(frozen=True)
class RunRow:
    """One finished run of a summary: its (method, β, seed) and its final.json, which has a key per final number
    (the core measurements', and a user measurement's under its name)."""

    method: str
    beta: float
    seed: int
    final: Mapping[str, Any]

    def value(self, key: str) -> Any:
        """A final metric: top level, or inside ``objective`` for :data:`OBJECTIVE_KEYS` (None if absent)."""
        if key in OBJECTIVE_KEYS:
            return (self.final.get("objective") or {}).get(key)
        return self.final.get(key)

    def to_json(self) -> dict:
        return {"method": self.method, "beta": self.beta, "seed": self.seed, **self.final}

    @classmethod
    def from_json(cls, data: Mapping) -> RunRow:
        rest = {k: v for k, v in data.items() if k not in ("method", "beta", "seed")}
        return cls(data["method"], data["beta"], data["seed"], rest)


@dataclass(frozen=True)
class MetricStat:
    """Mean over seeds and the half-width of its 95% t interval (NaN for one seed)."""

    mean: float
    ci95: float

    def to_json(self) -> dict:
        return {"mean": self.mean, "ci95": self.ci95}


@dataclass(frozen=True)
class Welch:
    """The unpaired Welch test beside a paired one: its own p at α, outside the Holm family (``adjusted`` False;
    None in summaries written before it was recorded)."""

    test: str
    p_value: float
    verdict: str
    adjusted: bool | None = omit()

    def to_json(self) -> dict:
        return _fields_json(self)


PRIMARY_ORDER = ("a", "b", "kind", "metric", "text", "claim", "family")
"""The keys a primary hypothesis' record starts with (its statement), before its test's."""


@dataclass(frozen=True)
class TestResult:
    """One decided claim (:func:`klgrad.compare.stats.decide` of a paired test): a secondary prediction, or the
    primary hypothesis, whose JSON starts with its statement (:data:`PRIMARY_ORDER`) and which, untested, holds
    only its statement and a verdict saying why. ``ci_tost``, ``ci_tost_level``, ``p_sign_flip_bracket``,
    ``sign_flip_method`` and ``adjustment`` are the keys of the exact sign-flip bracket and the 90% TOST of the
    statistics being written beside this (None, absent, in every record so far)."""

    __test__ = False  # not a pytest test class

    claim: str
    metric: str
    a: str
    b: str
    kind: str
    verdict: str
    test: str | None = omit()
    margin: float | None = omit()
    n_pairs: int | None = omit()
    differences: tuple[float, ...] | None = omit()
    mean_difference: float | None = omit()
    ci95: tuple[float, float] | None = omit()
    ci_tost: tuple[float, float] | None = omit()
    ci_tost_level: float | None = omit()
    p_value: float | None = omit()
    p_less: float | None = omit()
    p_greater: float | None = omit()
    p_difference: float | None = omit()
    p_sign_flip: float | None = omit()
    p_sign_flip_bracket: tuple[float, float] | None = omit()
    sign_flip_method: str | None = omit()
    n_negative: int | None = omit()
    welch: Welch | None = omit()
    p_adjusted: float | None = omit()
    p_difference_adjusted: float | None = omit()
    adjustment: str | None = omit()
    alpha: float | None = omit()
    text: str | None = omit()
    family: str | None = omit()

    @property
    def tested(self) -> bool:
        return self.p_adjusted is not None

    def to_json(self) -> dict:
        names = [f.name for f in dataclasses.fields(self) if f.name not in ("text", "family", "verdict")]
        if self.text is not None:  # a primary hypothesis: its statement first
            return _fields_json(self, (*PRIMARY_ORDER, *(n for n in names if n not in PRIMARY_ORDER), "verdict"))
        return _fields_json(self, (*names, "verdict", "family"))

    @classmethod
    def from_json(cls, data: Mapping) -> TestResult:
        _known(cls, data, "a decided claim")
        values = dict(data)
        if values.get("welch") is not None:
            values["welch"] = Welch(**values["welch"])
        for key in ("differences", "ci95", "ci_tost", "p_sign_flip_bracket"):
            if values.get(key) is not None:
                values[key] = tuple(values[key])
        return cls(**values)


@dataclass(frozen=True)
class ConvergenceResult:
    """``summary.json``'s ``convergence``: the stated criterion, whether every method checked met it (None: not
    decided yet, an amended grid before its decision's seed count) and each method's record
    (:func:`klgrad.compare.convergence.converged`, with its ``seeds``)."""

    criterion: str
    met: bool | None
    steps: int
    parameters: Mapping[str, Any]
    by_method: Mapping[str, Mapping[str, Any]] | None = omit()
    decided_at_seeds: int | None = omit()
    so_far: Mapping[str, Any] | None = omit()

    def to_json(self) -> dict:
        return _fields_json(
            self, ("criterion", "met", "steps", "parameters", "decided_at_seeds", "so_far", "by_method")
        )

    @classmethod
    def from_json(cls, data: Mapping) -> ConvergenceResult:
        _known(cls, data, "summary.json's convergence")
        return cls(**data)


@dataclass(frozen=True)
class Summary:
    """``summary.json`` of a grid with results: per (method, β) the mean ± 95% CI of every final metric
    (``table``, keyed ``method@β``), the decided predictions, the primary hypothesis decided alone, the
    convergence record, provenance and the runs' rows (written last)."""

    level: str
    steps: int
    seeds: int
    betas: tuple[float, ...]
    kl_metric: str
    temperature: float | None
    table: Mapping[str, Mapping[str, MetricStat]]
    predictions: tuple[TestResult, ...]
    primary: TestResult | None = omit()
    amendments: tuple[Mapping[str, Any], ...] | None = omit()
    registered_seeds: int | None = omit()
    primary_all_seeds: TestResult | None = omit()
    convergence: ConvergenceResult | None = omit()
    revision: str | None = omit()
    registered_at: str | None = omit()
    machines: tuple[str, ...] | None = omit()
    beta_scale: Mapping[str, Any] | None = omit()
    effective_betas: Mapping[str, float] | None = omit()
    runs: tuple[RunRow, ...] = ()

    ORDER = ("primary", "level", "steps", "seeds", "betas", "kl_metric", "temperature", "table",
             "predictions", "amendments", "registered_seeds", "primary_all_seeds", "convergence",
             "revision", "registered_at", "machines", "beta_scale", "effective_betas", "runs")  # fmt: skip

    def to_json(self) -> dict:
        return _fields_json(self, self.ORDER)

    @classmethod
    def from_json(cls, data: Mapping) -> Summary:
        _known(cls, data, "summary.json")
        v = dict(data)
        v["betas"] = tuple(v["betas"])
        v["table"] = {k: {m: MetricStat(**s) for m, s in row.items()} for k, row in v["table"].items()}
        v["predictions"] = tuple(TestResult.from_json(p) for p in v["predictions"])
        for key in ("primary", "primary_all_seeds"):
            if v.get(key) is not None:
                v[key] = TestResult.from_json(v[key])
        if v.get("convergence") is not None:
            v["convergence"] = ConvergenceResult.from_json(v["convergence"])
        for key in ("amendments", "machines"):
            if v.get(key) is not None:
                v[key] = tuple(v[key])
        v["runs"] = tuple(RunRow.from_json(r) for r in v.get("runs", ()))
        return cls(**v)


@dataclass(frozen=True)
class Registration:
    """The ``summary.json`` a grid starts with, before any result: what it will decide and by which criterion."""

    registered_at: str
    revision: str
    primary: Mapping[str, Any] | None
    convergence: Mapping[str, Any]
    status: str = "registered; no result yet"
    runs: tuple = ()
    amendments: tuple[Mapping[str, Any], ...] | None = omit()

    def to_json(self) -> dict:
        order = ("status", "registered_at", "revision", "primary", "convergence", "runs", "amendments")
        return _fields_json(self, order)

    @classmethod
    def from_json(cls, data: Mapping) -> Registration:
        _known(cls, data, "summary.json (a registration)")
        return cls(**{**data, "runs": tuple(data.get("runs", ()))})


def load_summary(path: Path) -> Summary | Registration:
    """A grid's summary.json: a :class:`Registration` before any result, else a :class:`Summary`."""
    data = json.loads(path.read_text())
    return Registration.from_json(data) if "status" in data else Summary.from_json(data)


@dataclass(frozen=True)
class GridRecord:
    """``grid.json``: a grid's design and provenance, written before any run (:mod:`klgrad.compare.design` for
    the rules a continuation and a merge follow). Keys absent from a file (``beta_scale``, ``amendments``,
    ``merged_from``, ``effective_betas``) are None or empty here and stay absent when it is written back."""

    revision: Mapping[str, Any]
    pinned: bool
    created: str
    config: str | None
    resolved_config: Mapping[str, Any]
    methods: tuple[str, ...]
    seeds: int
    betas: tuple[float, ...]
    level: str
    steps: int
    overrides: Mapping[str, Any]
    margin: float
    exact_prompts: int
    estimate_samples: int
    primary: Mapping[str, Any] | None
    convergence: Mapping[str, Any] | None
    cadence_steps: int | None = omit()
    """The steps of the grid's first session, which set its evaluation and checkpoint periods."""
    beta_scale: Mapping[str, Any] | None = omit()
    machine: Mapping[str, Any] | None = omit()
    amendments: tuple[Mapping[str, Any], ...] | None = omit()
    sessions: tuple[Mapping[str, Any], ...] = ()
    merged_from: tuple[Mapping[str, Any], ...] | None = omit()
    effective_betas: tuple[Mapping[str, Any], ...] | None = omit()
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Keys of a grid.json written by another klgrad that this one does not know: kept as they are."""

    @property
    def claim(self) -> Claim | None:
        p = self.primary
        return None if p is None else Claim(p["a"], p["b"], p["kind"], p["metric"])

    @property
    def criterion(self) -> ConvergenceCriterion:
        """The convergence criterion (the default one for a record without it)."""
        return ConvergenceCriterion(**(self.convergence or {}))

    @property
    def scale(self) -> BetaScale | None:
        return None if self.beta_scale is None else BetaScale(**self.beta_scale)

    @property
    def temperature(self) -> float:
        """The runs' one sampling temperature, every KL of the summary is taken at."""
        return self.resolved_config["rollout"]["temperature"]

    @property
    def revision_name(self) -> str:
        return self.revision["revision"]

    @property
    def registered_seeds(self) -> int:
        """The seed count registered: ``seeds`` before the first amendment (the primary is decided on those)."""
        return self.amendments[0]["seeds_from"] if self.amendments else self.seeds

    @property
    def allowed_seeds(self) -> int:
        """The most seeds the grid may have: its last amendment's ``seeds_to``, else ``seeds``."""
        return self.amendments[-1]["seeds_to"] if self.amendments else self.seeds

    def runs(self) -> list[tuple[str, float, int]]:
        """Every (method, β, seed) of the design, in the grid's order."""
        return [(m, b, s) for b in self.betas for m in self.methods for s in range(self.seeds)]

    ORDER = ("revision", "pinned", "created", "config", "resolved_config", "methods", "seeds", "betas",
             "level", "steps", "cadence_steps", "overrides", "margin", "exact_prompts", "estimate_samples",
             "primary", "convergence", "beta_scale", "machine", "amendments", "sessions", "merged_from",
             "effective_betas")  # fmt: skip

    def to_json(self) -> dict:
        return _fields_json(self, self.ORDER)

    @classmethod
    def from_json(cls, data: Mapping) -> GridRecord:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        v = {k: data[k] for k in data if k in names}
        for key in ("methods", "betas", "sessions", "amendments", "merged_from", "effective_betas"):
            if v.get(key) is not None:
                v[key] = tuple(v[key])
        return cls(**v, extra={k: data[k] for k in data if k not in names})

    def replace(self, **changes: Any) -> GridRecord:
        return dataclasses.replace(self, **changes)
