"""Integrations of klgrad's heads and objective with trainers people already run at scale.

- :mod:`klgrad.integrations.trl` — TRL's GRPOTrainer.
- :mod:`klgrad.integrations.verl` — verl (registered policy loss), in its own environment (tools/verl_env.sh).
"""
