"""What a trained policy cost the model elsewhere: KL in both directions to its reference on general chat prompts
(:func:`klgrad.exact.estimators.forgetting_kl`; docs/reproduction.md §12), for any two models ``klgrad eval
--model`` takes, from the command line as

    klgrad forgetting --policy RUN_OR_FOLDER [--reference FOLDER] [--samples N] [--out F.json]

(formerly ``python -m klgrad.eval.forgetting``, which now says so). A grid's runs are measured the same way by
``klgrad compare measure GRID forgetting``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from klgrad.flags import option
from klgrad.threads import thread_setting


@dataclass(frozen=True)
class ForgettingOptions:
    """``klgrad forgetting``: X and Y are what ``klgrad eval --model`` takes (:mod:`klgrad.eval.models`): a Hugging
    Face folder, a known model name, or a klgrad run directory or checkpoint (its starting model with the
    checkpoint's weights over it)."""

    policy: str = option(help="the trained policy: a klgrad run directory or HF model folder", metavar="X")
    reference: str | None = option(None, "its reference (default: a run's starting model)", metavar="Y")
    prompts: Path | None = option(None, "JSONL of {'prompt': ...} rows (default: the shipped general chat prompts)")
    samples: int = option(8, "samples per prompt and direction")
    max_new_tokens: int | None = option(None, "response cap of both directions (default 64, as a grid's)")
    temperature: float | None = option(None, "default: a run's rollout.temperature, else 1")
    device: Literal["auto", "cpu", "cuda"] = option("auto", "where the models load")
    seed: int = option(0, "sampling seed")
    threads: int | str = option("auto", "CPU threads: auto (as train.threads) or N", parse=thread_setting)
    out: Path | None = option(None, "also write the JSON here")


def measure_forgetting(options: ForgettingOptions) -> dict:
    """:func:`forgetting_kl` of the two models on the prompts, with where each came from (``policy``,
    ``checkpoint``, ``reference``). ``reference`` defaults to a run's starting model; ``temperature`` to a run's
    ``rollout.temperature`` (else 1). Raises ValueError when the policy is not a run and no reference is given."""
    from klgrad.eval.models import load_eval_model, locate_model, run_config
    from klgrad.eval.run import resolve_eval_device
    from klgrad.exact.estimators import CHAT_PROMPTS, FORGETTING_MAX_NEW_TOKENS, chat_prompts, forgetting_kl
    from klgrad.threads import cpu_threads

    device = resolve_eval_device(options.device, "klgrad")
    src = locate_model(options.policy)
    run_cfg = run_config(src.path) if src.checkpoint is not None else None
    if options.reference is None and run_cfg is None:
        raise ValueError("--reference is needed when --policy is not a klgrad run")
    temperature = options.temperature if options.temperature is not None else (
        run_cfg.rollout.temperature if run_cfg is not None else 1.0)  # fmt: skip
    with cpu_threads(options.threads):  # beside a training run: a share of the cores, not all of them
        policy = load_eval_model(src, device=device)
        reference = options.reference if options.reference is not None else str(policy.source)
        ref = load_eval_model(reference, device=device)
        out = forgetting_kl(
            policy.model.eval(),
            ref.model.eval(),
            policy.tokenizer,
            chat_prompts(options.prompts or CHAT_PROMPTS),
            options.samples,
            options.max_new_tokens or FORGETTING_MAX_NEW_TOKENS,
            temperature,
            seed=options.seed,
        )
    return {
        "policy": options.policy,
        "checkpoint": None if policy.checkpoint is None else str(policy.checkpoint),
        "reference": str(ref.checkpoint or ref.source),
        **out,
    }


if __name__ == "__main__":  # the module's former command line: a pointer, not a silent no-op
    raise SystemExit("python -m klgrad.eval.forgetting ... is now: klgrad forgetting --policy X [--reference Y] ...")
