"""Samplers: masks, EOS, truncation, grouping, and log-probs equal to a teacher-forced forward."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from klgrad.rollout.samplers import HFGenerateSampler, KlgradSampler, make_sampler
from tests.helpers.tolerances import logprob_tol

pytestmark = pytest.mark.numerics

PAD, BOS, EOS = 0, 1, 2


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=12,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        tie_word_embeddings=True,
    )
    cfg._attn_implementation = "eager"
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper distributions: some responses end early, some are truncated
        m.model.norm.weight.mul_(3.0)
    return m


def prompts():
    ids = torch.tensor([[PAD, PAD, BOS, 5, 6], [BOS, 7, 8, 9, 4], [PAD, BOS, 3, 3, 11]])
    return ids, ids != PAD


def teacher_forced(model, r, temperature):
    am = r.attention_mask
    pos = (am.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=r.input_ids, attention_mask=am.long(), position_ids=pos).logits
    p, t = r.prompt_ids.shape[1], r.response_ids.shape[1]
    lp = torch.log_softmax(logits[:, p - 1 : p - 1 + t].float() / temperature, -1)
    lp = lp.gather(-1, r.response_ids[..., None]).squeeze(-1)
    return lp.masked_fill(~r.response_mask, 0.0)


@pytest.mark.parametrize("engine", ["klgrad", "hf"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_equal_teacher_forced_forward(model, engine, temperature):
    ids, mask = prompts()
    s = make_sampler(engine, EOS, PAD)
    for seed in range(3):
        r = s.generate(
            model,
            ids,
            mask,
            group_size=4,
            max_new_tokens=7,
            temperature=temperature,
            generator=torch.Generator().manual_seed(seed),
        )
        # the sampler's incremental (KV-cache) log-probs vs one full forward: float32 rounding of two evaluations
        tol = logprob_tol(model, r.input_ids, r.attention_mask, temperature)
        torch.testing.assert_close(r.logp, teacher_forced(model, r, temperature), rtol=0, atol=tol)


@pytest.mark.parametrize("engine", ["klgrad", "hf"])
def test_masks_eos_truncation_and_groups(model, engine):
    ids, mask = prompts()
    g = 5
    r = make_sampler(engine, EOS, PAD).generate(
        model, ids, mask, group_size=g, max_new_tokens=6, generator=torch.Generator().manual_seed(1)
    )
    n = ids.shape[0] * g
    assert r.response_ids.shape[0] == n
    assert r.response_ids.shape[1] <= 6
    for i in range(n):  # groups contiguous: row i answers prompt i // g
        torch.testing.assert_close(r.prompt_ids[i], ids[i // g])
        row, m = r.response_ids[i].tolist(), r.response_mask[i].tolist()
        if EOS in row:
            k = row.index(EOS)
            assert m == [True] * (k + 1) + [False] * (len(row) - k - 1)  # EOS counts, after it nothing
            assert all(t == PAD for t in row[k + 1 :])
            assert not r.truncated[i]
        else:
            assert all(m)
            assert bool(r.truncated[i]) == (len(row) == 6)
    assert (r.logp[~r.response_mask] == 0).all()
    assert r.truncated.any() or (r.response_ids == EOS).any(dim=1).all()


def test_greedy_is_deterministic_and_agrees_between_engines(model):
    ids, mask = prompts()
    a = KlgradSampler(EOS, PAD).generate(model, ids, mask, group_size=2, max_new_tokens=6, greedy=True)
    b = HFGenerateSampler(EOS, PAD).generate(model, ids, mask, group_size=2, max_new_tokens=6, greedy=True)
    t = min(a.response_ids.shape[1], b.response_ids.shape[1])
    torch.testing.assert_close(a.response_ids[:, :t], b.response_ids[:, :t])
    assert torch.equal(a.response_ids[0], a.response_ids[1])  # greedy: the group is identical


def test_seeded_sampling_is_reproducible_and_top_p_restricts_support(model):
    ids, mask = prompts()
    s = KlgradSampler(EOS, PAD)
    a = s.generate(model, ids, mask, group_size=8, max_new_tokens=5, generator=torch.Generator().manual_seed(3))
    b = s.generate(model, ids, mask, group_size=8, max_new_tokens=5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.response_ids, b.response_ids)
    tiny = s.generate(
        model,
        ids,
        mask,
        group_size=8,
        max_new_tokens=5,
        top_p=1e-6,
        generator=torch.Generator().manual_seed(4),
    )
    greedy = s.generate(model, ids, mask, group_size=8, max_new_tokens=5, greedy=True)
    t = min(tiny.response_ids.shape[1], greedy.response_ids.shape[1])
    assert torch.equal(tiny.response_ids[:, :t], greedy.response_ids[:, :t])  # top_p -> 0 is greedy


def test_unknown_engine():
    with pytest.raises(ValueError, match=r"rollout\.engine"):
        make_sampler("vllm2", EOS, PAD)


def test_inverse_cdf_draw_hits_each_token_with_its_probability():
    """A grid of K uniforms (k + 0.5)/K must land on token v exactly round(K·p_v) times (up to one per edge)."""
    from klgrad.rollout.samplers import _sample

    p = torch.tensor([0.5, 0.0, 0.25, 0.125, 0.125])
    k = 4096
    logits = p.clamp_min(1e-45).log().expand(k, -1).clone()
    logits[:, 1] = -torch.inf  # a zero-probability token must never be drawn
    u = (torch.arange(k, dtype=torch.float32) + 0.5) / k
    tok, lp = _sample(logits, 1.0, 1.0, False, u)
    counts = torch.bincount(tok, minlength=5).float()
    assert counts[1] == 0
    assert torch.allclose(counts / k, p, atol=1.0 / k)  # a deterministic grid: off by at most one draw per edge
    assert torch.allclose(lp, p.log()[tok])


def test_top_p_draw_never_leaves_the_nucleus():
    from klgrad.rollout.samplers import _sample

    p = torch.tensor([0.6, 0.3, 0.06, 0.04])
    u = torch.linspace(0, 1 - 1e-7, 1000)
    tok, _ = _sample(p.log().expand(1000, -1), 1.0, 0.85, False, u)  # nucleus = {0, 1}
    counts = torch.bincount(tok, minlength=4)
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / 1000 - 2 / 3) < 2e-3


def test_rows_draw_the_same_tokens_whatever_the_batch_split(model):
    """Given per-row uniforms, a row's response depends on its own prompt only: halves of a batch sampled apart
    equal the whole batch (what makes a run split over processes draw what one process draws)."""
    ids, mask = prompts()
    s = KlgradSampler(EOS, PAD)
    u = torch.rand(6, 6, generator=torch.Generator().manual_seed(3))
    whole = s.generate(model, ids, mask, group_size=2, max_new_tokens=6, uniforms=u)
    first = s.generate(model, ids[:1], mask[:1], group_size=2, max_new_tokens=6, uniforms=u[:2])
    rest = s.generate(model, ids[1:], mask[1:], group_size=2, max_new_tokens=6, uniforms=u[2:])
    t1, t2 = first.response_ids.shape[1], rest.response_ids.shape[1]
    assert torch.equal(whole.response_ids[:2, :t1], first.response_ids)
    assert torch.equal(whole.response_ids[2:, :t2], rest.response_ids)
    assert not whole.response_mask[:2, t1:].any()
    assert not whole.response_mask[2:, t2:].any()
    with pytest.raises(ValueError, match="uniforms must be"):
        s.generate(model, ids, mask, group_size=2, max_new_tokens=6, uniforms=u[:5])


def test_every_engine_has_a_sampler():
    from klgrad.choices import ENGINES
    from klgrad.rollout.samplers import SAMPLERS

    assert tuple(SAMPLERS) == ENGINES


def test_every_engine_implements_the_sampler_protocol_and_nothing_more_is_asked():
    """The trainer calls ``generate`` with the protocol's keywords and ``sync_weights`` on every engine; only
    klgrad's own sampler takes ``uniforms=`` (its keyword, outside the protocol)."""
    import inspect

    from klgrad.rollout.batch import Sampler
    from klgrad.rollout.vllm_engine import VLLMSampler

    protocol = set(inspect.signature(Sampler.generate).parameters)
    for engine in (KlgradSampler, HFGenerateSampler, VLLMSampler):
        assert protocol <= set(inspect.signature(engine.generate).parameters), engine.__name__
        assert callable(engine.sync_weights), engine.__name__
    assert "uniforms" not in protocol
    assert "uniforms" in inspect.signature(KlgradSampler.generate).parameters
    model = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=1, num_key_value_heads=1))  # fmt: skip
    for sampler in (KlgradSampler(1, 0), HFGenerateSampler(1, 0)):
        assert sampler.sync_weights(model) is None  # they sample from the model itself: nothing to sync


# ----------------------------------------------------------------------------------------------------------
# rollout.sampler_dtype: a bf16 copy of the policy samples, as an inference engine does


BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2^-7: the spacing of bf16 numbers in [1, 2)


def bf16_logprob_tol(logits: torch.Tensor) -> float:
    """Bound on |Δ log p| between two bf16 evaluations of one model on the same tokens (KV-cache decode vs a full
    teacher-forced forward), both log-softmaxed in float32 from their bf16 logits.

    Each path ends by rounding its logits to bf16; the paths differ only in the order of their bf16 roundings, so
    we allow each logit of either path to land up to 2 bf16 spacings from the other's: |Δz| ≤ 2·eps·max|z|.
    log p_k = z_k − logsumexp(z) moves by at most 2·max_j|Δz_j| (the lse is 1-Lipschitz in the max norm), and
    the float32 log-softmax adds ~1e-6: tol = 4·eps_bf16·max|z| + 1e-5."""
    return 4 * BF16_EPS * float(logits.abs().max()) + 1e-5


@pytest.mark.parametrize("fast_forward", [True, False])
def test_bf16_sampler_logprobs_are_a_bf16_forwards_and_not_the_float32_ones(model, fast_forward):
    ids, mask = prompts()
    s = make_sampler("klgrad", EOS, PAD, fast_forward=fast_forward, dtype=torch.bfloat16)
    engine = s.engine_model(model)
    assert {p.dtype for p in engine.parameters()} == {torch.bfloat16}  # weights, hence activations, in bf16
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the trained model is untouched
    gaps = []
    for seed in range(3):
        r = s.generate(model, ids, mask, group_size=4, max_new_tokens=7, generator=torch.Generator().manual_seed(seed))
        bf16 = teacher_forced(engine, r, 1.0)
        pos = (r.attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            z = engine(input_ids=r.input_ids, attention_mask=r.attention_mask.long(), position_ids=pos).logits
        torch.testing.assert_close(r.logp, bf16, rtol=0, atol=bf16_logprob_tol(z))
        # against the float32 model: more than float32 rounding apart (bf16 keeps 8 significant bits)
        fp32 = teacher_forced(model, r, 1.0)
        gaps.append(float((r.logp - fp32)[r.response_mask].abs().max()))
        assert gaps[-1] > logprob_tol(model, r.input_ids, r.attention_mask, 1.0)
    assert max(gaps) > 1e-3


def test_bf16_copy_follows_the_policy_only_through_sync_weights(model):
    policy = LlamaForCausalLM(model.config).eval()
    policy.load_state_dict(model.state_dict())
    s = KlgradSampler(EOS, PAD, dtype=torch.bfloat16)
    engine = s.engine_model(policy)
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    with torch.no_grad():
        for p in policy.parameters():  # an optimizer step
            p.add_(0.05)
    assert all(torch.equal(v, before[k]) for k, v in s.engine_model(policy).state_dict().items())  # stale, as vLLM
    s.sync_weights(policy)
    assert s.engine_model(policy) is engine  # refreshed in place, not rebuilt
    for name, value in policy.state_dict().items():  # the policy's weights rounded to bf16
        assert torch.equal(engine.state_dict()[name], value.to(torch.bfloat16)), name
    other = LlamaForCausalLM(model.config).eval()  # another module gets its own copy
    assert s.engine_model(other) is not engine


def test_float32_sampler_has_no_copy(model):
    s = KlgradSampler(EOS, PAD)
    assert s.engine_model(model) is model
    s.sync_weights(model)  # nothing
    assert s.in_model_dtype().dtype is None
    assert KlgradSampler(EOS, PAD, dtype=torch.bfloat16).in_model_dtype().engine_model(model) is model
