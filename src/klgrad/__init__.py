"""klgrad: gradient-correct KL regularization for RL fine-tuning of language models.

A KL regulariser is judged by the gradient it produces. The public API (every exported name: docs/api.md):

- :func:`kl_estimate` — k1/k2/k3 value estimators;
- :func:`get_kl_head`, :func:`custom_kl_head` — heads with ``.coefficient`` and ``.penalty``;
- :func:`kl_loss` — a head at a level, on- or off-policy (IS, clipping);
- :func:`shape_rewards` — baselines, normalisation and the algorithm presets;
- :func:`policy_objective` — reward head + KL head, combined or decoupled.
"""

from klgrad.advantages import PRESETS, SHAPING_METHODS, ShapingStats, shape_rewards
from klgrad.kl import (
    KL_HEADS,
    LEVELS,
    KLHead,
    custom_kl_head,
    get_kl_head,
    importance_ratio,
    kl_estimate,
    kl_loss,
    kl_loss_per_sequence,
    level_coefficients,
)
from klgrad.objective import (
    ObjectiveSpec,
    ObjectiveTerms,
    aggregate,
    combined_advantages,
    decoupled_advantages,
    objective_diagnostics,
    policy_gradient_loss,
    policy_objective,
)

__version__ = "0.1.0"

__all__ = [
    "KL_HEADS",
    "LEVELS",
    "PRESETS",
    "SHAPING_METHODS",
    "KLHead",
    "ObjectiveSpec",
    "ObjectiveTerms",
    "ShapingStats",
    "__version__",
    "aggregate",
    "combined_advantages",
    "custom_kl_head",
    "decoupled_advantages",
    "get_kl_head",
    "importance_ratio",
    "kl_estimate",
    "kl_loss",
    "kl_loss_per_sequence",
    "level_coefficients",
    "objective_diagnostics",
    "policy_gradient_loss",
    "policy_objective",
    "shape_rewards",
]
