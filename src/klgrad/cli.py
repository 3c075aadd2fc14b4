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
    from klgrad.trainer.loop import cpu_threads

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
    from klgrad.compare.commands import compare_words

    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(compare_words(given))  # `klgrad compare --out D` is `compare run --out D`
    args.argv = given  # as given (compare --pin re-executes it)
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
