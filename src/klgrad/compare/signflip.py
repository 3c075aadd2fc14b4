"""The sign-flip (randomisation) test of paired per-seed differences, exact for any number of seeds.

Under H0 (d_s symmetric about 0) every sign pattern of the |d_s| is equally likely; p is the share of the 2^n
patterns whose signed sum is at least as extreme as the observed one (the observed pattern counts). Up to
:data:`MAX_EXACT_FLIPS` seeds every pattern is enumerated (:func:`sign_flip_enumerated`); beyond, a dynamic
programme on a lattice of step δ brackets the exact p (:func:`sign_flip_lattice`, its proof in the docstring);
Monte Carlo only by name (:func:`sign_flip_p_drawn`). :mod:`klgrad.compare.stats` uses it beside the paired t.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

MAX_EXACT_FLIPS = 20
"""Sign-flip tests enumerate all 2^n sign patterns up to n = 20 seeds (2^20 sums, 8 MiB); beyond, a dynamic
programme on a lattice brackets the exact p (:func:`sign_flip_lattice`)."""
LATTICE_STATES = 1 << 22
"""Largest lattice of that programme, K = Σ k_s points: 32 MiB of int64 counts (twice that during an update)."""
LATTICE_WORK = 1 << 30
"""Most n·K additions the programme may spend (a second or two): K stops at min(LATTICE_STATES, LATTICE_WORK/n)."""
LATTICE_RTOL = 1e-3
"""The lattice is refined (K × 4 from 2^16) until its bracket's width p_hi − p_lo is at most LATTICE_RTOL·p_hi."""
MAX_LATTICE_SEEDS = 1000
"""Beyond 1000 differences a probability 2^-n of the programme's float path would underflow float64."""
FLIP_DRAWS = 1 << 17
"""Random sign patterns of a Monte Carlo sign-flip p: its standard error √(p(1 − p)/B) is at most 0.0014."""
FLIP_SEED = 0
"""Seed of those patterns: the same differences always get the same p."""
TIE_RTOL = 1e-12
"""Two signed sums of the same |d_s| count as tied when they differ by at most TIE_RTOL·Σ|d_s|.

Derivation (u = 2^-53 ≈ 1.1e-16): a float sum of n terms is off by at most γ_{n−1}·Σ|x|, γ_k = k·u/(1 − k·u),
so two orders of summation of one exact tie differ by ≤ 2·γ_19·Σ|d| ≈ 4.2e-15·Σ|d| for n ≤ 20 (2·γ_99 ≈
2.2e-14·Σ|d| for the drawn patterns of up to 100 seeds). The differences
themselves come from operands: d_s = a_s − b_s carries the representation error of a_s and b_s, up to
u·max(|a_s|, |b_s|) each (1.0 − 1.3 and 2.0 − 2.3 differ by 2.2e-16), so ties meant by the data survive operands
up to 1e-12 / (2u) ≈ 4500 times |d|. Relative to Σ|d| rather than absolute (earlier code used
1e-12·max(1, Σ|d|)), so a common factor on every d cannot turn distinct sums into ties: five differences of
1e-13 then get 2/32 like five of 0.05, not p = 1."""


class SignFlip(NamedTuple):
    """A sign-flip p-value and how it was obtained: the exact p lies in [p_lo, p_hi].

    ``method`` is ``"enumerated"`` (all 2^n sign patterns counted: p = p_lo = p_hi) or ``"lattice"`` (the bracket of
    :func:`sign_flip_lattice`; p = p_hi, exact where p_lo = p_hi). Monte Carlo is never one of these: it is
    :func:`sign_flip_p_drawn`, called by name with its draw count."""

    p: float
    """The p to report: the exact p, or the bracket's upper end, a valid p-value (P(p_hi ≤ α) ≤ α under H0)."""
    p_lo: float
    p_hi: float
    method: str


def _scaled(d: Sequence[float]) -> tuple[np.ndarray, float] | None:
    """(d_s · 2^-e, Σ_s d_s · 2^-e) with 2^e the power of two above max|d_s|, or None for non-finite d.

    Multiplying by a power of two is exact in binary floating point (short of underflow), so every sum, tie and
    comparison of the sign-flip count is that of d itself, and no sum of up to 2^52 terms overflows. The sum is
    taken left to right like every enumerated pattern's (the observed pattern is one of them, bit for bit)."""
    x = np.asarray(d, dtype=np.float64)  # (n,)
    if not np.all(np.isfinite(x)):
        return None
    x = np.ldexp(x, -math.frexp(float(np.max(np.abs(x))))[1])
    return x, sum(x.tolist())


def _tail_count(sums: np.ndarray, obs: float, tol: float, alternative: str) -> int:
    """#{σ: T(σ) ≥ T_obs − tol}: T = Σσa (greater), −Σσa (less), |Σσa| (two-sided)."""
    if alternative == "greater":
        return int(np.count_nonzero(sums >= obs - tol))
    if alternative == "less":
        return int(np.count_nonzero(sums <= obs + tol))
    if alternative == "two-sided":
        return int(np.count_nonzero(np.abs(sums) >= abs(obs) - tol))
    raise ValueError(f"alternative must be 'less', 'greater' or 'two-sided', got {alternative!r}")


def sign_flip_enumerated(d: Sequence[float], alternative: str = "two-sided") -> float:
    """Exact sign-flip p of mean(d) = 0 by enumeration of all 2^n sign patterns (n ≤ MAX_EXACT_FLIPS).

    p = #{σ ∈ {±1}^n: T(σ) ≥ T_obs − tol} / 2^n, T(σ) = Σ σ_s|d_s| (greater), −Σ σ_s|d_s| (less) or |Σ σ_s|d_s||
    (two-sided), T_obs = T at σ_s = sign(d_s), tol = TIE_RTOL·Σ|d_s|. Under H0 (each d_s symmetric about 0) σ is
    uniform given |d|, so P(p ≤ α) ≤ α; the observed pattern is counted, so p ≥ 2^-n (two-sided ≥ 2^(1−n)).
    Vectorised: the 2^n sums are built by doubling, S_{j+1} = (S_j + |d_j|, S_j − |d_j|), summed left to right
    (bit for bit the plain loop's); memory 2^n float64 (8 MiB at n = 20) plus two halves in flight.
    """
    n = len(d)
    if n > MAX_EXACT_FLIPS:
        raise ValueError(f"{n} differences: enumeration stops at {MAX_EXACT_FLIPS} (use sign_flip_lattice)")
    scaled = _scaled(d) if n else None
    if scaled is None:
        return float("nan")
    x, obs = scaled
    mags = np.abs(x)
    sums = np.zeros(1)  # (1,)
    for m in mags.tolist():
        sums = np.concatenate((sums + m, sums - m))  # (2^(j+1),)
    return _tail_count(sums, obs, TIE_RTOL * sum(mags.tolist()), alternative) / (1 << n)


def _lattice_step(a: np.ndarray, states: int) -> tuple[np.ndarray, float, float]:
    """Integers k_s = round(a_s/δ), the step δ and E = Σ_s |a_s − k_s·δ| (≤ n·δ/2), with Σ k_s ≈ ``states``.

    δ = max(a)/k_max, so the largest magnitude (and all its ties) lies on the lattice. Among up to 4096 values of
    k_max in [7/8, 1]·states·max(a)/Σa the one with the smallest E (in units of δ, within 1e-6) is taken: data on
    a grid (rounded decimals, equal values) then get E ≈ 0 and an exact count.
    """
    a_max, total = float(a.max()), float(a.sum())
    top = max(1, int(states * a_max / total))
    cands = np.arange(max(1, top - top // 8), top + 1)[-4096:]  # (C,)
    delta = a_max / cands  # (C,)
    k = np.rint(a[None, :] / delta[:, None])  # (C, n)
    err = np.abs(a[None, :] - k * delta[:, None]).sum(axis=1)  # (C,)
    units = err / delta
    i = int(np.flatnonzero(units <= units.min() + 1e-6)[0])
    return k[i].astype(np.int64), float(delta[i]), float(err[i])


def _subset_sum_cdf(k: np.ndarray) -> tuple[np.ndarray, int, float]:
    """cdf[t] = #{subsets of the nonzero k_s (all ≥ 0) with sum ≤ t}, t = 0 … Σk, as int64 counts (m ≤ 62 nonzero
    k_s: exact, r = 0) or as probabilities over the 2^m subsets (r > 0); returns (cdf, m, r), r a bound on the
    relative error of every cdf[t].

    Dynamic programme over the k_s (the 0/1 knapsack count): c_{j+1}[t] = c_j[t] + c_j[t − k_j], so c_m[t] counts
    the subsets with sum t. Beyond 62 nonzero k_s the counts could pass 2^63, so c is kept as probabilities (halved
    each step, exactly, as every one is a multiple of 2^-m ≥ 2^-1000), each a sum of positive terms through at
    most m additions and the cdf through at most Σk + 1 more: r = γ_{m+Σk+1}, γ_j = j·u/(1 − j·u), u = 2^-53.
    Time O(m·Σk), memory 2·(Σk + 1) words (numpy buffers the in-place update of an overlapping slice).
    """
    ks = np.sort(k[k > 0])  # ascending: the occupied prefix grows slowly
    m, total = len(ks), int(ks.sum())
    exact = m <= 62
    c = np.zeros(total + 1, dtype=np.int64 if exact else np.float64)  # (Σk + 1,)
    c[0] = 1
    top = 0
    for kj in ks.tolist():
        c[kj : top + kj + 1] += c[: top + 1]  # the subsets without j, shifted by k_j: those with j
        top += kj
        if not exact:
            c[: top + 1] *= 0.5
    cdf = np.cumsum(c)  # (Σk + 1,)
    if exact:
        return cdf, m, 0.0
    j = m + total + 1
    return cdf, m, j * 2.0**-53 / (1 - j * 2.0**-53)


def _flip_bracket(dstar: np.ndarray, bound: float, states: int) -> tuple[float, float]:
    """Bounds on P(Σ_{s∈F} d*_s ≤ ``bound``) over the 2^n subsets F of the seeds, uniform (the engine of
    :func:`sign_flip_lattice`, whose docstring has the argument)."""
    n = len(dstar)
    a = np.abs(dstar)  # (n,)
    total = float(a.sum())
    eta = 2 * (n + 8) * 2.0**-53 * total  # float rounding of every sum, E and threshold below
    k_abs, delta, err = _lattice_step(a, states)
    k = np.where(dstar < 0, -k_abs, k_abs)  # (n,) signed, d*_s = k_s·δ + e_s
    cdf, m, rel = _subset_sum_cdf(k_abs)
    shift, top = int(k_abs[k < 0].sum()), int(k_abs.sum())  # Σ_F k + shift is a subset sum of the |k_s|

    def threshold(x: float) -> int:
        """The largest t with δ·(t − shift) ≤ x: δ·K_F ≤ x ⇔ K_F + shift ≤ t."""
        return math.floor(x / delta + shift)

    def lattice_all(t: int) -> float:
        """P(K_F + shift ≤ t) over every F (probability, int-exact where rel = 0)."""
        return 0.0 if t < 0 else 1.0 if t >= top else float(cdf[t])

    # F with at most 2 seeds (the observed pattern among them): their sums directly, not through the lattice
    i, j = np.triu_indices(n, 1)  # (n(n−1)/2,) pairs
    small_exact = np.concatenate(([0.0], dstar, dstar[i] + dstar[j]))  # (1 + n + n(n−1)/2,)
    small_lattice = np.concatenate(([0], k, k[i] + k[j])) + shift
    out = []
    for sign in (-1.0, 1.0):
        t = threshold(bound + sign * (err + eta))
        exact_count = int(np.count_nonzero(small_exact <= bound + sign * eta))
        lattice_count = int(np.count_nonzero(small_lattice <= t))
        if rel == 0.0:  # exact integers: the 2^(n−m) patterns of the k_s = 0 each
            big = (0 if t < 0 else (1 << m) if t >= top else int(cdf[t])) << (n - m)
            out.append((big - lattice_count + exact_count) / (1 << n))
        else:  # cdf within a factor 1 ± r of the truth; 4u more for the three roundings of this line
            rest = lattice_all(t) / (1 - sign * rel) - math.ldexp(lattice_count, -n)
            out.append((math.ldexp(exact_count, -n) + max(0.0, rest)) * (1 + sign * 2.0**-51))
    return out[0], min(1.0, out[1])


def sign_flip_lattice(d: Sequence[float], alternative: str = "two-sided", states: int | None = None) -> SignFlip:
    r"""Exact sign-flip p of mean(d) = 0 bracketed by a dynamic programme on a lattice: p ∈ [p_lo, p_hi].

    The p is :func:`sign_flip_enumerated`'s (same T, same tie tolerance tol = TIE_RTOL·Σ|d_s|). Take the
    reference pattern σ* with d*_s = σ*_s|d_s| = d_s (greater), −d_s (less), sign(Σd)·d_s (two-sided), s* = Σd*.
    Flipping the seeds of a set F gives S(σ) = s* − 2·Σ_{s∈F} d*_s, so S ≥ s* − tol ⇔ Σ_F d*_s ≤ tol/2 and

        p = P_F(Σ_F d*_s ≤ tol/2)  (greater, less),   p = min(1, 2·P_F(…))  (two-sided, s* > tol; 1 if s* ≤ tol),

    F uniform over the 2^n subsets (for the two-sided p the patterns with S ≤ −c mirror those with S ≥ c, c > 0).

    Lattice: d*_s = k_s·δ + e_s with integers k_s = round(d*_s/δ), |e_s| ≤ δ/2 (:func:`_lattice_step`). Then
    Σ_F d* = δ·K_F + Σ_F e_s with K_F = Σ_F k_s and |Σ_F e_s| ≤ E = Σ_s|e_s| ≤ n·δ/2 for every F, so

        {δK_F ≤ tol/2 − E} ⊆ {Σ_F d* ≤ tol/2} ⊆ {δK_F ≤ tol/2 + E}:   P(δK ≤ tol/2 − E) ≤ p ≤ P(δK ≤ tol/2 + E).

    K_F plus the sum of the |k_s| of negative d*_s is a subset sum of the |k_s|, counted by :func:`_subset_sum_cdf`
    (the distribution of the sum under random signs as a convolution of two-point laws). The sets F of at most two
    seeds (1 + n + n(n−1)/2 of them, the observed pattern F = ∅ first) are taken out of the lattice count and
    counted on their own sums, so the observed pattern and its neighbours, which sit within E of the threshold,
    do not widen the bracket (without this p_lo ≤ p − 2^-n always, and a p at its floor 2/2^n got p_lo = 0). E
    and tol/2 are widened by η = 2(n + 8)·u·Σ|d| (u = 2^-53), which covers the float rounding of the enumeration's
    sums (≤ γ_{n−1}·Σ|d|), of E and of the threshold on K, so [p_lo, p_hi] holds the enumerated p as well as the
    real-arithmetic one. η < tol/2 for n ≤ 2000: a lattice that holds every d_s (equal values, rounded data,
    E ≈ 0) gives p_lo = p_hi, the exact p.

    δ: ``states`` = K sets Σ|k_s| ≈ K, δ ≈ Σ|d|/K: time O(n·K) and 16·K bytes for the programme, plus O(n²) for
    the pairs. By default K starts at 2^16 and is multiplied by 4 until p_hi − p_lo ≤ LATTICE_RTOL·p_hi or K
    reaches min(LATTICE_STATES, LATTICE_WORK/n). The width is about the probability that Σ_F d* lies within E of
    tol/2: for an observed sum z standard deviations out, relative width ≈ 2z·E/√(Σd²) ≲ z·n^1.5/K; for three
    56-seed sums of the sharpening grid 6e-4, 6e-4 and 4e-4 at K = 2^20, 2^20 and 2^22 (under a second each).
    Near-ties are its floor: sums within E of the threshold whatever δ (the fourth, the reward spread, holds
    float32 copies of a few values 1e-8 apart and stays at 2e-3, so refining stops when a 4× finer lattice
    narrows the bracket by under 10%). p = p_hi.
    """
    n = len(d)
    scaled = _scaled(d) if n else None
    if scaled is None:
        return SignFlip(*(3 * [float("nan")]), "lattice")
    if n > MAX_LATTICE_SEEDS:
        raise ValueError(f"{n} differences: the lattice bracket stops at {MAX_LATTICE_SEEDS} (float64 underflow)")
    if alternative not in ("greater", "less", "two-sided"):
        raise ValueError(f"alternative must be 'less', 'greater' or 'two-sided', got {alternative!r}")
    x, obs = scaled  # (n,)
    total = sum(np.abs(x).tolist())
    if total == 0.0:  # every difference 0: every pattern ties with the observed one
        return SignFlip(1.0, 1.0, 1.0, "lattice")
    tol, eta = TIE_RTOL * total, 2 * (n + 8) * 2.0**-53 * total
    sign = {"greater": 1.0, "less": -1.0, "two-sided": 1.0 if obs >= 0 else -1.0}[alternative]
    star = sign * obs
    cap = max(1 << 10, min(LATTICE_STATES, LATTICE_WORK // n))
    size, width = (states if states is not None else min(cap, 1 << 16)), math.inf
    while True:
        lo, hi = _flip_bracket(sign * x, tol / 2, size)
        if alternative == "two-sided":
            lo = 1.0 if star - tol <= -eta else min(1.0, 2 * lo)
            hi = 1.0 if star - tol <= eta else min(1.0, 2 * hi)
        # stop when narrow, at the cap, or when a 4× finer lattice took off under 10% (near-ties at the threshold)
        if states is not None or hi - lo <= LATTICE_RTOL * hi or size >= cap or hi - lo > 0.9 * width:
            return SignFlip(hi, lo, hi, "lattice")
        size, width = min(cap, 4 * size), hi - lo


def sign_flip(d: Sequence[float], alternative: str = "two-sided") -> SignFlip:
    """The exact sign-flip p of mean(d) = 0 for any n: enumerated up to MAX_EXACT_FLIPS differences
    (:func:`sign_flip_enumerated`), bracketed beyond (:func:`sign_flip_lattice`, p = the bracket's upper end)."""
    if len(d) <= MAX_EXACT_FLIPS:
        p = sign_flip_enumerated(d, alternative) if len(d) else float("nan")
        return SignFlip(p, p, p, "enumerated")
    return sign_flip_lattice(d, alternative)


def sign_flip_p(d: Sequence[float], alternative: str = "two-sided") -> float:
    """Sign-flip permutation p-value of mean(d) = 0 (differences symmetric about 0 under H0): :func:`sign_flip`'s p.

    p = #{σ: T(σ) ≥ T_obs} / 2^n over every assignment σ of signs to |d_s|, with T = mean (greater), −mean (less)
    or |mean| (two-sided), ties within TIE_RTOL·Σ|d_s| counted as extreme. The observed assignment is one of them,
    so p ≥ 2^-n. Exact up to MAX_EXACT_FLIPS differences; beyond, the upper end of an exact bracket (never below
    the exact p; the bracket itself from :func:`sign_flip`).
    """
    return sign_flip(d, alternative).p


def sign_flip_p_drawn(
    d: Sequence[float], alternative: str = "two-sided", draws: int = FLIP_DRAWS, seed: int = FLIP_SEED
) -> float:
    """Monte Carlo sign-flip p-value: p = (1 + #{b: T(σ_b) ≥ T_obs}) / (B + 1) over B = ``draws`` sign patterns σ_b
    drawn uniformly (seeded), T as in :func:`sign_flip_p`, ties within TIE_RTOL·Σ|d_s| counted as extreme.

    Counting the observed pattern once more makes it a valid p-value, P(p ≤ α) ≤ α under H0 for any B (Phipson and
    Smyth 2010: permutation p-values should never be zero), at least 1/(B + 1); its standard error about the exact
    p is √(p(1 − p)/B) ≤ 0.5/√B. Patterns are drawn in blocks of 4096 (memory 4096·n·8 bytes)."""
    mags = np.abs(np.asarray(d, dtype=np.float64))  # (n,)
    obs = float(np.sum(np.asarray(d, dtype=np.float64)))
    tol = TIE_RTOL * float(mags.sum())
    rng = np.random.default_rng(seed)
    hits, left = 0, draws
    while left > 0:
        block = min(left, 4096)
        signs = 1.0 - 2.0 * rng.integers(0, 2, size=(block, len(mags)))  # (block, n) of ±1
        totals = signs @ mags  # (block,)
        if alternative == "greater":
            hits += int(np.count_nonzero(totals >= obs - tol))
        elif alternative == "less":
            hits += int(np.count_nonzero(totals <= obs + tol))
        else:
            hits += int(np.count_nonzero(np.abs(totals) >= abs(obs) - tol))
        left -= block
    return (1 + hits) / (draws + 1)
