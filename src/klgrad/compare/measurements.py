"""The named final measurements of a grid's runs: what each finished policy is measured by, one open registry.

A :class:`Measurement` is a function of a :class:`FinalContext` (the run's config and folder, its final policy
and reference loaded once and shared, the held-out prompts) returning the keys it adds to ``final.json``. Every run
gets the core measurements of its answers' length (:func:`core_measurements`): short answers
(``rollout.max_new_tokens`` ≤ 10) ``exact_kl``, ``forward_kl``, ``sampled_kl``; longer ones ``sampled_kl``,
``stepwise_kl``, ``forward_kl``. More are named on the command line, ``--measure NAME[:KEY=VALUE,...]``:

- ``kl_to_optimum:ref_samples=K`` (K ≥ 2): KL(π‖π*) to the optimum of J_β from samples, log Z from K reference
  samples per prompt (:func:`klgrad.exact.estimators.estimate_kl_to_optimum`; the exact value comes with
  ``exact_kl`` for short answers);
- ``forgetting:samples=N`` (N ≥ 2): both KLs to the reference on the shipped general chat prompts
  (:func:`klgrad.exact.estimators.forgetting_kl`, responses cut at 64 tokens);
- ``downstream``: ``klgrad eval`` of the final policy on its held-out prompts and a harder variant (one more
  digit per operand), greedy and ``samples`` (8) samples at the run's temperature, scored by its reward;
- a user's ``NAME=package.module:function``, called ``function(ctx, **options)``, or a :class:`Measurement`
  registered with :func:`register_measurement` (the built-ins are registered the same way; a name is taken once).

A built-in's keys are final.json's top-level keys (``exact_kl``, ``forgetting_reverse_kl``, ...); a user's dict is
stored under its name. Measured when the run finishes (``klgrad compare run``), they go into final.json before the
checkpoints may be deleted. Measured later (``klgrad compare measure DIR NAME ...``, :func:`measure_after`: a
finished run whose checkpoint is still there), they go into ``runs/RUN/NAME.json`` beside final.json with the
revision that measured them, and final.json is left as it is (a merge compares it; the new file is copied).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from klgrad.compare import measures
from klgrad.compare.context import FinalContext


@dataclass(frozen=True)
class Measurement:
    """A named final measurement: ``measure(ctx, **options) -> {key: value}``; ``options`` are its keyword
    defaults, set with ``NAME:KEY=VALUE`` (each value parsed as its default's type); ``nested``: store the result
    under ``name`` in final.json (a user's), else its keys at the top level (the built-ins')."""

    name: str
    measure: Callable[..., Mapping[str, Any]]
    doc: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)
    nested: bool = True

    def with_options(self, given: Mapping[str, str]) -> Measurement:
        """A copy with ``given`` options (strings as on the command line) over the defaults, each at least its
        :data:`MINIMA` (checked here, before any run)."""
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            raise ValueError(f"measurement {self.name}: unknown options {unknown}; it takes {sorted(self.options)}")
        options = {**self.options, **{k: _typed(self.options[k], v) for k, v in given.items()}}
        for k, least in MINIMA.get(self.name, {}).items():
            if not options[k] >= least:
                raise ValueError(f"measurement {self.name}: {k} must be >= {least}, got {options[k]}")
        return dataclasses.replace(self, options=options)

    def spec(self) -> str:
        """``NAME[:KEY=VALUE,...]``, how the command line names it."""
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        return self.name + (f":{opts}" if opts else "")

    def run(self, ctx: FinalContext) -> dict:
        out = dict(self.measure(ctx, **self.options))
        return {self.name: out} if self.nested else out


def _typed(default: Any, text: str) -> Any:
    if isinstance(default, bool):
        if text.lower() not in ("true", "false"):
            raise ValueError(f"expected true or false, got {text!r}")
        return text.lower() == "true"
    return type(default)(text) if default is not None else text


MINIMA = {"kl_to_optimum": {"ref_samples": 2}, "forgetting": {"samples": 2}, "downstream": {"samples": 1}}
"""The least value of a built-in's options: a spread needs two samples."""
MEASUREMENTS: dict[str, Measurement] = {}
"""Every measurement by name: the built-ins, and what :func:`register_measurement` added."""


def register_measurement(m: Measurement | Callable, name: str | None = None, doc: str = "") -> Measurement:
    """Register a measurement (or a function ``fn(ctx, **options)``, its keyword defaults the options) under its
    name; a name already taken is refused (ValueError)."""
    if not isinstance(m, Measurement):
        m = Measurement(name or m.__name__, m, doc or (m.__doc__ or "").strip(), _keyword_defaults(m))
    if m.name in MEASUREMENTS:
        raise ValueError(f"measurement {m.name!r} is registered already")
    MEASUREMENTS[m.name] = m
    return m


def _keyword_defaults(fn: Callable) -> dict[str, Any]:
    params = list(inspect.signature(fn).parameters.values())[1:]
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def parse_measurement(spec: str) -> Measurement:
    """``NAME[:KEY=VALUE,...]`` (a registered one) or ``NAME=package.module:function[:KEY=VALUE,...]`` (a user's,
    imported, never eval'd) -> :class:`Measurement`. Raises ValueError naming the spec."""
    from klgrad.import_path import import_object

    if "=" in spec and (":" not in spec or spec.index("=") < spec.index(":")):  # NAME=pkg.mod:fn[:k=v,...]
        name, _, target = spec.partition("=")
        options: dict[str, str] = {}
        if target.count(":") > 1:
            target, _, opts = target.rpartition(":")
            options = _options(spec, opts)
        obj = import_object(target, "--measure")
        base = obj if isinstance(obj, Measurement) else Measurement(name, obj, options=_keyword_defaults(obj))
        return dataclasses.replace(base, name=name).with_options(options)
    name, _, opts = spec.partition(":")  # NAME[:k=v,...]
    options = _options(spec, opts) if opts else {}
    if name not in MEASUREMENTS:
        raise ValueError(f"--measure {spec!r}: no measurement {name!r}; registered: {', '.join(MEASUREMENTS)}")
    return MEASUREMENTS[name].with_options(options)


def _options(spec: str, text: str) -> dict[str, str]:
    pairs = [p.partition("=") for p in text.split(",")]
    if any(not k or not eq for k, eq, _ in pairs):
        raise ValueError(f"--measure {spec!r}: options are KEY=VALUE separated by commas")
    return {k.strip(): v.strip() for k, _, v in pairs}


def hook_measurement(spec: str) -> Measurement:
    """``NAME=package.module:function`` of the older ``--final-hook``: ``function(cfg, run_dir) -> dict``, stored
    under NAME."""
    from klgrad.import_path import import_object

    name, eq, target = spec.partition("=")
    if not eq or not name:
        raise ValueError(f"--final-hook {spec!r}: expected NAME=MODULE:FUNCTION")
    hook = import_object(target, "--final-hook")
    return Measurement(name, lambda ctx: hook(ctx.cfg, ctx.run_dir), f"the hook {target}")


for _fn, _nested in (
    (measures.exact_kl, False),
    (measures.sampled_kl, False),
    (measures.stepwise_kl, False),
    (measures.forward_kl, False),
    (measures.kl_to_optimum, False),
    (measures.forgetting, False),
    (measures.downstream, True),
):
    register_measurement(
        Measurement(_fn.__name__, _fn, (_fn.__doc__ or "").split("\n\n")[0].strip(), _keyword_defaults(_fn), _nested)
    )


def core_measurements(short: bool) -> list[Measurement]:
    """What every run is measured by: enumerated for short answers, estimated along samples for longer ones (the
    order is final.json's)."""
    names = ("exact_kl", "forward_kl", "sampled_kl") if short else ("sampled_kl", "stepwise_kl", "forward_kl")
    return [MEASUREMENTS[n] for n in names]


def measure_run(
    cfg,
    run_dir: Path,
    prompts: int,
    samples: int,
    extra: Sequence[Measurement] = (),
    *,
    trained=None,
    device: str | None = None,
    pinned: str | None = None,
) -> dict:
    """The final numbers of one finished run: the core measurements, then ``extra`` in order, under
    ``torch.no_grad``. ``cfg`` is the run's config at the grid's nominal β (the β J_β is measured at), ``trained``
    the one it trained with (the same unless ``--beta-scale``): a user's measurement sees that one, ``ctx.cfg``."""
    import torch

    ctx = FinalContext(trained or cfg, run_dir, prompts, samples, objective_cfg=cfg, device=device, pinned=pinned)
    out: dict = {}
    with torch.no_grad():
        for m in [*core_measurements(ctx.short), *extra]:
            out.update(m.run(ctx))
    return out


@dataclass
class Measured:
    """What :func:`measure_after` did, run folder names by outcome."""

    measured: list[str] = field(default_factory=list)
    had_it: list[str] = field(default_factory=list)
    """Runs that have the measurement already (its file, or its keys in final.json)."""
    no_checkpoint: list[str] = field(default_factory=list)


def measure_after(
    out_dir: Path,
    record,
    extra: Sequence[Measurement],
    *,
    seeds: Sequence[int] | None = None,
    runs: Sequence[str] | None = None,
    device: str | None = None,
    progress: bool = True,
) -> Measured:
    """Measure ``extra`` on a grid's finished runs afterwards (module docstring): each into ``runs/RUN/NAME.json``
    with ``measured_by`` (the revision that measured), ``at`` and the ``checkpoint`` measured. Only ``seeds`` /
    ``runs`` (folder names) when given; a run that has the measurement is left alone (so it resumes), one whose
    checkpoints are gone is listed. The context is the run's own ``config.yaml`` at the grid's β, its final KL's
    prompts and samples; a pinned grid's commands run its pinned revision (:meth:`FinalContext.klgrad_source`)."""
    from tqdm.auto import tqdm

    from klgrad.compare.design import now, run_name, with_beta, write_json
    from klgrad.compare.provenance import source_revision
    from klgrad.config import load_config
    from klgrad.threads import cpu_threads
    from klgrad.trainer import latest_checkpoint

    done = Measured()
    todo = []
    for m, b, s in record.runs():
        run_dir = out_dir / "runs" / run_name(m, b, s)
        if not (run_dir / "final.json").is_file() or (seeds is not None and s not in seeds):
            continue
        if runs is not None and run_dir.name not in runs:
            continue
        final = json.loads((run_dir / "final.json").read_text())
        wanted = [x for x in extra if not (run_dir / f"{x.name}.json").is_file() and not _in_final(x, final)]
        if not wanted:
            done.had_it.append(run_dir.name)
        elif latest_checkpoint(run_dir) is None:
            done.no_checkpoint.append(run_dir.name)
        else:
            todo.append((run_dir, b, wanted))
    revision = source_revision().name
    pinned = record.revision.get("commit") if record.pinned else None
    for run_dir, beta, wanted in tqdm(todo, desc="klgrad compare measure", unit="run", disable=not progress):
        cfg = load_config(run_dir / "config.yaml")
        at_beta = cfg if record.beta_scale is None else with_beta(cfg, beta)
        ctx = FinalContext(
            cfg,
            run_dir,
            record.exact_prompts,
            record.estimate_samples,
            objective_cfg=at_beta,
            device=device,
            pinned=pinned,
        )
        checkpoint = str(latest_checkpoint(run_dir))
        with cpu_threads(cfg.train.threads):
            for x in wanted:
                import torch

                with torch.no_grad():
                    value = x.run(ctx)
                write_json(
                    run_dir / f"{x.name}.json",
                    {"measured_by": revision, "at": now(), "spec": x.spec(), "checkpoint": checkpoint, **value},
                )
        done.measured.append(run_dir.name)
    return done


def _in_final(m: Measurement, final: Mapping) -> bool:
    """Whether final.json holds the measurement already (a user's under its name; a built-in's keys, known by
    measuring them: :data:`FINAL_KEYS_OF`)."""
    keys = FINAL_KEYS_OF.get(m.name, (m.name,)) if not m.nested else (m.name,)
    return all(k in final for k in keys)


FINAL_KEYS_OF = {
    "kl_to_optimum": ("kl_to_optimum_sampled",),
    "forgetting": ("forgetting_reverse_kl",),
}
"""The final.json key that shows a built-in optional measurement was taken when its run finished."""
