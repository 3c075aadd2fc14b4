r"""The unbiased pass@k estimator of Chen et al. (2021), "Evaluating Large Language Models Trained on Code".

For one problem with n samples of which c are correct, the probability that at least one of k samples drawn
without replacement from those n is correct is

    pass@k = 1 − C(n − c, k) / C(n, k),

an unbiased estimate of the chance that k fresh samples contain a correct one. A benchmark's pass@k is its
mean over problems. Special cases: pass@1 = c / n; pass@n = 1 if c > 0 else 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    r"""Unbiased pass@k of one problem: n samples, c of them correct, 1 ≤ k ≤ n.

    pass@k = 1 − C(n−c, k) / C(n, k) = 1 − ∏_{i=n−c+1}^{n} (1 − k/i)

    (the ratio of binomials telescopes into c factors). The product is summed in log space with ``log1p``, so it
    never forms a binomial coefficient (no overflow at any n) and stays accurate when the ratio is tiny. It is 1
    exactly when n − c < k (every k-subset holds a correct sample) and 0 exactly when c = 0.

    Raises:
        ValueError: naming the argument, when not 0 ≤ c ≤ n or not 1 ≤ k ≤ n.
    """
    if not 0 <= c <= n:
        raise ValueError(f"c (correct samples) must be in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    if n - c < k:
        return 1.0
    return -math.expm1(math.fsum(math.log1p(-k / i) for i in range(n - c + 1, n + 1)))


def mean_pass_at_k(correct: Sequence[int], n: int, k: int) -> float:
    """A benchmark's pass@k: the mean over problems of :func:`pass_at_k` (``correct[i]`` of ``n`` samples of
    problem i are correct). ValueError when ``correct`` is empty."""
    if not correct:
        raise ValueError("pass@k of no problems is undefined")
    return math.fsum(pass_at_k(n, c, k) for c in correct) / len(correct)
