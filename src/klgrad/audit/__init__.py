"""The gradient audit (:mod:`klgrad.audit.run`) and the frameworks' KL (:mod:`klgrad.audit.frameworks`)."""

AUDIT_NAMES = (
    "With --framework, 'klgrad equivalent' names the klgrad gradient a framework's KL equals, one name per "
    "gradient: head@level (target). k2_as_loss@sequence (rkl) is the exact reverse-KL gradient; "
    "k2_as_loss@token (local_rkl) is the per-step reverse KL, what TRL >= 1.10's default "
    "(use_bias_correction_kl) differentiates to, not the sequence's; k3_as_loss@token (local_fkl) the per-step "
    "forward KL; none@sequence (zero) no gradient. Heads with the same gradient go by the first of none, "
    "k2_as_loss, then the registry (k1_in_reward at a level is named k2_as_loss there). '≈ name (error)': the "
    "nearest, with its relative error; 'head@level/|y|': under a per-sequence token mean. Remedies print as "
    "the framework's own flags or code, to paste."
)
"""The naming of ``klgrad audit --framework``'s gradients (its ``--help`` epilog; tests/audit check every name
here is the audit's). Here, not in :mod:`klgrad.audit.frameworks`, so that the CLI's parser loads no torch."""
