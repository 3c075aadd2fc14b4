"""klgrad command line: ``audit`` (gradient audit), ``compare`` (the paper's KL comparison), ``train``, ``sft``,
``eval`` (benchmark accuracy and pass@k), ``forgetting`` (both KLs of two models on chat prompts), ``export`` (a
run's policy as a Hugging Face folder), ``regime`` (which regime a config's prompts are in), ``reproduce`` (paper
figures) and ``completion`` (shell completion scripts, generated in :mod:`klgrad.completion`).

Each command is two functions side by side: ``add_NAME_parser`` declares its flags, ``cmd_NAME`` runs it; a
product's commands (``compare``/``regime``, ``eval``/``forgetting``/``convert-benchmarks``) declare theirs in its
``commands`` module, ``compare``'s generated from its typed records. Every command writes its results as files
(JSON, PNG) into ``--out`` and prints a readable summary.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from klgrad import __version__
from klgrad.audit import AUDIT_NAMES
from klgrad.choices import AUDIT_DTYPES, FRAMEWORKS, MODEL_DTYPES
from klgrad.completion import SHELLS, completion_script
from klgrad.reproduce.targets import TARGETS


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
        epilog=AUDIT_NAMES,
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
        from klgrad.audit.remedies import print_remedy

        print_remedy(name, rows, console)
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
    """``klgrad compare``: its subcommands (``run``, the default, ``merge``, ``amend``, ``report``, ``measure``,
    ``mean-length``) with flags generated from their records (:mod:`klgrad.compare.commands`)."""
    from klgrad.compare.commands import add_compare_parser as add

    add(sub, cmd_compare)


def cmd_compare(args: argparse.Namespace, overrides: list[str]) -> int:
    from klgrad.compare.commands import run_command

    return run_command(args, overrides)


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
    """``klgrad eval``: benchmark accuracy and pass@k of models (:mod:`klgrad.eval.commands`)."""
    from klgrad.eval.commands import add_eval_parser as add

    add(sub, cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from klgrad.eval.commands import cmd_eval as run

    return run(args)


def add_forgetting_parser(sub: argparse._SubParsersAction) -> None:
    """``klgrad forgetting``: what a trained policy cost the model elsewhere (:mod:`klgrad.eval.forgetting`)."""
    from klgrad.eval.commands import add_forgetting_parser as add

    add(sub, cmd_forgetting)


def cmd_forgetting(args: argparse.Namespace) -> int:
    from klgrad.eval.commands import cmd_forgetting as run

    return run(args)


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
    """``klgrad regime``: which regime a config's prompts are in (:mod:`klgrad.compare.commands`)."""
    from klgrad.compare.commands import add_regime_parser as add

    add(sub, cmd_regime)


def cmd_regime(args: argparse.Namespace, overrides: list[str]) -> int:
    from klgrad.compare.commands import cmd_regime as run

    return run(args, overrides)


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
    """``klgrad convert-benchmarks FILE ... --out DIR`` (:mod:`klgrad.eval.commands`)."""
    from klgrad.eval.commands import add_convert_parser as add

    add(sub, cmd_convert_benchmarks)


def cmd_convert_benchmarks(args: argparse.Namespace) -> int:
    from klgrad.eval.commands import cmd_convert_benchmarks as run

    return run(args)


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
        add_forgetting_parser,
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
    from klgrad.compare.commands import compare_words

    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(compare_words(given))  # `klgrad compare --out D` is `compare run --out D`
    args.argv = given  # as given (compare --pin re-executes it)
    if args.command in ("train", "sft", "compare", "reproduce", "eval", "forgetting", "export", "regime"):
        _quiet_transformers()
    if getattr(args, "takes_overrides", False):
        return int(args.func(args, extra) or 0)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "reproduce" and args.out is None:
        args.out = f"runs/reproduce/{args.name}"
    from klgrad.runlock import RunLockedError

    try:
        return int(args.func(args) or 0)
    except RunLockedError as e:  # --out is another process's: exit 2 before doing any work, as for bad arguments
        print(f"klgrad {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
