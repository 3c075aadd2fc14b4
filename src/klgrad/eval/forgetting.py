"""What a trained policy cost the model elsewhere, from the command line: KL in both directions to its reference
on general chat prompts (:func:`klgrad.exact.estimators.forgetting_kl`; docs/reproduction.md §12), for any two
models ``klgrad eval --model`` takes.

    python -m klgrad.eval.forgetting --policy RUN_OR_FOLDER [--reference FOLDER] [--samples N] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from klgrad.eval.models import load_eval_model, locate_model, run_config
from klgrad.eval.run import resolve_eval_device
from klgrad.exact.estimators import CHAT_PROMPTS, FORGETTING_MAX_NEW_TOKENS, chat_prompts, forgetting_kl
from klgrad.threads import cpu_threads, thread_setting


def main(argv: list[str] | None = None) -> int:
    """``python -m klgrad.eval.forgetting --policy X [--reference Y]``: :func:`forgetting_kl` of two models on
    the shipped chat prompts or ``--prompts``, printed as JSON (and written to ``--out``).

    X and Y are what ``klgrad eval --model`` takes (:mod:`klgrad.eval.models`): a Hugging Face folder, a known model
    name, or a klgrad run directory or checkpoint (its starting model with the checkpoint's weights over it).
    ``--reference`` defaults to a run's starting model; ``--temperature`` to a run's ``rollout.temperature``
    (else 1)."""
    ap = argparse.ArgumentParser(
        prog="python -m klgrad.eval.forgetting",
        description="KL(policy||reference) and KL(reference||policy) on general chat prompts, stepwise estimates with "
        "standard errors (docs/reproduction.md, section 12).",
    )
    ap.add_argument("--policy", required=True, help="the trained policy: a klgrad run directory or HF model folder")
    ap.add_argument("--reference", default=None, help="its reference (default: a run's starting model)")
    ap.add_argument("--prompts", type=Path, default=CHAT_PROMPTS, help="JSONL of {'prompt': ...} rows")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt and direction (default 8)")
    ap.add_argument("--max-new-tokens", type=int, default=FORGETTING_MAX_NEW_TOKENS)
    ap.add_argument("--temperature", type=float, default=None, help="default: a run's rollout.temperature, else 1")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads", type=thread_setting, default="auto", help="CPU threads: auto (default; as train.threads) or N"
    )
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    device = resolve_eval_device(args.device, "klgrad")
    src = locate_model(args.policy)
    run_cfg = run_config(src.path) if src.checkpoint is not None else None
    if args.reference is None and run_cfg is None:
        ap.error("--reference is needed when --policy is not a klgrad run")
    temperature = args.temperature if args.temperature is not None else (
        run_cfg.rollout.temperature if run_cfg is not None else 1.0)  # fmt: skip
    with cpu_threads(args.threads):  # beside a training run: a share of the cores, not all of them
        policy = load_eval_model(src, device=device)
        ref = load_eval_model(args.reference if args.reference is not None else str(policy.source), device=device)
        out = forgetting_kl(
            policy.model.eval(),
            ref.model.eval(),
            policy.tokenizer,
            chat_prompts(args.prompts),
            args.samples,
            args.max_new_tokens,
            temperature,
            seed=args.seed,
        )
    record = {
        "policy": args.policy,
        "checkpoint": None if policy.checkpoint is None else str(policy.checkpoint),
        "reference": str(ref.checkpoint or ref.source),
        **out,
    }
    text = json.dumps(record, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
