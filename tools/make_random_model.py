"""Write a randomly initialised Qwen2-architecture causal LM of a requested size, offline, for hardware checks.

    python tools/make_random_model.py --arch qwen2 --params 0.5B --out runs/gpu_check/model [--device cuda]
    python tools/make_random_model.py --params 0.5B --dry-run      # the shape and the count, nothing built

The tokenizer is klgrad's embedded character tokenizer (``src/klgrad/assets/tiny_addition``, 90 tokens) unless
``--tokenizer DIR`` names another; the vocabulary is set to it. Nothing is downloaded. The weights are random
(transformers' own initialisation, seeded): the model measures speed, memory and the code paths, not quality.

The shape follows Qwen2.5-0.5B's proportions (head size 64, 2 key/value heads, an MLP about 5-6 times the width):
the depth grows as the cube root of the size (24 layers at 0.5B), the width is the multiple of 128 nearest to
what fills the budget at that depth, and the MLP width is then solved from the exact count, so the model lands
within a fraction of a percent of the target (:func:`qwen2_shape`, :func:`qwen2_param_count`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER = REPO / "src" / "klgrad" / "assets" / "tiny_addition"
HEAD_DIM = 64
KV_HEADS = 2
LAYER_COEF = 18.3
"""A Qwen2 layer holds ≈ 18.3·h² parameters at Qwen2.5-0.5B's proportions: 2·h² for q and o, 3·h·i for the
MLP with i ≈ 5.43·h (4864 / 896), and the small k/v projections of 2 heads."""
DEPTH_DIVISOR = 33.0
"""Layers ≈ N^(1/3) / 33: 24 layers at 5e8 parameters, as Qwen2.5-0.5B."""

_UNITS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}


def parse_size(text: str) -> int:
    """``"0.5B"`` -> 500_000_000; ``"4M"``, ``"120k"``, ``"1.5e9"``, ``"123456"``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgG]?)\s*", text)
    if m is None:
        raise ValueError(f"not a parameter count: {text!r} (e.g. 0.5B, 4M, 120k, 1.5e9)")
    n = round(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise ValueError(f"parameter count must be positive, got {text!r}")
    return n


@dataclass(frozen=True)
class Qwen2Shape:
    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    tie: bool = True


def qwen2_param_count(shape: Qwen2Shape) -> int:
    """Parameters of ``Qwen2ForCausalLM`` with this shape (tied embeddings counted once).

    Per layer: q (h·H·d + H·d bias), k and v (h·K·d + K·d bias each), o (H·d·h, no bias), the SwiGLU MLP
    (3·h·i, no biases), two RMSNorm weights (2·h). Plus the embedding V·h (and the LM head V·h when untied) and
    the final norm h.
    """
    h, d = shape.hidden, shape.hidden // shape.heads
    q, kv = shape.heads * d, shape.kv_heads * d
    attention = (h * q + q) + 2 * (h * kv + kv) + q * h
    layer = attention + 3 * h * shape.intermediate + 2 * h
    return shape.layers * layer + shape.vocab * h * (1 if shape.tie else 2) + h


def qwen2_shape(target: int, vocab: int, *, layers: int | None = None, hidden: int | None = None) -> Qwen2Shape:
    """The shape whose :func:`qwen2_param_count` is nearest ``target`` (see the module docstring)."""
    if layers is None:
        layers = min(48, max(2, round(target ** (1 / 3) / DEPTH_DIVISOR)))
    if hidden is None:
        hidden = max(128, 128 * round(math.sqrt(target / (layers * LAYER_COEF)) / 128))
    if hidden % HEAD_DIM:
        raise ValueError(f"hidden must be a multiple of the head size {HEAD_DIM}, got {hidden}")
    heads = hidden // HEAD_DIM
    kv_heads = KV_HEADS if heads % KV_HEADS == 0 else 1
    base = Qwen2Shape(vocab, hidden, layers, 0, heads, kv_heads)
    per_unit = 3 * layers * hidden  # parameters per unit of MLP width
    intermediate = 16 * round((target - qwen2_param_count(base)) / per_unit / 16)
    if intermediate < 16:
        raise ValueError(
            f"{target:,} parameters is too small for {layers} layers of width {hidden} "
            f"({qwen2_param_count(base):,} without the MLP); ask for more or pass --layers/--hidden"
        )
    return Qwen2Shape(vocab, hidden, layers, intermediate, heads, kv_heads)


def qwen2_config(shape: Qwen2Shape, tokenizer, max_position: int = 4096):
    """A ``transformers.Qwen2Config`` of ``shape`` with the tokenizer's special ids (full attention)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max_position,
        tie_word_embeddings=shape.tie,
        use_sliding_window=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def build(shape: Qwen2Shape, tokenizer, seed: int, device: str = "cpu"):
    """A float32 ``Qwen2ForCausalLM`` initialised on ``device`` from ``seed`` (the caller's RNG untouched)."""
    import torch
    from transformers import Qwen2ForCausalLM

    config = qwen2_config(shape, tokenizer)
    devices = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        setattr(model.generation_config, name, getattr(tokenizer, name))
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="qwen2", choices=("qwen2",), help="architecture (qwen2)")
    p.add_argument("--params", required=True, help="target size, e.g. 0.5B, 4M")
    p.add_argument("--out", help="output model directory (safetensors + config + tokenizer)")
    p.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="tokenizer directory (default: embedded)")
    p.add_argument("--layers", type=int, help="fix the depth (default: from the size)")
    p.add_argument("--hidden", type=int, help="fix the width, a multiple of 64 (default: from the size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where to initialise (cuda is faster for large models)")
    p.add_argument("--dry-run", action="store_true", help="print the shape and count as JSON; build nothing")
    args = p.parse_args(argv)
    try:
        target = parse_size(args.params)
    except ValueError as e:
        p.error(str(e))
    if args.dry_run:
        vocab = _vocab_size(Path(args.tokenizer))
        shape = qwen2_shape(target, vocab, layers=args.layers, hidden=args.hidden)
        print(json.dumps({"target": target, "params": qwen2_param_count(shape), **asdict(shape)}))
        return 0
    if not args.out:
        p.error("--out is required (or --dry-run)")
    sys.path.insert(0, str(REPO / "src"))
    from transformers import AutoTokenizer

    from klgrad.models import count_parameters, save_model_and_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    shape = qwen2_shape(target, len(tokenizer), layers=args.layers, hidden=args.hidden)
    model = build(shape, tokenizer, args.seed, args.device)
    n = count_parameters(model)
    if n != qwen2_param_count(shape):  # the formula is what the shape was solved with: it must be exact
        raise RuntimeError(f"built {n:,} parameters, formula says {qwen2_param_count(shape):,}")
    out = save_model_and_tokenizer(model.to("cpu"), tokenizer, args.out)
    print(
        f"qwen2: {n:,} parameters (target {target:,}, {100 * (n - target) / target:+.2f}%): hidden {shape.hidden}, "
        f"layers {shape.layers}, heads {shape.heads} ({shape.kv_heads} kv), intermediate {shape.intermediate}, "
        f"vocab {shape.vocab} -> {out}"
    )
    return 0


def _vocab_size(tokenizer_dir: Path) -> int:
    """Tokens of a saved fast tokenizer (``tokenizer.json``: model vocabulary plus added tokens), no import."""
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    ids = set(data["model"]["vocab"].values()) | {t["id"] for t in data.get("added_tokens", [])}
    return len(ids)


if __name__ == "__main__":
    sys.exit(main())
