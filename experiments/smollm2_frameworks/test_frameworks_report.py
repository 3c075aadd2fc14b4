"""frameworks_report.py on a hand-made grid: each method's row (its role, its β', its numbers over seeds)
and its paired difference from k2_as_loss, computed by klgrad's own tests on the seeds both have."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

from klgrad.compare.stats import mean_ci, paired_t_p, sign_flip_p

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("frameworks_report", Path(__file__).parent / "frameworks_report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)

KL = {  # method: held-out stepwise KL per seed (trl/grpo-k3 misses seed 2: pairs only where both ran)
    "k2_as_loss": {0: 0.20, 1: 0.22, 2: 0.21},
    "trl/grpo-k3": {0: 0.15, 1: 0.16},
    "none": {0: 1.5, 1: 1.4, 2: 1.6},
}


def make_grid(path: Path) -> None:
    runs = [
        {
            "method": m,
            "beta": 0.5,
            "seed": s,
            "stepwise_kl": v,
            "forward_kl": v + 0.02,
            "reward_mean": 0.6 + v / 10,
            "greedy_accuracy": 0.8,
        }
        for m, by_seed in KL.items()
        for s, v in by_seed.items()
    ]
    path.mkdir()
    (path / "summary.json").write_text(json.dumps({"runs": runs}))
    record = {
        "resolved_config": {"rollout": {"temperature": 0.7}},
        "effective_betas": [
            {"method": "k2_as_loss", "beta": 0.5, "effective_beta": 0.5},
            {"method": "trl/grpo-k3", "beta": 0.5, "effective_beta": 8.984},
            {"method": "none", "beta": 0.5, "effective_beta": 0.5},
        ],
    }
    (path / "grid.json").write_text(json.dumps(record))


def test_rows_in_the_protocols_order_with_paired_differences_from_k2(tmp_path):
    make_grid(tmp_path / "g")
    rows = report.report(tmp_path / "g", tmp_path / "out")
    assert list(rows) == ["trl/grpo-k3", "k2_as_loss", "none"]  # the protocol's order (HEAD_TO_HEAD)
    assert rows["trl/grpo-k3"]["role"] == "TRL < 1.10 default"
    assert rows["trl/grpo-k3"]["effective_beta"] == 8.984
    mean, half = mean_ci([0.20, 0.22, 0.21])
    assert math.isclose(rows["k2_as_loss"]["stepwise_kl"]["mean"], mean, rel_tol=1e-12)
    assert rows["k2_as_loss"]["stepwise_kl"]["ci"] == [mean - half, mean + half]
    d = [0.15 - 0.20, 0.16 - 0.22]  # seeds 0 and 1 only
    v = rows["trl/grpo-k3"]["kl_vs_k2_as_loss"]
    assert v["n"] == 2
    assert math.isclose(v["mean"], sum(d) / 2, rel_tol=1e-12)
    assert (v["t_p"], v["sign_flip_p"]) == (paired_t_p(d), sign_flip_p(d))
    assert rows["k2_as_loss"]["kl_vs_k2_as_loss"] is None
    r = rows["trl/grpo-k3"]["reward_vs_k2_as_loss"]  # reward 0.6 + KL/10 per seed: the KL's differences / 10
    assert math.isclose(r["mean"], sum(d) / 20, rel_tol=1e-9)
    assert math.isclose(r["t_p"], v["t_p"], rel_tol=1e-9)  # a scaled copy of the KL's differences: the same t
    table = (tmp_path / "out" / "headtohead.md").read_text()
    assert "| `trl/grpo-k3` | TRL < 1.10 default | 8.984 | 0.155 [" in table
    assert (tmp_path / "out" / "headtohead.png").stat().st_size > 0
