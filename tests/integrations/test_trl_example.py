"""docs/trl.md's claims, run: its example as written (offline, CPU, warnings as errors), and what its metrics
say ``loss/kl`` is on- and off-policy (docs/metrics.md, ``loss/kl``)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.extras import reason
from tests.helpers.tolerances import gamma

pytest.importorskip("trl", reason=reason("trl"))

from klgrad.integrations.trl import KLGradGRPOTrainer, KLGradTRLConfig
from tests.helpers import trl_checks
from tests.helpers.trl_checks import make_trainer, policy_logps

# the shared fixtures, bound here so pytest finds them by name
offline, model_dir, dataset, setup = trl_checks.offline, trl_checks.model_dir, trl_checks.dataset, trl_checks.setup

ROOT = Path(__file__).parents[2]
G9 = gamma(9)
"""Two float32 computations of one response's U from the same log-probs, Σ_t l − Σ_t r (kl_loss at sequence
level) and Σ_t (l − r) (the kl/* estimates), over ≤ 8 tokens, differ by ≤ 2·γ_9·Σ_t (|l_t| + |r_t|); so ½U² by
≤ |U|·2·γ_9·Σ_t (|l_t| + |r_t|) (the ΔU² term is below float32's resolution of these values)."""
LOGP_MAX = 30.0
"""|l|, |r| of a sampled token: below −30 (p < 1e-13) a token is not drawn in the example's 640 samples, and the
reference stays within nats of the policy (``kl/logp_gap_abs`` ≈ 0.13)."""


def example_code() -> str:
    """The Python block under “A complete example” in docs/trl.md, as written."""
    text = (ROOT / "docs" / "trl.md").read_text(encoding="utf-8")
    section = text[text.index("## A complete example") :]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


@pytest.mark.slow
def test_the_example_runs_as_written_without_warnings(tmp_path: Path) -> None:
    """Every warning is an error (-W error): before the change ``GRPOConfig(gradient_checkpointing=False)`` and TRL's
    own generation raised transformers' FutureWarnings. The printed last log record holds every klgrad metric, and
    on-policy ``loss/kl`` is ``kl/k2`` (k2_as_loss at sequence level is ½U²)."""
    script = tmp_path / "example.py"
    script.write_text(example_code(), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-W", "error", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Warning" not in done.stderr, done.stderr[-3000:]
    record = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    for key in ("kl/k1", "kl/k2", "kl/k3", "kl/logp_gap", "kl/logp_gap_abs", "loss/kl", "reward"):
        assert key in record, key
    # G9's bound with Σ_t (|l| + |r|) ≤ 2·8·LOGP_MAX and mean |U| ≤ √(mean U²) = √(2·kl/k2), plus the means'
    # roundings (≤ 5 steps × 32 responses of positive terms: γ_161)
    tol = 2 * G9 * 2 * 8 * LOGP_MAX * (2 * record["kl/k2"]) ** 0.5 + gamma(161) * record["kl/k2"]
    assert abs(record["loss/kl"] - record["kl/k2"]) <= tol
    assert record["kl/k3"] > 0


def test_loss_kl_is_the_penalty_on_policy_and_the_surrogate_off_policy(setup: dict, dataset) -> None:
    """k2_as_loss at sequence level: on-policy ``loss/kl`` is ½U², ``kl/k2``; off-policy the value of the clipped
    surrogate ρ·c with c = U, at ρ = 1 (TRL's first pass over a batch) ``kl/k1``, an estimate that a batch can put
    below 0 though the KL cannot (docs/metrics.md says so); with another behaviour it is neither."""
    model, tok, out, inputs = setup["model"], setup["tokenizer"], setup["out"], setup["inputs"]
    cfg = KLGradTRLConfig("k2_as_loss", "sequence", "decoupled")
    trainer = make_trainer(KLGradGRPOTrainer, model, tok, dataset, out, klgrad_config=cfg)
    model.eval()
    metrics = trainer._metrics["eval"]

    def logged(batch: dict) -> dict[str, float]:
        with torch.no_grad():
            trainer.compute_loss(model, batch)
        return {k: metrics[k][-1] for k in ("loss/kl", "kl/k1", "kl/k2")}

    with torch.no_grad():
        current = policy_logps(trainer, model, inputs)  # (B, T): as the loss's forward computes them, ρ = 1 in value
    mask = inputs["completion_mask"].bool()
    ref = inputs["ref_per_token_logps"]
    u_sum = torch.where(mask, current - ref, 0.0).sum(-1).abs()  # (B,) |U|
    size = torch.where(mask, current.abs() + ref.abs(), 0.0).sum(-1)  # (B,) Σ_t (|l| + |r|)
    tol_u = float((2 * G9 * size).mean())  # mean of U's two computations (G9)
    tol_half_u2 = float((u_sum * 2 * G9 * size).mean())  # of ½U²'s

    on = logged(inputs)
    assert abs(on["loss/kl"] - on["kl/k2"]) <= tol_half_u2
    first_pass = logged({**inputs, "old_per_token_logps": current})
    assert abs(first_pass["loss/kl"] - first_pass["kl/k1"]) <= tol_u
    assert abs(first_pass["kl/k1"] - first_pass["kl/k2"]) > 1e-3  # the two identities are distinguishable here
    stale = logged({**inputs, "old_per_token_logps": setup["old"]})
    assert abs(stale["loss/kl"] - stale["kl/k1"]) > 1e-3
