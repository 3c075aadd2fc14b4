r"""Samples of the k1/k2/k3 value estimators drawn through the library's own :func:`klgrad.kl.kl_estimate`.

x ~ q (the sampler) and p (the reference) are torch distributions; klgrad's ``logp`` is log q(x) and its
``ref_logp`` is log p(x), so every estimate here is exactly what the library computes in training, in float64.
Also: reproducible per-run seeds, and a context manager for the thread count of this elementwise work.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.distributions import Normal, Uniform

from klgrad.kl import kl_estimate

ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
"""The value estimators, by ``kl_estimate``'s ``kind``."""


def sample_gaussian_estimators(
    mu_q: float,
    sigma_q: float,
    mu_p: float,
    sigma_p: float,
    n: int,
    seed: int,
    kinds: tuple[str, ...] = ESTIMATORS,
    chunk: int = 100_000,
) -> dict[str, torch.Tensor]:
    """Draw x ~ q = N(μq, σq²) (float64) and return ``kl_estimate``'s estimators and the ratio r = p/q.

    Returns a dict of (n,) float64 tensors: one per name in ``kinds`` plus ``log_r`` and ``r``. Work is done
    in chunks of ``chunk`` samples (cache-friendly; the result does not depend on ``chunk``).
    """
    g = torch.Generator().manual_seed(int(seed))
    x = mu_q + sigma_q * torch.randn(n, generator=g, dtype=torch.float64)  # (n,)
    f64 = torch.float64
    q = Normal(torch.tensor(mu_q, dtype=f64), torch.tensor(sigma_q, dtype=f64), validate_args=False)
    p = Normal(torch.tensor(mu_p, dtype=f64), torch.tensor(sigma_p, dtype=f64), validate_args=False)
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in (*kinds, "log_r")}
    for xc in x.split(chunk):
        logp, ref_logp = q.log_prob(xc), p.log_prob(xc)  # (c,), (c,): klgrad's logp is the sampler's density
        for k in kinds:
            parts[k].append(kl_estimate(logp, ref_logp, k))  # (c,)
        parts["log_r"].append(ref_logp - logp)  # (c,)
    out = {k: torch.cat(v) for k, v in parts.items()}  # (n,) each
    out["r"] = torch.exp(out["log_r"])  # (n,)
    return out


def sample_uniform_estimators(
    width_q: float, width_p: float, n: int, seed: int, kinds: tuple[str, ...] = ESTIMATORS
) -> dict[str, torch.Tensor]:
    """Draw x ~ q = U[0, w_q) (float64) and return ``kl_estimate``'s estimators against p = U[0, w_p].

    Returns a dict of (n,) float64 tensors: one per name in ``kinds`` plus ``log_r`` and ``r`` (r = p/q).
    """
    f64 = torch.float64
    g = torch.Generator().manual_seed(int(seed))
    x = width_q * torch.rand(n, generator=g, dtype=f64)  # (n,)
    q = Uniform(torch.tensor(0.0, dtype=f64), torch.tensor(width_q, dtype=f64), validate_args=False)
    p = Uniform(torch.tensor(0.0, dtype=f64), torch.tensor(width_p, dtype=f64), validate_args=False)
    logp, ref_logp = q.log_prob(x), p.log_prob(x)  # (n,), (n,)
    out = {k: kl_estimate(logp, ref_logp, k) for k in kinds}  # (n,) each
    out["log_r"] = ref_logp - logp  # (n,)
    out["r"] = torch.exp(out["log_r"])  # (n,)
    return out


def derive_seed(seed: int, *parts: int) -> int:
    """A distinct, reproducible 62-bit seed per (seed, parts) (a polynomial hash, cheap and stable)."""
    h = 1469598103934665603
    for v in (seed, *parts):
        h = ((h ^ (int(v) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 62)
    return h


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run a block with ``torch.set_num_threads(n)``, restoring the previous value afterwards.

    Elementwise float64 work on 1e5-sized chunks is memory-bound; on small shared machines extra intra-op
    threads only add contention (measured 45 ns/sample on 1 thread vs ~3 µs/sample on 2 busy cores).
    """
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
