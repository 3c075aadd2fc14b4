"""The paper's appendix I (the k3 value estimator), kept importable from its former single module.

The code lives in small modules now:

- :mod:`klgrad.experiments.gaussian_theory`: closed forms for Gaussians (KL, ratio moments, estimator moments,
  the finite-variance condition of k3);
- :mod:`klgrad.experiments.uniform_theory`: closed forms for uniforms with mismatched supports;
- :mod:`klgrad.experiments.estimator_sampling`: samples of k1/k2/k3 through :func:`klgrad.kl.kl_estimate`;
- :mod:`klgrad.experiments.k3_gaussian` (+ ``k3_gaussian_report``): `klgrad reproduce k3-gaussian`;
- :mod:`klgrad.experiments.k3_uniform_bias`: `klgrad reproduce k3-uniform-bias`.
"""

from __future__ import annotations

from klgrad.experiments.estimator_sampling import ESTIMATORS, sample_gaussian_estimators
from klgrad.experiments.gaussian_theory import (
    gaussian_estimator_moments,
    gaussian_kl,
    gaussian_ratio_moment,
    k3_variance_is_finite,
)
from klgrad.experiments.k3_gaussian import (
    PAPER_MU_P,
    PAPER_MU_Q,
    PAPER_N_SAMPLES,
    PAPER_RUNS,
    PAPER_SIGMA_P,
    PAPER_SIGMA_Q,
    PAPER_TRUE_KL,
    run_k3_gaussian,
)
from klgrad.experiments.k3_uniform_bias import run_k3_uniform_bias

__all__ = [
    "ESTIMATORS",
    "PAPER_MU_P",
    "PAPER_MU_Q",
    "PAPER_N_SAMPLES",
    "PAPER_RUNS",
    "PAPER_SIGMA_P",
    "PAPER_SIGMA_Q",
    "PAPER_TRUE_KL",
    "gaussian_estimator_moments",
    "gaussian_kl",
    "gaussian_ratio_moment",
    "k3_variance_is_finite",
    "run_k3_gaussian",
    "run_k3_uniform_bias",
    "sample_gaussian_estimators",
]
