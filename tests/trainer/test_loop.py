"""klgrad.trainer.loop: klgrad train end to end on the shipped tiny reference (CPU, a few seconds per run)."""

from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, load_model

from klgrad.config import ConfigError
from klgrad.kl import adaptive_beta
from klgrad.models import load_model_and_tokenizer
from klgrad.rollout.mismatch import mismatch_weights
from klgrad.rollout.samplers import make_sampler
from klgrad.trainer import EMBEDDED_DIR, evaluate, load_data, read_jsonl, reward_specs, train
from tests.helpers.tiny_runs import small
from tests.helpers.tolerances import adamw_step_bound, llama_depth, network_tol

# numerics (rerun by CI under torch's other CPU kernels) only where a tolerance depends on the kernels' rounding:
# bit-for-bit, exact-zero and file checks hold on any kernel set as they hold on one.
pytestmark = pytest.mark.slow
SAMPLE = Path(__file__).parents[2] / "data" / "samples" / "gsm8k_sample.jsonl"

EVERY_STEP = (
    "reward/mean",
    "reward/std_in_group",
    "reward/accuracy",
    "reward/format",
    "kl/k1",
    "kl/k2",
    "kl/k3",
    "kl/logp_gap",
    "kl/logp_gap_abs",
    "response/length",
    "entropy",
    "loss/policy",
    "loss/kl",
    "clip/frac",
    "ratio/mean",
    "ratio/max",
    "grad_norm",
    "beta",
    "time/rollout",
    "time/update",
    "tokens_per_s",
)


SMALL_FLAGS = {
    "rollout.prompts_per_step": 4,
    "rollout.group_size": 4,
    "data.n_eval": 8,
    "data.n_train": 200,
    "train.tensorboard": "false",
    "algo.micro_batch_size": 8,
    "train.threads": 2,
}
"""tests/helpers/tiny_runs.py's small run as ``klgrad train`` flags."""


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def test_end_to_end_run_logs_every_metric_and_checkpoints_the_policy_it_evaluated(tmp_path):
    cfg = small(tmp_path, **{"optim.lr": 1e-3})
    summary = train(cfg, progress=False)
    run = Path(cfg.train.out_dir)
    records = read_jsonl(run / "metrics.jsonl")
    assert records[0]["step"] == 0
    assert "eval/greedy_accuracy" in records[0]  # the reference's own evaluation
    steps = [r for r in records if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        for k in EVERY_STEP:
            assert k in r, k
            assert r[k] is not None, k
            assert math.isfinite(r[k]), (k, r[k])
        assert 0 <= r["reward/accuracy"] <= 1
        assert r["ratio/mean"] == 1.0  # on-policy
    evals = [r for r in records if "eval/greedy_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2, 3]
    for r in evals:  # the exact objective at every evaluation (short answers: on by default)
        assert r["eval/J_star"] >= r["eval/J"]
        assert r["eval/kl_to_optimum"] > 0  # neither the reference nor 3 steps reach the optimum
        assert 0 <= r["eval/objective_pruned_mass"] < 0.2
    for name in ("curves.png", "summary.json", "config.yaml", "run.json", "checkpoints/latest"):
        assert (run / name).exists(), name
    assert summary["steps"] == 3
    assert summary["eval_last"] == {k: v for k, v in evals[-1].items() if k.startswith("eval/") or k == "step"}
    # The policy the run evaluated at step 3 is the one its last checkpoint holds: evaluating the checkpoint
    # again gives the same numbers, discrete ones (accuracies) exactly and continuous ones within the rounding
    # of two float32 evaluations of one network (network_tol of the 4-layer Llama, width ≤ 512: 5.5e-4
    # relative; measured ~1e-7, from memory layout: the same process, other buffers). The step-2 evaluation,
    # one update away, differs by more than that in the exact KL, so a checkpoint of other weights would fail.
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000003"
    policy, tok = load_model_and_tokenizer(EMBEDDED_DIR / "tiny_addition")
    ref, _ = load_model_and_tokenizer(EMBEDDED_DIR / "tiny_addition")
    load_model(policy, str(run / "checkpoints" / "step_000003" / "policy.safetensors"))
    policy.eval()
    ref.eval()
    sampler = make_sampler("klgrad", tok.eos_token_id, tok.pad_token_id)
    again = evaluate(policy, ref, tok, load_data(cfg)[1], cfg, reward_specs(cfg), sampler, seed=cfg.train.seed)
    rel = network_tol(llama_depth(4), 512, 1.0)
    for key in ("eval/greedy_accuracy", "eval/greedy_reward", "eval/sampled_reward", "eval/sampled_accuracy"):
        assert again[key] == evals[-1][key], key
    for key in ("eval/kl_k1", "eval/kl_k3", "eval/J", "eval/J_star", "eval/exact_kl", "eval/kl_to_optimum"):
        assert again[key] == pytest.approx(evals[-1][key], rel=rel, abs=1e-9), key
    assert abs(evals[1]["eval/exact_kl"] - evals[2]["eval/exact_kl"]) > 10 * rel * evals[2]["eval/exact_kl"]
    # ... and it is not the reference: three updates at lr 1e-3 moved it measurably away (exact KL on the
    # held-out prompts, which is 0 up to float32 rounding, ~1e-7, for the reference itself).
    assert evals[-1]["eval/exact_kl"] > 1e-4
    assert abs(evals[0]["eval/exact_kl"]) < 1e-5
    assert steps[0]["lr"] == cfg.optim.lr  # constant schedule


def test_resume_after_interruption_reproduces_the_uninterrupted_run(tmp_path):
    full = small(tmp_path / "a", **{"train.steps": 4})
    train(full, progress=False)
    part = small(tmp_path / "b", **{"train.steps": 4})
    train(part, progress=False, stop_after=3)  # killed after step 3; last checkpoint at step 2
    train(part, resume=True, progress=False)

    def strip(rs):
        return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"} for r in rs]

    a = strip(read_jsonl(Path(full.train.out_dir) / "metrics.jsonl"))
    b = strip(read_jsonl(Path(part.train.out_dir) / "metrics.jsonl"))
    assert a == b
    wa = weights(Path(full.train.out_dir) / "checkpoints" / "step_000004" / "policy.safetensors")
    wb = weights(Path(part.train.out_dir) / "checkpoints" / "step_000004" / "policy.safetensors")
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.mark.parametrize(
    "over",
    [
        {"algo.ppo_epochs": 2, "algo.mini_batches": 2, "kl.head": "k3_as_loss", "kl.level": "token"},
        {"kl.form": "combined", "kl.head": "k1_in_reward", "kl.level": "token_to_go", "algo.shaping": "rloo"},
        {"kl.target_kl": 0.01, "kl.reset_ref_every": 2, "algo.entropy_coef": 0.01, "rollout.engine": "hf"},
    ],
)
def test_off_policy_combined_and_adaptive_paths_do_what_they_say(tmp_path, over):
    cfg = small(tmp_path, **over)
    train(cfg, progress=False)
    run = Path(cfg.train.out_dir)
    rs = [r for r in read_jsonl(run / "metrics.jsonl") if "reward/mean" in r]
    assert len(rs) == 3
    if cfg.algo.ppo_epochs > 1:
        assert any(r["ratio/max"] != 1.0 for r in rs)  # later epochs are off-policy
        assert all(r["loss/kl"] != 0.0 for r in rs)  # the decoupled k3 head is a loss
    else:
        assert all(r["ratio/max"] == 1.0 for r in rs)  # one update per rollout: on-policy, ratios exactly 1
    if cfg.kl.form == "combined":
        assert all(r["loss/kl"] == 0.0 for r in rs)  # the coefficient is in the reward: no separate KL loss
    if cfg.kl.target_kl is not None:  # the controller's rule, step by step, from the recorded KL
        for before, after in itertools.pairwise(rs):
            assert after["beta"] == adaptive_beta(before["beta"], before["kl/k1"], cfg.kl.target_kl, cfg.kl.adapt_rate)
        assert rs[0]["beta"] == cfg.kl.beta
    if cfg.kl.reset_ref_every:  # reset after step 2, before its checkpoint: the saved reference is the policy
        saved = run / "checkpoints" / "step_000002"
        policy, ref = weights(saved / "policy.safetensors"), weights(saved / "ref.safetensors")
        assert all(torch.equal(policy[k], ref[k]) for k in policy)
        start = weights(EMBEDDED_DIR / "tiny_addition" / "model.safetensors")
        assert any(not torch.equal(policy[k], start[k]) for k in policy.keys() & start.keys())  # not the start


def test_a_framework_preset_head_trains_records_its_settings_and_says_what_it_overrode(tmp_path, capsys):
    """``kl.head: <preset id>`` (klgrad.audit.framework_head): the run's config.yaml holds the preset's level, form
    and aggregation, stderr names what it overrode, and its KL term is a loss of its own (verl's low_var_kl: 0 at
    step 1, where π = π_ref, then k3 > 0)."""
    from klgrad.config import load_config, load_yaml

    head = "verl/kl-loss-low-var-kl"
    over = {"kl.form": "combined", "kl.level": "sequence", "optim.lr": 1e-2}
    cfg = small(tmp_path, **{"kl.head": head, "train.steps": 2, "train.eval_every": 0, **over})
    train(cfg, progress=False)
    run = Path(cfg.train.out_dir)
    kl = load_config(run / "config.yaml").kl
    assert (str(kl.head), kl.level, kl.form, kl.aggregation) == (head, "token", "decoupled", "token_mean")
    assert load_yaml((run / "config.yaml").read_text())["kl"]["head"] == head  # recorded as the id
    err = capsys.readouterr().err
    assert f"kl.head {head} (" in err
    assert "(overriding kl.level sequence, kl.form combined, kl.aggregation null)" in err
    rs = [r for r in read_jsonl(run / "metrics.jsonl") if "reward/mean" in r]
    assert len(rs) == 2
    assert rs[0]["loss/kl"] == pytest.approx(0.0, abs=1e-6)  # float32 log-probs of one model: k3(u ≈ 0) ≈ u²/2
    assert rs[1]["loss/kl"] > 1e-3


def test_train_and_update_never_see_a_preset_id(tmp_path, monkeypatch):
    """Config load turns a framework preset id into the KL term it denotes: ``klgrad train --kl.head <id>`` hands
    ``train()`` a config whose ``kl.head`` is the preset's :class:`~klgrad.objective.KLTermHead` (with the preset's
    level, form and aggregation), and ``train()`` hands it to every ``update()`` (tinker's batch-baseline preset, whose
    term refuses to run without the batch's baseline). Nothing in the trainer imports ``klgrad.audit``."""
    import ast

    import klgrad.trainer
    from klgrad.choices import is_preset_id
    from klgrad.cli import main
    from klgrad.objective import KLTermHead
    from klgrad.trainer import loop

    seen: list[tuple[str, object, object]] = []
    real_train, real_update = klgrad.trainer.train, loop.update

    def spy_train(cfg, **kw):
        seen.append(("train", cfg.kl.head, (cfg.kl.level, cfg.kl.form, cfg.kl.aggregation)))
        return real_train(cfg, **kw)

    def spy_update(policy, optimizer, batch, cfg, *args, **kw):
        seen.append(("update", cfg.kl.head, (cfg.kl.level, cfg.kl.form, cfg.kl.aggregation)))
        return real_update(policy, optimizer, batch, cfg, *args, **kw)

    monkeypatch.setattr(klgrad.trainer, "train", spy_train)
    monkeypatch.setattr(loop, "update", spy_update)
    flags = {**SMALL_FLAGS, "train.steps": 2, "train.eval_every": 0, "train.out_dir": str(tmp_path / "run")}
    args = [x for k, v in flags.items() for x in (f"--{k}", str(v))]
    assert main(["train", "--config", "configs/tiny_add.yaml", "--kl.head", "tinker/kl-advantage", *args]) == 0
    assert [where for where, _, _ in seen] == ["train", "update", "update"]
    for _, head, settings in seen:
        assert isinstance(head, KLTermHead)
        assert not is_preset_id(head)
        assert head.name == "tinker/kl-advantage"
        assert settings == ("token", "decoupled", "seq_mean_token_sum")
    trainer_dir = Path(klgrad.trainer.__file__).parent
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for path in trainer_dir.glob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not [m for m in imported if m and m.startswith("klgrad.audit")]


OPTIONAL_PASSES = ("behaviour_logprobs", "batch_stepwise_kl", "correct_mismatch", "adapt_beta", "reset_reference")
"""The loop's optional passes (klgrad.trainer.stages): each runs only when the config asks for it."""


@pytest.mark.parametrize(
    ("over", "called"),
    [
        ({}, ()),  # the default: on-policy, fixed β, no mismatch: no optional pass at all
        (
            {"algo.ppo_epochs": 2, "train.log_stepwise_kl": True, "rollout.mismatch_correction": "token",
             "kl.target_kl": 0.01, "kl.reset_ref_every": 1},
            OPTIONAL_PASSES,
        ),
        ({"rollout.sampler_dtype": "bfloat16"}, ("behaviour_logprobs",)),  # measured, not corrected
    ],
)  # fmt: skip
def test_each_optional_pass_is_a_stage_chosen_at_setup(tmp_path, monkeypatch, over, called):
    """:func:`klgrad.trainer.loop.choose_stages` picks a pass for each option that asks for one and the no-op for
    the others: over 2 steps each chosen pass runs every step and no other does."""
    from klgrad.trainer import loop

    calls = {name: 0 for name in OPTIONAL_PASSES}

    def counted(name, real):
        def stage(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return stage

    for name in OPTIONAL_PASSES:
        monkeypatch.setattr(loop, name, counted(name, getattr(loop, name)))
    train(small(tmp_path, **{"train.steps": 2, "train.eval_every": 0, **over}), progress=False)
    assert calls == {name: 2 if name in called else 0 for name in OPTIONAL_PASSES}


def test_file_data_path_runs(tmp_path):
    cfg = small(
        tmp_path,
        **{
            "data.task": "file",
            "data.path": str(SAMPLE),
            "data.prompt_column": "question",
            "rollout.max_new_tokens": 4,
            "train.steps": 1,
        },
    )
    train(cfg, progress=False)
    r = next(r for r in read_jsonl(Path(cfg.train.out_dir) / "metrics.jsonl") if "reward/mean" in r)
    assert r["reward/failures"] == 0  # the format reward found its pattern (data.response_format)


def test_refuses_to_overwrite_a_run(tmp_path):
    cfg = small(tmp_path, **{"train.steps": 1})
    train(cfg, progress=False)
    with pytest.raises(FileExistsError, match="--resume"):
        train(cfg, progress=False)


def test_cli_train_and_bad_override(tmp_path, capsys):
    from klgrad.cli import main

    assert main(["train", "--config", "configs/tiny_add.yaml", "--kl.bta", "0.5"]) == 2
    assert "kl.bta" in capsys.readouterr().err
    out = tmp_path / "cli"
    assert (
        main(
            [
                "train",
                "--config",
                "configs/tiny_add.yaml",
                "--train.steps",
                "1",
                "--train.out_dir",
                str(out),
                "--rollout.prompts_per_step",
                "2",
                "--rollout.group_size",
                "2",
                "--data.n_eval",
                "4",
                "--train.tensorboard",
                "false",
            ]
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1


def test_wandb_requested_but_missing_is_a_clear_error_before_writing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    cfg = small(tmp_path, **{"train.wandb": True})
    with pytest.raises(ValueError, match=r"train\.wandb"):
        train(cfg, progress=False)
    assert not Path(cfg.train.out_dir).exists()


@pytest.mark.numerics
def test_fast_forward_off_switch_and_identity_mismatch_correction_train_the_same(tmp_path):
    """Three runs of the same config: klgrad's fast forward (default), transformers' forward
    (model.fast_forward=false), and the sampler-mismatch correction switched on with klgrad's own sampler
    (sampler log-probs = trainer log-probs, so every weight is 1). Same samples, same first update, final
    weights within what AdamW can make of float32 rounding."""
    from klgrad.trainer import train

    runs = {
        "fast": {},
        "hf": {"model.fast_forward": False},
        "tis": {"rollout.mismatch_correction": "token"},
        "cpu": {"model.device": "cpu"},  # explicit device = what auto resolves to on this machine
    }
    final, records, cfgs = {}, {}, {}
    for name, over in runs.items():
        cfgs[name] = cfg = small(tmp_path / name, **{"train.eval_every": 0, **over})
        train(cfg, progress=False)
        final[name] = weights(tmp_path / name / "run" / "checkpoints" / "step_000003" / "policy.safetensors")
        records[name] = [json.loads(x) for x in (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = {name: [r for r in recs if "reward/mean" in r] for name, recs in records.items()}
    # The two forwards differ by float32 rounding only (tiny Llama: 4 layers, widths ≤ 512). Relative to the
    # magnitude of what is compared, they agree within network_tol(depth, 512, 1) ≈ 5.5e-4 for the forward
    # (and the backward doubles the depth): a wrong mask, position or cache gives O(1) differences.
    rel_fwd = network_tol(llama_depth(4), 512, 1.0)
    rel_bwd = network_tol(2 * llama_depth(4), 512, 1.0)
    lr, n_steps = cfgs["fast"].optim.lr, cfgs["fast"].train.steps
    for name in ("hf", "tis", "cpu"):
        # Same sampled responses at every step: the sampler draws each token by inverse CDF from the same
        # uniforms, so logits that agree to rounding pick the same token unless a uniform falls within ~1e-6
        # of a CDF boundary (probability ~1e-6 per token, ~1e-3 over the ~800 tokens of the run).
        assert [r["reward/mean"] for r in steps[name]] == [r["reward/mean"] for r in steps["fast"]]
        # Step 1 starts from the same weights and the same batch: the update's entropy and gradient norm are
        # the same computation up to rounding. (Its losses carry no information here: on-policy with policy =
        # reference both are sums that vanish up to rounding.)
        a, b = steps["fast"][0], steps[name][0]
        assert b["entropy"] == pytest.approx(a["entropy"], rel=rel_fwd), name
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rel_bwd), name
        # Later steps start from weights that differ by rounding amplified by AdamW (a gradient of rounding
        # size near AdamW's eps gives a step of up to ~lr): each weight of two such runs differs by at most
        # twice the largest distance n_steps AdamW steps can move it (adamw_step_bound(1e-4, 3) = 3.0e-4).
        bound = 2 * adamw_step_bound(lr, n_steps, cfgs["fast"].optim.betas)
        for k, w in final["fast"].items():
            torch.testing.assert_close(final[name][k], w, rtol=0, atol=bound, msg=f"{name}: {k}")
    # Mismatch weights exp(trainer logp - sampler logp) of one model with itself: 1 up to the rounding of two
    # forwards, rel_fwd of a token log-prob of magnitude <= ~10 in the exponent (<= 2e-2; measured ~1e-6).
    assert all(abs(r["mismatch/weight_mean"] - 1.0) < 10 * rel_fwd for r in steps["tis"])
    assert all("mismatch/weight_mean" not in r for r in records["fast"])


@pytest.mark.numerics
@pytest.mark.parametrize("fast_forward", [True, False])
def test_dropout_is_off_in_rl_so_step_one_has_zero_kl_and_unit_ratios(tmp_path, fast_forward):
    """The embedded reference with attention dropout 0.1 in its config. At step 1 policy = reference, and
    with lr 1e-30 the weights do not move (float32 spacing near the weights is ~1e-9), so both epochs of
    ppo_epochs=2 are at policy = reference = behaviour: the KL loss (k2 coefficient l̄ - r times the ratio) must
    be 0 and every importance ratio 1. With dropout on in the policy's train-mode passes both are noise
    (|log-ratio| of order 1), whichever forward (fast or transformers') is used."""
    import shutil

    model_dir = tmp_path / "dropout_model"
    shutil.copytree(EMBEDDED_DIR / "tiny_addition", model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    cfg = small(
        tmp_path,
        **{
            "model.path": str(model_dir),
            "model.fast_forward": fast_forward,
            "algo.ppo_epochs": 2,
            "algo.micro_batch_size": 16,  # the whole batch in one forward: the reference's shapes exactly
            "optim.lr": 1e-30,
            "train.steps": 1,
            "train.eval_every": 0,
        },
    )
    train(cfg, progress=False)
    rec = next(r for r in read_jsonl(Path(cfg.train.out_dir) / "metrics.jsonl") if r["step"] == 1)
    # float32 log-probs of <= 8 tokens summed (|log p| <= 20 each, a few roundings per token): 8·20·u·(a few)
    # ~ 1e-5 even if the passes differ; dropout left on gives O(1) (KL loss 4182 measured)
    assert abs(rec["loss/kl"]) <= 1e-5, rec["loss/kl"]
    assert abs(rec["kl/k1"]) <= 1e-5, rec["kl/k1"]
    assert abs(rec["ratio/mean"] - 1.0) <= 1e-5, rec["ratio/mean"]
    assert abs(rec["ratio/max"] - 1.0) <= 1e-5, rec["ratio/max"]


def test_top_p_run_without_kl_head_evaluates_kl_on_the_full_distribution(tmp_path):
    """rollout.top_p < 1 is allowed without a KL head, on-policy; eval's KL estimates then come from an
    untruncated sample (the sampler's log-probs are of the full distribution)."""
    cfg = small(tmp_path, **{"rollout.top_p": 0.9, "kl.head": "none", "train.steps": 1, "train.eval_every": 0})
    train(cfg, progress=False)
    rec = read_jsonl(Path(cfg.train.out_dir) / "metrics.jsonl")[-1]
    assert rec["step"] == 1
    assert math.isfinite(rec["eval/sampled_reward"])
    assert math.isfinite(rec["eval/kl_k1"])
    assert rec["eval/kl_k3"] >= 0.0


USER_HEADS = '''
"""A user's KL heads, outside klgrad: a penalty function and a KLHead."""
import dataclasses

from klgrad.kl import KL_HEADS


def half_square(logp, ref_logp):
    """½(log π − log π_ref)²: k2 as a loss, written by a user."""
    return 0.5 * (logp - ref_logp) ** 2


reward_k1 = dataclasses.replace(KL_HEADS["k1_in_reward"], name="my_k1_in_reward")
'''


def test_a_head_in_a_users_file_trains_through_kl_head_module_name(tmp_path, monkeypatch):
    """``--kl.head module:name`` trains a user's penalty ψ(logp, ref_logp) (made a head by custom_kl_head): the
    recorded config names it, and ψ = ½(l − r)² trains as the built-in k2_as_loss does (same draws, weights within
    the AdamW rounding bound of the test above: the two compute the same ψ and coefficient, the user's through
    autograd)."""
    (tmp_path / "user_heads_for_klgrad.py").write_text(USER_HEADS)
    monkeypatch.syspath_prepend(str(tmp_path))
    final, steps, cfgs = {}, {}, {}
    for name, head in (("builtin", "k2_as_loss"), ("user", "user_heads_for_klgrad:half_square")):
        cfgs[name] = cfg = small(tmp_path / name, **{"train.eval_every": 0, "train.steps": 2, "kl.head": head})
        train(cfg, progress=False)
        run = tmp_path / name / "run"
        final[name] = weights(run / "checkpoints" / "step_000002" / "policy.safetensors")
        steps[name] = [r for r in read_jsonl(run / "metrics.jsonl") if "reward/mean" in r]
    recorded = (tmp_path / "user" / "run" / "config.yaml").read_text()
    assert "head: user_heads_for_klgrad:half_square" in recorded
    assert [r["reward/mean"] for r in steps["user"]] == [r["reward/mean"] for r in steps["builtin"]]
    assert steps["user"][-1]["loss/kl"] == pytest.approx(steps["builtin"][-1]["loss/kl"], rel=1e-3)
    bound = 2 * adamw_step_bound(cfgs["user"].optim.lr, 2, cfgs["user"].optim.betas)
    for k, w in final["builtin"].items():
        torch.testing.assert_close(final["user"][k], w, rtol=0, atol=bound, msg=k)
    # a KLHead object by module:name, and a typo in the name, fail or run as they say
    over = {"kl.head": "user_heads_for_klgrad:reward_k1", "kl.form": "combined", "kl.level": "token_to_go"}
    cfg = small(tmp_path / "obj", **{"train.eval_every": 0, "train.steps": 1, **over})
    train(cfg, progress=False)
    with pytest.raises(ConfigError, match=r"kl\.head: .* has no attribute 'nope'"):
        train(small(tmp_path / "bad", **{"kl.head": "user_heads_for_klgrad:nope"}), progress=False)
    assert not (tmp_path / "bad").exists()  # refused before anything was written


@pytest.mark.numerics
def test_packed_and_padded_passes_train_the_same_20_steps(tmp_path):
    """The embedded default (configs/tiny_add.yaml) for 20 steps with ``train.packing`` on (real response positions
    only, the LM head fused into the log-softmax) and off (every padded position). Same samples at every step,
    the first update's statistics within float32 rounding of the two forwards, the final weights within what
    AdamW makes of rounding over 20 updates, and the held-out evaluation's greedy answers the same."""
    from klgrad.config import load_config

    final, steps, evals, cfgs = {}, {}, {}, {}
    for packing in (True, False):
        out = tmp_path / str(packing)
        over = {
            "train.packing": packing,
            "train.steps": 20,
            "train.eval_every": 0,
            "train.save_every": 20,
            "train.out_dir": str(out),
            "train.tensorboard": False,
            "train.threads": 2,  # pinned: the two runs must not differ in their reduction order by load
        }
        cfgs[packing] = cfg = load_config("configs/tiny_add.yaml", over)
        train(cfg, progress=False)
        final[packing] = weights(out / "checkpoints" / "step_000020" / "policy.safetensors")
        records = read_jsonl(out / "metrics.jsonl")
        steps[packing] = [r for r in records if "reward/mean" in r]
        evals[packing] = [r for r in records if "eval/greedy_accuracy" in r]
    assert len(steps[True]) == 20
    # Same draws: the sampler picks each token by inverse CDF from the same uniforms; weights that agree to
    # rounding change a token only when a uniform falls within ~1e-6 of a CDF boundary (~1e-2 over the run's
    # ~10^4 tokens).
    for key in ("reward/mean", "response/length"):
        assert [r[key] for r in steps[True]] == [r[key] for r in steps[False]], key
    # Step 1: the same weights and batch through two forwards that differ only in which positions they compute
    # and in the order of roundings (tiny Llama: 4 layers, widths ≤ 512): network_tol relative to the magnitude;
    # the backward doubles the chain of reductions. A wrong position, mask or head gives O(1) differences.
    a, b = steps[True][0], steps[False][0]
    assert a["entropy"] == pytest.approx(b["entropy"], rel=network_tol(llama_depth(4), 512, 1.0))
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=network_tol(2 * llama_depth(4), 512, 1.0))
    bound = 2 * adamw_step_bound(cfgs[True].optim.lr, 20, cfgs[True].optim.betas)  # 4.0e-3 at lr 1e-4
    for k, w in final[False].items():
        torch.testing.assert_close(final[True][k], w, rtol=0, atol=bound, msg=k)
    assert evals[True][-1]["eval/greedy_accuracy"] == evals[False][-1]["eval/greedy_accuracy"]


def test_resume_refuses_a_changed_beta_naming_it_and_leaves_the_run_as_it_was(tmp_path, capsys):
    """``--resume RUN --kl.beta 0.1`` on a run made at β = 0.5: exit 2 naming ``kl.beta``; config.yaml, metrics and
    checkpoints untouched (it once rewrote config.yaml with 0.1 and trained on at 0.5)."""
    from klgrad.cli import main

    cfg = small(tmp_path, **{"train.steps": 2})
    train(cfg, progress=False)
    run = Path(cfg.train.out_dir)
    before = {p.name: p.read_bytes() for p in (run / "config.yaml", run / "metrics.jsonl")}
    assert main(["train", "--resume", str(run), "--kl.beta", "0.1", "--train.steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "kl.beta cannot change on --resume" in err
    assert "0.5" in err
    assert "train.steps" not in err  # a field that may change is not refused
    assert {p.name: p.read_bytes() for p in (run / "config.yaml", run / "metrics.jsonl")} == before
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000002"]


def test_resume_with_more_steps_extends_the_run_on_its_new_schedule_and_records_it(tmp_path):
    """``train.steps`` may grow on resume (long comparison grids extend their runs): the new value is recorded in
    config.yaml, the resumed steps follow the new learning-rate schedule, and with a constant schedule the extended
    run is the run made that long from the start, bit for bit."""
    from klgrad.config import load_config
    from klgrad.schedule import lr_factor

    whole = small(tmp_path / "a", **{"train.steps": 4})
    train(whole, progress=False)
    short = small(tmp_path / "b", **{"train.steps": 2})
    train(short, progress=False)
    run = Path(short.train.out_dir)
    train(load_config(run / "config.yaml", {"train.steps": 4}), resume=True, progress=False)
    assert load_config(run / "config.yaml").train.steps == 4  # the record says what ran

    def stable(rs):
        return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"} for r in rs]

    assert stable(read_jsonl(run / "metrics.jsonl")) == stable(read_jsonl(Path(whole.train.out_dir) / "metrics.jsonl"))
    wa = weights(Path(whole.train.out_dir) / "checkpoints" / "step_000004" / "policy.safetensors")
    wb = weights(run / "checkpoints" / "step_000004" / "policy.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # a decaying schedule: steps 3 and 4 take the 4-step schedule's rates, not the 2-step one's
    lin = small(tmp_path / "c", **{"train.steps": 2, "optim.schedule": "linear", "train.save_every": 1})
    train(lin, progress=False)
    lin_run = Path(lin.train.out_dir)
    train(load_config(lin_run / "config.yaml", {"train.steps": 4}), resume=True, progress=False)
    lrs = {r["step"]: r["lr"] for r in read_jsonl(lin_run / "metrics.jsonl") if "lr" in r}
    for step in (3, 4):  # the rate recorded at a step is the one set after its update (the next step's)
        assert lrs[step] == pytest.approx(lin.optim.lr * lr_factor(step, 4, 0, "linear"), rel=1e-12)
    # step 3's update ran at the new schedule's rate (2-step schedule: 0 there, so the weights would not move)
    w2, w3 = (weights(lin_run / "checkpoints" / f"step_00000{s}" / "policy.safetensors") for s in (2, 3))
    assert any(not torch.equal(w2[k], w3[k]) for k in w2)


@pytest.mark.numerics
def test_bf16_sampler_trains_with_weights_from_trainer_over_sampler_log_probs(tmp_path, monkeypatch):
    """rollout.sampler_dtype = bfloat16: the rollout's log-probs are the bf16 copy's, the trainer recomputes them
    in float32, and the correction's weights are their ratio (not the trainer's log-probs against themselves,
    which would give w = 1 everywhere); the step records measure the gap; the policy stays float32."""
    import klgrad.trainer.loop as loop

    calls = []

    def spy(trainer_logp, sampler_logp, mask, level, cap):
        calls.append((trainer_logp.clone(), sampler_logp.clone(), mask.clone(), level))
        return mismatch_weights(trainer_logp, sampler_logp, mask, level, cap)

    monkeypatch.setattr(loop, "mismatch_weights", spy)
    over = {"rollout.sampler_dtype": "bfloat16", "rollout.mismatch_correction": "token", "rollout.mismatch_cap": 5.0}
    cfg = small(tmp_path, **{"train.steps": 2, "train.eval_every": 0, **over})
    train(cfg, progress=False)
    assert len(calls) == 2
    for trainer_logp, sampler_logp, mask, level in calls:
        assert level == "token"
        d = (trainer_logp - sampler_logp)[mask]
        # bf16 keeps 8 significant bits: log-probs of size ~1 differ by ~1e-3, far above float32 rounding (1e-6)
        assert float(d.abs().max()) > 1e-4
        w = mismatch_weights(trainer_logp, sampler_logp, mask, "token", 5.0)[mask]
        torch.testing.assert_close(w, d.exp().clamp(max=5.0))
        assert not torch.equal(w, torch.ones_like(w))
    records = [r for r in read_jsonl(Path(cfg.train.out_dir) / "metrics.jsonl") if "reward/mean" in r]
    # before the first update π = π_ref, and the batch KL is the trainer's: its log-probs and the reference's come
    # from one forward of equal weights, so every log-ratio is 0 exactly; the sampler's bf16 log-probs would give
    # the mismatch instead (mismatch/kl_k1, not 0)
    assert (records[0]["kl/k1"], records[0]["kl/logp_gap_abs"]) == (0.0, 0.0)
    assert records[0]["mismatch/kl_k1"] != 0.0
    for r in records:
        assert r["mismatch/logp_diff_abs"] > 0
        assert r["mismatch/kl_k3"] >= 0
        assert r["mismatch/logp_diff_max"] >= r["mismatch/logp_diff_abs"]
        assert math.isfinite(r["mismatch/kl_k1"])
        assert r["mismatch/weight_max"] != 1.0
    final = weights(Path(cfg.train.out_dir) / "checkpoints" / "step_000002" / "policy.safetensors")
    assert {v.dtype for v in final.values()} == {torch.float32}


def test_logging_the_stepwise_kl_is_zero_at_the_reference_and_changes_nothing_else(tmp_path):
    """``train.log_stepwise_kl``: two extra no-grad passes a step, so every other number of the run is the same bit for
    bit (one machine, one thread); at step 1 the policy is the reference, so each prefix's KL is 0 up to rounding;
    after it the logged KL is a KL the update made."""
    runs = {}
    for on in (False, True):
        cfg = small(tmp_path / str(on), **{"train.eval_every": 0, "train.threads": 1, "train.log_stepwise_kl": on})
        train(cfg, progress=False)
        runs[on] = read_jsonl(Path(cfg.train.out_dir) / "metrics.jsonl")

    def numbers(records: list[dict]) -> list[dict]:
        drop = ("tokens_per_s", "kl/stepwise")
        return [{k: v for k, v in r.items() if not k.startswith("time/") and k not in drop} for r in records]

    assert numbers(runs[True]) == numbers(runs[False])
    steps = [r for r in runs[True] if "kl/k1" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # step 1: the two models' float32 logits agree to rounding (δ ≲ 20·2^−23 ≈ 2.4e-6 at |z| ≤ 20), and a KL is second
    # order in δ, ≤ ½δ² ≈ 3e-12 a position, ≤ 10 positions: 1e-9 bounds it (measured 4e-13); one update moves it more
    assert 0.0 <= steps[0]["kl/stepwise"] <= 1e-9
    assert all(r["kl/stepwise"] > 1e-6 for r in steps[1:])
    assert not any("kl/stepwise" in r for r in runs[False])
