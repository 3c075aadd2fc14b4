"""klgrad command line: ``audit`` (gradient audit), ``compare`` (the paper's KL comparison), ``train``, ``sft``,
``eval`` (benchmark accuracy and pass@k), ``export`` (a run's policy as a Hugging Face folder), ``regime`` (which
regime a config's prompts are in), ``reproduce``
(paper figures) and ``completion`` (shell completion scripts, generated in :mod:`klgrad.completion`).

Each command is two functions side by side: ``add_NAME_parser`` declares its flags, ``cmd_NAME`` runs it. Every
command writes its results as files (JSON, PNG) into ``--out`` and prints a readable summary.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from klgrad import __version__
from klgrad.choices import ACCURACY_REWARDS, AUDIT_DTYPES, ENGINES, FRAMEWORKS, MODEL_DTYPES
from klgrad.completion import SHELLS, completion_script
from klgrad.reproduce.targets import TARGETS
from klgrad.threads import thread_setting


def _console():
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # CI logs and pipes: wide enough for the audit tables
        console = Console(width=150)
    return console


def add_audit_parser(sub: argparse._SubParsersAction) -> None:
    """``klgrad audit``: the exact-enumeration gradient audit (:mod:`klgrad.audit`)."""
    a = sub.add_parser(
        "audit",
        help="exact-enumeration gradient audit of every KL head, level and regime",
        description="Compute, by enumerating every response of small random tabular policies, the "
        "expected gradient of every (head, level, on/off-policy regime) and compare it "
        "with the exact reverse-KL gradient and the head's documented target.",
    )
    a.add_argument("--out", default="runs/audit", help="output folder (audit.json, audit.png, coefficients.*)")
    a.add_argument("--vocab", type=int, default=4, help="tokens per step, token 0 = EOS (default 4)")
    a.add_argument("--length", type=int, default=4, help="maximum response length (default 4)")
    a.add_argument("--no-eos", action="store_true", help="fixed-length responses (no EOS token)")
    a.add_argument("--seed", type=int, default=0, help="seed of the random policies")
    a.add_argument("--ref-distance", type=float, default=0.5, help="logit noise std from policy to reference")
    a.add_argument(
        "--behaviour-distance",
        type=float,
        default=0.3,
        help="logit noise std from policy to the behaviour (rollout) policy",
    )
    a.add_argument(
        "--staleness",
        default="1,4",
        help="stale-rollout axis: comma-separated k >= 1; the behaviour is the policy k exact gradient steps back "
        "(default 1,4; 'none' = off)",
    )
    a.add_argument("--clip-eps", type=float, default=0.2, help="KL-head clip in the clipped off-policy regime")
    a.add_argument("--beta", type=float, default=0.5, help="KL weight in the combined-vs-decoupled check")
    a.add_argument(
        "--penalty",
        default=None,
        metavar="MODULE:NAME",
        help="also audit your own head, as kl.head takes it: a penalty psi(logp, ref_logp) or a KLHead (imported by "
        "name, never eval'd)",
    )
    a.add_argument(
        "--dtype",
        default="float64",
        choices=AUDIT_DTYPES,
        help="precision axis: the dtype in which log-probs and the KL term are computed; every row gains dtype and "
        "dtype_grad_err, the per-token gradient's largest relative error against float64 over u in [-30, 30] "
        "(default float64: no error)",
    )
    a.add_argument(
        "--framework",
        default=None,
        metavar="NAME|all",
        help="only the frameworks' KL: " + ", ".join(FRAMEWORKS) + " or all (table + frameworks.json)",
    )
    a.add_argument(
        "--version",
        default=None,
        metavar="X",
        help="with --framework NAME: only the presets that hold for release X (default: the installed package's "
        "version when NAME is installed, else every version)",
    )
    a.set_defaults(func=cmd_audit)


def _audit_frameworks(name: str, version: str | None, cfg, out: Path, console, dtype: str = "float64") -> int:
    """``klgrad audit --framework NAME|all [--version X]``: the frameworks' table and ``frameworks.json`` alone,
    for the presets that hold for X (the installed package's version when X is not given)."""
    from klgrad.audit.frameworks import (
        defaults_summary,
        framework_rows,
        installed_version,
        is_default,
        print_framework_table,
        select,
        write_frameworks,
        zero_weight_text,
    )
    from klgrad.audit.run import make_problem

    if name == "all" and version is not None:
        print("klgrad audit: --version needs one --framework NAME, not all", file=sys.stderr)
        return 2
    if name != "all" and version is None and (found := installed_version(name)) is not None:
        version = found[1]
        console.print(f"[bold]{name}[/bold]: the installed package {found[0]} is version {version}")
    try:
        presets = select(name, version)
    except ValueError as e:
        print(f"klgrad audit: {e}", file=sys.stderr)
        return 2
    rows = framework_rows(make_problem(cfg), presets, dtype=dtype)
    print_framework_table(rows, console, version)
    if dtype != "float64":
        from klgrad.audit.precision import print_precision_table

        print_precision_table(rows, "id", console)
    if name != "all":
        defaults = [p for p in presets if is_default(p, version)]
        if version is not None and defaults:
            ids = ", ".join(f"{p.id} ({p.variant})" for p in defaults)
            console.print(f"\nIn {name} {version}, switching the KL on with default flags gives: {ids}", markup=False)
            for p in defaults:
                if (zero := zero_weight_text(p)) is not None:
                    console.print(f"  {p.id}: {zero}, so the switch alone adds no KL: set it", markup=False)
        else:
            console.print("\nDefaults by version:\n  " + "\n  ".join(defaults_summary(name) or ["none"]), markup=False)
        from klgrad.audit.frameworks_doc import REMEDIES

        for remedy in REMEDIES:
            if remedy.framework == name:
                console.print(f"\nThe exact reverse-KL gradient in {name}: {remedy.flags}", markup=False)
    console.print(f"\nwrote {write_frameworks(rows, out)}")
    return 0


def parse_staleness(text: str) -> tuple[int, ...]:
    """``--staleness 1,4`` -> (1, 4); ``none`` -> (). Raises ValueError naming the flag."""
    if text.strip().lower() == "none":
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"staleness: expected comma-separated integers or 'none', got {text!r}") from None


def cmd_audit(args: argparse.Namespace) -> int:
    from klgrad.audit.coefficients import write_coefficient_figure
    from klgrad.audit.run import AuditConfig, headline, print_tables, run_audit, write_audit

    try:
        cfg = AuditConfig(
            vocab=args.vocab,
            length=args.length,
            eos=not args.no_eos,
            seed=args.seed,
            ref_distance=args.ref_distance,
            behaviour_distance=args.behaviour_distance,
            staleness=parse_staleness(args.staleness),
            clip_eps=args.clip_eps,
            beta=args.beta,
        )
    except ValueError as e:
        print(f"klgrad audit: {e}", file=sys.stderr)
        return 2
    console = _console()
    out = Path(args.out)
    t0 = time.perf_counter()
    if args.framework is not None:
        return _audit_frameworks(args.framework, args.version, cfg, out, console, args.dtype)
    with console.status(f"enumerating every response of a V={cfg.vocab}, T={cfg.length} policy ..."):
        try:
            result = run_audit(cfg, penalty=args.penalty, dtype=args.dtype)
        except ValueError as e:
            print(f"klgrad audit: {e}", file=sys.stderr)
            return 2
    print_tables(result, console)
    paths = write_audit(result, out)
    write_coefficient_figure(out)
    console.print("\n[bold]Headline[/bold]")
    for k, v in headline(result).items():
        console.print(f"  {k:50s} {v:.3e}")
    console.print(
        f"\nwrote {paths['json']}, {paths['png']}, {out / 'coefficients.png'}, "
        f"{out / 'coefficients.json'} in {time.perf_counter() - t0:.1f}s"
    )
    return 0


def add_compare_parser(sub: argparse._SubParsersAction) -> None:
    """``klgrad compare``: the paper's KL comparison as a grid of training runs (:mod:`klgrad.compare.grid`)."""
    c = sub.add_parser(
        "compare",
        help="the paper's KL comparison: none, k1/k2/k3 as loss, k1 in reward; x seeds; with statistics",
        description="Train every method for every seed (and beta) with everything else equal; write the "
        "paper-style figure, a reward-KL frontier, and summary.json/.md with mean ± 95% CI and a verdict for "
        "each of the paper's predictions from a named test. Finished runs are skipped, interrupted ones resumed. "
        "Other config fields are dotted flags applied to every run (--rollout.prompts_per_step 4).",
    )
    c.add_argument("--config", default="configs/tiny_add.yaml", help="base training config")
    c.add_argument("--out", default="runs/compare", help="output folder")
    c.add_argument("--seeds", type=int, default=5, help="seeds per method (>= 2; runs of one seed are paired)")
    c.add_argument("--steps", type=int, default=60, help="RL steps per run")
    c.add_argument("--betas", default="0.5", help="comma-separated KL weights (a sweep adds frontier points)")
    c.add_argument(
        "--level",
        default="token",
        choices=("token", "sequence", "token_to_go"),
        help="where the KL heads act (default token: what GRPO/verl do, as in the paper's runs)",
    )
    c.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods: klgrad heads (default: all five), package.module:name, or framework preset "
        "ids of `klgrad audit --framework` (trl/grpo-k3: that framework's KL term, its own level and form)",
    )
    c.add_argument(
        "--beta-scale",
        default=None,
        metavar="off|length|length=L",
        help="same nominal KL strength for every method: a method whose KL aggregation divides by the response "
        "length (a token mean, e.g. trl/grpo-k3) trains at beta*L, L the reference's mean response length on the "
        "training prompts, measured once (or given: length=L) and recorded in grid.json with each method's "
        "effective beta; a token sum or sequence-level head at beta (default off: every method at beta)",
    )
    c.add_argument("--kl-prompts", type=int, default=20, help="held-out prompts of the final KL (default 20)")
    c.add_argument("--kl-samples", type=int, default=16, help="policy samples per prompt of the final KL (default 16)")
    c.add_argument(
        "--margin",
        type=float,
        default=None,
        help="equivalence margin of 'k1_as_loss ~ none', nats of final KL, stated before the runs (default 0.1)",
    )
    c.add_argument(
        "--optimum-ref-samples",
        type=int,
        default=0,
        metavar="K",
        help="also estimate each final policy's KL to the optimum pi* of J_beta from samples, log Z from K reference "
        "samples per held-out prompt (>= 256 advised; default 0: off; the exact value is reported for short answers)",
    )
    c.add_argument(
        "--forgetting-samples",
        type=int,
        default=0,
        metavar="N",
        help="also measure KL(pi||pi_ref) and KL(pi_ref||pi) on the shipped general chat prompts, N samples per "
        "prompt in each direction (default 0: off)",
    )
    c.add_argument(
        "--no-checkpoints",
        action="store_true",
        help="delete each run's checkpoints once its final numbers (and --final-hook evaluations) are written (a "
        "real model's are GBs per run); a grid whose checkpoints are gone cannot be extended",
    )
    g = c.add_argument_group(
        "long grids",
        "OUT/grid.json records the code revision (git commit, '-dirty-<hash>' for a tree with changes), the CPU "
        "and the design before any run; continuing a grid at another revision or with another design exits 2. "
        "Runs checkpoint every steps/10 (newest kept) and resume mid-way; a larger --steps extends a finished "
        "grid; --train.stop_when 'METRIC OP VALUE' stops a run early (docs/reproduction.md, 'Long grids').",
    )
    g.add_argument(
        "--pin",
        metavar="REV",
        default=None,
        help="run the grid from a detached git worktree of REV (made under $KLGRAD_PIN_DIR, default "
        "~/.cache/klgrad/pins/COMMIT), re-executing this command there, so edits beside it cannot change it",
    )
    g.add_argument(
        "--allow-dirty",
        action="store_true",
        help="run a pinned grid from a dirty tree: with --pin, a pinned worktree with local changes; without, the "
        "continuation of a grid recorded as pinned (recorded as COMMIT-dirty-HASH)",
    )
    g.add_argument(
        "--only-seeds",
        default=None,
        metavar="LIST",
        help="run only these of the grid's seeds, e.g. 4-7 or 0,2 (seeds of one grid on several machines; "
        "then --merge); with --merge, merge only these seeds, each whole",
    )
    g.add_argument(
        "--only-methods",
        default=None,
        metavar="LIST",
        help="train only these of --methods (comma-separated; the design stays all of --methods): one seed's "
        "methods as separate processes, then --merge",
    )
    g.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="DIR",
        type=Path,
        help="merge these grid folders (same revision and design, e.g. disjoint --only-seeds) into --out and "
        "summarise; trains nothing",
    )
    g.add_argument(
        "--amend-seeds",
        type=int,
        default=None,
        metavar="N",
        help="declare that the grid in --out (with a primary hypothesis) runs N seeds, before any seed past its "
        "registered count runs; recorded in grid.json with --reason; the primary stays decided on the registered "
        "seeds. Trains nothing",
    )
    g.add_argument("--reason", default="", metavar="TEXT", help="why --amend-seeds changes the seed count")
    g.add_argument(
        "--primary",
        default=None,
        metavar="CLAIM",
        help="the grid's pre-registered primary hypothesis, 'A<B[:METRIC]' (mean A below B) or 'A~B[:METRIC]' "
        "(within --margin); METRIC kl (default) or a final metric. Written to grid.json and summary.json before "
        "any run and tested alone; the other predictions form a secondary Holm family",
    )
    g.add_argument(
        "--converge-gap",
        type=float,
        default=None,
        metavar="NATS",
        help="the gap the grid must resolve: convergence needs the standard error of the last quarter's movement "
        "<= gap/4 (without it that bound is not checked)",
    )
    g.add_argument(
        "--converge-metric",
        default=None,
        metavar="KEY",
        help="logged metric the convergence criterion reads (default kl/k1: the training batch's sequence KL)",
    )
    g.add_argument(
        "--converge-without-lr-decay",
        action="store_true",
        help="drop the criterion's 'learning rate decays over the last third' condition (a constant lr)",
    )
    g.add_argument(
        "--final-hook",
        action="append",
        default=[],
        metavar="NAME=MODULE:FUNCTION",
        help="a downstream evaluation, FUNCTION(cfg, run_dir) -> dict, run on each finished run before its "
        "weights are deleted; stored in final.json under NAME (repeatable)",
    )
    c.set_defaults(func=cmd_compare, takes_overrides=True)


def parse_seed_list(text: str) -> list[int]:
    """``"4-7"`` → [4, 5, 6, 7]; ``"0,2,5"`` → [0, 2, 5]; ranges and single seeds may mix (``"0-2,5"``)."""
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"--only-seeds {text!r}: expected seeds like 4-7 or 0,2,5")
        out += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
    return sorted(set(out))


def final_hooks(specs: list[str]) -> dict:
    """``NAME=MODULE:FUNCTION`` flags → {name: function}; raises ValueError naming a bad one."""
    from klgrad.import_path import import_object

    hooks = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name:
            raise ValueError(f"--final-hook {spec!r}: expected NAME=MODULE:FUNCTION")
        hooks[name] = import_object(path, "--final-hook")
    return hooks


def compare_argv(argv: list[str]) -> list[str]:
    """The arguments after the ``compare`` command word."""
    return argv[argv.index("compare") + 1 :] if "compare" in argv else list(argv)


def exec_pinned(args: argparse.Namespace, execve=None) -> int:
    """``--pin REV``: make (or reuse) the pinned worktree and re-execute this compare command from it
    (:func:`klgrad.compare.provenance.pinned_command`). Returns 2 with a message when REV cannot be pinned."""
    import os

    from klgrad.compare import provenance as pv

    try:
        commit, worktree = pv.pin_worktree(args.pin, pv.package_source(), pv.pin_root(), args.allow_dirty)
    except (ValueError, OSError) as e:
        print(f"klgrad compare: {e}", file=sys.stderr)
        return 2
    argv, env = pv.pinned_command(worktree, commit, compare_argv(args.argv), dict(os.environ))
    print(f"klgrad compare: pinned to {commit} ({worktree})", file=sys.stderr, flush=True)
    (execve or os.execve)(argv[0], argv, env)
    return 0  # reached only when execve is replaced (tests)


GRID_KEYS = ("kl.head", "kl.beta", "kl.form", "kl.level", "train.seed", "train.out_dir", "train.steps")
"""Config fields ``klgrad compare`` sets per run; set them with its own flags, not as overrides."""


def cmd_compare(args: argparse.Namespace, overrides: list[str]) -> int:
    from klgrad.choices import is_preset_id
    from klgrad.compare.grid import METHODS, run_compare
    from klgrad.config import ConfigError, parse_override_args
    from klgrad.runlock import RunLockedError

    if args.pin:
        return exec_pinned(args)
    if (args.merge or args.amend_seeds is not None) and overrides:
        # they train nothing, so a token here is a mistake, most often a spaced seed list (--only-seeds 46 48)
        # whose tail would otherwise be dropped without a word
        print(
            f"klgrad compare: unrecognized arguments {' '.join(overrides)} (--merge and --amend-seeds take no "
            "config overrides; a seed list is one argument: --only-seeds 46,48,49 or 4-7)",
            file=sys.stderr,
        )
        return 2
    if args.merge:
        return cmd_merge(args)
    if args.amend_seeds is not None:
        return cmd_amend(args)
    methods = tuple(args.methods.split(",")) if args.methods else METHODS
    bad = [m for m in methods if m not in METHODS and ":" not in m and not is_preset_id(m)]
    why = None
    if (
        bad
        or args.seeds < 2
        or args.steps < 1
        or args.kl_prompts < 1
        or args.kl_samples < 2
        or (args.margin is not None and not args.margin > 0)
        or any(n == 1 or n < 0 for n in (args.optimum_ref_samples, args.forgetting_samples))
    ):
        why = (
            f"unknown methods {bad}; choose from {list(METHODS)}, a head's package.module:name or a framework "
            "preset id (klgrad audit --framework all)"
            if bad
            else "--seeds must be >= 2, --steps >= 1, --kl-prompts >= 1, --kl-samples >= 2, --margin > 0, "
            "--optimum-ref-samples and --forgetting-samples 0 or >= 2"
        )
    try:
        extra = parse_override_args(overrides)
    except ConfigError as e:
        why = str(e)
        extra = {}
    fixed = sorted(set(extra) & set(GRID_KEYS))
    if fixed:
        why = f"{fixed} are set by the grid per run (use --betas, --level, --seeds, --steps, --out)"
    try:
        only = None if args.only_seeds is None else parse_seed_list(args.only_seeds)
        hooks = final_hooks(args.final_hook)
        from klgrad.compare.beta_scale import parse_beta_scale

        parse_beta_scale(args.beta_scale)  # refused before anything runs
    except ValueError as e:
        why, only, hooks = why or str(e), None, {}
    if why:
        print(f"klgrad compare: {why}", file=sys.stderr)
        return 2
    betas = tuple(float(b) for b in args.betas.split(","))
    convergence = None
    if args.converge_gap is not None or args.converge_metric or args.converge_without_lr_decay:
        from klgrad.compare.convergence import ConvergenceCriterion

        convergence = ConvergenceCriterion(
            metric=args.converge_metric or "kl/k1",
            gap=args.converge_gap,
            lr_decay=None if args.converge_without_lr_decay else 1 / 3,
        )
    try:
        summary = run_compare(
            Path(args.out),
            config=args.config,
            seeds=args.seeds,
            steps=args.steps,
            betas=betas,
            level=args.level,
            methods=methods,
            exact_prompts=args.kl_prompts,
            estimate_samples=args.kl_samples,
            extra_overrides=extra,
            keep_checkpoints=not args.no_checkpoints,
            only_seeds=only,
            only_methods=None if args.only_methods is None else tuple(args.only_methods.split(",")),
            primary=args.primary,
            convergence=convergence,
            final_hooks=hooks,
            allow_dirty=args.allow_dirty,
            optimum_ref_samples=args.optimum_ref_samples,
            forgetting_samples=args.forgetting_samples,
            beta_scale=args.beta_scale,
            **({} if args.margin is None else {"margin": args.margin}),
        )
    except (ValueError, RunLockedError) as e:
        print(f"klgrad compare: {e}", file=sys.stderr)
        return 2
    from klgrad.compare.grid import summary_markdown

    _console().print(summary_markdown(summary))
    print(f"wrote {args.out}/grid.json, comparison.png, frontier.png, summary.json, summary.md, runs/")
    return 0


def cmd_amend(args: argparse.Namespace) -> int:
    """``klgrad compare --out DIR --amend-seeds N --reason TEXT`` (:func:`klgrad.compare.grid.amend_grid`)."""
    from klgrad.compare.grid import amend_grid
    from klgrad.runlock import RunLockedError

    try:
        record = amend_grid(Path(args.out), args.amend_seeds, args.reason)
    except (ValueError, RunLockedError) as e:
        print(f"klgrad compare: {e}", file=sys.stderr)
        return 2
    a = record["amendments"][-1]
    started = a["seeds_started"]
    print(f"amended {args.out}/grid.json: seeds {a['seeds_from']} -> {a['seeds_to']} (seeds started: {started})")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    """``klgrad compare --merge DIR ... --out OUT`` (:func:`klgrad.compare.merge.merge_grids`)."""
    from klgrad.compare.grid import summary_markdown
    from klgrad.compare.merge import merge_grids
    from klgrad.runlock import RunLockedError

    try:
        seeds = None if args.only_seeds is None else parse_seed_list(args.only_seeds)
        summary = merge_grids(list(args.merge), Path(args.out), seeds)
    except (ValueError, RunLockedError) as e:
        print(f"klgrad compare: {e}", file=sys.stderr)
        return 2
    _console().print(summary_markdown(summary))
    for run in summary["skipped"]:
        print(f"klgrad compare: left out {run} (not finished)", file=sys.stderr)
    print(f"wrote {args.out}/grid.json, summary.json, summary.md, runs/ (merged)")
    return 0


class TrainHelpFormatter(argparse.HelpFormatter):
    """``klgrad train --help``: its own options, then every dotted config flag with its doc, read off the config's
    JSON schema (:func:`klgrad.completion.config_options`) only when the help is printed."""

    def format_help(self) -> str:
        from klgrad.completion import config_options

        flags = "\n".join(f"  {o.flag} {{{','.join(o.choices)}}}  {o.help}" if o.choices else f"  {o.flag}  {o.help}"
                          for o in config_options())  # fmt: skip
        return f"{super().format_help()}\nconfig fields, each a dotted flag (docs/configuration.md):\n{flags}\n"


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    """``klgrad train``: one RL run; every config field is also a dotted flag (``--kl.beta 0.1``)."""
    t = sub.add_parser(
        "train",
        formatter_class=TrainHelpFormatter,
        help="RL-train a causal LM (embedded tiny model by default)",
        description="RL fine-tuning with a klgrad KL head. Any config field can be overridden with a dotted "
        "flag, e.g. --kl.head k3_as_loss --kl.beta 0.5 --train.steps 50 (fields: docs/configuration.md).",
    )
    t.add_argument("--config", default=None, help="YAML config (e.g. configs/tiny_add.yaml); defaults otherwise")
    t.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue the run in RUN_DIR")
    t.set_defaults(func=cmd_train, takes_overrides=True)


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from klgrad.config import ConfigError, load_config, parse_override_args

    try:
        if args.resume:
            run_dir = Path(args.resume)
            saved = run_dir / "config.yaml"
            if not saved.is_file():
                raise ConfigError(f"--resume {run_dir}: no config.yaml there (not a klgrad run directory)")
            cfg = load_config(saved, {**parse_override_args(overrides), "train.out_dir": str(run_dir)})
        else:
            cfg = load_config(args.config, parse_override_args(overrides))
    except ConfigError as e:
        problems = e.problems
        head = f"{len(problems)} problems in the config:\n  " if len(problems) > 1 else ""
        print(f"klgrad train: {head}" + "\n  ".join(problems), file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"klgrad train: {e}", file=sys.stderr)
        return 2
    from klgrad.runlock import RunLockedError
    from klgrad.trainer import train

    try:
        summary = train(cfg, resume=bool(args.resume))
    except (FileExistsError, FileNotFoundError, ValueError, RunLockedError) as e:  # RunLockedError: another writer
        print(f"klgrad train: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a guarded stop (non-finite steps, reward failure budget): the run is resumable
        print(f"klgrad train: stopped: {e}", file=sys.stderr)
        return 1
    from klgrad.distributed import is_main_process

    if not is_main_process():  # under accelerate launch rank 0 reports
        return 0
    first, last = summary["eval_first"], summary["eval_last"]
    console = _console()
    console.print(
        f"held-out greedy accuracy {first.get('eval/greedy_accuracy', float('nan')):.3f} (reference) -> "
        f"{last.get('eval/greedy_accuracy', float('nan')):.3f} after {summary['steps']} steps; "
        f"KL to reference {last.get('eval/kl_k1', float('nan')):.4f}; "
        f"{summary['mean_step_time_s']:.2f} s/step"
    )
    console.print(f"wrote {cfg.train.out_dir}/metrics.jsonl, curves.png, summary.json, checkpoints/")
    return 0


def add_sft_parser(sub: argparse._SubParsersAction) -> None:
    """``klgrad sft``: supervised fine-tuning of the tiny model into a reference (:mod:`klgrad.sft`)."""
    s = sub.add_parser("sft", help="fine-tune the tiny model into a reference (stops on held-out accuracy)")
    s.add_argument("--task", default="addition", choices=("addition", "addition_discovery", "scratchpad"))
    s.add_argument("--out", required=True, help="output model directory (safetensors + config + tokenizer)")
    s.add_argument(
        "--target-accuracy",
        type=float,
        default=0.6,
        help="stop at this held-out greedy accuracy against the answer the targets teach (addition_discovery: a+b+1)",
    )
    s.add_argument("--max-steps", type=int, default=3000, help="fail if the target is not reached by then")
    s.add_argument("--max-new-tokens", type=int, default=8, help="greedy decoding length in evaluation")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=cmd_sft)


def cmd_sft(args: argparse.Namespace) -> int:
    from klgrad.sft import SFTConfig, run_sft

    try:
        cfg = SFTConfig(
            task=args.task,
            target_accuracy=args.target_accuracy,
            max_steps=args.max_steps,
            seed=args.seed,
            max_new_tokens=args.max_new_tokens,
        )
        report = run_sft(cfg, Path(args.out))
    except (ValueError, RuntimeError) as e:
        print(f"klgrad sft: {e}", file=sys.stderr)
        return 2
    print(
        f"held-out greedy accuracy {report['heldout_greedy_accuracy']:.3f} after {report['steps']} steps "
        f"({report['seconds']:.0f} s); wrote {args.out}"
    )
    return 0


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    """``klgrad eval``: greedy accuracy, pass@1 and pass@k of models on benchmark files (:mod:`klgrad.eval`)."""
    e = sub.add_parser(
        "eval",
        help="greedy accuracy, pass@1 and pass@k of one or more models on benchmark files (Math-Verify)",
        description="Per benchmark file (JSONL / parquet / JSON / CSV / datasets folder with a prompt and an answer "
        "column; docs/eval.md), sample each problem once greedily and --samples times at --temperature, score "
        "with Math-Verify (klgrad's accuracy reward) and report greedy accuracy, pass@1, pass@k (unbiased "
        "estimator) and mean response length. Writes OUT/eval.json, OUT/completions/ and, for several models, "
        "OUT/results.md (models x benchmarks).",
    )
    e.add_argument(
        "--model",
        action="append",
        metavar="[LABEL=]MODEL",
        help="'embedded', a shipped model name, a Hugging Face model folder, a klgrad run directory (its newest "
        "valid checkpoint) or a checkpoint folder; repeat to compare (default: embedded)",
    )
    e.add_argument("--data", action="append", required=True, metavar="FILE", help="benchmark file; repeatable")
    e.add_argument("--samples", type=int, default=8, help="K: samples per problem for pass@1 and pass@K (default 8)")
    e.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    e.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0: off)")
    e.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="response cap (default: 1024, lowered to what fits the model's context)",
    )
    e.add_argument("--prompt-column", default="prompt", help="column holding the prompt (default prompt)")
    e.add_argument("--answer-column", default="answer", help="column holding the answer (default answer)")
    e.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N problems of each file")
    e.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda when available")
    e.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="weights dtype")
    e.add_argument(
        "--engine",
        default="klgrad",
        choices=ENGINES,
        help="klgrad (KV-cache sampler with the fast decode, default), hf (transformers generate), vllm (CUDA GPU)",
    )
    e.add_argument("--seed", type=int, default=0, help="sampling seed (every model draws the same random numbers)")
    e.add_argument("--batch-size", type=int, default=32, help="problems per sampler call (default 32)")
    e.add_argument("--no-chat-template", action="store_true", help="raw prompts even when the tokenizer has a template")
    e.add_argument(
        "--reward",
        default="accuracy",
        choices=ACCURACY_REWARDS,
        help="correctness: accuracy (Math-Verify, default) or final_number (Math-Verify on the last number written, "
        "as the chat arithmetic tasks train)",
    )
    e.add_argument(
        "--threads",
        type=thread_setting,
        default="auto",
        metavar="auto|N",
        help="CPU threads: auto (default) = this process's share of the cores beside other klgrad processes "
        "(a training run beside it), as train.threads: auto; N = N",
    )
    e.add_argument("--out", default="runs/eval", help="output folder (default runs/eval)")
    e.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from klgrad.eval.benchmarks import answer_warnings, load_benchmarks
    from klgrad.eval.models import locate_model
    from klgrad.eval.report import print_table, write_outputs
    from klgrad.eval.run import EvalSettings, evaluate_all, resolve_eval_device
    from klgrad.runlock import run_lock
    from klgrad.threads import cpu_threads

    try:  # every argument, file and model folder checked before any sampling
        settings = EvalSettings(
            samples=args.samples,
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            seed=args.seed,
            chat_template=not args.no_chat_template,
            engine=args.engine,
            reward=args.reward,
        )
        device = resolve_eval_device(args.device, args.engine)
        benchmarks = load_benchmarks(
            args.data, prompt_column=args.prompt_column, answer_column=args.answer_column, limit=args.limit
        )
        sources = [locate_model(m) for m in args.model or ["embedded"]]
    except (ValueError, OSError) as e:  # DataError is a ValueError; FileNotFoundError an OSError
        print(f"klgrad eval: {e}", file=sys.stderr)
        return 2
    warnings = answer_warnings(benchmarks)
    for w in warnings:
        print(f"klgrad eval: warning: {w}", file=sys.stderr)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = _console()
    out = Path(args.out)
    total = len(sources) * sum(len(b.examples) for b in benchmarks)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with run_lock(out), cpu_threads(args.threads), Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("loading", total=total)
        try:
            results = evaluate_all(
                sources,
                benchmarks,
                settings,
                device=device,
                dtype=args.dtype,
                advance=lambda what, n: progress.update(task, advance=n, description=what),
            )
        except (ValueError, OSError) as e:
            print(f"klgrad eval: {e}", file=sys.stderr)
            return 2
        paths = write_outputs(results, settings, args.data, out, warnings)
    print_table(results, settings, console)
    console.print(f"wrote {', '.join(str(p) for p in paths)} and {out / 'completions'}/")
    return 0


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    """``klgrad export``: a run's trained policy as a standard Hugging Face model folder (:mod:`klgrad.export`)."""
    x = sub.add_parser(
        "export",
        help="write a run's policy as a Hugging Face model folder (LoRA merged) for transformers / vLLM / lm-eval",
        description="Write the policy of a klgrad run directory (its newest valid checkpoint) or of one checkpoint "
        "folder as a standard Hugging Face folder: config.json, model.safetensors, generation_config.json and the "
        "tokenizer files (chat template included). A LoRA adapter is merged into the base weights. The folder is "
        "written beside --out and renamed into place (docs/export.md).",
    )
    x.add_argument("source", metavar="RUN|CHECKPOINT", help="a klgrad run directory or RUN/checkpoints/step_N")
    x.add_argument("--out", required=True, help="the model folder to write (refused if it exists and is not empty)")
    x.add_argument(
        "--dtype", default=None, choices=MODEL_DTYPES, help="weights dtype (default: the checkpoint's, model.dtype)"
    )
    x.add_argument("--force", action="store_true", help="replace a non-empty --out")
    x.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from klgrad.export import export_model

    try:
        done = export_model(args.source, args.out, dtype=args.dtype, force=args.force)
    except (ValueError, OSError) as e:  # FileNotFoundError and FileExistsError are OSErrors
        print(f"klgrad export: {e}", file=sys.stderr)
        return 2
    how = f"LoRA adapter merged into {done.base}" if done.lora else f"full fine-tuning of {done.base}"
    print(f"exported {done.checkpoint} ({how}) as {done.dtype} to {done.path}")
    return 0


def add_regime_parser(sub: argparse._SubParsersAction) -> None:
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
    r.set_defaults(func=cmd_regime, takes_overrides=True)


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


REPRODUCE_TARGETS: tuple[str, ...] = tuple(TARGETS)
"""``klgrad reproduce`` names (:data:`klgrad.reproduce.targets.TARGETS`)."""


def add_reproduce_parser(sub: argparse._SubParsersAction) -> None:
    """``klgrad reproduce NAME``: one of the paper's figures or claims."""
    r = sub.add_parser(
        "reproduce",
        help="reproduce one of the paper's results",
        description="Reproduce a figure or claim of the paper. Available: " + ", ".join(REPRODUCE_TARGETS),
    )
    r.add_argument("name", choices=REPRODUCE_TARGETS, help="which result")
    r.add_argument("--out", default=None, help="output folder (default runs/reproduce/NAME)")
    r.add_argument("--steps", type=int, default=None, help="RL steps for the offpolicy / group-norm runs (40)")
    r.set_defaults(func=cmd_reproduce)


def cmd_reproduce(args: argparse.Namespace) -> int:
    """Each target writes JSON + PNG + verdict.md into --out (holding its lock: one writer per directory)."""
    from klgrad.runlock import run_lock

    out = Path(args.out)
    with run_lock(out):
        return _reproduce(args, out)


def _reproduce(args: argparse.Namespace, out: Path) -> int:
    TARGETS[args.name](out, args.steps)
    print((out / "verdict.md").read_text())
    print(f"wrote {out}/ (JSON, PNG, verdict.md)")
    return 0


def add_convert_parser(sub: argparse._SubParsersAction) -> None:
    """``klgrad convert-benchmarks FILE ... --out DIR``: downloaded benchmark files into ``klgrad eval``'s rows."""
    from klgrad.eval.convert import FORMATS

    v = sub.add_parser(
        "convert-benchmarks",
        help="convert downloaded benchmark files (MATH-500, AIME, GSM8K, GPQA, ...) into klgrad eval's JSONL",
        description="Convert public benchmark files you have downloaded into JSONL rows {id, prompt, answer} that "
        "klgrad eval reads (docs/eval.md lists the layouts it knows).",
    )
    v.add_argument("sources", nargs="+", type=Path, help="downloaded benchmark files (.jsonl, .json, .parquet, .csv)")
    v.add_argument("--out", type=Path, required=True, help="folder for the converted NAME.jsonl files")
    v.add_argument("--name", default=None, help="output name (one source only; default: the source's file stem)")
    v.add_argument("--format", default="auto", choices=("auto", *FORMATS), help="source layout (default: detected)")
    v.add_argument("--instruction", default=None, help="appended to each prompt ('' for none; default: per format)")
    v.add_argument("--seed", type=int, default=0, help="seed of the GPQA option shuffle")
    v.set_defaults(func=cmd_convert_benchmarks)


def cmd_convert_benchmarks(args: argparse.Namespace) -> int:
    from klgrad.eval.convert import convert_sources

    return convert_sources(
        args.sources, args.out, name=args.name, fmt=args.format, instruction=args.instruction, seed=args.seed
    )


def add_completion_parser(sub: argparse._SubParsersAction) -> None:
    """``klgrad completion SHELL``: the shell completion script (:mod:`klgrad.completion`)."""
    k = sub.add_parser(
        "completion",
        help="print a shell completion script (bash, zsh, fish)",
        description="Print a completion script generated from this parser: subcommands, their options and, for "
        "train, every dotted config flag with its choices. bash: source <(klgrad completion bash); "
        "zsh: source <(klgrad completion zsh); fish: klgrad completion fish | source.",
    )
    k.add_argument("shell", choices=SHELLS, help="which shell")
    k.set_defaults(func=cmd_completion)


def cmd_completion(args: argparse.Namespace) -> int:
    sys.stdout.write(completion_script(args.shell, build_parser()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="klgrad", description="Gradient-correct KL regularization for RL fine-tuning.")
    p.add_argument("--version", action="version", version=f"klgrad {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (
        add_audit_parser,
        add_compare_parser,
        add_train_parser,
        add_sft_parser,
        add_eval_parser,
        add_export_parser,
        add_regime_parser,
        add_reproduce_parser,
        add_convert_parser,
        add_completion_parser,
    ):
        add(sub)
    return p


def _quiet_transformers() -> None:
    """klgrad shows its own progress; transformers' per-load bars would bury it."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given (compare --pin re-executes it)
    if args.command in ("train", "sft", "compare", "reproduce", "eval", "export", "regime"):
        _quiet_transformers()
    if getattr(args, "takes_overrides", False):
        return int(args.func(args, extra) or 0)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "out", "x") is None:
        args.out = f"runs/reproduce/{args.name}"
    from klgrad.runlock import RunLockedError

    try:
        return int(args.func(args) or 0)
    except RunLockedError as e:  # --out is another process's: exit 2 before doing any work, as for bad arguments
        print(f"klgrad {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
