"""sharpen_report.py on a hand-made grid of two runs: KL(π‖π*) per run against its formula computed by hand,
the downstream correctness matched to the regime's prompts by prompt text (not by file order, nor by the eval's
positional ids), the regime's example ids resolved through the run's task, and paired differences from klgrad's own
tests."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from klgrad.compare.stats import paired_by_seed
from klgrad.config import load_config
from klgrad.data.tasks import make_splits

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("sharpen_report", Path(__file__).resolve().parent / "sharpen_report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)

BETA = 0.5
REGIME = {  # two held-out prompts, K = 4 reference samples each: success rates 1/4 and 0
    "beta": BETA,
    "samples_per_prompt": 4,
    "prompts": [
        {"id": "a", "prompt": "Calculate a.", "masses": [[0.0, 0.75], [1.0, 0.25]], "success_rate": 0.25},
        {"id": "b", "prompt": "Calculate b.", "masses": [[0.0, 1.0]], "success_rate": 0.0},
    ],
}


def make_run(
    grid: Path, method: str, seed: int, kls: list[float], correct: dict[str, list[bool]], texts: dict | None = None
) -> Path:
    """A finished run as the grid writes it: final.json and the downstream hook's per-problem completions,
    written in the order b, a (the reverse of the regime's) under klgrad eval's positional ids."""
    texts = texts or {e["id"]: e["prompt"] for e in REGIME["prompts"]}
    d = grid / "runs" / f"{method}-beta{BETA}-seed{seed}"
    comp = d / "downstream" / "eval" / "completions" / "policy"
    comp.mkdir(parents=True)
    rows = [{"id": f"heldout-{n}", "prompt": texts[i], "correct": correct[i]} for n, i in enumerate("ba", 1)]
    (comp / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bench = {"greedy_accuracy": 0.5, "pass@1": 0.5, "pass@k": 1.0}
    final = {
        "stepwise_kl_per_prompt": kls,
        "stepwise_kl": sum(kls) / len(kls),
        "stepwise_kl_se": 0.01,
        "batch_kl_k1": 0.25 + seed / 100,
        "greedy_accuracy": 0.5,
        "steps": 60,
        "downstream": {"eval": {"benchmarks": {"heldout": bench, "harder": bench}}},
    }
    (d / "final.json").write_text(json.dumps(final))
    return d


def test_kl_to_optimum_by_hand_and_matched_by_prompt(tmp_path):
    correct = {"a": [True, True, False, False], "b": [False, False, False, False]}
    make_run(tmp_path, "k2_as_loss", 0, [0.5, 0.1], correct)
    run = report.runs(tmp_path)[0]
    got = report.kl_to_optimum(run, REGIME, BETA)
    # prompt a: KL 0.5, p = 1/2, Z = 0.75 + 0.25·e^2; prompt b: KL 0.1, p = 0, Z = 1
    z_a = 0.75 + 0.25 * math.exp(2.0)
    want = ((0.5 - 0.5 / BETA + math.log(z_a)) + (0.1 - 0.0 + 0.0)) / 2
    assert math.isclose(got["kl_to_optimum"], want, rel_tol=1e-12)  # a few float64 roundings
    var_w_a = 0.75 * 1 + 0.25 * math.exp(4.0) - z_a**2  # Var(e^{R/β}) under prompt a's masses
    var_p = 0.5 * 0.5 / 4 / BETA**2  # prompt a's success rate over its 4 samples; b's is 0
    se = math.sqrt(0.01**2 + (var_p + var_w_a / (4 * z_a**2)) / 4)
    assert math.isclose(got["se"], se, rel_tol=1e-12)
    assert (got["prompts"], got["prompts_never_rewarded"]) == (2, 1)


def test_the_regimes_example_ids_resolve_through_the_runs_task(tmp_path):
    """A regime without prompt texts (as ``klgrad regime`` writes it) names the task's example ids; the report
    regenerates the run's held-out split from its config.yaml to find their texts."""
    cfg = ROOT / "configs" / "smollm2_sharpen.yaml"
    d = load_config(str(cfg)).data
    _, heldout = make_splits(d.task, d.n_train, d.n_eval, d.seed, d.digits)
    first, second = heldout[:2]
    regime = {**REGIME, "prompts": [{k: v for k, v in e.items() if k != "prompt"} for e in REGIME["prompts"]]}
    regime["prompts"][0]["id"], regime["prompts"][1]["id"] = first.id, second.id
    correct = {"a": [True, True, False, False], "b": [False, False, False, False]}
    run_dir = make_run(tmp_path, "k2_as_loss", 0, [0.5, 0.1], correct, texts={"a": first.prompt, "b": second.prompt})
    shutil.copy(cfg, run_dir / "config.yaml")
    run = report.runs(tmp_path)[0]
    z_a = 0.75 + 0.25 * math.exp(2.0)
    want = ((0.5 - 0.5 / BETA + math.log(z_a)) + 0.1) / 2
    assert math.isclose(report.kl_to_optimum(run, regime, BETA)["kl_to_optimum"], want, rel_tol=1e-12)
    regime["prompts"][1]["id"] = "chat_addition-9+9+9"  # not a held-out example of this task
    with pytest.raises(ValueError, match="not in the run's held-out split"):
        report.kl_to_optimum(run, regime, BETA)


def test_the_primary_metric_against_the_training_prompts_fixed_points(tmp_path):
    correct = {"a": [True] * 4, "b": [False] * 4}
    k3_offsets = [-0.02, 0.01, -0.05]
    for seed, off in enumerate(k3_offsets):
        make_run(tmp_path, "k2_as_loss", seed, [0.2, 0.2], correct)
        d = make_run(tmp_path, "k3_as_loss", seed, [0.2, 0.2], correct)
        final = json.loads((d / "final.json").read_text())
        (d / "final.json").write_text(json.dumps({**final, "batch_kl_k1": final["batch_kl_k1"] + off}))
    train = {
        "n_prompts": 78,
        "samples_per_prompt": 256,
        "predicted_kl": {"reverse": 0.32, "forward": 0.23},
        "interval_95": {"reverse": [0.31, 0.33], "forward": [0.22, 0.24], "forward_minus_reverse": [-0.1, -0.08]},
    }
    got = report.primary(report.runs(tmp_path), train, tmp_path)
    k2 = [0.25 + s / 100 for s in range(3)]  # make_run's batch KL
    assert got["heads"]["k2_as_loss"]["predicted"] == 0.32  # π* for k2, the forward-KL fixed point for k3
    assert got["heads"]["k3_as_loss"]["predicted_ci"] == [0.22, 0.24]
    assert math.isclose(got["heads"]["k2_as_loss"]["measured"], sum(k2) / 3, rel_tol=1e-12)
    d = got["k3_minus_k2"]["measured"]
    assert d == paired_by_seed({s: k2[s] + o for s, o in enumerate(k3_offsets)}, dict(enumerate(k2)))
    assert math.isclose(d["mean"], sum(k3_offsets) / 3, abs_tol=1e-12)  # rounding of 0.25 + s/100 ± offset
    assert math.isclose(got["k3_minus_k2"]["predicted"], 0.23 - 0.32, rel_tol=1e-12)
    # t of the differences (sd 0.03) against the prediction −0.09: 0.07/(0.03/√3); for 2 degrees of freedom the
    # two-sided p is 1 − t/√(t² + 2) in closed form
    t = 0.07 / (0.03 / math.sqrt(3))
    assert math.isclose(got["k3_minus_k2"]["p_vs_predicted"], 1 - t / math.sqrt(t**2 + 2), rel_tol=1e-9)
    assert (tmp_path / "primary.png").stat().st_size > 0
    assert json.loads((tmp_path / "primary.json").read_text()) == json.loads(json.dumps(got))
    assert "k3_minus_k2_all_seeds" not in got
    assert "registered_seeds" not in got
    # an amended grid registered with 2 seeds: the test is the first two seeds', every seed's is recorded beside it
    amended = report.primary(report.runs(tmp_path), train, tmp_path, registered=2)
    assert amended["registered_seeds"] == 2
    assert amended["k3_minus_k2"]["measured"]["n"] == 2
    assert math.isclose(amended["k3_minus_k2"]["measured"]["mean"], sum(k3_offsets[:2]) / 2, abs_tol=1e-12)
    assert amended["k3_minus_k2_all_seeds"] == d
    assert amended["heads"]["k2_as_loss"]["seeds"] == 2


def test_without_a_regime_the_per_run_and_downstream_tables_are_written(tmp_path):
    """No regime.json: runs.md (one row per run, in method then seed order) and downstream.md, and no prediction."""
    correct = {"a": [True, False], "b": [False, False]}
    for method, seed in (("k3_as_loss", 1), ("k2_as_loss", 1), ("k2_as_loss", 0)):
        make_run(tmp_path / "grid", method, seed, [0.2, 0.3], correct)
    assert report.main([str(tmp_path / "grid"), "--out", str(tmp_path / "out")]) == 0
    rows = (tmp_path / "out" / "runs.md").read_text().splitlines()[2:]
    assert [r.split(" | ")[:3] for r in rows] == [
        ["| k2_as_loss", "0", "0.250"],
        ["| k2_as_loss", "1", "0.260"],
        ["| k3_as_loss", "1", "0.260"],
    ]
    assert (tmp_path / "out" / "downstream.md").is_file()
    assert not (tmp_path / "out" / "prediction.png").exists()


def test_downstream_and_forgetting_measured_afterwards_are_tabled_like_the_hooks_and_the_scripts(tmp_path):
    """`klgrad compare measure` writes downstream.json and forgetting.json (its KLs under "forgetting") beside a
    run's final.json: the tables are those of the hook's final.json and of the older forgetting files."""
    correct = {"a": [True, False], "b": [False, False]}
    grids = {}
    for name in ("before", "after"):
        grid = tmp_path / name
        for method, seed in (("k2_as_loss", 0), ("k3_as_loss", 0), ("k2_as_loss", 1), ("k3_as_loss", 1)):
            d = make_run(grid, method, seed, [0.2, 0.3], correct)
            kls = {"reverse_kl": 0.01 * (seed + 1), "forward_kl": 0.02 + 0.01 * (method == "k3_as_loss")}
            if name == "after":  # measured afterwards: out of final.json into files of their own
                final = json.loads((d / "final.json").read_text())
                (d / "downstream.json").write_text(
                    json.dumps({"measured_by": "x", "downstream": final.pop("downstream")})
                )
                (d / "final.json").write_text(json.dumps(final))
                kls = {"measured_by": "x", "forgetting": kls, "forgetting_reverse_kl": kls["reverse_kl"]}
            (d / "forgetting.json").write_text(json.dumps(kls))
        assert report.main([str(grid), "--out", str(tmp_path / f"out_{name}")]) == 0
        grids[name] = tmp_path / f"out_{name}"
    for table in ("downstream.md", "downstream.json", "forgetting.md", "forgetting.json"):
        assert (grids["after"] / table).read_text() == (grids["before"] / table).read_text(), table


def test_half_steps_are_the_criterions_window_halves():
    assert report.half_steps(60, 0.25) == (7, 8)  # (45, 52.5] and (52.5, 60]
    assert report.half_steps(31, 0.25) == (4, 4)  # (23.25, 27.125] and (27.125, 31]


def test_window_noise_by_hand(tmp_path):
    """Two runs at a constant lr over 8 steps (so the cut is the whole run, each half one step of P = 2 prompts ×
    G = 4 samples): every term of the sampling model computed by hand."""
    for seed in (0, 1):
        d = make_run(tmp_path, "k2_as_loss", seed, [0.2, 0.4], {"a": [True] * 4, "b": [False] * 4})
        final = json.loads((d / "final.json").read_text())
        final.update(sampled_k1_se=0.1, stepwise_kl_se=0.05)
        (d / "final.json").write_text(json.dumps(final))
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": t, "lr": 1e-5}) + "\n" for t in range(1, 9)))
    record = {"resolved_config": {"rollout": {"prompts_per_step": 2, "group_size": 4}}, "estimate_samples": 4}
    (tmp_path / "grid.json").write_text(json.dumps(record))
    test = {"deltas": [0.0, 0.4], "moved": 0.2, "se": 0.2}
    conv = {"parameters": {"gap": 0.08, "se_fraction": 0.25, "window": 0.25}, "by_method": {
        "k2_as_loss": {**test, "before_decay": dict(test)}}}  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps({"convergence": conv}))
    got = report.window_noise(report.runs(tmp_path), tmp_path, tmp_path)["methods"]["k2_as_loss"]
    # σ_w² = SE² × 2 prompts × 4 samples: k1 0.08, stepwise 0.02; σ_b² = Var(0.2, 0.4) − 0.02/4 = 0.015
    assert math.isclose(got["sd_within_k1"] ** 2, 0.08, rel_tol=1e-12)
    assert math.isclose(got["sd_within_stepwise"] ** 2, 0.02, rel_tol=1e-12)
    assert math.isclose(got["sd_between_prompts"] ** 2, 0.015, rel_tol=1e-9)
    for t in got["tests"].values():  # var(δ) = Σ over two halves of (σ_b² + σ_w²/4)/(1 step × 2 prompts)
        assert t["steps_per_half"] == [1, 1]
        assert math.isclose(t["sd_sampling_k1"] ** 2, 0.015 + 0.02, rel_tol=1e-9)
        assert math.isclose(t["sd_sampling_stepwise"] ** 2, 0.015 + 0.005, rel_tol=1e-9)
        assert math.isclose(t["sd_observed"] ** 2, 0.08, rel_tol=1e-12)  # Var(0, 0.4)
        assert math.isclose(t["sd_excess"] ** 2, 0.08 - 0.035, rel_tol=1e-9)
        assert math.isclose(t["sd_projected_stepwise"] ** 2, 0.045 + 0.02, rel_tol=1e-9)
        assert (t["seeds_needed_k1"], t["seeds_needed_stepwise"]) == (200, 163)  # ⌈0.08/0.02²⌉, ⌈162.5⌉
    assert got["scan"] == []  # these runs log no kl/k1 to scan
    assert (tmp_path / "noise.md").is_file()


def test_sampling_var_is_the_sum_over_both_halves():
    # two halves of 1 and 3 steps of P = 2 prompts × G = 4: (σ_b² + σ_w²/4)/(h·2) each
    got = report.sampling_var((1, 3), 0.015, 0.08, 4, 2)
    assert math.isclose(got, (0.015 + 0.02) / 2 + (0.015 + 0.02) / 6, rel_tol=1e-12)


def test_paired_movement_pairs_the_heads_by_seed():
    """δ_a − δ_b over the seeds both have (b has a seed a lacks): sd and correlation by hand."""
    conv = {"by_method": {
        "k3_as_loss": {"seeds": [0, 1, 2], "deltas": [0.1, 0.2, 0.6], "before_decay": None},
        "k2_as_loss": {"seeds": [0, 1, 2, 5], "deltas": [0.0, 0.2, 0.4, 9.0], "before_decay": None},
    }}  # fmt: skip
    got = report.paired_movement(conv, 0.02)
    assert (got["a"], got["b"], got["seeds"]) == ("k3_as_loss", "k2_as_loss", 3)
    t = got["tests"]["end"]
    assert math.isclose(t["sd"], 0.1, rel_tol=1e-9)  # differences 0.1, 0.0, 0.2
    assert math.isclose(
        t["correlation"], 0.10 / math.sqrt(0.14 * 0.08), rel_tol=1e-9
    )  # Σ dev products / √(Σ dev²·Σ dev²)
    assert t["seeds_needed"] == 25  # (0.1/0.02)²
    assert "before_decay" not in got["tests"]


def test_optimum_summary_means_over_seeds_and_pairs_the_heads_by_seed():
    """Each method's mean and t interval over its seeds; the paired difference only over seeds both heads have."""
    opt = {
        "k2_as_loss/seed0": {"kl_to_optimum": 0.30},
        "k2_as_loss/seed1": {"kl_to_optimum": 0.20},
        "k2_as_loss/seed2": {"kl_to_optimum": 0.40},
        "k3_as_loss/seed0": {"kl_to_optimum": 0.35},
        "k3_as_loss/seed1": {"kl_to_optimum": 0.20},
        "none/seed8": {"kl_to_optimum": 1.3},
    }
    got = report.optimum_summary(opt)
    k2 = got["by_method"]["k2_as_loss"]
    assert k2["n"] == 3
    assert math.isclose(k2["mean"], 0.30, abs_tol=1e-12)
    half = 4.302652729911275 * 0.1 / math.sqrt(3)  # t(0.975, 2) · sd / √n, sd of 0.3, 0.2, 0.4 is 0.1
    assert math.isclose(k2["ci"][1] - k2["mean"], half, rel_tol=1e-9)
    assert got["by_method"]["none"]["n"] == 1
    assert got["k3_minus_k2"] == paired_by_seed({0: 0.35, 1: 0.20}, {0: 0.30, 1: 0.20, 2: 0.40})
    assert got["k3_minus_k2"]["n"] == 2
    assert math.isclose(got["k3_minus_k2"]["mean"], 0.025, abs_tol=1e-12)


def enumerated_p(d: list[float]) -> float:
    """The two-sided sign-flip p by full enumeration, vectorised (2^n patterns in blocks), the library's tie rule."""
    from klgrad.compare.stats import TIE_RTOL

    mags = np.abs(np.asarray(d, dtype=np.float64))
    c = abs(float(np.sum(d))) - TIE_RTOL * float(mags.sum())
    n, hits, block = len(mags), 0, 1 << 14
    bits = np.arange(n)
    for start in range(0, 1 << n, block):
        patterns = np.arange(start, min(start + block, 1 << n))[:, None]
        signs = 1.0 - 2.0 * ((patterns >> bits) & 1)  # (block, n)
        hits += int(np.count_nonzero(np.abs(signs @ mags) >= c))
    return hits / (1 << n)


@pytest.mark.parametrize("n", [1, 2, 5, 9, 13, 16, 20])
def test_the_exact_p_is_the_enumerated_p_up_to_20_differences(n):
    rng = np.random.default_rng(n)
    for trial in range(4):
        d = list(rng.normal(0.3 * trial, 1.0, n))
        if trial == 3 and n > 2:  # ties and a zero: equal magnitudes, a difference of exactly 0
            d[1], d[2], d[0] = d[2], -d[2], 0.0
        got = report.sign_flip_p_exact(d)
        assert (got["method"], got["p_lo"], got["p"], got["p_hi"]) == ("enumerated", *[enumerated_p(d)] * 3)


def test_beyond_20_the_bracket_holds_the_closed_form_and_is_scale_invariant():
    d = [0.5, 0.7, 1.1, 0.2, 0.9, 1.3, 0.4] * 4  # 28 differences, all positive: p = 2/2^28 exactly
    p = report.sign_flip_p_exact(d)
    assert p["method"] == "lattice"
    assert p["p_lo"] <= 2 / 2**28 <= p["p_hi"]
    scaled = report.sign_flip_p_exact([1e-6 * x for x in d])
    assert (scaled["p_lo"], scaled["p_hi"]) == pytest.approx((p["p_lo"], p["p_hi"]), rel=1e-12)
    assert report.sign_flip_p_exact([0.0] * 25)["p"] == 1.0


def test_interim_looks_end_at_the_committed_summary():
    """The last look, recomputed from grid.json's merges and the runs' final numbers, is summary.json's test."""
    grid = ROOT / "experiments" / "smollm2_sharpen_converged"
    looks = report.interim_looks(grid)
    s = json.loads((grid / "summary.json").read_text())
    assert looks[-1]["n"] == s["seeds"]
    assert [x["n"] for x in looks] == sorted({x["n"] for x in looks})  # each look adds seeds
    for p in s["predictions"]:
        t = looks[-1]["tests"][p["metric"]]
        assert t["p_adjusted"] == pytest.approx(p["p_adjusted"], rel=1e-9)
        assert t["mean"] == pytest.approx(p["mean_difference"], rel=1e-9)
        assert p["verdict"].startswith(t["verdict"])
    assert looks[-1]["primary_all"]["p"] == pytest.approx(s["primary_all_seeds"]["p_value"], rel=1e-9)


def test_a_policy_that_does_not_move_fails_the_movement_test_at_its_level():
    assert report.frozen_pass_rate(56) == pytest.approx(1 - report.movement_power(0.0, 0.06, 56), abs=1e-9)
    assert 0.94 < report.frozen_pass_rate(56) < 0.96
    assert report.movement_power(0.03, 0.06, 16) > report.movement_power(0.015, 0.06, 16)
