"""Tests for klgrad.logprobs: chunked log-probs and entropies, and the one shift convention.

References are the naive formulas (``log_softmax(...).gather``, ``-(p · log p).sum``) and, for
``sequence_logprobs``, each row run alone without padding and scored by hand with the shift convention
(logits at position j - 1 predict token j). Padding is only a real test of ``position_ids`` for a model with
absolute position embeddings (RoPE is invariant to shifting every position by the same amount), so the
padding tests run on a tiny GPT-2 as well as on the tiny Llama.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GPT2Config, GPT2LMHeadModel

from klgrad.logprobs import (
    CHUNK_BYTES,
    default_chunk_size,
    head_logprobs,
    position_ids_from_mask,
    sequence_logprobs,
    token_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
)
from klgrad.models import build_char_tokenizer, build_tiny_model
from tests.helpers.tolerances import log_softmax_tol, logprob_tol, max_abs_logit, model_tol

pytestmark = pytest.mark.numerics

B, T, V = 3, 7, 11
CHUNKS = [1, 2, 3, T, T + 5, None]
TEMPERATURES = [1.0, 0.7, 2.5]


def naive_logprobs(logits, tokens, temperature=1.0):
    return torch.log_softmax(logits / temperature, -1).gather(-1, tokens[..., None])[..., 0]


def naive_entropy(logits, temperature=1.0):
    logp = torch.log_softmax(logits / temperature, -1)
    return -(logp.exp() * logp).sum(-1)


def random_logits(dtype=torch.float32, seed=0, scale=3.0, shape=(B, T, V)):
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(shape, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, shape[-1], shape[:2], generator=g)
    return logits.to(dtype), tokens


# ----------------------------------------------------------------------------------------------------------
# token_logprobs / token_entropy against the naive formulas


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_token_logprobs_matches_naive(chunk, temperature, dtype, tol):
    for seed in range(3):
        logits, tokens = random_logits(dtype, seed)
        logp = token_logprobs(logits, tokens, temperature, chunk_size=chunk)  # (B, T)
        assert logp.shape == (B, T)
        assert logp.dtype == dtype
        torch.testing.assert_close(logp, naive_logprobs(logits, tokens, temperature), rtol=0, atol=tol)
        assert (logp <= 0).all()


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_token_entropy_matches_naive(chunk, temperature, dtype, tol):
    for seed in range(3):
        logits, _ = random_logits(dtype, seed)
        ent = token_entropy(logits, temperature, chunk_size=chunk)  # (B, T)
        assert ent.shape == (B, T)
        assert ent.dtype == dtype
        torch.testing.assert_close(ent, naive_entropy(logits, temperature), rtol=0, atol=tol)
        assert (ent >= 0).all()
        assert (ent <= torch.log(torch.tensor(float(V), dtype=dtype)) + tol).all()


def test_hand_worked_values():
    # logits (0, ln 2, ln 3 ... ) chosen so softmax = (1, 2, 3) / 6: logp(token 2) = ln(1/2),
    # entropy = -Σ p ln p = -(1/6 ln 1/6 + 2/6 ln 2/6 + 3/6 ln 3/6).
    logits = torch.log(torch.tensor([[[1.0, 2.0, 3.0]]], dtype=torch.float64))
    p = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64) / 6
    assert token_logprobs(logits, torch.tensor([[2]])).item() == pytest.approx(-0.6931471805599453, abs=1e-15)
    assert token_entropy(logits).item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-15)
    # τ = 1/2 squares the probabilities: (1, 4, 9) / 14.
    assert token_logprobs(logits, torch.tensor([[0]]), 0.5).item() == pytest.approx(-2.6390573296152584)


@pytest.mark.parametrize("chunk", [1, 4, None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits(chunk, dtype):
    # Logits uniform in [-2, 2]: rounding to bf16 moves each by ≤ 2·2^-9 ≈ 0.0039, so logp = z_tok - lse(z)
    # moves by ≤ 2 × 0.0039 < 1e-2 from the float32 value (fp16: ≤ 2·2^-12 each).
    g = torch.Generator().manual_seed(0)
    logits32 = 4 * torch.rand(4, 9, 50, generator=g) - 2
    tokens = torch.randint(0, 50, (4, 9), generator=g)
    half = logits32.to(dtype)
    logp = token_logprobs(half, tokens, chunk_size=chunk)
    ent = token_entropy(half, chunk_size=chunk)
    assert logp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(logp, naive_logprobs(logits32, tokens), rtol=0, atol=1e-2)
    torch.testing.assert_close(ent, naive_entropy(logits32), rtol=0, atol=1e-2)
    # Against the same rounded values in float32 the only error is float32 arithmetic: two evaluations of a
    # log-softmax / entropy over V = 50 logits of range 4 in different orders (chunked vs whole, another kernel
    # set) differ by at most twice log_softmax_tol(50, 4) ≈ 1.5e-4; an error in the half-precision upcast or the
    # chunking moves values by ≥ 2^-12 relative per logit and by O(1) when wrong. Measured: 1.2e-6 (AVX2).
    tol = 2 * log_softmax_tol(50, 4.0)
    torch.testing.assert_close(logp, naive_logprobs(half.float(), tokens), rtol=0, atol=tol)
    torch.testing.assert_close(ent, naive_entropy(half.float()), rtol=0, atol=tol)


def test_extreme_logits_stay_finite():
    logits, tokens = random_logits(torch.float32, 0)
    logits[0, 0, 0] = 1e4  # one dominating logit
    logits[1] += 1e6  # a large common offset (log-softmax is shift invariant)
    logp = token_logprobs(logits, tokens, chunk_size=2)
    ent = token_entropy(logits, chunk_size=2)
    assert torch.isfinite(logp).all()
    assert torch.isfinite(ent).all()
    # one logit 1e4 above the rest: every other p_j ≈ e^-1e4 underflows to 0, so H is 0 up to the rounding of
    # the dominant term p·log p with p = 1 (|log p| ≤ u): a few float32 ulps of 0, far below 1e-6
    assert ent[0, 0].item() == pytest.approx(0.0, abs=1e-6)
    torch.testing.assert_close(logp, naive_logprobs(logits.double(), tokens).float(), rtol=0, atol=0.2)


# ----------------------------------------------------------------------------------------------------------
# gradients (custom chunked backward)


@pytest.mark.parametrize("chunk", [1, 3, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradcheck(chunk, temperature):
    logits, tokens = random_logits(torch.float64, 1, scale=1.0, shape=(2, 5, 6))
    logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, tokens, temperature, chunk), (logits,))
    assert torch.autograd.gradcheck(lambda x: token_entropy(x, temperature, chunk), (logits,))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.float64, 1e-13)])
def test_gradient_matches_naive_autograd(temperature, dtype, tol):
    logits, tokens = random_logits(dtype, 2)
    w = torch.randn(B, T, generator=torch.Generator().manual_seed(3), dtype=dtype)  # an upstream gradient

    def grads(fn_logp, fn_ent):
        x = logits.clone().requires_grad_(True)
        ((w * fn_logp(x)).sum() + (w.flip(0) * fn_ent(x)).sum()).backward()
        return x.grad

    ours = grads(
        lambda x: token_logprobs(x, tokens, temperature, chunk_size=2),
        lambda x: token_entropy(x, temperature, chunk_size=3),
    )
    naive = grads(lambda x: naive_logprobs(x, tokens, temperature), lambda x: naive_entropy(x, temperature))
    torch.testing.assert_close(ours, naive, rtol=10 * tol, atol=tol)


@pytest.mark.parametrize("chunk", [1, 3, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_logprobs_and_entropy_gradcheck(chunk, temperature):
    logits, tokens = random_logits(torch.float64, 1, scale=1.0, shape=(2, 5, 6))
    logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: token_logprobs_and_entropy(x, tokens, temperature, chunk), (logits,))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.float64, 1e-13)])
def test_fused_pair_equals_the_two_functions(temperature, dtype, tol):
    """Values and the single combined gradient equal token_logprobs + token_entropy (and so the naive path)."""
    logits, tokens = random_logits(dtype, 5)
    w = torch.randn(B, T, generator=torch.Generator().manual_seed(3), dtype=dtype)

    def run(fused):
        x = logits.clone().requires_grad_(True)
        if fused:
            lp, ent = token_logprobs_and_entropy(x, tokens, temperature, chunk_size=2)
        else:
            lp, ent = naive_logprobs(x, tokens, temperature), naive_entropy(x, temperature)
        ((w * lp).sum() + (w.flip(0) * ent).sum()).backward()
        return lp.detach(), ent.detach(), x.grad

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, rtol=10 * tol, atol=tol)


def head_inputs(dtype, seed, r=9, d=6, v=13, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = scale * torch.randn(r, d, generator=g, dtype=torch.float64)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64)
    bias = torch.randn(v, generator=g, dtype=torch.float64)
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype), torch.randint(0, v, (r,), generator=g)


@pytest.mark.parametrize("chunk", [1, 4, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_logprobs_gradcheck(chunk, temperature):
    """The fused head's backward (logits buffer overwritten by its gradient, multiplied out per chunk) is the
    derivative of its forward, for the hidden states, the head's weight and its bias."""
    hidden, weight, bias, tokens = head_inputs(torch.float64, 0)
    args = tuple(t.requires_grad_(True) for t in (hidden, weight, bias))
    assert torch.autograd.gradcheck(lambda h, w, b: head_logprobs(h, w, b, tokens, temperature, chunk), args)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    chunk=st.sampled_from([1, 2, 5, None]),
    temperature=st.sampled_from([0.3, 1.0, 2.0]),
    with_bias=st.booleans(),
)
def test_head_logprobs_equals_head_then_log_softmax(seed, scale, chunk, temperature, with_bias):
    """Property, float64 so that only the formula is compared: the fused head gives the values and gradients of
    F.linear followed by the naive log-softmax and entropy, for hidden states from tiny to logits of ~±100, any
    chunking and temperature, and its no-grad path (nothing kept) gives the same values."""
    hidden, weight, bias, tokens = head_inputs(torch.float64, seed, scale=scale)
    bias = bias if with_bias else None
    up = torch.randn(2, hidden.shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

    def run(fused):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if fused:
            lp, ent = head_logprobs(h, w, bias, tokens, temperature, chunk)
        else:
            x = torch.nn.functional.linear(h, w, bias)[None]
            lp, ent = naive_logprobs(x, tokens[None], temperature)[0], naive_entropy(x, temperature)[0]
        ((up[0] * lp).sum() + (up[1] * ent).sum()).backward()
        return lp.detach(), ent.detach(), h.grad, w.grad

    # float64, ~10 roundings over V = 13 terms of size ≤ 100 / 0.3: ~1e-12 absolute; 1e-9 leaves 1000x room
    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    with torch.no_grad():
        lp, _ = head_logprobs(hidden, weight, bias, tokens, temperature, chunk)
    torch.testing.assert_close(lp, run(True)[0], rtol=0, atol=1e-12)


def test_head_logprobs_frozen_head_makes_no_weight_gradient():
    """LoRA freezes the LM head: only the hidden states get a gradient (no (V, D) buffer is made for the head)."""
    hidden, weight, _, tokens = head_inputs(torch.float32, 3)
    h = hidden.requires_grad_(True)
    lp, _ = head_logprobs(h, weight, None, tokens)
    lp.sum().backward()
    assert h.grad is not None
    assert weight.grad is None


def test_bf16_gradient_has_input_dtype():
    logits, tokens = random_logits(torch.float32, 4, scale=1.0)
    x = logits.to(torch.bfloat16).requires_grad_(True)
    token_logprobs(x, tokens, chunk_size=2).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    y = x.detach().float().requires_grad_(True)
    naive_logprobs(y, tokens).sum().backward()
    torch.testing.assert_close(x.grad.float(), y.grad, rtol=0, atol=1e-2)


def test_chunk_size_default_and_validation():
    assert default_chunk_size(8, 151_936) * 8 * 151_936 * 4 <= CHUNK_BYTES
    assert (default_chunk_size(8, 151_936) + 1) * 8 * 151_936 * 4 > CHUNK_BYTES
    assert default_chunk_size(4096, 151_936) == 1
    logits, tokens = random_logits()
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(logits, tokens, chunk_size=-1)
    with pytest.raises(ValueError, match="temperature"):
        token_entropy(logits, temperature=0.0)
    with pytest.raises(ValueError, match="tokens shape"):
        token_logprobs(logits, tokens[:, :-1])


_MEMORY_SCRIPT = """
import torch
from klgrad.logprobs import token_entropy, token_logprobs

def status_mib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024

def peak_extra_mib(fn):
    # Reset the peak-RSS mark (VmHWM) to the current RSS, run fn, report how far the peak rose above it.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_mib("VmRSS:")
    fn()
    return status_mib("VmHWM:") - before

torch.set_num_threads(1)
B, T, V = 1, 512, 151_936  # float32 logits: 297 MiB
logits = torch.randn(B, T, V)
tokens = torch.randint(0, V, (B, T))
x = logits.clone().requires_grad_(True)
token_logprobs(logits[:, :2], tokens[:, :2], chunk_size=1)  # warm-up: first-call allocations
token_entropy(logits[:, :2], chunk_size=1)
torch.log_softmax(logits[:, :2], -1)

def chunked():
    token_logprobs(logits, tokens, chunk_size=8)
    token_entropy(logits, chunk_size=8)
    token_logprobs(x, tokens, chunk_size=8)  # with grad: saves only the logits and (B, T) stats

def naive():
    with torch.no_grad():
        torch.log_softmax(logits, -1).gather(-1, tokens[..., None])

print(peak_extra_mib(chunked), peak_extra_mib(naive))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak-RSS reset")
def test_peak_memory_is_a_fraction_of_naive():
    # Fresh process, peak RSS above the RSS just before each call (VmHWM reset through clear_refs, so pages
    # the kernel reclaims in between do not skew it): the naive log_softmax materialises another (B, T, V)
    # float32 tensor (297 MiB); an 8-position chunk is 4.6 MiB and a few are alive at once (~13 MiB).
    # A fixed mmap threshold makes glibc return every freed chunk at once (its default threshold adapts,
    # which made the chunked figure wander between 12 and 41 MiB from run to run).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    script = textwrap.dedent(_MEMORY_SCRIPT)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
    chunked_mib, naive_mib = map(float, out.stdout.split())
    assert naive_mib > 250, out.stdout
    assert chunked_mib < 0.1 * naive_mib, out.stdout


# ----------------------------------------------------------------------------------------------------------
# sequence_logprobs: the shift convention and position_ids


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


TINY_LLAMA = {"hidden": 32, "layers": 2, "heads": 2, "intermediate": 64, "initializer_range": 0.2}
TINY_GPT2 = {"n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 2, "initializer_range": 0.2}


def tiny_llama(tokenizer, attn="eager"):
    # initializer_range 0.2 (not 0.02) makes the random model's distributions far from uniform, so
    # wrong positions or a wrong shift change the log-probs by much more than the tolerance.
    return build_tiny_model(tokenizer, seed=0, attn_implementation=attn, **TINY_LLAMA).eval()


def tiny_gpt2(tokenizer):
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    cfg = GPT2Config(vocab_size=len(tokenizer), attn_implementation="eager", **ids, **TINY_GPT2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT2LMHeadModel(cfg).eval()


@pytest.fixture(scope="module")
def gpt2(tokenizer):
    return tiny_gpt2(tokenizer)


MODELS = {
    "llama-eager": lambda tok: tiny_llama(tok, "eager"),
    "llama-sdpa": lambda tok: tiny_llama(tok, "sdpa"),
    "gpt2": tiny_gpt2,
}

PROMPTS = ["1+2=", "12+34=", "7=", "(3*4)-5="]
RESPONSES = [["3", "<eos>", "<pad>"], ["4", "6", "<eos>"], ["7", "\n", "<eos>"], ["7", " ", "a"]]  # 3 each


def prompt_and_response_ids(tokenizer):
    """Prompts get BOS by id (text never encodes to a special token); responses are given token by token."""
    prompts = [[tokenizer.bos_token_id, *tokenizer(p)["input_ids"]] for p in PROMPTS]
    responses = [tokenizer.convert_tokens_to_ids(r) for r in RESPONSES]
    return prompts, responses


def batch(tokenizer):
    prompts, responses = prompt_and_response_ids(tokenizer)
    enc = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")  # left-padded
    resp = torch.tensor(responses)  # (B, 3)
    input_ids = torch.cat([enc["input_ids"], resp], 1)  # (B, L)
    mask = torch.cat([enc["attention_mask"], (resp != tokenizer.pad_token_id).long()], 1)  # (B, L)
    return input_ids, mask, enc["input_ids"].shape[1]


def alone(model, prompt, response, temperature=1.0):
    """Row run alone, unpadded, scored by hand: token j's log-prob is read from logits[j - 1]."""
    ids = torch.tensor([prompt + response])  # (1, L)
    n = len(response)
    logits = model(input_ids=ids).logits[0] / temperature  # (L, V)
    logp_all = torch.log_softmax(logits, -1)  # (L, V)
    targets = ids[0, -n:]  # (n,)
    logp = logp_all[-n - 1 : -1].gather(-1, targets[:, None])[:, 0]  # (n,)
    entropy = -(logp_all.exp() * logp_all).sum(-1)[-n - 1 : -1]  # (n,)
    return logp, entropy


def test_position_ids_from_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 1, 2, 2]]


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_left_padded_equals_each_row_alone(tokenizer, name, temperature, packing):
    model = MODELS[name](tokenizer)
    input_ids, mask, start = batch(tokenizer)
    real = mask[:, start:].bool()  # (B, 3) response tokens
    with torch.no_grad():
        logp, ent = sequence_logprobs(model, input_ids, mask, start, temperature, with_entropy=True, packing=packing)
        assert logp.shape == ent.shape == (len(PROMPTS), 3)
        assert not logp.requires_grad
        # a padded batch vs each row alone: float32 rounding of two evaluations (tests/helpers/tolerances.py)
        tol = logprob_tol(model, input_ids, mask, temperature)
        z = 2 * max_abs_logit(model, input_ids, mask) / temperature  # the logit range bounds dH/dz
        for i, (prompt, response) in enumerate(zip(*prompt_and_response_ids(tokenizer), strict=True)):
            ref_logp, ref_ent = alone(model, prompt, response, temperature)
            # Padded: all 3 positions compare, even row 0's trailing <pad> target (read from the logits at
            # <eos>, a real position). Packed: padding is not computed and reads 0.
            keep = torch.ones_like(real[i]) if not packing else real[i]
            torch.testing.assert_close(logp[i][keep], ref_logp[keep], rtol=0, atol=tol)
            torch.testing.assert_close(ent[i][keep], ref_ent[keep], rtol=0, atol=tol * z)
            if packing:
                assert not logp[i][~keep].any()
                assert not ent[i][~keep].any()


@settings(max_examples=10, deadline=None)
@given(extra=st.integers(1, 6), garbage=st.integers(0, 89))
def test_extra_left_padding_changes_nothing(tokenizer, gpt2, extra, garbage):
    # Property: more left padding, filled with any token id, leaves the response log-probs unchanged.
    model = gpt2
    input_ids, mask, start = batch(tokenizer)
    pad_ids = torch.full((len(PROMPTS), extra), garbage)  # (B, extra)
    padded_ids = torch.cat([pad_ids, input_ids.masked_fill(mask == 0, garbage)], 1)  # (B, extra + L)
    padded_mask = torch.cat([torch.zeros_like(pad_ids), mask], 1)  # (B, extra + L)
    with torch.no_grad():
        ref, _ = sequence_logprobs(model, input_ids, mask, start)
        got, _ = sequence_logprobs(model, padded_ids, padded_mask, start + extra)
    real = mask[:, start:].bool()  # a masked response token's own id changed; its score is not compared
    torch.testing.assert_close(got[real], ref[real], rtol=0, atol=logprob_tol(model, input_ids, mask))


@pytest.mark.parametrize("packing", [False, True])
def test_gradient_flows_and_matches_reference(tokenizer, packing):
    model = tiny_llama(tokenizer)
    input_ids, mask, start = batch(tokenizer)
    real = mask[:, start:].bool()  # (B, 3) response tokens: the loss sums these only
    logp, _ = sequence_logprobs(model, input_ids, mask, start, packing=packing)
    assert logp.requires_grad
    logp[real].sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert all(g.abs().sum() > 0 for g in ours.values())

    model.zero_grad()
    rows = zip(*prompt_and_response_ids(tokenizer), strict=True)
    sum(alone(model, p, r)[0][keep].sum() for (p, r), keep in zip(rows, real, strict=True)).backward()
    rel = 2 * model_tol(model.config, 1.0)  # the backward doubles the chain of reductions
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours[n], p.grad, rtol=rel, atol=rel * float(p.grad.abs().max()))


@pytest.mark.parametrize("micro_batch_size", [1, 3, 4, 100])
def test_micro_batching_changes_nothing(tokenizer, micro_batch_size):
    model = tiny_llama(tokenizer)
    input_ids, mask, start = batch(tokenizer)
    with torch.no_grad():
        full, full_ent = sequence_logprobs(model, input_ids, mask, start, with_entropy=True)
        mb, mb_ent = sequence_logprobs(
            model, input_ids, mask, start, with_entropy=True, micro_batch_size=micro_batch_size
        )
        mb_no_ent, none = sequence_logprobs(model, input_ids, mask, start, micro_batch_size=micro_batch_size)
    assert none is None
    # the same rows in batches of another size: rounding of two evaluations (tests/helpers/tolerances.py)
    tol = logprob_tol(model, input_ids, mask)
    torch.testing.assert_close(mb, full, rtol=0, atol=tol)
    torch.testing.assert_close(mb_ent, full_ent, rtol=0, atol=tol * 2 * max_abs_logit(model, input_ids, mask))
    torch.testing.assert_close(mb_no_ent, full, rtol=0, atol=tol)


def test_model_without_logits_to_keep(tokenizer):
    model = tiny_llama(tokenizer)

    class Wrapped(torch.nn.Module):  # a causal LM whose forward has no `logits_to_keep`
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask, position_ids, use_cache):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)

    input_ids, mask, start = batch(tokenizer)
    with torch.no_grad():
        ref, _ = sequence_logprobs(model, input_ids, mask, start)
        got, _ = sequence_logprobs(Wrapped(model), input_ids, mask, start)
    # all logits vs the kept ones only: the same rows, other matmul shapes (tests/helpers/tolerances.py)
    torch.testing.assert_close(got, ref, rtol=0, atol=logprob_tol(model, input_ids, mask))


def test_sequence_logprobs_validation(tokenizer):
    model = tiny_llama(tokenizer)
    input_ids, mask, _ = batch(tokenizer)
    for bad in (0, input_ids.shape[1]):
        with pytest.raises(ValueError, match="response_start"):
            sequence_logprobs(model, input_ids, mask, bad)
    with pytest.raises(ValueError, match="attention_mask"):
        sequence_logprobs(model, input_ids, mask[:, 1:], 3)
