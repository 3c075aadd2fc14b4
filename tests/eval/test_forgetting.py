"""``klgrad forgetting`` (formerly ``python -m klgrad.eval.forgetting``): both KLs to the reference on chat
prompts, for model folders and for
klgrad run directories (their checkpoint over their starting model)."""

from __future__ import annotations

import json

from klgrad.cli import main as cli_main
from klgrad.models.sources import EMBEDDED_DIR
from tests.helpers.run_dirs import make_run


def main(argv: list[str]) -> int:
    return cli_main(["forgetting", *argv])


def test_module_entry_point_writes_both_kls(tmp_path, capsys):
    """``klgrad forgetting``: a model folder against itself on two prompts: 0 both ways, as JSON."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+2="}\n{"prompt": "33+4="}\n', encoding="utf-8")
    model = str(EMBEDDED_DIR / "tiny_addition")
    argv = ["--policy", model, "--reference", model, "--prompts", str(prompts), "--samples", "2"]
    assert main([*argv, "--max-new-tokens", "4", "--out", str(tmp_path / "f.json")]) == 0
    saved = json.loads((tmp_path / "f.json").read_text())
    assert saved == json.loads(capsys.readouterr().out)
    assert (saved["reverse_kl"], saved["forward_kl"], saved["n_prompts"]) == (0.0, 0.0, 2)


def test_module_entry_point_takes_a_run_directory(tmp_path, capsys):
    """``--policy RUN`` loads the run's newest checkpoint over its starting model, which is the default
    reference, at the run's sampling temperature: an unchanged policy is at 0 both ways, a perturbed one is not;
    a model folder without ``--reference`` is refused."""
    from klgrad.config import Config

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+2="}\n{"prompt": "33+4="}\n', encoding="utf-8")
    argv = ["--prompts", str(prompts), "--samples", "2", "--max-new-tokens", "4", "--device", "cpu"]
    same, _ = make_run(tmp_path / "same", noise=0.0)
    assert main(["--policy", str(same), *argv]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["reverse_kl"], out["forward_kl"]) == (0.0, 0.0)  # the same weights: every log-ratio is 0 exactly
    assert out["checkpoint"] == str(same / "checkpoints" / "step_000003")
    assert out["temperature"] == Config().rollout.temperature
    moved, _ = make_run(tmp_path / "moved", noise=0.05)
    assert main(["--policy", str(moved), *argv]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["reverse_kl"] > 0
    assert out["forward_kl"] > 0
    assert main(["--policy", str(EMBEDDED_DIR / "tiny_addition"), *argv]) == 2  # a model folder needs --reference
    assert "--reference is needed" in capsys.readouterr().err


def test_the_module_command_line_points_to_the_command():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "klgrad.eval.forgetting", "--policy", "x"], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert "klgrad forgetting --policy" in done.stderr


def test_it_takes_its_cpu_share_or_the_threads_given(tmp_path, monkeypatch, capsys):
    """Beside a training run it must not take every core: the measurement runs registered as a klgrad process
    (``--threads auto``, the default; klgrad.threads) or with ``--threads N``, and torch's count is given back."""
    import os

    import torch

    import klgrad.exact.estimators as estimators
    from klgrad.threads import registry_dir

    seen = []

    def measure(*args, **kwargs):
        seen.append(((registry_dir() / str(os.getpid())).is_file(), torch.get_num_threads()))
        return {}

    monkeypatch.setattr(estimators, "forgetting_kl", measure)  # klgrad.eval.forgetting imports it at call time
    model = str(EMBEDDED_DIR / "tiny_addition")
    before = torch.get_num_threads()
    assert main(["--policy", model, "--reference", model, "--device", "cpu"]) == 0
    assert main(["--policy", model, "--reference", model, "--device", "cpu", "--threads", "1"]) == 0
    assert seen[0][0]  # registered while it measured
    assert seen[1] == (False, 1)
    assert torch.get_num_threads() == before
    assert not (registry_dir() / str(os.getpid())).exists()
    capsys.readouterr()
