"""A tiny `klgrad compare` grid end to end: runs, skips finished runs, writes every file."""

from __future__ import annotations

import json

import pytest
import torch

from klgrad.cli import main
from klgrad.experiments.compare import method_overrides, run_compare
from klgrad.trainer import prompt_indices, read_jsonl, rollout_uniforms
from tolerances import llama_depth, network_tol

pytestmark = [pytest.mark.slow, pytest.mark.numerics]

SMALL = {
    "data.n_eval": 8,
    "data.n_train": 200,
    "rollout.prompts_per_step": 4,
    "rollout.group_size": 4,
    "algo.micro_batch_size": 16,
    "train.eval_objective_prompts": 3,
}


def test_tiny_grid_end_to_end_and_skips_finished_runs(tmp_path):
    out = tmp_path / "cmp"
    kw = dict(
        seeds=2,
        steps=2,
        methods=("none", "k2_as_loss", "k3_as_loss"),
        exact_prompts=3,
        estimate_samples=4,
        progress=False,
        extra_overrides=SMALL,
    )
    summary = run_compare(out, **kw)
    for name in ("comparison.png", "frontier.png", "summary.json", "summary.md"):
        assert (out / name).is_file(), name
    data = json.loads((out / "summary.json").read_text())
    assert len(data["runs"]) == 6
    for r in data["runs"]:
        assert 0 <= r["greedy_accuracy"] <= 1
        assert r["exact_kl"] >= -1e-9  # a KL
        assert r["exact_kl_pruned_mass"] < 0.2
        obj = r["objective"]  # the exact objective of the final policy, on the exact KL's prompts
        assert obj["beta"] == 0.5  # the grid's β, method none included
        assert obj["n_prompts"] == 3
        assert obj["kl"] == r["exact_kl"]  # one enumeration gives both
        assert obj["J_star"] >= obj["J"]
        assert 0 <= obj["pruned_mass"] < 0.2
        # float64 sums over a few thousand outcomes of size ≤ ~10: rounding ~1e-12, far below 1e-10
        assert obj["J_star"] - obj["J"] == pytest.approx(0.5 * obj["kl_to_optimum"], abs=1e-10)
        run_dir = out / "runs" / f"{r['method']}-beta0.5-seed{r['seed']}"
        evals = [e for e in read_jsonl(run_dir / "metrics.jsonl") if "eval/J" in e]
        assert [e["step"] for e in evals] == [0, 1, 2]  # the reference, then every evaluation
        assert all(e["eval/J_star"] >= e["eval/J"] for e in evals)
        # Step 0 is the reference against itself, two float32 instances: logits agree within
        # δ = network_tol(depth, 512, LOGIT_BOUND), log-probs within 2δ (log-softmax is 2-Lipschitz); a per-step
        # KL(p‖q) with log q − log p of range ≤ 4δ is ≤ (4δ)²/8 = 2δ² (Hoeffding's lemma), T = 8 steps add up.
        delta = network_tol(llama_depth(4), 512, 30.0)
        assert abs(evals[0]["eval/exact_kl"]) <= 8 * 2 * delta**2
    assert "kl_to_optimum" in summary["table"]["k2_as_loss@0.5"]
    claims = [p["claim"] for p in summary["predictions"]]
    assert any("k2_as_loss keeps KL below k3_as_loss" in c for c in claims)
    for p in summary["predictions"]:
        assert p["verdict"] in ("supported", "opposite", "not resolved at this sample size")
        assert "paired" in p["test"]
        assert p["n_pairs"] == 2
        assert len(p["differences"]) == 2
        assert p["ci95"][0] <= p["mean_difference"] <= p["ci95"][1]
    md = (out / "summary.md").read_text()
    assert "Welch" in md
    assert "paired" in md
    # The paired design: at step 1 every method's policy is the reference, and runs of one seed draw the same
    # prompts and uniforms, so they sample the very same responses (equal rewards and lengths, exactly).
    for seed in (0, 1):
        first = [
            next(r for r in read_jsonl(out / "runs" / f"{m}-beta0.5-seed{seed}" / "metrics.jsonl") if r["step"] == 1)
            for m in kw["methods"]
        ]
        for k in ("reward/mean", "reward/accuracy", "response/length", "kl/k1"):
            assert len({r[k] for r in first}) == 1, (seed, k)
    mtimes = {p: p.stat().st_mtime for p in (out / "runs").glob("*/final.json")}
    run_compare(out, **kw)  # everything finished: nothing is retrained
    assert {p: p.stat().st_mtime for p in (out / "runs").glob("*/final.json")} == mtimes


def test_runs_of_one_seed_share_prompts_and_uniforms_whatever_the_method():
    """The draws are functions of (seed, step) alone, and the grid's configs differ only in kl.* fields."""
    assert prompt_indices(3, 7, 200, 32) == prompt_indices(3, 7, 200, 32)
    assert prompt_indices(3, 7, 200, 32) != prompt_indices(4, 7, 200, 32)
    assert torch.equal(rollout_uniforms(3, 7, slice(0, 4), 8, 6), rollout_uniforms(3, 7, slice(0, 4), 8, 6))
    changed = set()
    for m in ("none", "k1_as_loss", "k2_as_loss", "k3_as_loss", "k1_in_reward"):
        changed |= set(method_overrides(m, "token", 0.5))
    assert all(k.startswith("kl.") for k in changed), changed


def test_methods_differ_only_in_the_kl_choice():
    a, b = method_overrides("k2_as_loss", "token", 0.5), method_overrides("k3_as_loss", "token", 0.5)
    assert {k for k in a if a[k] != b[k]} == {"kl.head"}
    assert method_overrides("k1_in_reward", "token", 0.5)["kl.level"] == "token_to_go"
    assert method_overrides("k1_in_reward", "sequence", 0.5)["kl.form"] == "combined"
    with pytest.raises(ValueError, match="unknown method"):
        method_overrides("k4", "token", 0.5)


def test_cli_rejects_bad_grids(capsys):
    assert main(["compare", "--methods", "k4_as_loss"]) == 2
    assert "unknown methods" in capsys.readouterr().err
    assert main(["compare", "--seeds", "1"]) == 2


def test_final_kl_is_against_the_reference_the_run_reset_to(tmp_path):
    """kl.reset_ref_every = 2 with 2 steps: the reference is reset to the policy after the last step, so the
    run ends regularised towards itself and its final KL is exactly 0 (the policy did move: lr 1e-3)."""
    from safetensors.torch import load_file

    from klgrad.config import load_config
    from klgrad.experiments.compare import final_kl
    from klgrad.trainer import EMBEDDED_DIR, train

    over = {
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "data.n_eval": 8,
        "data.n_train": 200,
        "train.steps": 2,
        "train.eval_every": 0,
        "train.out_dir": str(tmp_path / "run"),
        "train.tensorboard": False,
        "optim.lr": 1e-3,
        "kl.reset_ref_every": 2,
    }
    cfg = load_config("configs/tiny_add.yaml", over)
    train(cfg, progress=False)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    policy, start = (
        load_file(str(ckpt / "policy.safetensors")),
        load_file(str(EMBEDDED_DIR / "tiny_addition" / "model.safetensors")),
    )
    assert any(not torch.equal(policy[k], start[k]) for k in policy if k in start)  # the policy moved
    out = final_kl(cfg, tmp_path / "run", n_prompts=2, samples=4)
    assert out["exact_kl"] == 0.0
    assert out["objective"]["kl"] == 0.0  # judged against the reset reference too
    # sampled: the sampler's KV-cache log-probs vs a full forward of the same weights, float32 rounding only
    assert abs(out["sampled_k1"]) < 1e-5
    assert abs(out["sampled_k3"]) < 1e-5
