"""A grid's design: the methods it compares and the config overrides that make each (:func:`method_overrides`),
its runs' folders (:func:`run_name`), and ``OUT/grid.json``, its design and provenance, written before any run and
checked on every continuation (the record's fields: :class:`klgrad.compare.records.GridRecord`).

It records the revision of the klgrad code that runs (:func:`klgrad.compare.provenance.source_revision`) and
whether it runs pinned, the machine, the base config (its path, and the resolved fields every run shares), the
methods, seeds, betas, level, dotted overrides, the β scale and each method's effective β (``--beta-scale``),
the equivalence margin, the final-KL sizes, the primary hypothesis and the convergence criterion, and one
``sessions`` entry per invocation (time, machine, revision, steps, seeds).

A continuation (the same ``--out`` again, a larger ``--steps``, more seeds or methods) must agree with it
(:func:`settle_design`): the same code (the same package content, else the same revision name;
:func:`klgrad.compare.provenance.same_code`; else :class:`GridMismatchError` naming both; a grid recorded as
pinned also refuses a dirty tree unless allowed), the same config, level,
betas, overrides, margin, final-KL sizes, primary hypothesis and convergence criterion; ``steps`` may only grow
(every run is then extended), seeds and methods may be added. A primary hypothesis or criterion not given is taken
from the record; a primary hypothesis cannot be added once a run exists (it would not be pre-registered). Before
any run exists only the revision is checked.

A grid with a primary hypothesis and runs takes more seeds than it was registered with only after an amendment
(:func:`amend_seeds`, ``klgrad compare amend --out DIR --seeds N --reason TEXT``), recorded in ``amendments`` with
its time, the seeds that had started and why, and declared before any seed past the registered count has run: the
primary hypothesis stays decided on the registered seeds (:func:`registered_seeds`), so adding seeds cannot be a
second look at it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from klgrad.compare.provenance import same_code

if TYPE_CHECKING:
    from klgrad.config import Config

METHODS: tuple[str, ...] = ("none", "k1_as_loss", "k2_as_loss", "k3_as_loss", "k1_in_reward")
"""The paper's four heads (decoupled form at the grid's level) and ``k1_in_reward`` (combined form)."""
EQUIVALENCE_MARGIN = 0.1
"""δ of "k1_as_loss ≈ none" in nats of final KL(π‖π_ref), stated before any run (``--margin``). A margin taken from
the same runs, such as ½·|KL_none − KL_k2|, would judge runs by a margin they set: on the discovery task it comes
to ±1 nat, as wide as the effect regularisation has there."""
GRID_FILE = "grid.json"
FIXED_FIELDS = (
    "config",
    "resolved_config",
    "level",
    "betas",
    "overrides",
    "margin",
    "exact_prompts",
    "estimate_samples",
    "primary",
    "convergence",
    "beta_scale",
)
"""Design fields a continuation must leave as they are (``beta_scale``: absent unless ``--beta-scale``)."""
INHERITED_FIELDS = ("primary", "convergence")
"""Fields a continuation may omit (None): they are then the record's."""
STEP_FIELDS = ("steps", "eval_every", "save_every", "out_dir", "seed", "keep_checkpoints")
"""``train.*`` fields left out of ``resolved_config``: set per run or from ``--steps``."""


class GridMismatchError(ValueError):
    """A continuation or merge that does not agree with a grid's record (exit 2 on the command line)."""


def method_overrides(method: str, level: str, beta: float) -> dict:
    """Config overrides that make one method of the comparison: a klgrad head at ``level``, a user's
    ``package.module:name``, or a framework preset id (``trl/grpo-k3``), which brings its own ``kl.level``,
    ``kl.form`` and ``kl.aggregation`` (:func:`klgrad.audit.framework_head.preset_settings`; ``level`` does not
    apply). ``k1_in_reward`` at level ``token`` uses ``token_to_go``, the per-token return form (a combined
    coefficient must be a return)."""
    from klgrad.choices import is_preset_id

    if is_preset_id(method):  # an unknown id: a ValueError with the close matches
        from klgrad.audit.framework_head import find_preset, preset_settings

        settings = preset_settings(find_preset(method))
        return {"kl.head": method, "kl.beta": beta, **{f"kl.{k}": v for k, v in settings.items()}}
    if method == "none":
        return {"kl.head": "none", "kl.beta": beta, "kl.form": "decoupled", "kl.level": level}
    if method == "k1_in_reward":
        return {
            "kl.head": "k1_in_reward",
            "kl.beta": beta,
            "kl.form": "combined",
            "kl.level": "token_to_go" if level == "token" else level,
        }
    if method in ("k1_as_loss", "k2_as_loss", "k3_as_loss"):
        return {"kl.head": method, "kl.beta": beta, "kl.form": "decoupled", "kl.level": level}
    if ":" in method:  # a user's head, package.module:name: in the reward when its style says so, else a loss
        from klgrad.kl import get_kl_head

        if get_kl_head(method).style == "in_reward":
            return {**method_overrides("k1_in_reward", level, beta), "kl.head": method}
        return {"kl.head": method, "kl.beta": beta, "kl.form": "decoupled", "kl.level": level}
    raise ValueError(
        f"unknown method {method!r}; choose from {METHODS}, a head's 'package.module:name' or a framework preset id"
    )


def with_beta(cfg: Config, beta: float) -> Config:
    """``cfg`` with ``kl.beta`` = ``beta`` (a run of a ``--beta-scale`` grid measured at the grid's nominal β)."""
    return dataclasses.replace(cfg, kl=dataclasses.replace(cfg.kl, beta=beta))


def run_name(method: str, beta: float, seed: int) -> str:
    """The run's folder under ``runs/``: a preset id's ``/`` becomes ``+`` (one folder per run)."""
    return f"{method.replace('/', '+')}-beta{beta:g}-seed{seed}"


def now() -> str:
    """UTC time, ISO 8601 to the second."""
    return datetime.now(UTC).replace(microsecond=0).isoformat()


def shared_config(resolved: dict) -> dict:
    """The resolved config without the ``train`` fields that depend on the run or on ``--steps``
    (:data:`STEP_FIELDS`)."""
    out = {k: v for k, v in resolved.items() if k != "train"}
    out["train"] = {k: v for k, v in resolved.get("train", {}).items() if k not in STEP_FIELDS}
    return out


def read_grid(out_dir: Path) -> dict | None:
    """The grid's record, or None when ``out_dir`` holds none."""
    path = out_dir / GRID_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` as JSON atomically (a temporary file, then rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def revision_hint(recorded: dict) -> str:
    """How to continue a grid recorded at ``recorded`` (grid.json's ``revision``)."""
    if recorded.get("commit") and not recorded.get("dirty"):
        return f"continue it with `klgrad compare --pin {recorded['commit']} ...` (same flags)"
    return "its code was a dirty tree, which cannot be recreated: start a new grid (another --out)"


def check_revision(old: dict, new: dict, what: str) -> None:
    """Raise :class:`GridMismatchError` unless the two records run the same code
    (:func:`~klgrad.compare.provenance.same_code`: the same revision, or the same package content)."""
    a, b = old["revision"]["revision"], new["revision"]["revision"]
    if not same_code(old["revision"], new["revision"]):
        raise GridMismatchError(
            f"{what} was run at revision {a}; this klgrad ({new['revision']['source']}) is {b}. Runs of one grid "
            f"must share one revision: {revision_hint(old['revision'])}"
        )


def registered_seeds(record: dict) -> int:
    """The seed count a grid was registered with: ``seeds`` before its first amendment (the primary hypothesis is
    decided on seeds ``0 .. registered_seeds - 1``)."""
    amendments = record.get("amendments") or []
    return amendments[0]["seeds_from"] if amendments else record["seeds"]


def allowed_seeds(record: dict) -> int:
    """The most seeds a grid may have: its last amendment's ``seeds_to``, else its recorded ``seeds``."""
    amendments = record.get("amendments") or []
    return amendments[-1]["seeds_to"] if amendments else record["seeds"]


def amend_seeds(record: dict, seeds: int, reason: str, started: list[int], revision: str, at: str) -> dict:
    """``record`` with the amendment "the grid runs ``seeds`` seeds" appended to its ``amendments`` (``at``: when;
    ``revision``: the klgrad that declared it; ``started``: the seeds with a run in the grid folder now).

    Refused (:class:`GridMismatchError`) for a grid without a primary hypothesis (it adds seeds with ``--seeds``),
    without a reason, with no more seeds than it may already have, or once a seed past that count has started:
    the amendment is declared before the seeds it adds."""
    if record.get("primary") is None:
        raise GridMismatchError("the grid has no primary hypothesis: add seeds with --seeds, no amendment is needed")
    if not reason.strip():
        raise GridMismatchError("--reason: an amendment states why the seed count changes")
    now_allowed = allowed_seeds(record)
    if seeds <= now_allowed:
        raise GridMismatchError(f"amend --seeds {seeds}: the grid already has {now_allowed} seeds")
    late = sorted(s for s in started if s >= now_allowed)
    if late:
        raise GridMismatchError(
            f"seeds {late} (past the {now_allowed} the grid may have) have run already: an amendment adding seeds "
            "must be declared before they run"
        )
    entry = {
        "at": at,
        "revision": revision,
        "seeds_from": now_allowed,
        "seeds_to": seeds,
        "seeds_started": sorted(started),
        "reason": reason.strip(),
    }
    return {**record, "seeds": seeds, "amendments": [*(record.get("amendments") or []), entry]}


def check_seed_count(record: dict, seeds: int, has_runs: bool, where: str) -> None:
    """Refuse ``seeds`` past what a grid with a primary hypothesis and runs may have (:func:`allowed_seeds`)."""
    if has_runs and record.get("primary") is not None and seeds > allowed_seeds(record):
        raise GridMismatchError(
            f"{where} was registered with {allowed_seeds(record)} seeds and a primary hypothesis; {seeds} seeds "
            f"need an amendment declared first: klgrad compare amend --out {where} --seeds {seeds} --reason TEXT"
        )


def settle_design(
    old: dict | None, new: dict, has_runs: bool, where: str = "the grid", allow_dirty: bool = False
) -> dict:
    """The record to write for a continuation of ``old`` by ``new`` (module docstring for the rules); raises
    :class:`GridMismatchError` naming the field and both values. A grid recorded as pinned refuses a dirty tree
    (even one whose package files are the commit's) unless ``allow_dirty``."""
    if (old is None or old.get("primary") is None) and new.get("primary") is not None and has_runs:
        raise GridMismatchError(
            f"{where} has runs already: a primary hypothesis stated now would not be pre-registered; "
            "start a new grid (another --out) to state one"
        )
    if old is None:
        return {**new, "sessions": [new["session"]]}
    check_revision(old, new, where)
    if old.get("pinned") and new["revision"].get("dirty") and not allow_dirty:
        raise GridMismatchError(
            f"{where} is a pinned grid and this klgrad ({new['revision']['source']}) is a dirty tree "
            f"({new['revision']['revision']}): {revision_hint(old['revision'])}, or pass --allow-dirty"
        )
    new = dict(new)
    for k in INHERITED_FIELDS:
        if new.get(k) is None and old.get(k) is not None:
            new[k] = old[k]
    for k in FIXED_FIELDS if has_runs else ():  # before any run the design may still change
        if old.get(k) != new.get(k):
            raise GridMismatchError(f"{where} records {k} = {old.get(k)!r}; this invocation has {new.get(k)!r}")
    check_seed_count(old, new["seeds"], has_runs, where)
    if new["steps"] < old["steps"]:
        raise GridMismatchError(
            f"{where} records {old['steps']} steps; --steps {new['steps']} would shorten it (only extension is allowed)"
        )
    methods = list(old["methods"]) + [m for m in new["methods"] if m not in old["methods"]]
    return {
        **new,
        "revision": old["revision"],  # the grid's; each session's own is in "sessions"
        "methods": methods,
        "seeds": max(old["seeds"], new["seeds"]),
        **({"amendments": old["amendments"]} if old.get("amendments") else {}),
        "created": old.get("created", new["created"]),
        "sessions": [*old.get("sessions", []), new["session"]],
    }
