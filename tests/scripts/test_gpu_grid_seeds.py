"""scripts/gpu_grid_seeds.sh, the sharpening grid's seeds on a CUDA machine: its design is the committed grid's (so
the seeds it brings back merge), and its queue runs every seed once, at most PARALLEL at a time, each followed by its
forgetting measurement, within the budget. The queue runs here with a stand-in ``python3`` that records its
arguments (the real processes need CUDA and SmolLM2's weights)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_grid_seeds.sh"
GRID = ROOT / "results" / "smollm2_sharpen_converged" / "grid.json"


def compare_flags() -> dict[str, str]:
    """The flags of the script's ``klgrad compare`` command, flag → value."""
    text = SCRIPT.read_text()
    cmd = re.search(r"python3 -m klgrad compare (.*?)\s*\\\n\s*&&", text, re.S).group(1).replace("\\\n", " ")
    words = shlex.split(cmd)
    return {w: words[i + 1] for i, w in enumerate(words) if w.startswith("--") and i + 1 < len(words)}


def test_the_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_its_design_is_the_committed_grids():
    """Every field a merge compares (klgrad.compare.merge.check_mergeable) is what the committed grid records."""
    grid = json.loads(GRID.read_text())
    flags = compare_flags()
    assert flags["--config"] == grid["config"]
    assert int(flags["--steps"]) == grid["steps"]
    assert int(flags["--seeds"]) == grid["seeds"]
    assert [float(b) for b in flags["--betas"].split(",")] == grid["betas"]
    assert flags["--level"] == grid["level"]
    assert int(flags["--kl-prompts"]) == grid["exact_prompts"]
    assert int(flags["--kl-samples"]) == grid["estimate_samples"]
    assert float(flags["--converge-gap"]) == grid["convergence"]["gap"]
    p = grid["primary"]
    assert flags["--primary"] == f"{p['a']}<{p['b']}:{p['metric']}"
    for key, value in grid["overrides"].items():  # recorded as typed values
        given = flags[f"--{key}"]
        assert (float(given) if isinstance(value, float) else given) == value, key
    assert grid["revision"]["revision"].startswith(re.search(r"REV=\$\{REV:-(\w+)\}", SCRIPT.read_text()).group(1))


def _stand_ins(bin_dir: Path, log: Path) -> None:
    """``python3`` that records its arguments and, for a compare, sleeps a little (to overlap); ``nvidia-smi``."""
    bin_dir.mkdir()
    py = bin_dir / "python3"
    py.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$(date +%s.%N) start $$ $*" >> {log}\n'
        'case "$*" in *"klgrad compare"*) sleep 1 ;; esac\n'
        f'echo "$(date +%s.%N) end $$" >> {log}\n'
    )
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho stand-in\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)


def test_the_queue_runs_each_seed_once_then_a_registered_seeds_forgetting_at_most_parallel_at_a_time(tmp_path):
    log = tmp_path / "calls.log"
    _stand_ins(tmp_path / "bin", log)
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "SEEDS": "0 1 16",
        "NONE_SEEDS": "1",
        "PARALLEL": "2",
        "BUDGET": "60",
        "GPU_CHECK": "0",
        "OUT": str(tmp_path),
        "WORK": str(tmp_path / "work"),
    }
    subprocess.run(["bash", str(SCRIPT)], env=env, check=True, capture_output=True, timeout=120)
    lines = log.read_text().splitlines()
    compares = [ln for ln in lines if "klgrad compare" in ln]
    assert len(compares) == 3
    for s in (0, 1, 16):
        mine = [ln for ln in compares if f"--only-seeds {s} " in ln]
        assert len(mine) == 1
        assert f"--out {tmp_path / 'work' / 'g' / f'seed{s}'} " in mine[0]
        assert "--pin c798603" in mine[0]
        assert ("--methods k3_as_loss,k2_as_loss,none " in mine[0]) == (s == 1)
        forgetting = f"scripts/grid_forgetting.py {tmp_path / 'work' / 'g' / f'seed{s}'} --samples 4 --device cuda"
        assert (forgetting in log.read_text()) == (s < 16)  # measured on the registered seeds only
    live: set[str] = set()  # pids of the compares running, in the log's order of events
    most = 0
    for ln in lines:
        _, kind, pid = ln.split()[:3]
        if kind == "start" and "klgrad compare" in ln:
            live.add(pid)
            most = max(most, len(live))
        elif kind == "end":
            live.discard(pid)
    assert most == 2  # two at once, never three
    for name in ("grid.tgz", "logs.tgz"):
        assert (tmp_path / name).is_file()
