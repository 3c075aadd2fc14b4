"""klgrad.reproduce.estimator_sampling: k1/k2/k3 samples drawn through kl_estimate, seeds, thread count."""

from __future__ import annotations

import math

import pytest
import torch

from klgrad.reproduce.estimator_sampling import (
    derive_seed,
    sample_gaussian_estimators,
    sample_uniform_estimators,
    torch_threads,
)
from klgrad.reproduce.gaussian_theory import gaussian_kl

pytestmark = pytest.mark.numerics
LOG2 = math.log(2.0)


def test_kl_estimate_mapping_matches_paper_formulas():
    s = sample_gaussian_estimators(0.1, 0.2, 0.0, 1.0, 5_000, seed=3)
    r, log_r = s["r"], s["log_r"]
    torch.testing.assert_close(s["k1"], -log_r, rtol=0, atol=1e-12)
    torch.testing.assert_close(s["k2"], 0.5 * log_r**2, rtol=0, atol=1e-12)
    torch.testing.assert_close(s["k3"], r - 1 - log_r, rtol=1e-12, atol=1e-12)
    # chunking does not change anything
    s2 = sample_gaussian_estimators(0.1, 0.2, 0.0, 1.0, 5_000, seed=3, chunk=777)
    for k in ("k1", "k2", "k3", "r"):
        assert torch.equal(s[k], s2[k])


def test_k3_unbiased_when_its_variance_is_finite():
    # sigma_q = 0.9: E_q[r^4] finite too (sigma_q^2 > 3/4 sigma_p^2), so the CLT standard error is valid.
    kl = gaussian_kl(0.1, 0.9, 0.0, 1.0)
    n = 200_000
    s = sample_gaussian_estimators(0.1, 0.9, 0.0, 1.0, n, seed=11)
    for k in ("k1", "k3"):
        se = float(s[k].std()) / math.sqrt(n)
        assert abs(float(s[k].mean()) - kl) < 4 * se, k
    assert abs(float(s["r"].mean()) - 1.0) < 4 * float(s["r"].std()) / math.sqrt(n)


def test_uniform_samples_are_the_closed_form_constants():
    # q = U[0, 1), p = U[0, 2]: r = 1/2 at every sample, so each estimator is one float64 expression of log 2
    s = sample_uniform_estimators(1.0, 2.0, 1_000, seed=5)
    assert s["k1"].shape == (1_000,)
    torch.testing.assert_close(s["r"], torch.full((1_000,), 0.5, dtype=torch.float64), rtol=0, atol=1e-15)
    torch.testing.assert_close(s["k1"], torch.full_like(s["k1"], LOG2), rtol=0, atol=1e-15)
    torch.testing.assert_close(s["k3"], torch.full_like(s["k3"], LOG2 - 0.5), rtol=0, atol=1e-15)
    # the samples lie in [0, w_q): a sampler drawing outside supp(q) would give log q = -inf
    s3 = sample_uniform_estimators(3.0, 4.0, 1_000, seed=5)
    torch.testing.assert_close(s3["k1"], torch.full_like(s3["k1"], math.log(4.0 / 3.0)), rtol=0, atol=1e-15)


def test_samples_are_reproducible_per_seed():
    a = sample_gaussian_estimators(0.1, 0.9, 0.0, 1.0, 100, seed=1)
    b = sample_gaussian_estimators(0.1, 0.9, 0.0, 1.0, 100, seed=1)
    c = sample_gaussian_estimators(0.1, 0.9, 0.0, 1.0, 100, seed=2)
    assert torch.equal(a["k3"], b["k3"])
    assert not torch.equal(a["k3"], c["k3"])


def test_derive_seed_is_stable_distinct_and_62_bit():
    assert derive_seed(0, 1, 2) == derive_seed(0, 1, 2)
    seeds = {derive_seed(s, part, i) for s in range(3) for part in range(1, 5) for i in range(50)}
    assert len(seeds) == 3 * 4 * 50
    assert all(0 <= x < 2**62 for x in seeds)
    assert derive_seed(0, 1, 2) != derive_seed(0, 2, 1)  # order matters: (run kind, index) are not swappable


def test_torch_threads_sets_and_restores():
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), torch_threads(1):
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before
