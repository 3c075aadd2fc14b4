"""A 1-layer float64 Llama over 5 tokens for exact-enumeration tests (brute force over every response)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

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
