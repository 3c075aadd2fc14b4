"""``klgrad export``: a run's trained policy as a standard Hugging Face model folder.

The source is a klgrad run directory (its newest checkpoint whose checksums verify) or one checkpoint folder
``RUN/checkpoints/step_N``, resolved as ``klgrad eval --model`` resolves it (:mod:`klgrad.eval.models`). The
folder written holds ``config.json``, ``model.safetensors``, ``generation_config.json`` and the tokenizer files
(with the chat template when the tokenizer has one): transformers, vLLM and lm-evaluation-harness load it as
any plain model folder, without klgrad or peft.

- Full fine-tuning: the run's starting model with the checkpoint's ``policy.safetensors`` over it; the weights
  are copied bit for bit.
- LoRA (``adapter.safetensors``): the adapter merged into the base weights, W + (α/r)·B·A
  (:func:`klgrad.trainer.checkpoints.load_lora_policy`); no adapter layers are left.
- ``config.json`` is the starting model's: training turns dropout off in the model's config
  (:func:`klgrad.models.disable_dropout`), and the export puts the base's dropout settings back, so nothing
  klgrad did for training is left in it. Only ``dtype`` may differ (below).
- ``generation_config.json``: the starting model's, with the tokenizer's EOS added to its stop ids (klgrad's
  sampler stops a response at the tokenizer's EOS, so the policy was trained to end with it) and the pad and BOS
  ids filled in from the tokenizer where the base leaves them unset.
- The tokenizer is the starting model's, saved as loaded (not the left-padding copy klgrad samples with).
- dtype: the checkpoint's (the run's ``model.dtype``) unless another is asked for; a LoRA merge is done in the
  checkpoint's dtype first and cast after.

The folder is written next to ``out`` and renamed into place (:func:`klgrad.models.save_model_and_tokenizer`), so
no reader ever sees a half-written model; an existing non-empty ``out`` is refused unless ``force``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer

from klgrad.choices import MODEL_DTYPES
from klgrad.eval.models import find_checkpoint, load_checkpoint_policy, run_config
from klgrad.models.dropout import _is_dropout_name
from klgrad.models.factory import save_model_and_tokenizer
from klgrad.models.lora import ADAPTER_FILE

_LOAD_ONLY_TOKENIZER_KEYS = ("is_local", "local_files_only")
"""What transformers 5 records in a loaded tokenizer's ``init_kwargs`` about how it was loaded (and would write to
``tokenizer_config.json``): not settings of the tokenizer, so not exported."""


@dataclass(frozen=True)
class Exported:
    """What :func:`export_model` wrote, and from what."""

    path: Path
    """The Hugging Face folder written (resolved)."""
    run_dir: Path
    checkpoint: Path
    """The checkpoint folder exported."""
    base: Path
    """The run's starting model (its tokenizer and config are this folder's)."""
    dtype: str
    """The dtype of the exported weights."""
    lora: bool
    """Whether a LoRA adapter was merged into the base."""


def locate_source(source: str | Path) -> tuple[Path, Path]:
    """``(run directory, checkpoint folder)`` of ``source``: a run directory (its newest valid checkpoint) or a
    checkpoint folder ``RUN/checkpoints/step_N``.

    Raises:
        FileNotFoundError: ``source`` does not exist.
        NotADirectoryError: ``source`` is a file.
        ValueError: a folder that is neither; a run without a valid checkpoint; a torn checkpoint folder.
    """
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such run directory or checkpoint folder")
    if not path.is_dir():
        raise NotADirectoryError(f"{path}: a file, not a run directory or checkpoint folder")
    found = find_checkpoint(path, name=str(path))
    if found is None:
        raise ValueError(
            f"{path}: neither a klgrad run directory (no config.yaml) nor one of its checkpoint folders "
            "(RUN/checkpoints/step_N); a Hugging Face model folder needs no export"
        )
    return found


def check_out(out: Path, *, force: bool, run_dir: Path) -> None:
    """Refuse an ``out`` that cannot or should not be replaced: a file; a non-empty folder without ``force``;
    the run directory itself or a folder holding it (replacing it would delete the run being exported).

    Raises:
        FileExistsError: a file, or a non-empty folder without ``force``.
        ValueError: ``out`` is or contains ``run_dir``.
    """
    target, run = out.resolve(), run_dir.resolve()
    if target == run or target in run.parents:
        raise ValueError(f"--out {out}: is or contains the run directory {run_dir}; choose another folder")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"--out {out}: exists and is not empty; pass --force to replace it")


def restore_dropout(config: Any, base: Any) -> int:
    """Set every dropout probability of ``config`` (and its sub-configs) back to ``base``'s value, undoing
    :func:`klgrad.models.disable_dropout`'s change to the config; returns how many values changed."""
    changed = 0
    for name, value in vars(base).items():
        if _is_dropout_name(name) and isinstance(value, float) and getattr(config, name, value) != value:
            setattr(config, name, value)
            changed += 1
        elif hasattr(value, "to_dict") and hasattr(value, "model_type") and hasattr(config, name):
            changed += restore_dropout(getattr(config, name), value)
    return changed


def _ids(value: int | list[int] | None) -> list[int]:
    """A token-id setting as a list (None: empty)."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def set_generation_ids(generation_config: Any, tokenizer: Any) -> None:
    """``eos_token_id``: the base's stop ids plus the tokenizer's EOS (an int when there is one id); ``pad_token_id``
    and ``bos_token_id``: the base's, else the tokenizer's (pad falling back to the first stop id)."""
    eos = _ids(generation_config.eos_token_id)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(int(tokenizer.eos_token_id))
    if eos:
        generation_config.eos_token_id = eos[0] if len(eos) == 1 else eos
    if generation_config.pad_token_id is None:
        pad = tokenizer.pad_token_id
        generation_config.pad_token_id = pad if pad is not None else (eos[0] if eos else None)
    if generation_config.bos_token_id is None and tokenizer.bos_token_id is not None:
        generation_config.bos_token_id = tokenizer.bos_token_id


def export_model(source: str | Path, out: str | Path, *, dtype: str | None = None, force: bool = False) -> Exported:
    """Write the policy of a run directory or checkpoint folder ``source`` as a Hugging Face folder ``out``
    (module docstring: what it holds). Loads on the CPU; ``dtype`` None keeps the checkpoint's.

    Everything is checked before any weights load; the folder appears whole or not at all.

    Raises:
        FileNotFoundError, NotADirectoryError, ValueError: what :func:`locate_source` and :func:`check_out`
            raise, an unknown ``dtype``; and whatever loading the run's starting model raises.
        FileExistsError: ``out`` exists and is not empty, without ``force``.
    """
    out = Path(out)
    if dtype is not None and dtype not in MODEL_DTYPES:
        raise ValueError(f"--dtype {dtype!r}: expected one of {', '.join(MODEL_DTYPES)}")
    run_dir, ckpt = locate_source(source)
    check_out(out, force=force, run_dir=run_dir)
    trained = run_config(run_dir).model.dtype
    model, _, base = load_checkpoint_policy(run_dir, ckpt, device=torch.device("cpu"), dtype=trained)
    restore_dropout(model.config, AutoConfig.from_pretrained(base, local_files_only=True))
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)  # as shipped: no left-padding copy
    for key in _LOAD_ONLY_TOKENIZER_KEYS:
        tokenizer.init_kwargs.pop(key, None)
    set_generation_ids(model.generation_config, tokenizer)
    final = dtype or trained
    model = model.to(getattr(torch, final)).eval()  # MODEL_DTYPES are torch's names
    path = save_model_and_tokenizer(model, tokenizer, out)
    return Exported(path, run_dir, ckpt, base, final, (ckpt / ADAPTER_FILE).is_file())
