"""The shipped configs live in the package (``src/klgrad/configs``, with ``configs`` at the checkout's root a
relative symlink to it): a wheel carries every one of them, and ``klgrad compare``'s default
``configs/tiny_add.yaml`` resolves from an installed wheel in any directory."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_CONFIGS = ROOT / "src" / "klgrad" / "configs"


def shipped_configs() -> list[str]:
    """Every file under ``src/klgrad/configs`` as its path inside the wheel (``klgrad/configs/...``)."""
    return sorted(
        f"klgrad/configs/{p.relative_to(PACKAGE_CONFIGS).as_posix()}"
        for p in PACKAGE_CONFIGS.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )


def test_root_configs_is_a_relative_link_to_the_package_configs():
    """``--config configs/<name>.yaml`` and every documented ``configs/...`` path keep working from a checkout."""
    link = ROOT / "configs"
    assert link.is_symlink()
    assert os.readlink(link) == "src/klgrad/configs"
    assert link.resolve() == PACKAGE_CONFIGS.resolve()
    expected = {"tiny_add.yaml", "tiny_discovery.yaml", "tiny_scratchpad.yaml", "paper_qwen2.5_math_1.5b.yaml"}
    assert expected <= {p.name for p in PACKAGE_CONFIGS.glob("*.yaml")}
    assert {"ddp_cpu.yaml", "fsdp_gpu.yaml"} <= {p.name for p in (PACKAGE_CONFIGS / "accelerate").glob("*.yaml")}


def _clean_copy(dest: Path) -> Path:
    """pyproject.toml, README.md and src/ without build leftovers: an existing ``*.egg-info/SOURCES.txt`` would
    put files in the wheel that the package-data globs miss, so the copy has none."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(ROOT / "src", dest / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"))
    return dest


@pytest.mark.slow
def test_wheel_carries_every_shipped_config_and_resolves_it_anywhere(tmp_path):
    """Build a wheel (no network: the installed setuptools) from a clean copy; it holds every file under
    ``src/klgrad/configs`` (so the pyproject package-data globs cover them, new ones included), and from the
    unpacked wheel ``configs/tiny_add.yaml`` and ``tiny_add.yaml`` resolve to its own file in an empty directory."""
    if importlib.util.find_spec("setuptools") is None or importlib.util.find_spec("pip") is None:
        pytest.skip("building a wheel needs pip and setuptools")
    src = _clean_copy(tmp_path / "src_copy")
    out = tmp_path / "wheel"
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)]
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = out.glob("klgrad-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "site")
    configs = shipped_configs()
    assert "klgrad/configs/tiny_add.yaml" in configs
    assert {"klgrad/configs/accelerate/ddp_cpu.yaml", "klgrad/configs/accelerate/fsdp_gpu.yaml"} <= set(configs)
    assert [c for c in configs if c not in names] == []

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import klgrad; "
        "from klgrad.config import resolve_config_path as r; "
        "print(klgrad.__file__); print(r('configs/tiny_add.yaml').resolve()); print(r('tiny_add.yaml').resolve())"
    )
    ran = subprocess.run(
        [sys.executable, "-c", probe, str(tmp_path / "site")],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    init, *resolved = ran.stdout.split()
    site = (tmp_path / "site" / "klgrad").resolve()
    assert Path(init).resolve().parent == site  # the wheel's klgrad, not the checkout's
    assert resolved == [str(site / "configs" / "tiny_add.yaml")] * 2
