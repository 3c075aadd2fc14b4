"""The reproduce targets that need real training runs, kept importable from their former single module.

- ``offpolicy``: :mod:`klgrad.experiments.offpolicy`;
- ``group-norm`` (RL half): :mod:`klgrad.experiments.group_norm_rl`, whose reward the runs' config names as
  ``klgrad.experiments.rl_repro:near_constant_reward``;
- the shared run/plot helpers: :mod:`klgrad.experiments.training_runs`.
"""

from __future__ import annotations

from klgrad.experiments.group_norm_rl import near_constant_reward, run_group_norm_rl
from klgrad.experiments.offpolicy import run_offpolicy

__all__ = ["near_constant_reward", "run_group_norm_rl", "run_offpolicy"]
