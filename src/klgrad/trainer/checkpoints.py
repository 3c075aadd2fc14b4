"""Checkpoints: atomic (temporary folder, checksums written last, rename) and verified on load.

A checkpoint folder ``checkpoints/step_NNNNNN`` holds ``policy.safetensors`` (a LoRA run, ``model.lora_rank`` >
0: ``adapter.safetensors``, the adapter's A and B only, since the base weights are the starting model's),
``ref.safetensors`` (only when the reference is reset during the run), ``stale.safetensors`` (only with
``rollout.staleness`` k > 0: the last k snapshots of the trainable parameters, :mod:`klgrad.trainer.staleness`),
``optim.pt`` (AdamW and scheduler state, torch RNG: tensors and plain containers only), ``state.json`` (step, β,
config) and ``checksums.json`` (sha256 of each file; its presence means the folder is complete).
``checkpoints/latest`` names the newest one, a hint for people only.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from klgrad.config import Config, to_dict
from klgrad.models.dropout import disable_dropout
from klgrad.models.factory import load_model_and_tokenizer
from klgrad.models.lora import ADAPTER_FILE, apply_lora, load_adapter, save_adapter
from klgrad.models.sources import reference_path
from klgrad.trainer.faults import NO_HOOKS, Hooks
from klgrad.trainer.staleness import STALE_FILE, Snapshot, load_stale, save_stale


def sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_is_valid(path: Path) -> bool:
    """True when every file listed in ``checksums.json`` exists with its recorded sha256."""
    try:
        sums = json.loads((path / "checksums.json").read_text())
        return bool(sums) and all(sha256(path / name) == digest for name, digest in sums.items())
    except (OSError, ValueError):
        return False


def save_checkpoint(
    run_dir: Path,
    step: int,
    policy,
    ref,
    optimizer,
    scheduler,
    beta: float,
    cfg: Config,
    save_ref: bool,
    hooks: Hooks = NO_HOOKS,
    stale: list[Snapshot] | None = None,
) -> Path:
    """Write ``run_dir/checkpoints/step_{step}`` atomically and point ``latest`` at it; returns its path. A LoRA
    run (``cfg.model.lora_rank`` > 0) writes the adapter (``adapter.safetensors``) instead of the whole policy.
    ``hooks``: the fault-injection seam (:mod:`klgrad.trainer.faults`). ``stale``: the snapshots a stale-rollout
    run resumes with (``stale.safetensors``; none: no file)."""
    ckpt_root = run_dir / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".tmp_step_{step:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    if cfg.model.lora_rank:
        save_adapter(policy, tmp / ADAPTER_FILE)
    else:
        save_model(policy, str(tmp / "policy.safetensors"))
    hooks.at("checkpoint_file", step)
    if save_ref:
        save_model(ref, str(tmp / "ref.safetensors"))
    if stale:
        save_stale(stale, tmp / STALE_FILE)
    torch.save(
        {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
        },
        tmp / "optim.pt",
    )
    (tmp / "state.json").write_text(json.dumps({"step": step, "beta": beta, "config": to_dict(cfg)}, indent=1))
    sums = {f.name: sha256(f) for f in sorted(tmp.iterdir())}
    (tmp / "checksums.json").write_text(json.dumps(sums, indent=1))  # written last: its presence = complete
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    hooks.at("checkpoint_rename", step)
    pointer = ckpt_root / "latest.tmp"
    pointer.write_text(final.name)
    pointer.replace(ckpt_root / "latest")
    return final


def prune_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (``step_*`` folders whose ``checksums.json``
    exists; checksums are not re-hashed here) of ``run_dir``; returns the deleted folders. Call it after a save
    has completed, so the newest valid checkpoint is never the one deleted (``train.keep_checkpoints``)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = run_dir / "checkpoints"
    complete = sorted(p for p in root.glob("step_*") if (p / "checksums.json").is_file()) if root.is_dir() else []
    old = complete[:-keep]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint whose checksums verify; torn or corrupt ones are skipped (the ``latest`` pointer is
    only a hint for people: a kill between the folder rename and the pointer update leaves it one behind)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return None
    for path in sorted(root.glob("step_*"), reverse=True):
        if checkpoint_is_valid(path):
            return path
    return None


def load_policy_weights(path: Path, policy) -> None:
    """The checkpoint's policy weights (``policy.safetensors``) into ``policy``, nothing else."""
    load_model(policy, str(path / "policy.safetensors"))


def load_weights(path: Path, policy, ref) -> None:
    """The checkpoint's policy into ``policy``, and its reference into ``ref`` when the run reset its reference
    (``kl.reset_ref_every``: the reference in force at that step; otherwise ``ref`` stays the starting model).
    A LoRA checkpoint's adapter goes into ``policy``'s adapter (it must have one of the same rank and targets)."""
    if (path / ADAPTER_FILE).is_file():
        load_adapter(policy, path / ADAPTER_FILE)
    else:
        load_policy_weights(path, policy)
    if (path / "ref.safetensors").is_file():
        load_model(ref, str(path / "ref.safetensors"))


def load_checkpoint(path: Path, policy, ref, optimizer, scheduler) -> tuple[int, float]:
    """Load a checkpoint into the given objects; returns (step, β)."""
    load_weights(path, policy, ref)
    try:  # weights_only: tensors and plain containers only, never arbitrary pickled objects
        state = torch.load(path / "optim.pt", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError) as e:
        # torch's message suggests weights_only=False: the wrong advice for a file we do not trust; omit it
        raise ValueError(
            f"{path / 'optim.pt'}: refused to load: it holds objects other than tensors and plain containers "
            f"({type(e).__name__}); klgrad never unpickles arbitrary objects. Delete this checkpoint to fall back."
        ) from e
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])  # per-step sampling uses its own (seed, step) generator
    meta = json.loads((path / "state.json").read_text())
    return int(meta["step"]), float(meta["beta"])


def load_stale_snapshots(path: Path, k: int, device: torch.device | str) -> list[Snapshot]:
    """The stale snapshots of checkpoint ``path`` for a run with ``rollout.staleness`` = k (none when k = 0).
    Raises ValueError when k > 0 and the checkpoint has none: resuming would sample from the wrong policies."""
    if k == 0:
        return []
    if not (path / STALE_FILE).is_file():
        raise ValueError(
            f"{path}: no {STALE_FILE}, but rollout.staleness = {k}: the old policies the next steps must sample "
            "from are not in this checkpoint; start a new run"
        )
    return load_stale(path / STALE_FILE, device)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder: ``path`` itself when it holds ``checksums.json``, else the newest valid checkpoint of
    the run directory ``path``; raises when there is none or it does not verify."""
    path = Path(path)
    ckpt = path if (path / "checksums.json").is_file() else latest_checkpoint(path)
    if ckpt is None:
        raise FileNotFoundError(f"{path}: neither a checkpoint folder nor a run directory with a valid checkpoint")
    if not checkpoint_is_valid(ckpt):
        raise ValueError(f"{ckpt}: checksums do not verify (a torn or corrupt checkpoint)")
    return ckpt


def load_lora_policy(checkpoint: str | Path, cfg: Config, *, device: str | torch.device = "cpu"):
    """The trained policy of a LoRA run, for inference: ``(model, tokenizer)``.

    Args:
        checkpoint: a checkpoint folder (``run/checkpoints/step_NNNNNN``, holding ``adapter.safetensors``) or a
            run directory (its newest checkpoint whose checksums verify).
        cfg: the run's :class:`~klgrad.config.Config` (``model.path``, ``model.dtype``, ``model.lora_*``; the
            run directory's ``config.yaml`` loads with :func:`klgrad.config.load_config`).
        device: where the weights go.

    Returns:
        The base model of ``cfg`` (``model.path`` or the embedded reference) with the checkpoint's adapter
        merged into its weights (W + (α/r)·B·A; a plain transformers model, no peft layers left), dropout off,
        in eval mode; and its tokenizer (left padding).

    Raises:
        ValueError: ``cfg.model.lora_rank`` is 0, the checkpoint does not verify, or its adapter does not match
            the configured rank and targets.
        FileNotFoundError: no checkpoint there.
    """
    if cfg.model.lora_rank < 1:
        raise ValueError("load_lora_policy: cfg.model.lora_rank is 0 (a full fine-tuning run has policy.safetensors)")
    ckpt = resolve_checkpoint(checkpoint)
    attn = None if cfg.model.attn_implementation == "auto" else cfg.model.attn_implementation
    model, tokenizer = load_model_and_tokenizer(
        reference_path(cfg), dtype=cfg.model.dtype, attn_implementation=attn, device=device
    )
    disable_dropout(model)
    peft_model = apply_lora(model, cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.lora_targets)
    load_adapter(model, ckpt / ADAPTER_FILE)
    merged = peft_model.merge_and_unload()
    return merged.eval(), tokenizer
