"""Dropout off for RL: the log-probs klgrad compares must be of one deterministic policy.

RL fine-tuning compares log-probs of the same tokens taken in different passes: behaviour vs current policy
(importance ratios), policy vs reference (KL heads, combined-form coefficients), sampler vs trainer. With
dropout on, each pass evaluates a different random sub-network, so at a step where policy = reference the
log-ratio, the KL coefficients and the ratios are noise instead of 0, 0 and 1 (and depend on whether a pass
runs in train or eval mode). TRL does the same by default (``GRPOConfig.disable_dropout``).
"""

from __future__ import annotations

from typing import Any

import torch


def _is_dropout_name(name: str) -> bool:
    """HF's names for dropout probabilities: ``*dropout*`` (attention_dropout, hidden_dropout_prob,
    dropout_rate, ...) and ``*pdrop`` (GPT-2's resid_pdrop, embd_pdrop, attn_pdrop)."""
    return not name.startswith("_") and ("dropout" in name or name.endswith("pdrop"))


def _zero_float_attrs(obj: Any) -> int:
    """Set every positive float dropout attribute in ``vars(obj)`` to 0.0; returns how many changed."""
    changed = 0
    for name, value in list(vars(obj).items()):
        if _is_dropout_name(name) and isinstance(value, float) and value > 0.0:
            setattr(obj, name, 0.0)
            changed += 1
    return changed


def _zero_config(config: Any, seen: set[int]) -> int:
    """A transformers config and its sub-configs (``text_config``, ...): dropout probabilities to 0.0."""
    if config is None or id(config) in seen or not hasattr(config, "to_dict"):
        return 0
    seen.add(id(config))
    changed = _zero_float_attrs(config)
    for value in list(vars(config).values()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a nested PretrainedConfig
            changed += _zero_config(value, seen)
    return changed


def disable_dropout(model: torch.nn.Module) -> int:
    """Turn every dropout of ``model`` off in place, in train mode too; returns how many settings changed.

    Three places hold a dropout probability, and all are set to 0:
      - every ``torch.nn.Dropout``-family module (``p``);
      - float attributes of any module named ``*dropout*`` / ``*pdrop`` that attention code reads directly
        (transformers' Llama attention calls its kernel with ``dropout=0.0 if not self.training else
        self.attention_dropout``, copied from the config at construction: no ``nn.Dropout`` module exists);
      - the same names in ``model.config`` and its sub-configs (read by code that builds layers later, and
        saved with the model, so a checkpoint of an RL run reloads without dropout too).
    A second call returns 0.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            module.p = 0.0
            changed += 1
        changed += _zero_float_attrs(module)
    return changed + _zero_config(getattr(model, "config", None), set())
