"""klgrad: gradient-correct KL regularization for RL fine-tuning of language models.

A KL regulariser is judged by the gradient it produces. The public API (every exported name: docs/api.md):

- :func:`kl_estimate` — k1/k2/k3 value estimators;
- :func:`get_kl_head`, :func:`custom_kl_head` — heads with ``.coefficient`` and ``.penalty``;
- :func:`kl_loss` — a head at a level, on- or off-policy (IS, clipping);
- :func:`shape_rewards` — baselines, normalisation and the algorithm presets;
- :func:`policy_objective` — reward head + KL head, combined or decoupled.
"""

import importlib

from klgrad import choices as _choices
from klgrad.version import __version__ as __version__

_HOME: dict[str, str] = {
    **dict.fromkeys(("SHAPING_PRESETS", "SHAPING_METHODS", "LEVELS"), "klgrad.choices"),
    **dict.fromkeys(("ShapingStats", "shape_rewards"), "klgrad.advantages"),
    **dict.fromkeys(
        (
            "KL_HEADS",
            "KLHead",
            "custom_kl_head",
            "get_kl_head",
            "register_kl_head",
            "importance_ratio",
            "kl_estimate",
            "kl_loss",
            "kl_loss_per_sequence",
            "level_coefficients",
        ),
        "klgrad.kl",
    ),
    **dict.fromkeys(
        (
            "ObjectiveSpec",
            "ObjectiveTerms",
            "aggregate",
            "combined_advantages",
            "decoupled_advantages",
            "objective_diagnostics",
            "policy_gradient_loss",
            "policy_objective",
        ),
        "klgrad.objective",
    ),
}
"""Where each public name lives. They load on first use (PEP 562), so that ``import klgrad.config`` (a YAML
check) does not import torch."""


def _framework_preset(cfg):
    """``kl.head: <preset id>`` -> that framework's KL term (:func:`klgrad.audit.framework_head.resolve_head`): the
    library's presets registered as a user's package registers its own resolver, so ``import klgrad.config`` still
    loads no torch (the presets load on the first config that names one)."""
    if not _choices.is_preset_id(cfg.kl.head):
        return cfg
    import dataclasses

    from klgrad.audit.framework_head import resolve_head

    return dataclasses.replace(cfg, kl=resolve_head(cfg.kl))


_choices.HEAD_RESOLVERS.append(_framework_preset)


def __getattr__(name: str):
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'klgrad' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = sorted([*_HOME, "__version__"])
