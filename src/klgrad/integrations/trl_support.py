"""Which TRL releases :mod:`klgrad.integrations.trl` runs on, and why the others are refused (no TRL import here).

``KLGradGRPOTrainer`` overrides four private methods of TRL's ``GRPOTrainer`` (``_compute_loss``,
``_generate_and_score_completions``, ``_calculate_rewards``, ``_get_per_token_logps_and_entropies``). TRL changes
private signatures without notice, so the releases it runs on are the ones tested: every minor release from 1.10
(the first whose default KL, ``use_bias_correction_kl``, the audit diagnoses) to 1.16, each run through
tests/integrations/test_trl*.py by ``tools/trl_matrix.sh`` (report: docs/trl_matrix.md). One of them cannot run
without Triton: TRL 1.15's ``GRPOTrainer`` computes every log-prob with a Triton kernel (``trl.kernels``,
imported without a fallback), so on a machine without Triton (PyTorch's CPU wheels have none) TRL's own trainer
fails at its first forward; 1.14 and 1.16 fall back to plain PyTorch.
"""

from __future__ import annotations

from importlib import metadata, util

from packaging.version import Version

OLDEST = Version("1.10")
"""The oldest TRL the matrix tests (tools/trl_matrix.sh)."""
NEWEST_TESTED = Version("1.16")
"""The newest minor release the matrix tests; newer ones are not refused (the trainer checks its hooks ran)."""
NEEDS_TRITON = ((Version("1.15"), Version("1.16")),)
"""[low, high) ranges of TRL whose GRPOTrainer computes log-probs only with Triton."""
INSTALL = "pip install 'klgrad[trl]' (TRL >= 1.10; on a machine without Triton, not 1.15)"


def trl_problem(version: str, has_triton: bool) -> str | None:
    """Why ``klgrad.integrations.trl`` refuses TRL ``version`` (``has_triton``: whether Triton imports here), as
    the ImportError's text; None when it runs."""
    v = Version(Version(version).base_version)  # 1.15.0rc1 is a 1.15
    if v < OLDEST:
        return (
            f"klgrad.integrations.trl needs TRL >= {OLDEST} (tested 1.10–{NEWEST_TESTED.base_version}: "
            f"tools/trl_matrix.sh, docs/trl_matrix.md); TRL {version} is installed. KLGradGRPOTrainer overrides four "
            "private methods of GRPOTrainer, whose signatures TRL changes without notice, and it is not tested on "
            f"TRL {version}: {INSTALL}"
        )
    for low, high in NEEDS_TRITON:
        if low <= v < high and not has_triton:
            return (
                f"klgrad.integrations.trl cannot run on TRL {version} without Triton: TRL {low.base_version}'s "
                "GRPOTrainer computes every log-prob with a Triton kernel (trl.kernels, no PyTorch fallback), so "
                "TRL's own trainer fails at its first forward, and Triton is not installed (PyTorch's CPU wheels "
                f"have none). Use TRL 1.10–1.14 or >= 1.16 (pip install 'trl>=1.16'), or install triton"
            )
    return None


def installed_trl_problem() -> str | None:
    """:func:`trl_problem` of the installed TRL (None when TRL is not installed: the import says so itself)."""
    try:
        version = metadata.version("trl")
    except metadata.PackageNotFoundError:
        return None
    return trl_problem(version, util.find_spec("triton") is not None)
