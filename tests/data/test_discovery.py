"""The discovery task: the shipped ``tiny_addition_discovery`` reference rarely writes the rewarded answer, and
``configs/tiny_discovery.yaml`` trains from it.

The reference was fine-tuned (``klgrad sft --task addition_discovery``) on targets that state the true sum with
probability q = DISCOVERY_CORRECT_FRACTION and a+b+1 otherwise. A model that has learnt that mixture writes the
true sum with probability q·c, c <= 1 being how often it adds correctly, plus its slips from a+b+1 onto a+b,
which are at most its error rate on the taught answer (10% greedy when sft stopped at 0.9). The test bounds the
sampled rate at T = 1 by 2q (measured on all 200 held-out prompts: 0.071; sd of a 512-sample rate near it:
0.011, so 2.6 sd of room), and asks for more than none (RL needs some correct samples to learn from).
"""

from __future__ import annotations

import json

import pytest

from klgrad.cli import main
from klgrad.config import load_config
from klgrad.data import DISCOVERY_CORRECT_FRACTION, make_splits
from klgrad.models import load_model_and_tokenizer
from klgrad.sft import greedy_accuracy, sampled_accuracy
from klgrad.trainer import EMBEDDED_DIR, reference_path

CONFIG = "configs/tiny_discovery.yaml"
REFERENCE = EMBEDDED_DIR / "tiny_addition_discovery"


@pytest.fixture(scope="module")
def heldout():
    cfg = load_config(CONFIG)
    _, held = make_splits(cfg.data.task, cfg.data.n_train, cfg.data.n_eval, cfg.data.seed, cfg.data.digits)
    return held[:64]


def test_config_starts_from_the_shipped_discovery_reference():
    cfg = load_config(CONFIG)
    assert cfg.data.task == "addition_discovery"
    assert reference_path(cfg) == REFERENCE
    assert (REFERENCE / "model.safetensors").is_file()
    report = json.loads((REFERENCE / "sft_report.json").read_text())
    assert report["config"]["task"] == "addition_discovery"
    assert report["config"]["data_seed"] == cfg.data.seed


def test_reference_rarely_writes_the_rewarded_answer(heldout):
    q, n = DISCOVERY_CORRECT_FRACTION, 8 * len(heldout)
    model, tok = load_model_and_tokenizer(REFERENCE)
    rate = sampled_accuracy(model, tok, heldout, "addition_discovery", 8, samples=8, seed=0)
    assert 0 < rate < 2 * q, (rate, n)
    # greedy decoding follows the taught answer a+b+1, hardly ever the true sum
    assert greedy_accuracy(model, tok, heldout, "addition_discovery", 8) < 2 * q
    assert greedy_accuracy(model, tok, heldout, "addition_discovery", 8, taught=True) >= 0.5
    # the addition reference, on the same prompts and draws, writes the true sum far more often
    model, tok = load_model_and_tokenizer(EMBEDDED_DIR / "tiny_addition")
    assert sampled_accuracy(model, tok, heldout, "addition", 8, samples=8, seed=0) > 3 * rate


def test_two_training_steps_run(tmp_path):
    out = tmp_path / "disc"
    args = ["train", "--config", CONFIG, "--train.steps", "2", "--train.out_dir", str(out)]
    args += ["--rollout.prompts_per_step", "4", "--rollout.group_size", "4", "--data.n_eval", "8"]
    args += ["--train.eval_every", "2", "--train.tensorboard", "false"]
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2
