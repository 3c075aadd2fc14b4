"""``klgrad eval``: greedy accuracy, pass@1 and pass@k of models on benchmark files, scored with Math-Verify.

- :mod:`klgrad.eval.passk`: the unbiased pass@k estimator;
- :mod:`klgrad.eval.models`: a ``--model`` value (shipped name, HF folder, klgrad run or checkpoint) -> model;
- :mod:`klgrad.eval.benchmarks`: benchmark files and the prompts a model sees (chat template or raw);
- :mod:`klgrad.eval.run`: sampling and scoring; :mod:`klgrad.eval.report`: eval.json, results.md, the table.
"""

from klgrad.eval.passk import mean_pass_at_k, pass_at_k

__all__ = ["mean_pass_at_k", "pass_at_k"]
