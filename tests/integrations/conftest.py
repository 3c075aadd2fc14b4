"""The TRL tests' fixtures (tests/helpers/trl_checks.py), where the integration runs: TRL installed and supported
(klgrad.integrations.trl_support); elsewhere the TRL test modules skip or test the refusal themselves."""

import importlib.util

from klgrad.integrations.trl_support import installed_trl_problem

if importlib.util.find_spec("trl") is not None and installed_trl_problem() is None:
    from tests.helpers.trl_checks import dataset, model_dir, offline, setup  # noqa: F401
