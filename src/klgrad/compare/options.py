"""The typed records of ``klgrad compare``'s subcommands; each command's flags are generated from its record
(:mod:`klgrad.flags`), so an option has one name from the flag to the code (``--exact-prompts`` is
``GridDesign.exact_prompts`` is grid.json's ``exact_prompts``). Older spellings are hidden aliases
(``--kl-prompts``; CHANGELOG.md lists them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from klgrad.choices import Level
from klgrad.compare.beta_scale import BetaScale, parse_beta_scale
from klgrad.compare.claims import Claim, parse_claim
from klgrad.compare.convergence import ConvergenceCriterion
from klgrad.compare.design import EQUIVALENCE_MARGIN, METHODS
from klgrad.flags import option


def parse_seed_list(text: str) -> tuple[int, ...]:
    """``"4-7"`` → (4, 5, 6, 7); ``"0,2,5"`` → (0, 2, 5); ranges and single seeds may mix (``"0-2,5"``)."""
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"--only-seeds {text!r}: expected seeds like 4-7 or 0,2,5")
        out += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
    return tuple(sorted(set(out)))


def _measurement(spec: str):
    from klgrad.compare.measurements import parse_measurement

    return parse_measurement(spec)


def _hook(spec: str):
    from klgrad.compare.measurements import hook_measurement

    return hook_measurement(spec)


def _samples_of(name: str, key: str):
    """An older ``--NAME-samples K`` flag: the measurement ``name:key=K``, or nothing for 0 (off)."""

    def parse(text: str):
        return None if int(text) == 0 else _measurement(f"{name}:{key}={int(text)}")

    return parse


@dataclass(frozen=True)
class GridDesign:
    """What a grid states before any run, recorded in grid.json: a continuation must agree with it
    (:func:`klgrad.compare.design.settle_design`)."""

    config: str | None = option("configs/tiny_add.yaml", "base training config")
    methods: tuple[str, ...] = option(
        METHODS,
        "comma-separated methods: klgrad heads, package.module:name, or framework preset ids of `klgrad audit "
        "--framework` (trl/grpo-k3: that framework's KL term, its own level and form)",
    )
    seeds: int = option(5, "seeds per method (>= 2; runs of one seed are paired)")
    steps: int = option(60, "RL steps per run")
    betas: tuple[float, ...] = option((0.5,), "comma-separated KL weights (a sweep adds frontier points)")
    level: Level = option("token", "where the KL heads act (token: what GRPO/verl do, as in the paper's runs)")
    beta_scale: BetaScale | None = option(
        None,
        "same nominal KL strength for every method: a method whose KL aggregation divides by the response length (a "
        "token mean, e.g. trl/grpo-k3) trains at beta*L, L the reference's mean response length on the training "
        "prompts, measured once (or given: length=L) and recorded in grid.json with each method's effective beta "
        "(default off: every method at beta)",
        parse=parse_beta_scale,
        metavar="off|length|length=L",
    )
    exact_prompts: int = option(20, "held-out prompts of the final KL", aliases=("--kl-prompts",), metavar="N")
    estimate_samples: int = option(
        16, "policy samples per prompt of the final KL", aliases=("--kl-samples",), metavar="N"
    )
    margin: float = option(EQUIVALENCE_MARGIN, "equivalence margin of 'k1_as_loss ~ none', nats of final KL")
    primary: Claim | None = option(
        None,
        "the pre-registered primary hypothesis, 'A<B[:METRIC]' (mean A below B) or 'A~B[:METRIC]' (within "
        "--margin); METRIC kl (default) or a final metric. Written to grid.json and summary.json before any run and "
        "tested alone; the other predictions form a secondary Holm family",
        parse=parse_claim,
        metavar="CLAIM",
    )
    convergence: ConvergenceCriterion | None = option(None, nested=True, only=("metric", "gap", "lr_decay"))
    overrides: Mapping[str, Any] = option({}, flag=False)
    """Dotted config overrides applied to every run (``--rollout.prompts_per_step 4``), grid.json's ``overrides``."""


@dataclass(frozen=True)
class RunOptions:
    """``klgrad compare run`` (the default): run, resume or extend the grid in ``out``."""

    out: Path = option(Path("runs/compare"), "output folder")
    design: GridDesign = option(GridDesign(), nested=True, prefix="")
    measure: tuple = option(
        (),
        "a final measurement beyond the core ones, NAME[:KEY=VALUE,...] (kl_to_optimum:ref_samples=256, "
        "forgetting:samples=4, downstream) or NAME=package.module:function; repeatable",
        parse=_measurement,
        repeat=True,
        metavar="NAME",
        legacy={
            "--optimum-ref-samples": _samples_of("kl_to_optimum", "ref_samples"),
            "--forgetting-samples": _samples_of("forgetting", "samples"),
            "--final-hook": _hook,
        },
    )
    checkpoints: bool = option(
        True,
        "keep each run's checkpoints once its final numbers are written (--no-checkpoints: delete them, a real "
        "model's are GBs per run; a grid whose checkpoints are gone cannot be extended)",
    )
    only_seeds: tuple[int, ...] | None = option(
        None,
        "run only these of the grid's seeds, e.g. 4-7 or 0,2 (then `merge`)",
        parse=parse_seed_list,
        metavar="LIST",
    )
    only_methods: tuple[str, ...] | None = option(
        None, "train only these of --methods (the design stays all of them), then `merge`", metavar="LIST"
    )
    pin: str | None = option(
        None,
        "run the grid from a detached git worktree of REV (made under $KLGRAD_PIN_DIR, default "
        "~/.cache/klgrad/pins/COMMIT), re-executing this command there with its arguments as given",
        metavar="REV",
    )
    allow_dirty: bool = option(
        False, "with --pin, a pinned worktree with local changes; without, continue a grid recorded as pinned"
    )
    progress: bool = option(True, flag=False)

    @classmethod
    def of(cls, out: str | Path, **fields: Any) -> RunOptions:
        """The options from fields of :class:`GridDesign` and of this record by name, from Python:
        ``RunOptions.of("runs/g", seeds=2, methods=("k2_as_loss", "k3_as_loss"), primary="k2_as_loss<k3_as_loss")``
        (``primary`` and ``beta_scale`` may be given as their flags' text, sequences as lists)."""
        design = {f.name for f in dataclasses.fields(GridDesign)}
        unknown = sorted(set(fields) - design - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"RunOptions.of: unknown fields {unknown}")
        d = {k: v for k, v in fields.items() if k in design}
        if isinstance(d.get("primary"), str):
            d["primary"] = parse_claim(d["primary"])
        if isinstance(d.get("beta_scale"), str):
            d["beta_scale"] = parse_beta_scale(d["beta_scale"])
        for k in ("methods", "betas"):
            if k in d:
                d[k] = tuple(d[k])
        run = {k: (tuple(v) if isinstance(v, list) else v) for k, v in fields.items() if k not in design}
        return cls(out=Path(out), design=GridDesign(**d), **run)


@dataclass(frozen=True)
class MergeOptions:
    """``klgrad compare merge``: seeds of one grid run apart, into one grid; trains nothing."""

    inputs: tuple[Path, ...] = option(help="grid folders (same revision and design)", positional=True)
    out: Path = option(Path("runs/compare"), "the merged grid's folder (may hold the grid already)")
    only_seeds: tuple[int, ...] | None = option(
        None, "merge only these seeds, each whole", parse=parse_seed_list, metavar="LIST"
    )


@dataclass(frozen=True)
class AmendOptions:
    """``klgrad compare amend``: declare that a grid with a primary hypothesis runs more seeds; trains nothing."""

    seeds: int = option(help="the seed count the grid runs from now on", aliases=("--amend-seeds",), metavar="N")
    out: Path = option(Path("runs/compare"), "the grid's folder")
    reason: str = option("", "why the seed count changes (recorded in grid.json)", metavar="TEXT")


@dataclass(frozen=True)
class ReportOptions:
    """``klgrad compare report``: regenerate summaries and figures from the runs; trains and measures nothing."""

    dirs: tuple[Path, ...] = option(help="grid folders", positional=True)
    temperature: float | None = option(
        None, "the runs' rollout.temperature, for a summary written before it was recorded"
    )
    figures: bool = option(True, "redraw the figures as well")


@dataclass(frozen=True)
class MeasureOptions:
    """``klgrad compare measure``: take final measurements of a grid's finished runs afterwards."""

    grid: Path = option(help="the grid's folder", positional=True)
    measure: tuple = option(
        help="NAME[:KEY=VALUE,...] or NAME=package.module:function", positional=True, parse=_measurement
    )
    only_seeds: tuple[int, ...] | None = option(None, "only these seeds", parse=parse_seed_list, metavar="LIST")
    only_runs: tuple[str, ...] | None = option(None, "only these run folders (comma-separated)", metavar="LIST")
    device: Literal["auto", "cpu", "cuda"] | None = option(
        None, "where the models load (default: the CPU for short answers, else each run's model.device)"
    )
