"""klgrad.integrations.trl against the real TRL GRPOTrainer (CPU, offline, the embedded tiny model).

(a) klgrad configured as TRL's own KL gives TRL's loss and gradient; (b) klgrad's heads inside TRL give klgrad
core's gradient on the same tensors; (c) a real ``train()`` logs klgrad's metrics. Run with ``-s`` to see the
measured max abs differences (quoted in docs/trl.md). The fixtures and helpers: tests/helpers/trl_checks.py; a
framework preset's KL inside TRL: test_trl_presets.py; docs/trl.md's example: test_trl_example.py.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from torch import Tensor

from klgrad import combined_advantages, kl_loss_per_sequence, policy_gradient_loss, shape_rewards
from klgrad.models import load_model_and_tokenizer
from tests.helpers.extras import reason
from tests.helpers.tolerances import gamma, sum_tol

pytest.importorskip("trl", reason=reason("trl"))  # the whole module runs TRL: skipped without the extra
from trl import GRPOConfig, GRPOTrainer

from klgrad.integrations.trl import KLGradGRPOTrainer, KLGradTRLConfig, aggregate_like_trl
from tests.helpers import trl_checks
from tests.helpers.trl_checks import (
    BETA,
    GROUP,
    LEVEL_NAMES,
    LOSS_TYPES,
    TERM,
    Grads,
    Recorder,
    check,
    grads_of,
    loss_and_grad,
    make_trainer,
    max_abs,
    policy_logps,
    set_mode,
)

# the shared fixtures, bound here so pytest finds them by name
offline, model_dir, dataset, setup = trl_checks.offline, trl_checks.model_dir, trl_checks.dataset, trl_checks.setup

pytestmark = pytest.mark.numerics


# ----------------------------------------------------------------------------------------------------------
# packaging and configuration


def test_import_klgrad_does_not_import_trl() -> None:
    code = "import sys, klgrad, klgrad.integrations; assert 'trl' not in sys.modules, 'trl imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_trl_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` now raises ImportError
    monkeypatch.delitem(sys.modules, "klgrad.integrations.trl")
    with pytest.raises(ImportError, match=r"pip install 'klgrad\[trl\]'"):
        import klgrad.integrations.trl  # noqa: F401


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"head": "k4"}, "head"),
        ({"level": "tokens"}, "level"),
        ({"form": "mixed"}, "form"),
        ({"clip_eps": 1.5}, "clip_eps"),
        ({"ratio_level": "batch"}, "ratio_level"),
        ({"shaping": "zscore"}, "shaping"),
        ({"std_min": 0.0}, "std_min"),
        ({"std_max": -1.0}, "std_max"),
        ({"form": "combined", "level": "token"}, "level"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field) as error:
        KLGradTRLConfig(**kwargs)
    assert "KLGradTRLConfig" in str(error.value)


def test_trainer_rejects_settings_it_cannot_honour(setup: dict, dataset: Dataset) -> None:
    model, tok, out = setup["model"], setup["tokenizer"], setup["out"]
    combined = KLGradTRLConfig("k1_in_reward", "sequence", "combined")
    with pytest.raises(ValueError, match=r"KLGradTRLConfig\.shaping"):
        make_trainer(KLGradGRPOTrainer, model, tok, dataset, out, klgrad_config=combined, scale_rewards="batch")
    with pytest.raises(ValueError, match=r"multi_objective_aggregation"):
        make_trainer(
            KLGradGRPOTrainer,
            model,
            tok,
            dataset,
            out,
            klgrad_config=combined,
            multi_objective_aggregation="normalize_then_sum",
        )
    with pytest.warns(UserWarning, match=r"beta is 0"):
        make_trainer(KLGradGRPOTrainer, model, tok, dataset, out, beta=0.0)


def test_trl_parser_reads_the_klgrad_config_from_yaml_and_flags(tmp_path: Path) -> None:
    """TRL's own TrlParser builds KLGradTRLConfig beside GRPOConfig from a recipe YAML and command-line flags (a
    field typed ``str | KLHead`` made argparse call KLHead('k3_as_loss') and fail)."""
    from trl import TrlParser

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"output_dir: {tmp_path / 'out'}\nuse_cpu: true\nbf16: false\nhead: k3_as_loss\nlevel: token\nclip_eps: 0.1\n"
    )
    parser = TrlParser(dataclass_types=[GRPOConfig, KLGradTRLConfig])
    _, cfg = parser.parse_args_and_config(["--config", str(recipe), "--head", "k1_in_reward", "--form", "combined",
                                           "--level", "token_to_go"])  # fmt: skip
    assert cfg == KLGradTRLConfig("k1_in_reward", "token_to_go", "combined", clip_eps=0.1)
    assert cfg.kl_head.name == "k1_in_reward"


def test_the_plugin_takes_the_config_s_kl_record_and_declares_no_kl_option() -> None:
    """One record: the TRL plug-in's KL options are the run config's (:class:`klgrad.config.KLHeadOptions`, the base
    of the ``kl`` section), inherited, never declared again, so they refuse a value by the same rule; it adds only the
    combined form's shaping, and its β is TRL's own."""
    import dataclasses

    from klgrad.config import ConfigError, KLConfig, KLHeadOptions, load_config

    assert issubclass(KLGradTRLConfig, KLHeadOptions)
    assert issubclass(KLConfig, KLHeadOptions)
    assert set(KLGradTRLConfig.__annotations__) == {"shaping", "std_min", "std_max"}  # its own fields: no KL option
    assert "beta" not in {f.name for f in dataclasses.fields(KLGradTRLConfig)}
    for kwargs in ({"clip_eps": 1.5}, {"form": "combined", "level": "token"}):
        with pytest.raises(ValueError, match=list(kwargs)[-1]):
            KLGradTRLConfig(**kwargs)
        with pytest.raises(ConfigError, match=rf"^kl\.{list(kwargs)[-1]} "):
            load_config(None, {f"kl.{k}": v for k, v in kwargs.items()})
    cfg = KLGradTRLConfig("k3_as_loss", "token", clip_eps=None)
    assert cfg.kl_options(0.25) == KLConfig(head="k3_as_loss", level="token", clip_eps=None, beta=0.25)


def test_aggregate_like_trl_hand_values() -> None:
    # totals S = [2, 6], token counts n = [1, 3], B = 2, L = 4, N = 8 tokens, G = 2 accumulation steps, S_gen = 1
    totals = torch.tensor([2.0, 6.0], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    kw = {"num_items_in_batch": 8.0, "max_completion_length": 4, "steps_per_generation": 1, "num_processes": 1}
    expect = {
        "grpo": (2 / 1 + 6 / 3) / 2 / 2,  # mean_i S_i / n_i, / G
        "bnpo": 8 / 4 / 2,  # Σ S / Σ n / G
        "dr_grpo": 8 / (2 * 4) / 2,  # Σ S / (B L) / G
        "dapo": 8 / (8 * 2 / 1),  # Σ S / (N / P · G / S_gen)
        "luspo": (2 + 6) / 2 / 2,  # mean_i S_i / G
    }
    for loss_type, value in expect.items():
        got = aggregate_like_trl(totals, mask, loss_type, accumulation_steps=2, train=True, **kw)
        assert float(got) == pytest.approx(value, abs=1e-15), loss_type
    assert float(aggregate_like_trl(totals, mask, "dapo", accumulation_steps=2, train=False, **kw)) == 1.0


# ----------------------------------------------------------------------------------------------------------
# (a) parity with TRL's own KL


def parity_cases(inputs: dict, old: Tensor) -> list[tuple[bool, str, dict]]:
    """(training mode?, loss_type, batch): dapo in eval and training, on- and off-policy; other loss types
    off-policy in training (their aggregation is also checked by hand in test_aggregate_like_trl_hand_values)."""
    off = {**inputs, "old_per_token_logps": old}
    cases = [(train, "dapo", batch) for train in (False, True) for batch in (inputs, off)]
    return cases + [(True, loss_type, off) for loss_type in LOSS_TYPES if loss_type != "dapo"]


@pytest.mark.parametrize("bias_correction", [False, True])
def test_trl_choice_reproduces_trl_loss(setup: dict, dataset: Dataset, bias_correction: bool) -> None:
    """TRL's KL is per-token k3 as loss, optionally times an unclipped token importance ratio ρ (bias correction).

    use_bias_correction_kl=False: klgrad k3_as_loss, token level, decoupled, is_correction=False gives TRL's
    loss and gradient, on- and off-policy. True: TRL's term ρ·k3 has value k3 on-policy (so the loss equals
    klgrad's k3 configuration) but gradient ρ(∇k3 + k3∇l) = ρ·u·∇l: klgrad's k2_as_loss at token level with a
    token ratio and no clip. Its gradient is not k3's: the test checks that too.
    """
    model, tok, out, inputs = setup["model"], setup["tokenizer"], setup["out"], setup["inputs"]
    trl = make_trainer(GRPOTrainer, model, tok, dataset, out, use_bias_correction_kl=bias_correction)
    k3_cfg = KLGradTRLConfig("k3_as_loss", "token", "decoupled", is_correction=False)
    k2_cfg = KLGradTRLConfig("k2_as_loss", "token", "decoupled", clip_eps=None, ratio_level="token")
    k3 = make_trainer(KLGradGRPOTrainer, model, tok, dataset, out, klgrad_config=k3_cfg)
    k2 = make_trainer(KLGradGRPOTrainer, model, tok, dataset, out, klgrad_config=k2_cfg)
    loss_diff, grad_diff, param_diff, k3_gap = 0.0, 0.0, 0.0, 0.0
    for train, loss_type, batch in parity_cases(inputs, setup["old"]):
        set_mode([trl, k3, k2], model, train)
        for t in (trl, k3, k2):
            t.loss_type = loss_type
        trl_loss, trl_grads = loss_and_grad(trl, model, batch)
        assert math.isfinite(trl_loss)
        same_value = not bias_correction or "old_per_token_logps" not in batch  # TRL's value: ρ·k3
        if same_value:
            k3_loss, k3_grads = loss_and_grad(k3, model, batch)
            loss_diff = max(loss_diff, abs(trl_loss - k3_loss))
        twin = loss_and_grad(k2, model, batch)[1] if bias_correction else k3_grads
        d_logp, d_param = trl_grads.diff(twin)
        grad_diff, param_diff = max(grad_diff, d_logp), max(param_diff, d_param)
        if bias_correction and same_value:
            k3_gap = max(k3_gap, trl_grads.diff(k3_grads)[0])
    model.eval()
    check(f"(a) use_bias_correction_kl={bias_correction}", loss=loss_diff, d_logp=grad_diff, d_param=param_diff)
    if bias_correction:
        print(f"    TRL's vs klgrad k3_as_loss's ∂loss/∂logp: max |Δ| {k3_gap:.1e} (they differ, as they must)")
        assert k3_gap > 1e-4


# ----------------------------------------------------------------------------------------------------------
# (b) parity with klgrad core


def test_k2_decoupled_matches_kl_loss(setup: dict, dataset: Dataset) -> None:
    """loss = [Σ_i,t PG_it + β Σ_i KL_i] / N (dapo, eval), with klgrad's policy_gradient_loss and kl_loss on TRL's
    log-probs and advantages; every level on-policy, and off-policy (clip 0.2) with both ratio levels."""
    model, tok, out, inputs, old = setup["model"], setup["tokenizer"], setup["out"], setup["inputs"], setup["old"]
    model.eval()
    mask = inputs["completion_mask"].bool()
    adv = inputs["advantages"][:, None].expand(mask.shape)  # (B, T)
    n_items = float(inputs["num_items_in_batch"])
    plain = make_trainer(GRPOTrainer, model, tok, dataset, out)

    def core_loss(level: str, ratio_level: str, behaviour: Tensor | None) -> Tensor:
        logp = policy_logps(plain, model, inputs)  # (B, T)
        pg = policy_gradient_loss(logp, adv, mask, old_logp=behaviour, clip_eps_low=0.2, clip_eps_high=0.2)
        kl = kl_loss_per_sequence(
            "k2_as_loss", logp, inputs["ref_per_token_logps"], mask,
            old_logp=behaviour, level=level, clip_eps=0.2, ratio_level=ratio_level,
        )  # fmt: skip
        return (pg.sum() + BETA * kl.sum()) / n_items

    cases = [(level, "sequence", None) for level in LEVEL_NAMES]
    cases += [(level, ratio_level, old) for level in LEVEL_NAMES for ratio_level in ("sequence", "token")]
    grad_diff = param_diff = 0.0
    seen: dict[tuple[str, str, bool], Grads] = {}
    for level, ratio_level, behaviour in cases:
        cfg = KLGradTRLConfig("k2_as_loss", level, "decoupled", clip_eps=0.2, ratio_level=ratio_level)
        ours = make_trainer(KLGradGRPOTrainer, model, tok, dataset, out, klgrad_config=cfg)
        batch = inputs if behaviour is None else {**inputs, "old_per_token_logps": behaviour}
        _, grads = loss_and_grad(ours, model, batch)
        _, core = grads_of(lambda: core_loss(level, ratio_level, behaviour), model)  # noqa: B023 (called now)
        d_logp, d_param = grads.diff(core)
        grad_diff, param_diff = max(grad_diff, d_logp), max(param_diff, d_param)
        seen[(level, ratio_level, behaviour is None)] = grads
    check(f"(b) k2_as_loss decoupled vs klgrad core ({len(cases)} cases)", d_logp=grad_diff, d_param=param_diff)
    for ratio_level, on_policy in (("sequence", True), ("sequence", False), ("token", False)):  # level is wired
        by_level = [seen[(level, ratio_level, on_policy)] for level in LEVEL_NAMES]
        assert min(a.diff(b)[0] for i, a in enumerate(by_level) for b in by_level[i + 1 :]) > 1e-4


@pytest.mark.parametrize("level", ["sequence", "token_to_go"])
def test_k1_in_reward_combined_matches_combined_advantages(setup: dict, dataset: Dataset, level: str) -> None:
    """TRL's advantages become combined_advantages(R, k1_in_reward, l_gen, r, m, β, level, G, grpo), (B, T), and the
    loss gradient is klgrad's policy gradient with them."""
    model, tok, out = setup["model"], setup["tokenizer"], setup["out"]
    model.eval()
    recorder = Recorder()
    cfg = KLGradTRLConfig("k1_in_reward", level, "combined")
    ours = make_trainer(KLGradGRPOTrainer, model, tok, dataset, out, reward=recorder, klgrad_config=cfg)
    torch.manual_seed(2)
    batch = ours._generate_and_score_completions(setup["rows"])
    mask = batch["completion_mask"].bool()
    rewards = torch.tensor(recorder.last)  # (B,) raw R
    with torch.no_grad():
        logp_gen = policy_logps(ours, model, batch)
    core_adv = combined_advantages(
        rewards, "k1_in_reward", logp_gen, batch["ref_per_token_logps"], mask,
        beta=BETA, level=level, group_size=GROUP, method="grpo",
    )  # fmt: skip
    adv_diff = max_abs(batch["advantages"], core_adv)
    no_kl = torch.where(mask, shape_rewards(rewards, GROUP, "grpo")[:, None], 0.0)
    assert batch["advantages"].shape == mask.shape
    assert max_abs(batch["advantages"], no_kl) > 1e-3  # β·C really entered the advantages

    n_items = float(batch["num_items_in_batch"])
    _, grads = loss_and_grad(ours, model, batch)
    _, core = grads_of(
        lambda: policy_gradient_loss(policy_logps(ours, model, batch), core_adv, mask).sum() / n_items, model
    )
    d_logp, d_param = grads.diff(core)
    check(f"(b) k1_in_reward combined {level}", advantage=adv_diff, d_logp=d_logp, d_param=d_param)


def test_combined_std_min_std_max_pass_through(setup: dict, dataset: Dataset) -> None:
    """std_min / std_max reach combined_advantages: with std_min = 10 (above any group std of R - β·C here, so it
    binds) TRL's advantages equal klgrad core's with the same bounds and differ from the unclipped ones."""
    model, tok, out = setup["model"], setup["tokenizer"], setup["out"]
    model.eval()
    recorder = Recorder()
    cfg = KLGradTRLConfig("k1_in_reward", "sequence", "combined", std_min=10.0, std_max=20.0)
    ours = make_trainer(KLGradGRPOTrainer, model, tok, dataset, out, reward=recorder, klgrad_config=cfg)
    torch.manual_seed(2)
    batch = ours._generate_and_score_completions(setup["rows"])
    mask = batch["completion_mask"].bool()
    rewards = torch.tensor(recorder.last)  # (B,) raw R
    with torch.no_grad():
        logp_gen = policy_logps(ours, model, batch)

    def core(**bounds: float) -> torch.Tensor:
        return combined_advantages(
            rewards, "k1_in_reward", logp_gen, batch["ref_per_token_logps"], mask,
            beta=BETA, level="sequence", group_size=GROUP, method="grpo", **bounds,
        )  # fmt: skip

    assert max_abs(batch["advantages"], core(std_min=10.0, std_max=20.0)) < 1e-6
    assert max_abs(batch["advantages"], core()) > 1e-3  # std_min binds


# ----------------------------------------------------------------------------------------------------------
# (c) a real train()


@pytest.mark.parametrize(
    ("cfg", "trl_args", "expected"),
    [
        (
            KLGradTRLConfig("k2_as_loss", "sequence", "decoupled"),
            {"num_iterations": 2},  # off-policy: TRL keeps old log-probs, klgrad clips the KL head
            ("kl/k1", "kl/k2", "kl/k3", "kl/logp_gap", "kl/logp_gap_abs", "loss/kl", "clip/kl_frac"),
        ),
        (
            KLGradTRLConfig("k1_in_reward", "token_to_go", "combined"),
            {},
            ("kl/k1", "kl/k2", "kl/k3", "kl/logp_gap", "kl/reward_penalty"),
        ),
    ],
    ids=["k2-decoupled-offpolicy", "k1-combined-token_to_go"],
)
def test_train_logs_klgrad_metrics(
    model_dir: Path, dataset: Dataset, tmp_path: Path, cfg: KLGradTRLConfig, trl_args: dict, expected: tuple
) -> None:
    model, tok = load_model_and_tokenizer(model_dir, attn_implementation="eager")
    trainer = make_trainer(
        KLGradGRPOTrainer,
        model,
        tok,
        dataset,
        tmp_path,
        klgrad_config=cfg,
        max_steps=3,
        learning_rate=3e-3,
        **trl_args,
    )
    trainer.train()
    steps = [rec for rec in trainer.state.log_history if "loss" in rec]
    assert len(steps) == 3
    for rec in steps:
        for key in expected:
            assert key in rec, (key, rec)
            assert math.isfinite(rec[key]), (key, rec)
        assert "kl" not in rec  # TRL's own KL term is off: the KL is counted once, as klgrad's
    assert steps[-1]["kl/k3"] > 0  # the policy moved away from the reference


TRL_PRESETS = {  # audit preset id -> the GRPOConfig that selects it
    "trl/grpo-k3": {"use_bias_correction_kl": False},
    "trl/grpo-k3-bias-correction": {"use_bias_correction_kl": True},
    "trl/grpo-k3-bias-correction-gspo": {"use_bias_correction_kl": True, "importance_sampling_level": "sequence"},
}


@pytest.mark.parametrize("preset_id", list(TRL_PRESETS))
def test_audit_presets_are_trls_own_kl(setup: dict, dataset: Dataset, preset_id: str) -> None:
    """The GRPO presets of ``klgrad audit --framework trl`` against TRL itself on the same tensors: with zero
    advantages TRL's loss is β·(its per-token KL, token-mean over the batch, loss_type "bnpo"), so the preset's
    per-token term aggregated the same way must give TRL's loss and its gradient w.r.t. the log-probs, on- and
    off-policy. Tolerances: ``check``'s (the same arithmetic, other operation order)."""
    from klgrad.audit.frameworks import select

    (preset,) = [p for p in select("trl") if p.id == preset_id]
    model, tok, out, inputs = setup["model"], setup["tokenizer"], setup["out"], setup["inputs"]
    trl = make_trainer(GRPOTrainer, model, tok, dataset, out, **TRL_PRESETS[preset_id])
    trl.loss_type = "bnpo"
    set_mode([trl], model, False)
    loss_diff, grad_diff = 0.0, 0.0
    for batch in ({**inputs}, {**inputs, "old_per_token_logps": setup["old"]}):
        batch["advantages"] = torch.zeros_like(batch["advantages"])
        trl_loss, trl_grads = loss_and_grad(trl, model, batch)
        logp = policy_logps(trl, model, batch).detach().requires_grad_(True)
        mask = batch["completion_mask"].to(logp.dtype)
        old = batch.get("old_per_token_logps", logp.detach())
        term = preset.token_kl(logp, batch["ref_per_token_logps"], old, batch["completion_mask"].bool())  # (B, T)
        ours = BETA * (term * mask).sum() / mask.sum()
        (g_logp,) = torch.autograd.grad(ours, logp)
        loss_diff = max(loss_diff, abs(float(ours) - trl_loss))
        trl_g = trl_grads.logp[:, -logp.shape[1] :]  # the forward's log-probs cover prompt and completion
        grad_diff = max(grad_diff, max_abs(g_logp * mask, trl_g * mask))
    print(f"\naudit preset {preset.variant!r} vs TRL: max |Δloss| {loss_diff:.1e}, max |Δ∂loss/∂logp| {grad_diff:.1e}")
    assert loss_diff <= 2 * sum_tol(58, TERM)
    assert grad_diff <= 2 * gamma(10) * TERM
