"""Small random models for tests: a 1-layer float64 Llama over 5 tokens for exact-enumeration tests (brute force
over every response), and the 2-layer float32 Llama (grouped-query attention) and Qwen2 (q/k/v biases) that the
fast-forward and LoRA tests compare with transformers."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

PAD, BOS, EOS, V = 0, 1, 2, 5
HIDDEN, INTER = 16, 32


def tiny_llama64(seed: int, attn: str = "eager") -> LlamaForCausalLM:
    """Random weights from ``seed``, final norm ×4 (sharper distributions). ``attn="sdpa"`` keeps attention in
    float64 throughout; transformers' eager attention computes its softmax in float32."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        tie_word_embeddings=True,
    )
    cfg._attn_implementation = attn
    m = LlamaForCausalLM(cfg).eval().double()
    with torch.no_grad():
        m.model.norm.weight.mul_(4.0)
    return m


COMMON = dict(  # the fast-forward and LoRA tests' models
    vocab_size=23,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention: 2 query heads per key/value head
    max_position_embeddings=64,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
)


def llama() -> LlamaForCausalLM:
    """2-layer float32 Llama with grouped-query attention (:data:`COMMON`), seed 0, eval mode."""
    torch.manual_seed(0)
    cfg = LlamaConfig(**COMMON, tie_word_embeddings=True)
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg).eval()


def qwen2() -> Qwen2ForCausalLM:
    """2-layer float32 Qwen2 (:data:`COMMON`), seed 1, with non-zero q/k/v biases, eval mode."""
    torch.manual_seed(1)
    cfg = Qwen2Config(**COMMON, tie_word_embeddings=False, rope_theta=1000.0)
    cfg._attn_implementation = "eager"
    m = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # non-zero biases, so a path that ignored them would fail
        for layer in m.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return m


def full_forward_logits(model, ids, mask):
    """One transformers forward over whole left-padded rows (positions counted from each row's first token), no
    grad: the reference the fast decoder and the GPU sampler are compared with."""
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits
