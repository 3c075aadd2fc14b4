"""vLLM engine (CPU-side checks) and the sampler-vs-trainer mismatch correction (truncated IS).

vLLM is never mocked: on a machine without it (or without a CUDA GPU) these tests check the clear errors; the
pure weights are checked against hand-computed closed forms, on extreme inputs (hypothesis) and as an
identity; the objective is checked unchanged with weights None / ones and scaled exactly with constant weights.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from klgrad.config import ConfigError, KLConfig, load_config
from klgrad.machine import vllm_requirements_error, vllm_unavailable_reason
from klgrad.objective import ObjectiveSpec, decoupled_advantages, policy_objective
from klgrad.rollout.mismatch import mismatch_weights
from klgrad.rollout.samplers import make_sampler

F64 = torch.float64
TIGHT = {"rtol": 1e-12, "atol": 1e-12}
NAN = float("nan")


def test_token_weights_hand_computed():
    # d = l - s per token: [0.5, -1.0, 2.0 | pad]; min(e^d, 2): [e^0.5 = 1.6487, e^-1 = 0.3679, 2 (capped)]
    l = torch.tensor([[0.0, -2.0, 1.0, NAN]], dtype=F64)
    s = torch.tensor([[-0.5, -1.0, -1.0, 7.0]], dtype=F64)
    m = torch.tensor([[True, True, True, False]])
    w = mismatch_weights(l, s, m, "token", cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[math.exp(0.5), math.exp(-1.0), 2.0, 0.0]], dtype=F64), **TIGHT)


def test_sequence_weights_hand_computed():
    # row 0: Σ d = 0.5 - 1.0 + 0.2 = -0.3 -> e^-0.3 on every response token; row 1: Σ d = 3 -> capped at 5
    l = torch.tensor([[0.0, -2.0, -0.3], [NAN, 0.0, 0.0]], dtype=F64)
    s = torch.tensor([[-0.5, -1.0, -0.5], [NAN, -1.0, -2.0]], dtype=F64)
    m = torch.tensor([[True, True, True], [False, True, True]])
    w = mismatch_weights(l, s, m, "sequence", cap=5.0)
    e = math.exp(-0.3)
    torch.testing.assert_close(w, torch.tensor([[e, e, e], [0.0, 5.0, 5.0]], dtype=F64), **TIGHT)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_identity_when_sampler_equals_trainer(level):
    g = torch.Generator().manual_seed(0)
    l = -torch.rand(4, 6, generator=g, dtype=F64) * 5
    m = torch.rand(4, 6, generator=g) > 0.3
    w = mismatch_weights(l, l.clone(), m, level, cap=2.0)
    assert torch.equal(w, torch.where(m, 1.0, 0.0).to(F64))


def test_weights_are_detached_and_at_least_float32():
    l = torch.zeros(2, 3, dtype=torch.bfloat16, requires_grad=True)
    w = mismatch_weights(l, torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool))
    assert not w.requires_grad
    assert w.dtype == torch.float32


@settings(max_examples=200, deadline=None)
@given(
    diffs=st.lists(st.floats(-1e4, 1e4, allow_nan=False), min_size=1, max_size=8),
    cap=st.floats(1e-3, 1e3),
    level=st.sampled_from(["token", "sequence"]),
)
def test_extreme_inputs_stay_finite_and_within_the_cap(diffs, cap, level):
    l = torch.tensor([diffs], dtype=torch.float32)
    s = torch.zeros_like(l)
    w = mismatch_weights(l, s, torch.ones_like(l, dtype=torch.bool), level, cap=cap)
    assert torch.isfinite(w).all()
    assert (w >= 0).all()
    assert (w <= cap * (1 + 1e-6)).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"level": "tok"}, "level"), ({"cap": 0.0}, "cap"), ({"cap": math.inf}, "cap"), ({"cap": -1.0}, "cap")],
)
def test_bad_arguments(kwargs, match):
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=match):
        mismatch_weights(x, x, torch.ones(1, 2, dtype=torch.bool), **kwargs)


def _objective_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    B, T, G = 4, 5, 2
    logp = (-torch.rand(B, T, generator=g, dtype=F64) * 3).requires_grad_(True)
    ref = -torch.rand(B, T, generator=g, dtype=F64) * 3
    old = logp.detach() + 0.1 * torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    adv = decoupled_advantages(torch.rand(B, generator=g, dtype=F64), mask, G, "grpo")
    return logp, ref, old, mask, adv


@pytest.mark.parametrize("old", [False, True])
def test_objective_unchanged_with_none_or_unit_weights(old):
    logp, ref, old_logp, mask, adv = _objective_inputs(1)
    spec = ObjectiveSpec(KLConfig(head="k2_as_loss", beta=0.5, level="token"))
    kw = {"old_logp": old_logp if old else None}
    base = policy_objective(logp, ref, mask, adv, spec, **kw)
    (g_base,) = torch.autograd.grad(base.loss, logp)
    ones = policy_objective(logp, ref, mask, adv, spec, mismatch_weights=torch.ones_like(ref), **kw)
    (g_ones,) = torch.autograd.grad(ones.loss, logp)
    assert torch.equal(base.loss, ones.loss)
    assert torch.equal(g_base, g_ones)


def test_objective_weights_scale_only_the_reward_head():
    # w = 3 everywhere: policy loss and its gradient x3, KL loss unchanged
    logp, ref, _, mask, adv = _objective_inputs(2)
    spec = ObjectiveSpec(KLConfig(head="k2_as_loss", beta=0.5, level="token"))
    base = policy_objective(logp, ref, mask, adv, spec)
    w = policy_objective(logp, ref, mask, adv, spec, mismatch_weights=torch.full_like(ref, 3.0))
    torch.testing.assert_close(w.policy_loss, 3 * base.policy_loss, **TIGHT)
    torch.testing.assert_close(w.kl_loss, base.kl_loss, **TIGHT)
    pg_only = ObjectiveSpec(KLConfig(head="none"))
    (g1,) = torch.autograd.grad(policy_objective(logp, ref, mask, adv, pg_only).loss, logp)
    weights = torch.full_like(ref, 3.0)
    (g3,) = torch.autograd.grad(policy_objective(logp, ref, mask, adv, pg_only, mismatch_weights=weights).loss, logp)
    torch.testing.assert_close(g3, 3 * g1, **TIGHT)


def test_objective_per_token_weights_match_a_loop_reference():
    # on-policy, seq_mean_token_sum, no KL: loss = -(1/B) Σ_i Σ_t m w A ρ with ρ = 1 in value
    logp, ref, _, mask, adv = _objective_inputs(3)
    w = torch.rand(ref.shape, generator=torch.Generator().manual_seed(9), dtype=F64) * 2
    out = policy_objective(logp, ref, mask, adv, ObjectiveSpec(KLConfig(head="none")), mismatch_weights=w)
    B, T = ref.shape
    expect = -sum(float(w[i, t] * adv[i, t]) for i in range(B) for t in range(T) if mask[i, t]) / B
    assert math.isclose(float(out.loss.detach()), expect, rel_tol=1e-12, abs_tol=1e-12)


def test_objective_rejects_misshaped_weights():
    logp, ref, _, mask, adv = _objective_inputs(4)
    with pytest.raises(ValueError, match="mismatch_weights"):
        policy_objective(logp, ref, mask, adv, ObjectiveSpec(), mismatch_weights=torch.ones(1, 1, dtype=F64))


# -- the engine's requirements: the real check on this machine, never a mock of vLLM ------------------------


def test_requirement_messages():
    assert "pip install 'klgrad[vllm]'" in vllm_requirements_error(False, False)
    assert "pip install 'klgrad[vllm]'" in vllm_requirements_error(False, True)
    assert "needs a CUDA GPU" in vllm_requirements_error(True, False)
    assert vllm_requirements_error(True, True) is None


needs_no_vllm = pytest.mark.skipif(vllm_unavailable_reason() is None, reason="vLLM and a GPU are present here")


@needs_no_vllm
def test_make_sampler_vllm_raises_the_clear_error_here():
    reason = vllm_unavailable_reason()
    with pytest.raises(RuntimeError) as e:
        make_sampler("vllm", 1, 0)
    assert str(e.value) == reason
    assert ("pip install 'klgrad[vllm]'" in reason) or ("needs a CUDA GPU" in reason)


@needs_no_vllm
def test_config_with_vllm_engine_fails_naming_the_field_here():
    with pytest.raises(ConfigError) as e:
        load_config(overrides={"rollout.engine": "vllm"})
    assert str(e.value).startswith("rollout.engine")
    assert vllm_unavailable_reason() in str(e.value)


def test_config_mismatch_fields():
    cfg = load_config(overrides={"rollout.mismatch_correction": "sequence", "rollout.mismatch_cap": 5})
    assert (cfg.rollout.mismatch_correction, cfg.rollout.mismatch_cap) == ("sequence", 5.0)
    assert load_config().rollout.mismatch_correction == "none"
    for bad in ({"rollout.mismatch_cap": 0}, {"rollout.mismatch_correction": "tok"}):
        with pytest.raises(ConfigError, match=r"^rollout\.mismatch_"):
            load_config(overrides=bad)


def test_other_engines_refuse_vllm_options():
    with pytest.raises(ValueError, match=r"takes only \['dtype', 'fast_forward'\]"):
        make_sampler("klgrad", 1, 0, model_path="x")
    with pytest.raises(ValueError, match=r"takes only \[\]"):
        make_sampler("hf", 1, 0, fast_forward=True)
    assert not make_sampler("klgrad", 1, 0, fast_forward=False).fast_forward


def test_weight_change_detector_sees_optimizer_steps_and_loads():
    # VLLMSampler.generate re-syncs when these version counters move: every in-place write must move them
    from klgrad.rollout.vllm_engine import _param_versions

    model = torch.nn.Linear(3, 2)
    before = _param_versions(model)
    assert _param_versions(model) == before  # reading changes nothing
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    after_step = _param_versions(model)
    assert all(a != b for a, b in zip(after_step, before, strict=True))
    model.load_state_dict(model.state_dict())
    assert _param_versions(model) != after_step
