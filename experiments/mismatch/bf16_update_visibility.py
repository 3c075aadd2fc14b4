"""How much of a run's update a bf16 copy of the weights can show (experiments/mismatch/README.md, section 3).

A weight's bf16 copy moves only once its float32 value has moved by half a bf16 spacing at |w|, 2^(⌊log2|w|⌋−8).
AdamW moves a weight by about the lr per step (|m̂/√v̂| ≲ 1; at most (1−β1)/√(1−β2) ≈ 3.16 with betas 0.9, 0.999),
so after n steps |Δw| ≤ n·lr (typical bound) or 3.16·n·lr (worst case). Prints, for each bound, the share of the
model's weights whose half-spacing exceeds it: weights whose bf16 copy cannot have changed.

    PYTHONPATH=src python experiments/mismatch/bf16_update_visibility.py [--model NAME] [--lr 3e-6] [--steps 1 20 60]
"""

from __future__ import annotations

import argparse
import math

import torch

from klgrad.models import load_model_and_tokenizer
from klgrad.models.sources import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--lr", type=float, default=3e-6)
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 20, 60])
    args = ap.parse_args()
    model, _ = load_model_and_tokenizer(resolve_model(args.model))
    w = torch.cat([p.detach().flatten().float() for p in model.parameters()])  # (n_params,)
    half_spacing = torch.pow(2.0, torch.floor(torch.log2(w.abs().clamp_min(1e-30))) - 8)  # (n_params,)
    worst = (1 - 0.9) / math.sqrt(1 - 0.999)
    print(f"{w.numel():,} weights; median |w| {float(w.abs().median()):.4g}, median half-spacing "
          f"{float(half_spacing.median()):.3g}")  # fmt: skip
    for n in args.steps:
        for name, bound in (("typical", n * args.lr), ("worst case", worst * n * args.lr)):
            frozen = float((half_spacing > bound).double().mean())
            print(f"{n} steps at lr {args.lr:g}, {name} |Δw| <= {bound:.2e}: {frozen:.3f} cannot change in bf16")


if __name__ == "__main__":
    main()
