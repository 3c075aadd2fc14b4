"""``klgrad compare`` and ``klgrad regime`` on the command line: each subcommand's flags generated from its typed
record (:mod:`klgrad.compare.options`, :mod:`klgrad.flags`) and its handler beside them.

    klgrad compare [run] --out DIR ...           run, resume or extend a grid (the default subcommand)
    klgrad compare merge DIR ... --out OUT       seeds of one grid run apart, into one grid
    klgrad compare amend --out DIR --seeds N --reason TEXT
    klgrad compare report DIR ...                regenerate summaries and figures from the runs
    klgrad compare measure DIR NAME ...          final measurements of finished runs, afterwards
    klgrad compare mean-length --config C ...    L̄ as --beta-scale length measures it

The older mode flags still work: ``klgrad compare --merge DIR ... --out OUT`` is ``merge``, ``klgrad compare --out
DIR --amend-seeds N --reason TEXT`` is ``amend`` (:func:`compare_words`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from klgrad.compare.options import AmendOptions, MeasureOptions, MergeOptions, ReportOptions, RunOptions
from klgrad.flags import add_flags, parse_record

SUBCOMMANDS = ("run", "merge", "amend", "report", "measure", "mean-length")
GRID_KEYS = ("kl.head", "kl.beta", "kl.form", "kl.level", "train.seed", "train.out_dir", "train.steps")
"""Config fields ``klgrad compare run`` sets per run; set them with its own flags, not as overrides."""


def _fail(message: str) -> int:
    print(f"klgrad compare: {message}", file=sys.stderr)
    return 2


def compare_words(argv: list[str]) -> list[str]:
    """``argv`` (the whole command line) with the subcommand ``klgrad compare`` implies made explicit: ``run``
    unless a subcommand or ``--help`` is given, ``merge`` for the older ``--merge DIR ...`` (the flag dropped:
    its folders are merge's), ``amend`` for the older ``--amend-seeds N``."""
    if "compare" not in argv:
        return argv
    i = argv.index("compare") + 1
    head, rest = argv[:i], argv[i:]
    if rest and (rest[0] in SUBCOMMANDS or rest[0] in ("-h", "--help")):
        return argv
    if "--merge" in rest:
        return [*head, "merge", *(a for a in rest if a != "--merge")]
    if any(a == "--amend-seeds" or a.startswith("--amend-seeds=") for a in rest):
        return [*head, "amend", *rest]
    return [*head, "run", *rest]


def add_compare_parser(sub: argparse._SubParsersAction, func) -> None:
    """``klgrad compare``: the paper's KL comparison as a grid of training runs (:mod:`klgrad.compare.grid`);
    ``func`` is the command's handler (:func:`run_command` dispatches to the subcommand's)."""
    c = sub.add_parser(
        "compare",
        help="the paper's KL comparison: none, k1/k2/k3 as loss, k1 in reward; x seeds; with statistics",
        description="A grid of training runs (method x beta x seed, everything else equal) with paired statistics. "
        "`klgrad compare --out DIR ...` is `klgrad compare run --out DIR ...`.",
    )
    c.set_defaults(func=func, takes_overrides=True, default_subcommand="run")
    cs = c.add_subparsers(dest="compare_command", metavar="SUBCOMMAND")
    r = cs.add_parser(
        "run",
        help="run, resume or extend a grid (the default)",
        description="Train every method for every seed (and beta) with everything else equal; write the "
        "paper-style figure, a reward-KL frontier, and summary.json/.md with mean ± 95% CI and a verdict for each of "
        "the paper's predictions from a named test. Finished runs are skipped, interrupted ones resumed, a larger "
        "--steps extends them. OUT/grid.json records the code revision and the design before any run; continuing a "
        "grid at another revision or with another design exits 2. Other config fields are dotted flags applied to "
        "every run (--rollout.prompts_per_step 4); --train.stop_when 'METRIC OP VALUE' stops a run early.",
    )
    add_flags(r, RunOptions)
    r.set_defaults(compare_func=cmd_run)
    m = cs.add_parser("merge", help="merge grid folders of one design (e.g. disjoint --only-seeds); trains nothing")
    add_flags(m, MergeOptions)
    m.set_defaults(compare_func=cmd_merge)
    a = cs.add_parser(
        "amend",
        help="declare that a grid with a primary hypothesis runs N seeds; trains nothing",
        description="Before any seed past the registered count runs: recorded in grid.json with --reason; the "
        "primary hypothesis stays decided on the registered seeds.",
    )
    add_flags(a, AmendOptions)
    a.set_defaults(compare_func=cmd_amend)
    p = cs.add_parser("report", help="regenerate summary.json, summary.md and the figures from the runs")
    add_flags(p, ReportOptions)
    p.set_defaults(compare_func=cmd_report)
    x = cs.add_parser(
        "measure",
        help="take final measurements of a grid's finished runs afterwards (runs/RUN/NAME.json)",
        description="Each named measurement of each finished run whose checkpoint is left, into runs/RUN/NAME.json "
        "beside final.json (which is left as it is); runs that have it are skipped, so it resumes. Built-ins: "
        "exact_kl, sampled_kl, stepwise_kl, forward_kl, kl_to_optimum[:ref_samples=K], forgetting[:samples=N], "
        "downstream[:samples=K]; or NAME=package.module:function.",
    )
    add_flags(x, MeasureOptions)
    x.set_defaults(compare_func=cmd_measure)
    n = cs.add_parser(
        "mean-length",
        help="print the reference's mean response length L̄ of a config, as --beta-scale length measures it",
        description="For --beta-scale length=L on seeds run apart. Config fields are dotted flags.",
    )
    n.add_argument("--config", required=True, help="the grid's base training config")
    n.set_defaults(compare_func=cmd_mean_length)


def run_command(args: argparse.Namespace, overrides: list[str]) -> int:
    """``klgrad compare SUBCOMMAND``: the subcommand's handler; only ``run`` and ``mean-length`` take dotted
    config overrides."""
    func = getattr(args, "compare_func", None)
    if func is None:  # `klgrad compare` parsed without a subcommand (not from the command line)
        func = cmd_run
    if func not in (cmd_run, cmd_mean_length) and overrides:
        # they train nothing, so a token here is a mistake, most often a spaced seed list (--only-seeds 46 48)
        # whose tail would otherwise be dropped without a word
        return _fail(
            f"unrecognized arguments {' '.join(overrides)} ({args.compare_command} takes no config overrides; a "
            "seed list is one argument: --only-seeds 46,48,49 or 4-7)"
        )
    if func in (cmd_run, cmd_mean_length):
        return func(args, overrides)
    return func(args)


def _console():
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=150)


def cmd_run(args: argparse.Namespace, overrides: list[str]) -> int:
    from klgrad.choices import is_preset_id
    from klgrad.compare.design import METHODS
    from klgrad.config import ConfigError, parse_override_args
    from klgrad.runlock import RunLockedError

    options: RunOptions = parse_record(RunOptions, args)
    if options.pin:
        return exec_pinned(args, options)
    d = options.design
    bad = [m for m in d.methods if m not in METHODS and ":" not in m and not is_preset_id(m)]
    if bad:
        return _fail(
            f"unknown methods {bad}; choose from {list(METHODS)}, a head's package.module:name or a "
            "framework preset id (klgrad audit --framework all)"
        )
    if d.seeds < 2 or d.steps < 1 or d.exact_prompts < 1 or d.estimate_samples < 2 or not d.margin > 0:
        return _fail("--seeds must be >= 2, --steps >= 1, --exact-prompts >= 1, --estimate-samples >= 2, --margin > 0")
    try:
        extra = parse_override_args(overrides)
    except ConfigError as e:
        return _fail(str(e))
    fixed = sorted(set(extra) & set(GRID_KEYS))
    if fixed:
        return _fail(f"{fixed} are set by the grid per run (use --betas, --level, --seeds, --steps, --out)")
    import dataclasses

    from klgrad.compare.grid import run_compare
    from klgrad.compare.render import summary_markdown

    options = dataclasses.replace(options, design=dataclasses.replace(d, overrides=extra))
    try:
        summary = run_compare(options)
    except (ValueError, RunLockedError) as e:
        return _fail(str(e))
    _console().print(summary_markdown(summary))
    print(f"wrote {options.out}/grid.json, comparison.png, frontier.png, summary.json, summary.md, runs/")
    return 0


def exec_pinned(args: argparse.Namespace, options: RunOptions, execve=None) -> int:
    """``--pin REV``: make (or reuse) the pinned worktree and re-execute this compare command from it with its
    arguments as given (:func:`klgrad.compare.provenance.pinned_command`: the pinned revision reads them, so a
    revision before these subcommands needs the flags it knew). Returns 2 with a message when REV cannot be
    pinned."""
    import os

    from klgrad.compare import provenance as pv

    try:
        commit, worktree = pv.pin_worktree(options.pin, pv.package_source(), pv.pin_root(), options.allow_dirty)
    except (ValueError, OSError) as e:
        return _fail(str(e))
    given = args.argv[args.argv.index("compare") + 1 :] if "compare" in args.argv else list(args.argv)
    argv, env = pv.pinned_command(worktree, commit, given, dict(os.environ))
    print(f"klgrad compare: pinned to {commit} ({worktree})", file=sys.stderr, flush=True)
    (execve or os.execve)(argv[0], argv, env)
    return 0  # reached only when execve is replaced (tests)


def cmd_amend(args: argparse.Namespace) -> int:
    """``klgrad compare amend --out DIR --seeds N --reason TEXT`` (:func:`klgrad.compare.grid.amend_grid`)."""
    from klgrad.compare.grid import amend_grid
    from klgrad.runlock import RunLockedError

    options: AmendOptions = parse_record(AmendOptions, args)
    try:
        record = amend_grid(options.out, options.seeds, options.reason)
    except (ValueError, RunLockedError) as e:
        return _fail(str(e))
    a = record.amendments[-1]
    started = a["seeds_started"]
    print(f"amended {options.out}/grid.json: seeds {a['seeds_from']} -> {a['seeds_to']} (seeds started: {started})")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    """``klgrad compare merge DIR ... --out OUT`` (:func:`klgrad.compare.merge.merge_grids`)."""
    from klgrad.compare.merge import merge_grids
    from klgrad.compare.render import summary_markdown
    from klgrad.runlock import RunLockedError

    options: MergeOptions = parse_record(MergeOptions, args)
    seeds = None if options.only_seeds is None else list(options.only_seeds)
    try:
        merged = merge_grids(list(options.inputs), options.out, seeds)
    except (ValueError, RunLockedError) as e:
        return _fail(str(e))
    _console().print(summary_markdown(merged.summary))
    for run in merged.skipped:
        print(f"klgrad compare: left out {run} (not finished)", file=sys.stderr)
    print(f"wrote {options.out}/grid.json, summary.json, summary.md, runs/ (merged)")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """``klgrad compare report DIR ...`` (:func:`klgrad.compare.report.report`)."""
    from klgrad.compare.report import report

    options: ReportOptions = parse_record(ReportOptions, args)
    for d in options.dirs:
        try:
            report(d, options.temperature, options.figures)
        except (ValueError, OSError) as e:
            return _fail(f"{d}: {e}")
        print(f"wrote {d / 'summary.json'}, {d / 'summary.md'}" + (" and the figures" if options.figures else ""))
    return 0


def cmd_measure(args: argparse.Namespace) -> int:
    """``klgrad compare measure DIR NAME ...`` (:func:`klgrad.compare.measurements.measure_after`)."""
    import json

    from klgrad.compare.measurements import measure_after
    from klgrad.compare.records import GridRecord

    options: MeasureOptions = parse_record(MeasureOptions, args)
    path = options.grid / "grid.json"
    if not path.is_file():
        return _fail(f"{options.grid} holds no grid.json: not a klgrad compare grid")
    record = GridRecord.from_json(json.loads(path.read_text()))
    try:
        done = measure_after(
            options.grid,
            record,
            options.measure,
            seeds=options.only_seeds,
            runs=options.only_runs,
            device=options.device,
        )
    except (ValueError, OSError) as e:
        return _fail(str(e))
    for run in done.no_checkpoint:
        print(f"{run}: no valid checkpoint left, skipped", file=sys.stderr)
    names = ", ".join(m.name for m in options.measure)
    print(
        f"{len(done.measured)} measured ({names}), {len(done.had_it)} had it, {len(done.no_checkpoint)} without "
        f"checkpoints, in {options.grid}"
    )
    return 0


def cmd_mean_length(args: argparse.Namespace, overrides: list[str]) -> int:
    """``klgrad compare mean-length --config C [--dotted.key V ...]``: L̄ of the config (with the overrides) as
    :func:`klgrad.compare.beta_scale.mean_response_length` measures it."""
    from klgrad.compare.beta_scale import mean_response_length
    from klgrad.config import ConfigError, load_config, parse_override_args

    try:
        cfg = load_config(args.config, parse_override_args(overrides))
    except ConfigError as e:
        return _fail(str(e))
    print(f"{mean_response_length(cfg):.6g}")
    return 0


def add_regime_parser(sub: argparse._SubParsersAction, func) -> None:
    """``klgrad regime``: which regime a config's prompts are in (:mod:`klgrad.compare.regime`)."""
    r = sub.add_parser(
        "regime",
        help="predict from the reference's own samples whether k2 or k3 holds the policy closer (sharpen/discover)",
        description="Sample the config's reference K times on its first training (or --split heldout) "
        "prompts, group each prompt's samples by reward value and compute exactly the sequence-level fixed "
        "points of the reverse-KL heads (k1_in_reward, k2_as_loss: pi* ~ pi_ref e^(R/beta)) and of k3 (the "
        "forward-KL optimum), their KL to the reference per prompt and over the set with bootstrap intervals. "
        "Writes regime.json and regime.png. Config fields are dotted flags (--model.path M --data.task file "
        "--data.path D).",
    )
    r.add_argument("--config", default=None, help="YAML config (e.g. configs/smollm2_sharpen.yaml); defaults otherwise")
    r.add_argument("--out", default="runs/regime", help="output folder (default runs/regime)")
    r.add_argument("--beta", type=float, default=None, help="KL weight of the fixed points (default: kl.beta)")
    r.add_argument("--samples", type=int, default=32, help="K: reference samples per prompt (default 32)")
    r.add_argument("--prompts", type=int, default=64, help="prompts sampled, the split's first (default 64)")
    r.add_argument(
        "--split",
        choices=("train", "heldout"),
        default="train",
        help="the training prompts (default) or the held-out ones klgrad compare measures its final KL on",
    )
    r.add_argument("--seed", type=int, default=0, help="sampling and bootstrap seed")
    r.set_defaults(func=func, takes_overrides=True)


def cmd_regime(args: argparse.Namespace, overrides: list[str]) -> int:
    from klgrad.compare.regime import run_regime
    from klgrad.config import load_config, parse_override_args
    from klgrad.runlock import RunLockedError, run_lock

    try:
        cfg = load_config(args.config, parse_override_args(overrides))
        out = Path(args.out)
        with run_lock(out):
            result = run_regime(
                cfg, out, beta=args.beta, samples=args.samples, prompts=args.prompts, seed=args.seed, split=args.split
            )
    except (ValueError, OSError, RunLockedError) as e:
        print(f"klgrad regime: {e}", file=sys.stderr)
        return 2
    kl, fkl, ci = result["predicted_kl"], result["predicted_forward_kl"], result["interval_95"]
    print(
        f"{result['n_prompts']} prompts x {result['samples_per_prompt']} samples: reference success rate "
        f"{result['success_rate']:.3f} ({result['prompts_never_rewarded']} prompts never rewarded)\n"
        f"predicted KL to the reference at beta={result['beta']:g}: k1_in_reward/k2_as_loss {kl['reverse']:.4f} "
        f"[{ci['reverse'][0]:.4f}, {ci['reverse'][1]:.4f}], k3 {kl['forward']:.4f} "
        f"[{ci['forward'][0]:.4f}, {ci['forward'][1]:.4f}]\n"
        f"forward KL(ref||fixed point): k1_in_reward/k2_as_loss {fkl['reverse']:.4f} "
        f"[{ci['forward_kl_reverse'][0]:.4f}, {ci['forward_kl_reverse'][1]:.4f}], k3 {fkl['forward']:.4f} "
        f"[{ci['forward_kl_forward'][0]:.4f}, {ci['forward_kl_forward'][1]:.4f}]\n"
        f"closer to the reference: {result['closer']}"
    )
    top = result.get("most_influential")
    if top is not None:
        print(
            f"most influential prompt: {top['id'] or top['index']} (success rate {top['success_rate']:.3g}), "
            f"forward - reverse {top['forward_minus_reverse']:+.4f}; the set's mean "
            f"{top['mean_forward_minus_reverse']:+.4f}, without it {top['mean_without']:+.4f}"
        )
    print(f"wrote {out}/regime.json, regime.png")
    return 0
