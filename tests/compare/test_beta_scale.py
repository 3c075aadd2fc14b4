"""``klgrad compare run --beta-scale``: every method at the same nominal KL strength (klgrad.compare.beta_scale)."""

from __future__ import annotations

import json

import pytest

import klgrad.compare.beta_scale as beta_scale_module
from klgrad.compare.beta_scale import (
    BetaScale,
    aggregation_normaliser,
    beta_factor,
    effective_beta,
    mean_response_length,
    parse_beta_scale,
    settle_scale,
)
from klgrad.compare.design import GridMismatchError, method_overrides
from klgrad.compare.grid import run_compare as run_grid
from klgrad.compare.merge import merge_grids
from klgrad.compare.options import RunOptions
from klgrad.compare.records import Summary
from klgrad.compare.render import summary_markdown
from klgrad.trainer import read_jsonl
from tests.helpers.tiny_runs import SMALL_GRID, small

L = 6.5


def run_compare(out, **fields):
    """:func:`klgrad.compare.grid.run_compare` of the options named by ``fields``."""
    return run_grid(RunOptions.of(out, **fields))


def method_config(tmp_path, method: str, beta: float = 0.5, **over):
    """The small tiny-model config of one compare method at ``beta`` (level sequence)."""
    return small(tmp_path, **method_overrides(method, "sequence", beta), **over)


def test_a_token_mean_divides_by_the_length_a_token_sum_does_not():
    assert aggregation_normaliser("seq_mean_token_sum", L) == 1.0
    assert aggregation_normaliser("token_mean", L) == L
    assert aggregation_normaliser("seq_mean_token_mean", L) == L


def test_the_factor_is_the_kl_normaliser_over_the_policy_gradients_and_one_in_the_reward():
    assert beta_factor("decoupled", "token_mean", "seq_mean_token_sum", L) == L
    assert beta_factor("decoupled", "seq_mean_token_sum", "seq_mean_token_sum", L) == 1.0
    assert beta_factor("decoupled", "token_mean", "token_mean", L) == 1.0  # both divided by L̄: ratio kept
    assert beta_factor("decoupled", "seq_mean_token_sum", "token_mean", L) == 1 / L
    assert beta_factor("combined", "token_mean", "seq_mean_token_sum", L) == 1.0  # reduced with the reward


@pytest.mark.parametrize(
    ("method", "factor"),
    [
        ("trl/grpo-k3", L),  # batch token mean (TRL's dapo loss_type)
        ("trl/grpo-k3-bias-correction", L),
        ("verl/kl-loss-low-var-kl", L),
        ("openrlhf/k1-reward", L),  # KL in the reward, reduced by its token mean
        ("skyrl/kl-loss-k3", L),  # per-sequence mean of token means
        ("trl/rloo-k1-reward", 1.0),  # token sum
        ("k2_as_loss", 1.0),  # klgrad's sequence head, the shared token-sum aggregation
        ("k1_in_reward", 1.0),
        ("none", 1.0),
    ],
)
def test_a_token_mean_method_trains_at_beta_times_the_length_a_sequence_head_at_beta(tmp_path, method, factor):
    cfg = method_config(tmp_path, method, 0.2, **{"algo.shaping": "rloo"})
    assert effective_beta(cfg, L) == pytest.approx(0.2 * factor)


def test_the_flag_parses_off_length_and_a_given_length():
    assert parse_beta_scale(None) is None
    assert parse_beta_scale("off") is None
    assert parse_beta_scale("length") == BetaScale()
    assert parse_beta_scale("length=7.25") == BetaScale(mean_length=7.25, measured=False)
    for bad in ("tokens", "length=0", "length=x", "length=-1"):
        with pytest.raises(ValueError, match="--beta-scale"):
            parse_beta_scale(bad)


def test_a_recorded_length_is_reused_and_a_given_one_is_not_measured(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(beta_scale_module, "mean_response_length", refuse)
    cfg = method_config(tmp_path, "k2_as_loss")
    recorded = BetaScale(mean_length=3.0).as_dict()
    assert settle_scale(BetaScale(), recorded, cfg) == BetaScale(mean_length=3.0)
    assert settle_scale(BetaScale(mean_length=4.0, measured=False), None, cfg).mean_length == 4.0
    assert settle_scale(None, recorded, cfg) is None


def test_the_reference_length_is_a_mean_number_of_response_tokens_and_repeats(tmp_path):
    cfg = method_config(tmp_path, "k2_as_loss")
    a = mean_response_length(cfg, prompts=4, samples=2)
    assert 1.0 <= a <= cfg.rollout.max_new_tokens
    assert a == mean_response_length(cfg, prompts=4, samples=2)  # a fixed seed: every machine's L̄ alike


def test_the_summary_table_states_each_methods_effective_beta():
    summary = {
        "level": "sequence",
        "steps": 2,
        "seeds": 2,
        "betas": [0.5],
        "kl_metric": "exact_kl",
        "temperature": 1.0,
        "table": {"trl/grpo-k3@0.5": {}, "k2_as_loss@0.5": {}},
        "predictions": [],
        "beta_scale": BetaScale(mean_length=L).as_dict(),
        "effective_betas": {"trl/grpo-k3@0.5": 0.5 * L, "k2_as_loss@0.5": 0.5},
    }
    md = summary_markdown(Summary.from_json(summary))
    assert "| method @ β | β' (kl.beta) | greedy acc." in md
    assert "| trl/grpo-k3@0.5 | 3.25 |" in md
    assert "| k2_as_loss@0.5 | 0.5 |" in md
    assert "L̄ = 6.500 tokens" in md
    unscaled = {k: v for k, v in summary.items() if k not in ("beta_scale", "effective_betas")}
    assert "β'" not in summary_markdown(Summary.from_json(unscaled))  # a grid without --beta-scale: its table as before


SMALL = {**SMALL_GRID, "algo.shaping": "rloo", "train.threads": 1}
KW = dict(exact_prompts=3, estimate_samples=4, progress=False, level="sequence", overrides=SMALL)


@pytest.mark.slow
def test_a_scaled_grid_records_each_beta_trains_at_it_and_extends_like_any_other(tmp_path, monkeypatch):
    """grid.json records L̄ and β' = β·L̄ for a token-mean preset, β for klgrad's sequence head; each run trains at
    its β' and its J_β is at the nominal β; a larger --steps extends the preset's runs from their checkpoint and
    reuses the recorded L̄; a continuation without the flag is refused."""
    out = tmp_path / "g"
    calls = []

    def fake_length(cfg, prompts, samples, seed):
        calls.append((prompts, samples, seed))
        return L

    monkeypatch.setattr(beta_scale_module, "mean_response_length", fake_length)
    kw = dict(seeds=2, methods=("trl/grpo-k3", "k2_as_loss"), beta_scale="length", **KW)
    run_compare(out, steps=2, **kw)
    grid = json.loads((out / "grid.json").read_text())
    assert grid["beta_scale"]["mean_length"] == L
    assert grid["beta_scale"]["measured"]
    eff = {r["method"]: r["effective_beta"] for r in grid["effective_betas"]}
    assert eff == {"trl/grpo-k3": pytest.approx(0.5 * L), "k2_as_loss": 0.5}
    for m, run in (("trl/grpo-k3", "trl+grpo-k3-beta0.5-seed1"), ("k2_as_loss", "k2_as_loss-beta0.5-seed1")):
        final = json.loads((out / "runs" / run / "final.json").read_text())
        assert final["kl_beta"] == pytest.approx(eff[m])
        assert f"beta: {eff[m]}" in (out / "runs" / run / "config.yaml").read_text()
        o = final["objective"]
        assert (o["J_star"] - o["J"]) / o["kl_to_optimum"] == pytest.approx(0.5, rel=1e-6)  # nominal β

    summary = run_compare(out, steps=3, **kw)  # extend: resumes, L̄ from the record
    assert len(calls) == 1
    for run in ("trl+grpo-k3-beta0.5-seed0", "trl+grpo-k3-beta0.5-seed1"):
        d = out / "runs" / run
        assert [r["step"] for r in read_jsonl(d / "metrics.jsonl")] == [0, 1, 2, 3]
        assert json.loads((d / "final.json").read_text())["steps"] == 3
        assert (d / "final.step2.json").is_file()
        assert [(p["from_step"], p["to_step"]) for p in read_jsonl(d / "provenance.jsonl")] == [(0, 2), (2, 3)]
    saved = json.loads((out / "summary.json").read_text())
    assert saved["effective_betas"] == {"trl/grpo-k3@0.5": pytest.approx(0.5 * L), "k2_as_loss@0.5": 0.5}
    assert summary.beta_scale["mean_length"] == L
    assert "| trl/grpo-k3@0.5 | 3.25 |" in (out / "summary.md").read_text()
    with pytest.raises(GridMismatchError, match="beta_scale"):
        run_compare(out, steps=3, **{**kw, "beta_scale": None})


@pytest.mark.slow
def test_seeds_run_apart_with_a_given_length_merge_with_their_effective_betas(tmp_path):
    """``PARALLEL`` in experiments/smollm2_frameworks/frameworks_grid.sh:
    each seed into its own folder with L̄ given (recorded as given),
    merged into one grid whose summary states each method's β'."""
    kw = dict(seeds=2, steps=1, methods=("trl/grpo-k3", "k2_as_loss"), beta_scale=f"length={L}", **KW)
    run_compare(tmp_path / "a", only_seeds=[0], **kw)
    run_compare(tmp_path / "b", only_seeds=[1], **kw)
    summary = merge_grids([tmp_path / "a", tmp_path / "b"], tmp_path / "m").summary
    merged = json.loads((tmp_path / "m" / "grid.json").read_text())
    assert merged["beta_scale"] == BetaScale(mean_length=L, measured=False).as_dict()
    assert summary.effective_betas == {"trl/grpo-k3@0.5": pytest.approx(0.5 * L), "k2_as_loss@0.5": 0.5}
    assert "given on the command line" in (tmp_path / "m" / "summary.md").read_text()
    run_compare(tmp_path / "c", only_seeds=[1], **{**kw, "beta_scale": "length=5"})
    with pytest.raises(GridMismatchError, match="beta_scale"):  # another L̄ is another design
        merge_grids([tmp_path / "a", tmp_path / "c"], tmp_path / "m2")
