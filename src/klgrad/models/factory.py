"""Build a tiny Llama, load any local causal LM by path, save atomically.

Everything here is offline: loading never touches the Hub (``local_files_only=True``) and reads safetensors
only (``use_safetensors=True``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

DEFAULT_CPU_ATTENTION = "eager"
DEFAULT_CUDA_ATTENTION = "sdpa"

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def tiny_llama_config(
    vocab_size: int,
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    intermediate: int = 512,
    max_position: int = 256,
    **overrides: Any,
) -> LlamaConfig:
    """A small Llama config: 1.06M parameters with the defaults at ``vocab_size`` = 90 (tied embeddings).

    Parameters: per layer 4·h² (attention) + 3·h·i (SwiGLU MLP) + 2·h (RMSNorms) = 262,400 at h=128,
    i=512; four layers 1,049,600, plus the tied embedding V·h and the final norm h.

    ``attn_implementation`` defaults to ``"eager"``. Measured once, 2026-11-21 (2 vCPU Xeon, 2 threads, torch 2.13,
    transformers 5.23; this model at V = 90; batch 256 × 24 tokens; forward with ``labels`` + backward; median
    of 10 after 2 warm-ups, eager and sdpa interleaved in one process on an otherwise idle machine):
    eager 0.088 s forward + 0.159 s backward, sdpa 0.090 s + 0.158 s without a mask; with a left-padding mask
    and position_ids eager 0.087 s + 0.152 s, sdpa 0.088 s + 0.155 s. At 24 tokens the two are equal (also
    at 14 tokens: 0.059 + 0.091 s vs 0.053 + 0.089 s): an earlier, unrecorded measurement during development
    that had sdpa 7-8× slower did not reproduce.
    While other processes used the 2 cores, every op slowed ~15× (OpenMP threads waiting on descheduled
    peers) for either implementation, so a single contended run can show either as several times slower.
    Eager stays the default on CPU: within noise of sdpa here, and the reference kernel every HF model has.
    ``overrides`` go to :class:`LlamaConfig` unchanged (e.g. ``rope_theta``, ``attn_implementation``).
    """
    kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "intermediate_size": intermediate,
        "max_position_embeddings": max_position,
        "tie_word_embeddings": True,
        "attn_implementation": DEFAULT_CPU_ATTENTION,
    }
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def build_tiny_model(tokenizer: PreTrainedTokenizerBase, seed: int, **overrides: Any) -> LlamaForCausalLM:
    """A freshly initialised float32 tiny Llama whose vocabulary and special ids come from ``tokenizer``.

    Initialisation is seeded with ``torch.manual_seed(seed)`` inside a forked RNG, so the same seed gives
    bitwise-identical weights and the caller's global RNG state is left untouched. ``overrides`` go to
    :func:`tiny_llama_config` (``hidden``, ``layers``, ... or any :class:`LlamaConfig` field).
    """
    ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    config = tiny_llama_config(len(tokenizer), **{**ids, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model = model.to(torch.float32)
    for name, value in ids.items():
        setattr(model.generation_config, name, value)
    return model


def default_attention(device: str | torch.device) -> str:
    """``"eager"`` on CPU (as fast as sdpa for tiny models; see :func:`tiny_llama_config`), else sdpa."""
    return DEFAULT_CPU_ATTENTION if torch.device(device).type == "cpu" else DEFAULT_CUDA_ATTENTION


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}") from None


def _check_model_dir(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"model path {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json (not a saved HF model)")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"model directory {str(path)!r} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)})"
        )


def load_model_and_tokenizer(
    path: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str | None = None,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load any local ``AutoModelForCausalLM`` directory (safetensors) and its tokenizer, offline.

    Args:
        path: a directory written by ``save_pretrained`` (ours or any HF causal LM).
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` (or ``fp32``/``bf16``/``fp16``) or a torch dtype.
        attn_implementation: used if given; otherwise :func:`default_attention` of ``device``.
        device: where the weights go.

    Returns:
        ``(model, tokenizer)``, the model in eval mode. The tokenizer is set to left padding (prompts are
        left-padded for generation) and, if it has no pad token, uses its EOS token for padding.

    Raises:
        FileNotFoundError: the directory, its ``config.json`` or its tokenizer files are missing.
        NotADirectoryError: ``path`` is a file.
        ValueError: unknown ``dtype``.
    """
    path = Path(path)
    _check_model_dir(path)
    torch_dtype = _resolve_dtype(dtype)
    attn = attn_implementation or default_attention(device)
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch_dtype,
        attn_implementation=attn,
        use_safetensors=True,
        local_files_only=True,
    )
    model = model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def save_model_and_tokenizer(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | os.PathLike[str]
) -> Path:
    """Write a standard HF directory (``model.safetensors``, ``config.json``, tokenizer files) at ``path``.

    The directory is written to a temporary sibling and renamed into place, so readers never see a
    half-written model. An existing ``path`` is first renamed aside and deleted only after the new one is
    in place (if the final rename fails, the old directory is put back). The swap is two renames, not one:
    POSIX cannot atomically replace a non-empty directory. Returns the resolved path.
    """
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; a model directory is ordinarily world-readable
    try:
        model.save_pretrained(tmp)  # safetensors is the only format in transformers 5
        tokenizer.save_pretrained(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old: Path | None = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:12]}")
        os.replace(path, old)
    try:
        os.replace(tmp, path)
    except BaseException:
        if old is not None:
            os.replace(old, path)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return path


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once, as ``model.parameters()`` yields them)."""
    return sum(p.numel() for p in model.parameters())
