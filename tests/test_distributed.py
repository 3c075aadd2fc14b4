"""klgrad train under ``accelerate launch``: 2 CPU processes (DDP over gloo) against one process.

Same config and seed: the same sampled rewards at every step, the same clip fractions, the update statistics
within float32 rounding of the forward and backward passes, policy weights within the AdamW step bound (see
tests/helpers/tolerances.py for each derivation), and only rank 0 writes (one metrics line per step, one TensorBoard
event file, one checkpoint set). The second case takes batch-level shaping, the combined form, two
mini-batches of several micro-batches and two epochs, and is interrupted after step 2 and resumed.
docs/distributed.md quotes the measured differences (``KLGRAD_DISTRIBUTED_REPORT=PATH`` writes them as JSON).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from klgrad.config import ConfigError, load_config
from klgrad.distributed import check_config
from klgrad.trainer import EMBEDDED_DIR, read_jsonl, train
from tests.helpers.extras import needs_extras
from tests.helpers.tolerances import adamw_step_bound, llama_depth, network_tol

pytestmark = [pytest.mark.slow, pytest.mark.numerics]
ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/tiny_add.yaml"
STEPS = 3
BASE = {
    "rollout.prompts_per_step": 8,
    "rollout.group_size": 4,
    "data.n_eval": 8,
    "data.n_train": 200,
    "train.steps": STEPS,
    "train.eval_every": 0,
    "train.save_every": 2,
    "train.threads": 1,
    "algo.micro_batch_size": 8,
    "model.device": "cpu",  # CPU DDP (gloo) against one CPU process, on GPU machines too (docs/distributed.md)
}
CASES = {
    "grpo": {"train.tensorboard": True},
    "batch_norm_combined_minibatches_resumed": {
        "train.tensorboard": False,
        "algo.shaping": "reinforce_pp_baseline",  # batch_norm(group_baseline): global batch statistics
        "kl.form": "combined",
        "kl.head": "k1_in_reward",
        "kl.level": "token_to_go",
        "algo.mini_batches": 2,
        "algo.micro_batch_size": 4,  # two micro-batches per mini-batch and rank: no_sync on the first
        "algo.ppo_epochs": 2,
        "optim.lr": 1e-3,
    },
}
REPORT: dict[str, dict] = {}
LOGIT_BOUND = 30.0
"""Bound on |logit| of the embedded tiny reference and the policies trained from it here (measured max |z| on
held-out prompts: see test_logit_bound_holds)."""


def cli_args(over: dict) -> list[str]:
    args = ["--config", CONFIG]
    for k, v in over.items():
        args += [f"--{k}", json.dumps(v)]
    return args


def launch(args: list[str]) -> subprocess.Popen:
    """``accelerate launch --config_file configs/accelerate/ddp_cpu.yaml -m klgrad train ARGS`` (2 processes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KLGRAD_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/ddp_cpu.yaml"]
    cmd += ["--main_process_port", str(29500 + os.getpid() % 1000), "-m", "klgrad", "train", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-4000:]
    return out


def single_process_run(over: dict) -> Path:
    """The same config in this process (no accelerate), restoring torch's thread count."""
    threads = torch.get_num_threads()
    try:
        cfg = load_config(CONFIG, over)
        train(cfg, progress=False)
    finally:
        torch.set_num_threads(threads)
    return Path(cfg.train.out_dir)


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{STEPS:06d}" / "policy.safetensors"))


@needs_extras("accelerate")
@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_train_like_one(tmp_path, case):
    over = {**BASE, **CASES[case]}
    dist_run, single_run = tmp_path / "two", tmp_path / "one"
    resumed = case.endswith("resumed")
    first = launch(cli_args({**over, "train.out_dir": str(dist_run), **({"train.steps": 2} if resumed else {})}))
    single_process_run({**over, "train.out_dir": str(single_run)})  # meanwhile
    finish(first)
    if resumed:  # every rank loads the step-2 checkpoint and goes on to step 3
        finish(launch(["--resume", str(dist_run), "--train.steps", str(STEPS)]))

    one, two = read_jsonl(single_run / "metrics.jsonl"), read_jsonl(dist_run / "metrics.jsonl")
    rel_fwd, rel_bwd = network_tol(llama_depth(4), 512, 1.0), network_tol(2 * llama_depth(4), 512, 1.0)
    # rank 0 alone wrote: one line per step (the step-0 line is the reference's evaluation)
    assert [r["step"] for r in two] == list(range(STEPS + 1))
    for a, b in zip(one[1:], two[1:], strict=True):
        for k in ("reward/mean", "reward/std_in_group", "reward/accuracy", "reward/format"):
            assert a[k] == b[k], (a["step"], k, a[k], b[k])  # the same sampled responses, exactly
        # The clip fraction is a statistic of the update, not of the samples: from the second optimizer step
        # on, the two runs' weights differ by AdamW-amplified rounding, and a ratio lying that close to 1 ± ε
        # can land on either side. Each such decision moves clip/frac by one unit (1/32 in these batches:
        # measured under ATEN_CPU_CAPABILITY=avx2, where one flipped at step 3); allow two per step. A wrong
        # ratio or clip range moves it by many units.
        assert abs(a["clip/frac"] - b["clip/frac"]) <= 2 / 32 + 1e-12, (a["step"], a["clip/frac"], b["clip/frac"])
        assert a["response/length"] == b["response/length"], a["step"]
        # The batches are the same; the passes differ in row count per matmul (16 rows vs 32) and DDP's
        # summation order: float32 rounding of a 4-layer Llama of width <= 512, network_tol (forward, and
        # twice the depth for the backward). Later steps start from weights that differ only where AdamW
        # amplified rounding, i.e. where the gradient is ~0, so the statistics differ there to second order.
        for k, rel in (("entropy", rel_fwd), ("grad_norm", rel_bwd)):
            assert b[k] == pytest.approx(a[k], rel=rel), (a["step"], k)
        # Means of sums of <= 8 token log-prob differences: each log-prob moves by <= 2 x the logits'
        # rounding (log-softmax is 2-Lipschitz in the max norm), the logits (|z| <= LOGIT_BOUND) by rel_fwd.
        for k in ("kl/k1", "loss/policy", "loss/kl"):
            assert b[k] == pytest.approx(a[k], rel=rel_fwd, abs=8 * 2 * rel_fwd * LOGIT_BOUND), (a["step"], k)
    wa, wb = final_weights(single_run), final_weights(dist_run)
    assert wa.keys() == wb.keys()
    diff = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    reference = load_file(str(EMBEDDED_DIR / "tiny_addition" / "model.safetensors"))
    moved = max(float((wa[k] - reference[k]).abs().max()) for k in wa if k in reference)
    REPORT[case] = {"max_abs_weight_diff": diff, "max_abs_weight_change": moved}
    # AdamW turns gradient rounding near its eps into steps of up to ~lr: two runs whose gradients agree to
    # rounding differ per weight by at most twice the distance the run's updates can move a weight.
    lr = over.get("optim.lr", 1e-4)
    updates = STEPS * over.get("algo.ppo_epochs", 1) * over.get("algo.mini_batches", 1)
    assert diff <= 2 * adamw_step_bound(lr, updates), diff
    assert moved >= 0.5 * lr  # and training did move the weights (a first AdamW step moves a weight by ~lr)
    ckpts = sorted(p.name for p in (dist_run / "checkpoints").iterdir())
    assert ckpts == ["latest", "step_000002", f"step_{STEPS:06d}"]  # one checkpoint set, no temporary folders
    events = list((dist_run / "tb").glob("events.out.tfevents.*")) if not resumed else []
    assert len(events) == (0 if resumed else 1)
    assert json.loads((dist_run / "run.json").read_text())["num_processes"] == 2
    for name in ("summary.json", "curves.png", "config.yaml"):
        assert (dist_run / name).is_file(), name
    if path := os.environ.get("KLGRAD_DISTRIBUTED_REPORT"):
        Path(path).write_text(json.dumps(REPORT, indent=1))


# ----------------------------------------------------------------------------------------------------------
# the rules behind the equality, without launching


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"rollout.prompts_per_step": 9}, "rollout.prompts_per_step"),
        ({"rollout.prompts_per_step": 8, "algo.mini_batches": 8}, "algo.mini_batches"),
        ({"rollout.engine": "hf"}, "rollout.engine"),
    ],
)
def test_settings_two_processes_cannot_reproduce_are_config_errors(over, field):
    cfg = load_config(CONFIG, {"rollout.prompts_per_step": 8, **over})
    check_config(cfg, 1)  # one process: fine
    with pytest.raises(ConfigError, match=rf"^{field} "):
        check_config(cfg, 2)


def test_logit_bound_holds():
    """The magnitude LOGIT_BOUND that the equality tolerances scale with holds for the embedded reference."""
    from klgrad.models import load_model_and_tokenizer
    from klgrad.rollout.encoding import encode_prompts
    from klgrad.trainer import load_data

    model, tok = load_model_and_tokenizer(EMBEDDED_DIR / "tiny_addition")
    _, heldout = load_data(load_config(CONFIG, {}))
    ids, mask = encode_prompts(tok, [e.prompt + e.answer for e in heldout[:64]])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits  # (B, L, V)
    assert float(logits[mask].abs().max()) < LOGIT_BOUND / 2  # half: room for the few steps of training here
