"""End-to-end RL step: ``klgrad train`` vs TRL's GRPOTrainer on the same work, on two workloads: the embedded
default (``configs/tiny_add.yaml``: 2-digit addition, ≤ 8 new tokens) and ``configs/tiny_scratchpad.yaml``
(column addition written out, ≤ 32 new tokens, answers of ~20 tokens).

Same model (the shipped tiny reference of the task), tokenizer, prompts, 32 prompts × 8 samples, temperature
1, β = 0.5, one on-policy update per batch, CPU fp32, the same reward functions (klgrad's built-in accuracy +
format, which have TRL's signature). Each contender runs in rounds of ``steps`` optimizer steps, rounds
alternating klgrad / TRL / TRL-without-checkpointing; the first ``warmup`` steps of every round are dropped; a
step's time is the wall clock between consecutive step ends (everything: generation, rewards, reference pass,
update, logging).

TRL runs with its defaults except what this offline CPU machine needs, and no checkpoints: ``bf16=False``
(fp32, as klgrad; the CPU has no bf16 units), ``use_cpu=True``, ``use_vllm=False`` (vLLM needs a GPU),
``report_to="none"`` and ``HF_HUB_OFFLINE=1`` (no network), ``save_strategy="no"`` (no checkpoint writes in the
timed steps; klgrad's run is configured likewise, ``train.save_every`` beyond the run). Its default
``gradient_checkpointing=True`` recomputes the forward in backward; the "TRL (no ckpt)" row turns it off,
the strongest TRL baseline here, and the reported ratio is against the faster of the two.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from bench.common import TRL_OFFLINE_CPU, median, print_table, step_records, write_json
from klgrad.config import load_config
from klgrad.data.tasks import make_splits
from klgrad.rewards import accuracy_reward, format_reward
from klgrad.trainer import EMBEDDED_DIR, train

CONFIGS = Path(__file__).parents[1] / "configs"
WORKLOADS = {"addition": ("tiny_add.yaml", 8), "scratchpad": ("tiny_scratchpad.yaml", 32)}
"""task -> (config, max new tokens)."""


def klgrad_round(steps: int, seed: int, task: str = "addition") -> tuple[list[float], int]:
    """Step times (s) of one ``klgrad train`` run of ``steps`` steps; also the response tokens of the last step."""
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(
            CONFIGS / WORKLOADS[task][0],
            {
                "train.steps": steps,
                "train.eval_every": 0,
                "train.save_every": 1_000_000,
                "train.out_dir": f"{out}/run",
                "train.seed": seed,
            },
        )
        with step_records() as steps_written:
            train(cfg, progress=False)
    stamps = [t for t, _ in steps_written]
    tokens = [rec.get("response/length", 0.0) for _, rec in steps_written]
    return [b - a for a, b in itertools.pairwise(stamps[:-1])], tokens  # the last step also evaluates


def trl_round(steps: int, seed: int, gradient_checkpointing: bool | None, task: str = "addition") -> list[float]:
    """Step times (s) of one TRL GRPOTrainer.train() of ``steps`` steps on the same work."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from klgrad.models import load_model_and_tokenizer

    model_dir = EMBEDDED_DIR / f"tiny_{task}"
    model, tokenizer = load_model_and_tokenizer(model_dir)
    train, _ = make_splits(task, 2000, 50, 0, 2)
    ds = Dataset.from_dict(  # TRL tokenizes without special tokens: prepend BOS as klgrad's encoder does
        {
            "prompt": [tokenizer.bos_token + e.prompt for e in train],
            "answer": [e.answer for e in train],
            "task": [task] * len(train),
        }
    )
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    extra = {} if gradient_checkpointing is None else {"gradient_checkpointing": gradient_checkpointing}
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=256,
            num_generations=8,
            max_completion_length=WORKLOADS[task][1],
            temperature=1.0,
            beta=0.5,
            learning_rate=1e-4,
            max_steps=steps,
            seed=seed,
            **TRL_OFFLINE_CPU,
            reward_weights=[1.0, 0.1],
            **extra,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[accuracy_reward, format_reward],
            args=args,
            train_dataset=ds,
            processing_class=tokenizer,
            callbacks=[Clock()],
        )
        trainer.train()
    return [b - a for a, b in itertools.pairwise(stamps)]


def measure(task: str, rounds: int, steps: int, warmup: int) -> dict:
    """Alternated rounds of klgrad and both TRL settings on one workload; medians and the speed-up."""
    times: dict[str, list[float]] = {"klgrad": [], "TRL (defaults)": [], "TRL (no ckpt)": []}
    resp_len: list[float] = []
    for r in range(rounds):
        t, lengths = klgrad_round(steps + warmup, seed=r, task=task)
        times["klgrad"] += t[warmup - 1 :]
        resp_len += lengths[warmup:]
        times["TRL (defaults)"] += trl_round(steps + warmup, r, None, task)[warmup - 1 :]
        times["TRL (no ckpt)"] += trl_round(steps + warmup, r, False, task)[warmup - 1 :]
    tok = 32 * 8 * (sum(resp_len) / max(1, len(resp_len)))
    med = {k: median(v) for k, v in times.items()}
    best_trl = min(med["TRL (defaults)"], med["TRL (no ckpt)"])
    rows = [
        [k, len(v), med[k], 1.0 / med[k], tok / med[k], best_trl / med[k] if k == "klgrad" else med["klgrad"] / med[k]]
        for k, v in times.items()
    ]
    print_table(
        f"end-to-end RL step, {task} (32 prompts × 8 samples, ≤ {WORKLOADS[task][1]} new tokens, β = 0.5, "
        "on-policy, CPU fp32)",
        ["contender", "steps timed", "median s/step", "steps/s", "response tok/s", "speed-up"],
        rows,
    )
    return {"times_s": times, "median_s": med, "speedup_vs_best_trl": best_trl / med["klgrad"]}


def main(rounds: int = 2, steps: int = 8, warmup: int = 2) -> dict:
    by_task = {task: measure(task, rounds, steps, warmup) for task in WORKLOADS}
    print("speed-up: klgrad row = fastest TRL / klgrad; TRL rows = klgrad / that TRL (so < 1 = slower than klgrad)")
    result = {
        **by_task["addition"],  # the embedded default's numbers at the top level, as before
        "workloads": by_task,
        "speedup_by_workload": {task: r["speedup_vs_best_trl"] for task, r in by_task.items()},
    }
    write_json("e2e", result)
    return result


if __name__ == "__main__":
    main()
