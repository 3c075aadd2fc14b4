"""The fast functional decoder reproduces the transformers forward it replaces (Llama with GQA, Qwen2 with
q/k/v biases, left padding, many steps) and declines what it does not implement."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from klgrad.models.fast_forward import FastForward, unsupported_reason
from klgrad.rollout.samplers import KlgradSampler
from tests.helpers.tiny_llama import BOS, COMMON, EOS, PAD, full_forward_logits, llama, qwen2
from tests.helpers.tolerances import max_abs_logit, model_tol

pytestmark = pytest.mark.numerics


@pytest.mark.parametrize("make", [llama, qwen2])
def test_prefill_and_steps_equal_a_full_forward(make):
    model = make()
    assert unsupported_reason(model) is None
    prompts = torch.tensor([[PAD, PAD, BOS, 5, 6], [BOS, 7, 8, 9, 4], [PAD, BOS, 3, 3, 11]])
    mask = prompts != PAD
    g, steps = 2, 6
    dec = FastForward(model)
    logits = [dec.prefill(prompts, mask, g, steps)]  # (N, V) each
    gen = torch.Generator().manual_seed(0)
    toks = []
    for _ in range(steps - 1):
        t = torch.randint(3, 23, (prompts.shape[0] * g,), generator=gen)
        toks.append(t)
        logits.append(dec.step(t))
    ids = torch.cat([prompts.repeat_interleave(g, 0), torch.stack(toks, 1)], 1)
    full_mask = torch.cat([mask.repeat_interleave(g, 0), torch.ones(ids.shape[0], steps - 1, dtype=torch.bool)], 1)
    ref = full_forward_logits(model, ids, full_mask)[:, prompts.shape[1] - 1 :]  # (N, steps, V)
    # two float32 evaluations of a 2-layer Llama of width <= 96 (model_tol: rounding of each chained reduction)
    tol = model_tol(model.config, float(ref.abs().max()))
    torch.testing.assert_close(torch.stack(logits, 1), ref, rtol=0, atol=tol)
    dec.step(toks[0])  # the last free slot
    with pytest.raises(RuntimeError, match="cache full"):
        dec.step(toks[0])


def test_weights_are_read_live_not_copied():
    """An optimizer step between rollouts must be seen: the decoder holds the model's parameters, not copies."""
    model = llama()
    prompts = torch.tensor([[BOS, 5, 6]])
    mask = prompts != PAD
    before = FastForward(model).prefill(prompts, mask, 1, 1)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.add_(0.1)
    after = FastForward(model).prefill(prompts, mask, 1, 1)
    full = full_forward_logits(model, prompts, mask)[:, -1]
    torch.testing.assert_close(after, full, rtol=0, atol=model_tol(model.config, float(full.abs().max())))
    assert not torch.allclose(before, after)


def test_sampler_fast_and_transformers_paths_draw_the_same_tokens():
    model = llama()
    prompts = torch.tensor([[PAD, BOS, 5, 6], [BOS, 7, 8, 9]])
    u = torch.rand(8, 10, generator=torch.Generator().manual_seed(2))
    fast = KlgradSampler(EOS, PAD).generate(model, prompts, prompts != PAD, group_size=4, max_new_tokens=10, uniforms=u)
    slow = KlgradSampler(EOS, PAD, fast_forward=False)
    ref = slow.generate(model, prompts, prompts != PAD, group_size=4, max_new_tokens=10, uniforms=u)
    assert KlgradSampler(EOS, PAD).uses_fast_path(model)
    assert not slow.uses_fast_path(model)
    assert torch.equal(fast.response_ids, ref.response_ids)
    # log-probs move by at most twice the logits' rounding (model_tol at the batch's largest logit)
    tol = 2 * model_tol(model.config, max_abs_logit(model, ref.input_ids, ref.attention_mask))
    torch.testing.assert_close(fast.logp, ref.logp, rtol=0, atol=tol)


def test_unsupported_models_are_declined_and_sampled_through_transformers():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=23, n_embd=32, n_layer=1, n_head=2, n_positions=32)).eval()
    assert "model_type" in unsupported_reason(gpt2)
    with pytest.raises(ValueError, match="does not support"):
        FastForward(gpt2)
    cfg = LlamaConfig(**COMMON, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert "RoPE" in unsupported_reason(LlamaForCausalLM(cfg))
    prompts = torch.tensor([[BOS, 5, 6]])
    r = KlgradSampler(EOS, PAD).generate(gpt2, prompts, prompts != PAD, group_size=2, max_new_tokens=3)
    assert r.response_ids.shape[0] == 2


def test_dropping_finished_rows_changes_nothing():
    """On the embedded model responses end at different steps, so the fast path drops finished rows from its
    cache mid-rollout; every row must still get exactly the tokens and log-probs of the transformers path."""
    from klgrad.data.tasks import make_splits
    from klgrad.models import load_model_and_tokenizer
    from klgrad.rollout.encoding import encode_prompts
    from klgrad.trainer import EMBEDDED_DIR

    model, tok = load_model_and_tokenizer(EMBEDDED_DIR / "tiny_addition")
    model.eval()
    train, _ = make_splits("addition", 16, 1, 0, 2)
    ids, mask = encode_prompts(tok, [e.prompt for e in train])
    u = torch.rand(128, 8, generator=torch.Generator().manual_seed(5))
    kw = dict(group_size=8, max_new_tokens=8, uniforms=u)
    fast = KlgradSampler(tok.eos_token_id, tok.pad_token_id).generate(model, ids, mask, **kw)
    ref = KlgradSampler(tok.eos_token_id, tok.pad_token_id, fast_forward=False).generate(model, ids, mask, **kw)
    lengths = fast.lengths
    assert int((lengths < lengths.max()).sum()) > 128 // 4  # enough rows finished early to trigger a drop
    assert torch.equal(fast.response_ids, ref.response_ids)
    assert torch.equal(fast.response_mask, ref.response_mask)
    tol = 2 * model_tol(model.config, max_abs_logit(model, ref.input_ids, ref.attention_mask))  # as above
    torch.testing.assert_close(fast.logp, ref.logp, rtol=0, atol=tol)


@pytest.mark.parametrize("make", [llama, qwen2])
def test_shared_prompt_logprobs_and_gradients_equal_the_full_forward(make):
    """GRPO batch: 3 left-padded prompts × 4 right-padded responses of different lengths. The shared-prompt path
    (each prompt run once) must give the per-row forward's log-probs, entropies and parameter gradients."""
    from klgrad.logprobs import _shared_prompt_logits, sequence_logprobs

    model = make().train()
    prompts = torch.tensor([[PAD, PAD, BOS, 5, 6], [BOS, 7, 8, 9, 4], [PAD, BOS, 3, 3, 11]])
    g, t = 4, 6
    gen = torch.Generator().manual_seed(4)
    resp = torch.randint(3, 23, (12, t), generator=gen)
    lengths = torch.tensor([6, 1, 3, 4, 2, 6, 5, 1, 3, 6, 2, 4])
    resp_mask = torch.arange(t)[None] < lengths[:, None]  # (12, 6) real tokens then padding
    resp = resp.masked_fill(~resp_mask, PAD)
    ids = torch.cat([prompts.repeat_interleave(g, 0), resp], 1)
    mask = torch.cat([(prompts != PAD).repeat_interleave(g, 0), resp_mask], 1)
    assert _shared_prompt_logits(model, ids, mask, 5) is not None  # the shared path is the one under test
    weights = torch.randn(12, t, generator=gen)

    def run(shared, packing=False):
        model.zero_grad()
        lp, ent = sequence_logprobs(model, ids, mask, 5, 0.7, with_entropy=True, fast_forward=shared, packing=packing)
        (torch.where(resp_mask, weights * lp + 0.3 * ent, 0.0)).sum().backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        return lp.masked_fill(~resp_mask, 0), ent.masked_fill(~resp_mask, 0), grads

    lp1, ent1, g1 = run(True)
    lp0, ent0, g0 = run(False)
    lp2, ent2, g2 = run(True, packing=True)  # real positions only, the head fused into the log-softmax
    # Log-probs: twice the logits' rounding; entropies: H moves by at most max|Δz| times the logit range
    # (dH/dz_j = -p_j (z_j - E_p z)), bounded by 2 max|z|. Gradients: the backward doubles the chain of
    # reductions (tolerance relative to each tensor's largest entry).
    z = max_abs_logit(model, ids, mask) / 0.7  # temperature 0.7 scales the logits
    tol = 2 * model_tol(model.config, z)
    rel = 2 * model_tol(model.config, 1.0)
    for lp, ent, grads in ((lp1, ent1, g1), (lp2, ent2, g2)):
        torch.testing.assert_close(lp, lp0, rtol=0, atol=tol)
        torch.testing.assert_close(ent, ent0, rtol=0, atol=tol * z)
        for k in g0:
            torch.testing.assert_close(grads[k], g0[k], rtol=rel, atol=rel * float(g0[k].abs().max()), msg=k)


def test_shared_prompt_path_declines_holes_and_unshared_batches():
    from klgrad.logprobs import _shared_prompt_logits

    model = llama()
    ids = torch.tensor([[BOS, 5, 6, 7], [BOS, 5, 6, 8]])
    holes = torch.tensor([[True, True, False, True], [True, True, True, True]])  # real token after padding
    assert _shared_prompt_logits(model, ids, holes, 2) is None
    distinct = torch.tensor([[BOS, 5, 6, 7], [BOS, 4, 6, 8]])
    assert _shared_prompt_logits(model, distinct, torch.ones_like(distinct, dtype=torch.bool), 2) is None
