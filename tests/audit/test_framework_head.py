"""klgrad.audit.framework_head: ``kl.head: <preset id>`` trains the record ``klgrad audit --framework`` audits.

For every preset (and each regime the audit gives it), one optimizer step of :func:`klgrad.trainer.update` on a
float64 1-layer Llama (tests/helpers/tiny_llama.py) with SGD at learning rate 1 moves the weights by exactly minus
the step's gradient. The task rewards are 0 and ``algo.shaping`` is ``none``, so the reward head's advantage is
exactly 0 and the whole step is the KL term's. It must equal the gradient, by autograd through the same model, of
the audit's own per-response loss of the preset (:meth:`FrameworkKL.loss` at the aggregation the audit gives it,
``token_sum`` for the sum family, ``seq_mean``) summed over the batch, times β over the aggregation's normaliser
(responses B, or the batch's tokens for a token mean).

Reward-entry presets are checked under ``algo.shaping: none``: the KL return reaches the loss linearly and
unnormalised (a normalising shaper, GRPO's std, would divide the framework's KL by the task reward's std, which
neither the audit nor the trainer models); the task advantage is 0, so the KL's PPO clip is the only clip acting.
On-policy the behaviour log-probs are the policy's own (detached); off-policy they are another model's
(``batch.old_logp``), the framework's own ratio handling. A preset whose reference is π_old (RPG's iterative
reference, prime-rl) is audited off-policy only, with r := o: so here. Tinker's batch baseline is the penalty's
token mean over the batch in training (what the framework computes; the audit takes its expectation): the
expected side takes it from the record's :meth:`FrameworkKL.penalty_mean` with unit weights.

Tolerance: both sides evaluate the same float64 network and the same record on the same inputs; they differ only
in the order of their roundings (where β/normaliser enters the backward, the per-response sums of the
aggregation). So they are two evaluations of one float64 gradient through the 1-layer Llama:
network_tol(2·depth, width 32, max |Δw|, float64) (tests/helpers/tolerances.py), ≈ 1.5e-13 × max(|Δw|, 1)
(observed: at most 1.5e-3 of it, a few float64 ulps). A wrong
normaliser, a dropped clamp or ratio, or another entry point moves the weights by orders of magnitude more.
"""

from __future__ import annotations

import pytest
import torch

from klgrad.audit.framework_head import (
    KL_AGGREGATION,
    PRESETS_BY_ID,
    find_preset,
    preset_settings,
    preset_term,
    resolve_head,
)
from klgrad.audit.frameworks import audited_aggregation
from klgrad.audit.presets import PRESETS
from klgrad.config import ConfigError, load_config, resolve_heads
from klgrad.objective import KLTermHead
from klgrad.trainer import Batch, update
from tests.helpers.tiny_llama import tiny_llama64
from tests.helpers.tolerances import llama_depth, network_tol
from tests.helpers.update_batch import F64, LOGPROBS, G, L, N, P, make_batch

BETA = 0.3


BATCHES = {"on_policy": make_batch(0, False, rewards=False), "off_policy": make_batch(0, True, rewards=False)}


def config(head: str, **over):
    base = {
        "rollout.prompts_per_step": P,
        "rollout.group_size": G,
        "kl.head": head,
        "kl.beta": BETA,
        "algo.shaping": "none",
        "algo.micro_batch_size": 4,  # two micro-batches: the normalisers are the mini-batch's
        "optim.grad_clip": None,
    }
    return load_config(None, {**base, **over})


def audit_step(preset, batch: Batch) -> dict[str, torch.Tensor]:
    """start − ∇[β/D · Σ_i audit_loss_i], the audit's per-response loss of ``preset`` (:meth:`FrameworkKL.loss`) on
    the policy of seed 10, D the aggregation's normaliser."""
    policy = tiny_llama64(seed=10, attn="sdpa")
    params = dict(policy.named_parameters())
    logp, _ = LOGPROBS(policy, batch.input_ids, batch.attention_mask, L, False)  # (N, T)
    o = logp.detach() if batch.old_logp is None else batch.old_logp
    r = o if preset.reference_is_behaviour else batch.ref_logp
    mask = batch.mask
    baseline = preset.penalty_mean(o, r, mask, torch.ones(N, dtype=F64)) if preset.batch_baseline else None
    audited = audited_aggregation(preset.aggregation)  # token_sum for the sum family, or seq_mean
    per_sequence = preset.loss(r, mask, audited, baseline=baseline)(logp, o)  # (N,)
    d = float(mask.sum()) if preset.aggregation == "token_mean" else float(N)
    loss = BETA * per_sequence.sum() / d
    if not loss.requires_grad:  # a term without l (an ignored flag): no gradient
        return {k: v.detach().clone() for k, v in params.items()}
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {
        k: v.detach() - (torch.zeros_like(v) if g is None else g)
        for (k, v), g in zip(params.items(), grads, strict=True)
    }


def train_step(head: str, batch: Batch) -> dict[str, torch.Tensor]:
    """Weights after one :func:`update` (SGD, lr 1) from the policy of seed 10, ``kl.head`` = ``head`` (the loaded
    config's: the preset's KL term)."""
    cfg = config(head)
    policy = tiny_llama64(seed=10, attn="sdpa").train()
    update(policy, torch.optim.SGD(policy.parameters(), lr=1.0), batch, cfg, LOGPROBS)
    return {k: v.detach().clone() for k, v in policy.named_parameters()}


CASES = [pytest.param(p.id, regime, id=f"{p.id}-{regime}") for p in PRESETS for regime in p.regimes]


@pytest.mark.parametrize(("head", "regime"), CASES)
def test_one_training_step_has_the_audits_gradient(head, regime):
    preset, batch = find_preset(head), BATCHES[regime]
    start = {k: v.detach().clone() for k, v in tiny_llama64(seed=10, attn="sdpa").named_parameters()}
    expected, got = audit_step(preset, batch), train_step(head, batch)
    scale = max(float((expected[k] - start[k]).abs().max()) for k in expected)
    bound = network_tol(2 * llama_depth(1), 32, max(scale, 1.0), F64)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=bound, msg=f"{head} {regime}: {k}")


def test_every_preset_is_a_case():
    assert {c.values[0] for c in CASES} == set(PRESETS_BY_ID)
    assert len(PRESETS_BY_ID) == len(PRESETS)


def test_the_preset_sets_level_form_and_aggregation_and_says_what_it_overrode():
    """Config load makes the preset id its KL term (:func:`resolve_head`, through :func:`resolve_heads`): the term
    named by the id, the preset's settings, and a note saying what it overrode."""
    cfg = config("openrlhf/k1-reward", **{"kl.form": "combined", "kl.level": "sequence"})
    kl, line = cfg.kl, cfg.kl.head.note
    assert isinstance(kl.head, KLTermHead)
    assert kl.head.name == "openrlhf/k1-reward"
    assert (kl.level, kl.form, kl.aggregation) == ("token_to_go", "decoupled", "token_mean")
    assert "overriding kl.level sequence, kl.form combined, kl.aggregation null" in line
    assert resolve_heads(cfg) == cfg  # idempotent
    assert resolve_head(kl) is kl
    recorded = {f"kl.{k}": v for k, v in preset_settings(find_preset("openrlhf/k1-reward")).items()}
    again = config("openrlhf/k1-reward", **recorded)
    assert again == cfg  # a recorded config.yaml: the same settings, and the same term (equal by name)
    assert "overriding" not in again.kl.head.note
    assert resolve_heads(config("k3_as_loss")) == config("k3_as_loss")
    assert config("k3_as_loss").kl.head == "k3_as_loss"
    loss = preset_settings(find_preset("verl/kl-loss-low-var-kl"))
    assert loss == {"level": "token", "form": "decoupled", "aggregation": "token_mean"}
    assert preset_settings(find_preset("slime/kl-loss-k1"))["aggregation"] == KL_AGGREGATION["seq_mean"]


def test_an_unknown_preset_id_names_kl_head_and_its_close_matches():
    with pytest.raises(ConfigError, match=r"kl\.head: 'verl/low-var-kl' is not a framework preset id; did you mean "
                       r"\['verl/kl-loss-low-var-kl'"):  # fmt: skip
        config("verl/low-var-kl")  # refused at load
    with pytest.raises(ConfigError, match=r"kl\.head must be one of .* a framework preset id"):
        config("trll/grpo-k3")  # not a framework: refused by the config itself


def test_a_batch_baseline_preset_needs_its_baseline():
    with pytest.raises(ValueError, match="baseline"):
        preset_term(find_preset("tinker/kl-advantage"))
