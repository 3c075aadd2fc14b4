"""``klgrad eval`` and ``klgrad convert-benchmarks`` on the command line: each command's flags and its handler
(``klgrad.cli`` registers them)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from klgrad.choices import ACCURACY_REWARDS, ENGINES
from klgrad.threads import thread_setting


def _console():
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=150)


def add_eval_parser(sub: argparse._SubParsersAction, func) -> None:
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
    e.set_defaults(func=func)


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


def add_convert_parser(sub: argparse._SubParsersAction, func) -> None:
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
    v.set_defaults(func=func)


def cmd_convert_benchmarks(args: argparse.Namespace) -> int:
    from klgrad.eval.convert import convert_sources

    return convert_sources(
        args.sources, args.out, name=args.name, fmt=args.format, instruction=args.instruction, seed=args.seed
    )


def add_forgetting_parser(sub: argparse._SubParsersAction, func) -> None:
    """``klgrad forgetting``: both KLs of two models on general chat prompts, flags from
    :class:`klgrad.eval.forgetting.ForgettingOptions`."""
    from klgrad.eval.forgetting import ForgettingOptions
    from klgrad.flags import add_flags

    f = sub.add_parser(
        "forgetting",
        help="KL(policy||reference) and KL(reference||policy) on general chat prompts (what a run cost elsewhere)",
        description="Stepwise estimates with standard errors of both KLs between two models on the shipped general "
        "chat prompts (docs/reproduction.md, section 12), printed as JSON. A grid's runs: klgrad compare measure "
        "GRID forgetting.",
    )
    add_flags(f, ForgettingOptions)
    f.set_defaults(func=func)


def cmd_forgetting(args: argparse.Namespace) -> int:
    import json

    from klgrad.eval.forgetting import ForgettingOptions, measure_forgetting
    from klgrad.flags import parse_record

    options: ForgettingOptions = parse_record(ForgettingOptions, args)
    try:
        record = measure_forgetting(options)
    except (ValueError, OSError) as e:
        print(f"klgrad forgetting: {e}", file=sys.stderr)
        return 2
    text = json.dumps(record, indent=1)
    print(text)
    if options.out is not None:
        options.out.write_text(text + "\n", encoding="utf-8")
    return 0
