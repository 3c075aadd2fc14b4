"""A framework preset id as ``KLGradTRLConfig.head``: that framework's KL term inside TRL's loss, or a refusal at
construction naming what to use instead (klgrad.integrations.trl, “A framework preset”).

One preset of every family (what decides the term's code path: where it enters, the return, the ratio, the clip,
a batch baseline, π_old as the reference, the aggregation) against klgrad core on the same tensors, on- and
off-policy: TRL's policy loss as klgrad's ``policy_gradient_loss`` computes it (dapo, eval: Σ/N, checked in
test_trl.py (b)) plus β · the preset's own term (:func:`klgrad.audit.framework_head.preset_term`, the record the
audit differentiates) reduced by klgrad's aggregation of the preset (``KL_AGGREGATION``), whatever TRL's loss_type.
Tolerances: ``check``'s (tests/helpers/trl_checks.py), with its bound on a per-token term |A·ρ| + β·|k| measured on
each case's batch (``term_bound``: a k3 of a token the moved policy finds unlikely reaches ~5 here).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from klgrad import policy_gradient_loss
from klgrad.audit.framework_head import KL_AGGREGATION, preset_term
from klgrad.audit.presets import PRESETS
from klgrad.models import load_model_and_tokenizer
from klgrad.objective import aggregate_totals
from tests.helpers.extras import reason
from tests.helpers.tolerances import gamma, llama_depth, network_tol

pytest.importorskip("trl", reason=reason("trl"))
from klgrad.integrations.trl import KLGradGRPOTrainer, KLGradTRLConfig, beta_conversion
from tests.helpers import trl_checks
from tests.helpers.trl_checks import BETA, GROUP, grads_of, loss_and_grad, make_trainer, policy_logps

# the shared fixtures, bound here so pytest finds them by name
offline, model_dir, dataset, setup = trl_checks.offline, trl_checks.model_dir, trl_checks.dataset, trl_checks.setup

pytestmark = pytest.mark.numerics


def family(p) -> tuple:
    """What decides a preset's code path in the trainer and in its term."""
    reward = p.style == "reward"
    return (p.style, reward and p.returns, reward and p.ratio, reward and p.clip is None, p.batch_baseline,
            p.reference_is_behaviour, p.aggregation)  # fmt: skip


def depends_on_u(p) -> bool:
    """Whether the per-token rule changes with u = l − r (not so for an ignored flag: slime's grpo kl-coef)."""
    u = torch.tensor([[-0.5, 0.5]], dtype=torch.float64)
    value = p.token_kl(u, torch.zeros_like(u), u, torch.ones_like(u, dtype=torch.bool))
    return bool(value[0, 0] != value[0, 1])


FAMILIES: dict[tuple, str] = {}
"""One preset id per family: the first whose term depends on u (a constant term has no gradient to compare)."""
for _p in sorted(PRESETS, key=lambda p: not depends_on_u(p)):
    FAMILIES.setdefault(family(_p), _p.id)


def test_families_cover_every_preset() -> None:
    assert {family(p) for p in PRESETS} == set(FAMILIES)
    assert len(FAMILIES) >= 10  # loss and reward, three returns, two ratios, baselines, π_old, three aggregations


def test_a_preset_id_is_accepted_with_the_preset_s_own_settings_only() -> None:
    """The preset sets level, form, ratio and clip itself: any of those options, or the combined form's shaping, at
    a value other than the default is refused at construction, naming the option; an unknown id is refused with the
    closest ids (before the change both were accepted and train() failed at the first loss)."""
    cfg = KLGradTRLConfig(head="openrlhf/k1-reward")
    assert cfg.preset.id == "openrlhf/k1-reward"
    assert cfg.kl_options(0.1).level == "token_to_go"  # the record shows what trains: the preset's settings
    assert cfg.kl_options(0.1).aggregation == "token_mean"
    for kwargs in ({"form": "combined"}, {"level": "token"}, {"clip_eps": 0.1}, {"ratio_level": "token"},
                   {"is_correction": False}, {"shaping": "grpo"}, {"std_min": 0.1}):  # fmt: skip
        (name,) = kwargs
        with pytest.raises(ValueError, match=rf"{name} .* does not apply to a framework preset") as error:
            KLGradTRLConfig(head="openrlhf/k1-reward", **kwargs)
        assert "openrlhf/k1-reward sets level token_to_go, form decoupled" in str(error.value)
    with pytest.raises(ValueError, match=r"did you mean \['openrlhf/k1-reward'"):
        KLGradTRLConfig(head="openrlhf/k1-rewards")


def term_bound(preset, l, r, mask, old, adv) -> float:
    """A bound on a per-token loss term |A·ρ| + β·|k| (check's TERM, measured): ρ ≤ ρ_max; a loss preset's term as
    computed; a reward preset's ≤ ρ_max·Σ_t |k_t − b| ≤ ρ_max·2·T·max|k| (|b| ≤ max|k|, b a mean of k)."""
    o = l if old is None else old
    r = o if preset.reference_is_behaviour else r
    rho = float(torch.exp(l - o)[mask].max())
    if preset.style == "loss":
        k = float(preset.token_kl(l, r, o, mask)[mask].abs().max())
    else:
        k = rho * 2 * mask.shape[1] * float(preset.penalty(o, r, mask).abs().max())
    return float(adv.abs().max()) * max(rho, 1.2) + BETA * k


@pytest.mark.slow
@pytest.mark.parametrize("preset_id", list(FAMILIES.values()))
def test_every_preset_family_trains_its_own_term(setup: dict, dataset, preset_id: str) -> None:
    model, tok, out = setup["model"], setup["tokenizer"], setup["out"]
    preset = KLGradTRLConfig(head=preset_id).preset
    ours = make_trainer(KLGradGRPOTrainer, model, tok, dataset, out, klgrad_config=KLGradTRLConfig(head=preset_id))
    assert ours.loss_type == "dapo"  # the preset's own reduction below, not TRL's
    model.eval()
    generated = setup["inputs"]  # scored by TRL itself
    if preset.batch_baseline:  # this trainer's generation computes b
        torch.manual_seed(2)
        generated = ours._generate_and_score_completions(setup["rows"])
    mask = generated["completion_mask"].bool()
    ref = generated["ref_per_token_logps"]
    with torch.no_grad():
        l_gen = policy_logps(ours, model, generated)  # (B, T) the behaviour on-policy
    torch.manual_seed(3)
    old = l_gen + 0.2 * torch.randn_like(l_gen)  # another behaviour: ratios around 1, some beyond the clip

    def baseline(behaviour: torch.Tensor) -> torch.Tensor | None:
        """b = Σ m·k(o, r) / Σ m over the batch, by the record's formula."""
        if not preset.batch_baseline:
            return None
        r = behaviour if preset.reference_is_behaviour else ref
        k = torch.where(mask, preset.token_kl(behaviour, r, behaviour, mask), 0.0)
        return k.sum() / mask.sum()

    if preset.batch_baseline:
        assert float(generated["klgrad_kl_baseline"]) == pytest.approx(float(baseline(l_gen)), rel=1e-6, abs=1e-9)
    n_items = float(generated["num_items_in_batch"])
    adv = generated["advantages"][:, None].expand(mask.shape)  # (B, T)
    diffs, bounds = {"d_logp": 0.0, "d_param": 0.0}, []
    for behaviour in (None, old):
        batch = dict(generated)
        if behaviour is not None:
            batch["old_per_token_logps"] = behaviour
            if preset.batch_baseline:
                batch["klgrad_kl_baseline"] = baseline(behaviour)  # what TRL's generation would have computed
        b = baseline(l_gen if behaviour is None else behaviour)

        def core(
            batch: dict = batch, behaviour: torch.Tensor | None = behaviour, b: object = b, beta: float = BETA
        ) -> torch.Tensor:
            logp = policy_logps(ours, model, batch)  # (B, T)
            pg = policy_gradient_loss(logp, adv, mask, old_logp=behaviour, clip_eps_low=0.2, clip_eps_high=0.2)
            totals = preset_term(preset, b)(logp, ref, mask, behaviour)  # (B,)
            bounds.append(term_bound(preset, logp.detach(), ref, mask, behaviour, adv))
            kl = aggregate_totals(totals, mask, KL_AGGREGATION[preset.aggregation], num_tokens=n_items)
            return pg.sum() / n_items + beta * kl

        _, grads = loss_and_grad(ours, model, batch)
        _, expected = grads_of(core, model)
        d_logp, d_param = grads.diff(expected)
        diffs = {"d_logp": max(diffs["d_logp"], d_logp), "d_param": max(diffs["d_param"], d_param)}
        if behaviour is None:  # the KL term is really there: without it the gradient differs
            _, no_kl = grads_of(lambda: core(beta=0.0), model)
            assert grads.diff(no_kl)[0] > 1e-6
    # check's tolerances with TERM replaced by this batch's bound: ∂loss/∂logp per token ≤ 10 roundings of terms
    # ≤ max(bounds) on each side; parameter gradients, relative to their largest entry, do not depend on the scale
    print(f"\npreset {preset_id} vs klgrad core: max |Δ∂loss/∂logp| {diffs['d_logp']:.1e} (per-token term bound "
          f"{max(bounds):.2f}), parameter gradients max |Δ|/max|g| {diffs['d_param']:.1e}")  # fmt: skip
    assert diffs["d_logp"] <= 2 * gamma(10) * max(bounds)
    assert diffs["d_param"] <= 2 * network_tol(2 * llama_depth(4), 512, 1.0)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("preset_id", "trl_args"),
    [
        ("openrlhf/k1-reward", {}),  # the example: accepted, then failed at the first loss
        ("tinker/kl-advantage", {"num_iterations": 2, "gradient_accumulation_steps": 2}),  # baseline survives splits
    ],
)
def test_a_preset_trains(model_dir: Path, dataset, tmp_path: Path, preset_id: str, trl_args: dict) -> None:
    model, tok = load_model_and_tokenizer(model_dir, attn_implementation="eager")
    cfg = KLGradTRLConfig(head=preset_id)
    trainer = make_trainer(
        KLGradGRPOTrainer, model, tok, dataset, tmp_path, klgrad_config=cfg, max_steps=2, learning_rate=3e-3,
        **trl_args,
    )  # fmt: skip
    assert trainer.klgrad_summary.startswith(f"KL: {preset_id} (")
    trainer.train()
    steps = [rec for rec in trainer.state.log_history if "loss" in rec]
    assert len(steps) == 2
    for rec in steps:
        for key in ("kl/k1", "kl/k2", "kl/k3", "kl/logp_gap", "loss/kl"):
            assert math.isfinite(rec[key]), (key, rec)
        assert "clip/kl_frac" not in rec  # the preset clips by its own rule
        assert "kl" not in rec  # TRL's own KL is off


def test_beta_conversion_says_what_beta_weighs() -> None:
    by_id = {p.id: p for p in PRESETS}
    verl = beta_conversion(by_id["verl/kl-loss-low-var-kl"], "dapo")
    assert verl.startswith("β = GRPOConfig.beta is verl's KL coefficient on its own reduction, token_mean")
    assert verl.endswith("the weight of TRL's own KL at the same beta")  # both a batch token mean
    roll = beta_conversion(by_id["roll/kl-loss-k3"], "dapo")  # where the framework's default weight was recorded
    assert roll.startswith("β = GRPOConfig.beta is roll's KL coefficient (kl_loss_coef, default 0) on its own")
    # a token sum (1/B)Σ_i S_i against TRL's token mean Σ_i S_i/(B·L̄): L̄ times heavier
    assert "L̄ times TRL's own KL" in beta_conversion(by_id["deepseek-v3.2/unbiased-kl"], "dapo")
    assert "1/L̄ times" in beta_conversion(by_id["verl/kl-loss-low-var-kl"], "luspo")
    assert "L_max times" in beta_conversion(by_id["deepseek-v3.2/unbiased-kl"], "dr_grpo")
    assert "no constant multiple" in beta_conversion(by_id["verl/kl-loss-low-var-kl"], "grpo")  # 1/|y| weights
    assert GROUP == 4  # the batch shape the parity cases above were measured on
