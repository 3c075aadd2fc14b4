"""What ``klgrad eval --model X`` evaluates: X resolved to (model, tokenizer, label) in one place.

X is one of:

- ``embedded`` (the default tiny reference, ``tiny_addition``) or the name of another shipped model
  (``tiny_scratchpad``, ``tiny_addition_discovery``; :data:`klgrad.models.sources.EMBEDDED_DIR`);
- a Hugging Face model folder (``config.json``, safetensors, tokenizer files), a known model name
  (``smollm2-135m-instruct``), a ``.gguf`` file or a Hugging Face id (:func:`klgrad.models.sources.resolve_model`);
- a klgrad run directory (``config.yaml`` + ``checkpoints/step_N/``): the run's starting model (its config's
  ``model.path``, or the embedded reference of its task) with the newest checkpoint whose checksums verify
  loaded over it; or one checkpoint folder ``RUN/checkpoints/step_N`` itself.

``LABEL=X`` names the model in the tables (default: the shipped name, the folder name, or ``RUN@step_N``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from klgrad.config import Config, load_config
from klgrad.models import load_model_and_tokenizer
from klgrad.models.sources import EMBEDDED_DIR, ModelSourceError, reference_path, resolve_model
from klgrad.trainer.checkpoints import checkpoint_is_valid, latest_checkpoint, load_policy_weights

EMBEDDED = "embedded"
"""The ``--model`` name of the default shipped reference."""
EMBEDDED_DEFAULT = "tiny_addition"
"""The shipped model ``embedded`` stands for (the default of ``klgrad train``)."""

_LABEL = re.compile(r"[A-Za-z0-9][\w.@+-]*")


@dataclass(frozen=True)
class EvalModel:
    """A model ready to sample from, with how it was found."""

    model: torch.nn.Module
    tokenizer: Any
    label: str
    """Its name in tables and in ``eval.json``."""
    source: Path
    """The Hugging Face folder its weights start from (a run's base model; vLLM builds its engine from it)."""
    checkpoint: Path | None = None
    """The klgrad checkpoint loaded over ``source``, if any."""


def shipped_models() -> list[str]:
    """Names of the shipped models (folders of :data:`~klgrad.models.sources.EMBEDDED_DIR`)."""
    return sorted(p.name for p in EMBEDDED_DIR.iterdir() if (p / "config.json").is_file())


def split_label(arg: str) -> tuple[str | None, str]:
    """``"LABEL=X"`` -> ``(LABEL, X)``; anything else (an existing path, or no plain name before ``=``) ->
    ``(None, arg)``. A plain name is a letter or digit followed by letters, digits and ``_ . @ + -``."""
    name, eq, rest = arg.partition("=")
    if eq and rest and _LABEL.fullmatch(name) and not Path(arg).exists():
        return name, rest
    return None, arg


def find_checkpoint(path: Path, *, name: str | None = None) -> tuple[Path, Path] | None:
    """``(run directory, checkpoint)`` when ``path`` is a klgrad run directory (its newest valid checkpoint) or
    one of its checkpoint folders; None for anything else. ``name`` starts the error messages (default
    ``--model PATH``; ``klgrad export`` passes the bare path).

    Raises:
        ValueError: a run without a valid checkpoint, or a checkpoint folder whose checksums do not verify
            (torn or corrupt): evaluating the base model instead would be a silently wrong result.
    """
    name = f"--model {path}" if name is None else name
    if (path / "config.yaml").is_file():
        ckpt = latest_checkpoint(path)
        if ckpt is None:
            raise ValueError(
                f"{name}: a klgrad run directory without a valid checkpoint under {path / 'checkpoints'} "
                "(none saved yet, or every one torn or corrupt)"
            )
        return path, ckpt
    run_dir = path.parent.parent
    if path.parent.name == "checkpoints" and (run_dir / "config.yaml").is_file():
        if not checkpoint_is_valid(path):
            raise ValueError(f"{name}: checkpoint whose checksums.json does not verify (torn or corrupt)")
        return run_dir, path
    return None


def run_config(run_dir: Path) -> Config:
    """A run's saved ``config.yaml``, with the settings that only matter where it trained (its device and
    rollout engine) reset so that it loads on any machine."""
    return load_config(run_dir / "config.yaml", {"model.device": "auto", "rollout.engine": "klgrad"})


def load_checkpoint_policy(run_dir: Path, ckpt: Path, *, device: torch.device, dtype: str) -> tuple[Any, Any, Path]:
    """(model, tokenizer, base model folder) of a run's checkpoint: the run's starting model
    (:func:`~klgrad.models.sources.reference_path` of its config) with the checkpoint's weights over it.

    A LoRA checkpoint (``adapter.safetensors`` instead of ``policy.safetensors``) loads through
    :func:`klgrad.trainer.checkpoints.load_lora_policy`: the base with the adapter merged into its weights.
    """
    cfg = run_config(run_dir)
    base = reference_path(cfg)
    if (ckpt / "adapter.safetensors").is_file():
        from klgrad.trainer.checkpoints import load_lora_policy

        model, tokenizer = load_lora_policy(ckpt, cfg, device=device)
        return model.eval(), tokenizer, base
    if not (ckpt / "policy.safetensors").is_file():
        raise ValueError(f"--model {ckpt}: checkpoint without policy.safetensors or adapter.safetensors")
    model, tokenizer = load_model_and_tokenizer(base, dtype=dtype, device=device)
    load_policy_weights(ckpt, model)
    return model.eval(), tokenizer, base


@dataclass(frozen=True)
class ModelSource:
    """Where a ``--model`` value points, found without loading any weights."""

    label: str
    path: Path
    """The Hugging Face folder (a shipped model, a plain folder), or the run directory."""
    checkpoint: Path | None = None
    """The run's checkpoint to load (None: ``path`` is a Hugging Face folder)."""


def locate_model(arg: str) -> ModelSource:
    """Resolve a ``--model`` value (module docstring) and check it, loading nothing, so that a bad second model
    fails before the first is evaluated.

    Raises:
        FileNotFoundError: neither a shipped name nor an existing folder; a folder that is not a saved HF model.
        ValueError: a run without a valid checkpoint, or a torn checkpoint folder.
    """
    label, spec = split_label(arg)
    shipped = shipped_models()
    name = EMBEDDED_DEFAULT if spec == EMBEDDED else spec
    if name in shipped and not Path(spec).exists():
        return ModelSource(label or spec, EMBEDDED_DIR / name)
    path = Path(spec)
    if not path.is_dir():
        try:  # a known name (smollm2-135m-instruct), a .gguf file or a Hugging Face id
            return ModelSource(label or Path(spec).name.removesuffix(".gguf"), resolve_model(spec))
        except ModelSourceError as e:
            raise ModelSourceError(f"--model {spec}: {e}; shipped: {EMBEDDED!r}, {', '.join(shipped)}") from e
    found = find_checkpoint(path)
    if found is not None:
        run_dir, ckpt = found
        base = reference_path(run_config(run_dir))
        if not base.is_dir():
            raise FileNotFoundError(f"--model {spec}: the run's starting model {base} (model.path) does not exist")
        return ModelSource(label or f"{run_dir.resolve().name}@{ckpt.name}", run_dir, ckpt)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {spec}: neither a Hugging Face model folder (no config.json) nor a klgrad run (no config.yaml)"
        )
    return ModelSource(label or path.resolve().name, path)


def load_eval_model(arg: str | ModelSource, *, device: torch.device, dtype: str = "float32") -> EvalModel:
    """The one place a ``--model`` value becomes (model, tokenizer, label): :func:`locate_model`, then a Hugging
    Face folder's weights, or a run's starting model with its checkpoint over it
    (:func:`load_checkpoint_policy`, where LoRA checkpoints are handled too).

    Raises:
        what :func:`locate_model` and :func:`klgrad.models.load_model_and_tokenizer` raise; ValueError for a
        LoRA checkpoint without LoRA support.
    """
    src = arg if isinstance(arg, ModelSource) else locate_model(arg)
    if src.checkpoint is None:
        model, tokenizer = load_model_and_tokenizer(src.path, dtype=dtype, device=device)
        return EvalModel(model, tokenizer, src.label, src.path)
    model, tokenizer, base = load_checkpoint_policy(src.path, src.checkpoint, device=device, dtype=dtype)
    return EvalModel(model, tokenizer, src.label, base, src.checkpoint)
