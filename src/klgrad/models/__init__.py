"""Models: the character tokenizer, the tiny Llama factory, loading and saving any local causal LM."""

from klgrad.models.dropout import disable_dropout
from klgrad.models.factory import (
    build_tiny_model,
    count_parameters,
    default_attention,
    load_model_and_tokenizer,
    save_model_and_tokenizer,
    tiny_llama_config,
)
from klgrad.models.tokenizer import CHARS, SPECIAL_TOKENS, build_char_tokenizer, char_vocab

__all__ = [
    "CHARS",
    "SPECIAL_TOKENS",
    "build_char_tokenizer",
    "build_tiny_model",
    "char_vocab",
    "count_parameters",
    "default_attention",
    "disable_dropout",
    "load_model_and_tokenizer",
    "save_model_and_tokenizer",
    "tiny_llama_config",
]
