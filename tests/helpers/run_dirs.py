"""A klgrad run directory made without training: for the tests of what reads runs (``klgrad eval --model RUN``,
``klgrad forgetting --policy RUN``)."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from klgrad.config import Config, to_dict
from klgrad.eval.models import EMBEDDED_DEFAULT
from klgrad.models import load_model_and_tokenizer
from klgrad.models.sources import EMBEDDED_DIR
from klgrad.trainer.checkpoints import save_checkpoint


def make_run(root: Path, noise: float, steps: tuple[int, ...] = (3,)) -> tuple[Path, dict]:
    """A klgrad run directory as ``klgrad train`` writes it (config.yaml, checkpoints/step_N via save_checkpoint)
    whose policy is the embedded reference plus seeded noise; returns it and the last checkpoint's weights."""
    cfg = Config()
    run = root / "run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    policy, _ = load_model_and_tokenizer(EMBEDDED_DIR / EMBEDDED_DEFAULT)
    optimizer = torch.optim.AdamW(policy.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0)
    gen = torch.Generator().manual_seed(0)
    for step in steps:
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(noise * torch.randn(p.shape, generator=gen))
        save_checkpoint(run, step, policy, policy, optimizer, scheduler, 0.5, cfg, save_ref=False)
    return run, {k: v.clone() for k, v in policy.state_dict().items()}
