"""``klgrad eval``: greedy accuracy, pass@1 and pass@k of models on benchmark files, scored with Math-Verify.

- :mod:`klgrad.eval.passk`: the unbiased pass@k estimator.
"""

from klgrad.eval.passk import mean_pass_at_k, pass_at_k

__all__ = ["mean_pass_at_k", "pass_at_k"]
