"""tools/same_run.py: two run directories are the same run when everything but the timings is equal, bit for bit."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

spec = importlib.util.spec_from_file_location("same_run", Path(__file__).with_name("same_run.py"))
same_run = importlib.util.module_from_spec(spec)
sys.modules["same_run"] = same_run
spec.loader.exec_module(same_run)


def fake_run(root: Path, *, weight: float = 1.0, reward: float = 0.5, seconds: float = 0.1) -> Path:
    """A run directory as klgrad train leaves it: two records, a summary, one checkpoint."""
    ckpt = root / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    (root / "checkpoints" / "latest").write_text(ckpt.name)
    rows = [
        {"step": 0, "eval/J": 0.25},
        {"step": 1, "reward/mean": reward, "time/step": seconds, "tokens_per_s": 9 / seconds},
    ]
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "summary.json").write_text(
        json.dumps({"steps": 1, "mean_step_time_s": seconds, "last": {"reward/mean": reward}})
    )
    save_file({"w": torch.full((3,), weight)}, ckpt / "policy.safetensors")
    state = {
        "optimizer": {"state": {0: {"exp_avg": torch.ones(3)}}},
        "torch_rng": torch.randint(0, 255, (8,), dtype=torch.uint8),
    }
    torch.save(state, ckpt / "optim.pt")
    (ckpt / "state.json").write_text(json.dumps({"step": 1, "beta": 0.5, "config": {"train": {"out_dir": str(root)}}}))
    return root


def test_timings_and_the_output_folder_do_not_count(tmp_path, capsys):
    a, b = fake_run(tmp_path / "a"), fake_run(tmp_path / "b", seconds=0.3)
    assert same_run.differences(a, b) == []
    assert same_run.main([str(a), str(b)]) == 0
    assert "same run" in capsys.readouterr().out


def test_one_weight_one_ulp_apart_is_another_run(tmp_path):
    nudged = float(torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)))  # 1 + 2^-23: one float32 ulp
    a, b = fake_run(tmp_path / "a"), fake_run(tmp_path / "b", weight=nudged)
    assert same_run.differences(a, b) == ["policy.safetensors: w differs"]
    assert same_run.main([str(a), str(b)]) == 1


def test_a_metric_that_differs_is_named_with_its_step(tmp_path):
    a, b = fake_run(tmp_path / "a"), fake_run(tmp_path / "b", reward=0.5000001)
    diffs = same_run.differences(a, b)
    assert diffs == [
        "metrics.jsonl step 1: reward/mean: 0.5 != 0.5000001",
        "summary.json: last.reward/mean: 0.5 != 0.5000001",
    ]
