"""gpu_grid_seeds.sh, the sharpening grid's seeds on a CUDA machine: its design is the committed grid's (so
the seeds it brings back merge), and its queue runs every (seed, method) once, each into its own folder that starts
as a copy of the grid's grid.json, at most PARALLEL at a time with THREADS CPU threads each, each run followed by
its final measurements afterwards (downstream; forgetting for a registered seed), within the budget. The queue
runs here with a stand-in ``python3`` that records its arguments (the real processes need CUDA and SmolLM2's
weights)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "gpu_grid_seeds.sh"
GRID = ROOT / "experiments" / "smollm2_sharpen_converged" / "grid.json"


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
    assert "--primary" not in flags  # one method a process: the primary is the copied grid.json's (inherited)
    assert grid["primary"] is not None
    for key, value in grid["overrides"].items():  # recorded as typed values
        given = flags[f"--{key}"]
        assert (float(given) if isinstance(value, float) else given) == value, key
    assert grid["revision"]["revision"].startswith(re.search(r"REV=\$\{REV:-(\w+)\}", SCRIPT.read_text()).group(1))


def _stand_ins(bin_dir: Path, log: Path) -> None:
    """``python3`` that records its arguments and thread count and, for a compare, sleeps a little (to overlap);
    ``nvidia-smi``."""
    bin_dir.mkdir()
    py = bin_dir / "python3"
    py.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$(date +%s.%N) start $$ threads=$OMP_NUM_THREADS $*" >> {log}\n'
        'case "$*" in *"klgrad compare"*) sleep 1 ;; esac\n'
        f'echo "$(date +%s.%N) end $$" >> {log}\n'
    )
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\necho stand-in\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)


def test_the_queue_runs_each_seed_and_method_once_in_its_own_folder_at_most_parallel_at_a_time(tmp_path):
    log = tmp_path / "calls.log"
    _stand_ins(tmp_path / "bin", log)
    grid_json = tmp_path / "grid.json"
    grid_json.write_text('{"stand-in": true}')
    work = tmp_path / "work"
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "SEEDS": "0 1 16",
        "NONE_SEEDS": "1",
        "PARALLEL": "2",
        "THREADS": "3",
        "GRID_JSON": str(grid_json),
        "BUDGET": "60",
        "GPU_CHECK": "0",
        "OUT": str(tmp_path),
        "WORK": str(work),
    }
    done = subprocess.run(["bash", str(SCRIPT)], env=env, check=True, capture_output=True, text=True, timeout=120)
    assert "--- gpu_check" not in done.stdout  # GPU_CHECK=0: no check ran, none is reported
    text = log.read_text()
    lines = text.splitlines()
    compares = [ln for ln in lines if "klgrad compare" in ln and "klgrad compare measure" not in ln]
    measures = [ln for ln in lines if "klgrad compare measure" in ln]
    runs = [(0, "k3_as_loss"), (0, "k2_as_loss"), (1, "k3_as_loss"), (1, "k2_as_loss"), (1, "none"),
            (16, "k3_as_loss"), (16, "k2_as_loss")]  # fmt: skip
    assert len(compares) == len(measures) == len(runs)
    for s, m in runs:
        folder = work / "g" / f"seed{s}-{m}"
        mine = [ln for ln in compares if f"--only-seeds {s} " in ln and f"--methods {m} " in ln]
        assert len(mine) == 1, (s, m)
        assert f"--out {folder} " in mine[0]
        assert "--pin c798603" in mine[0]
        assert " threads=3 " in mine[0]
        assert (folder / "grid.json").read_text() == grid_json.read_text()  # the design and its primary
        (measured,) = [ln for ln in measures if f"measure {folder} " in ln]  # after its run, in its folder
        assert " downstream " in measured
        assert " threads=3 " in measured
        assert measured.endswith("--device cuda")
        assert ("forgetting:samples=4" in measured) == (s < 16)  # measured on the registered seeds only
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


def test_a_process_without_the_primary_flag_inherits_the_committed_grids_primary():
    """The copied grid.json states the primary; a process of one method cannot state it (it names two methods),
    and the continuation rule takes the record's, so the folders merge with the same design."""
    from klgrad.compare.design import settle_design

    old = json.loads(GRID.read_text())
    new = {**{k: v for k, v in old.items() if k not in ("sessions", "amendments", "merged_from")}}
    new.update(primary=None, methods=["k2_as_loss"], session={"at": "now"}, created="now")
    settled = settle_design(old, new, has_runs=True, where="the copy")
    assert settled["primary"] == old["primary"]
    assert settled["methods"][:2] == old["methods"][:2]
