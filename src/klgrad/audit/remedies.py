"""The exact reverse-KL gradient in each framework, as that framework's own flags or code: one :class:`Remedy` per
framework, the audited preset behind its claim (tests/audit/test_frameworks.py checks every claim against the
audit), printed by ``klgrad audit --framework NAME`` as lines to paste and tabulated in docs/frameworks.md.

A remedy's ``paste`` is written in the framework's own syntax: Python for TRL (``RLOOConfig(...)``), Hydra
``key=value`` overrides for verl and SkyRL, command-line flags for OpenRLHF, slime, ms-swift and Open-Instruct,
YAML ``key: value`` for the frameworks configured by a YAML file. Lines starting with ``#`` are comments in every
one of them (Python, a shell command line, YAML), so the printed block pastes as it is; they carry the conditions
(one update per rollout, a version, a clamp). No Markdown: the page renders code lines as code itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from klgrad.audit.frameworks import fmt_error


@dataclass(frozen=True)
class Remedy:
    """One framework's way to the exact reverse-KL gradient, the preset and aggregation that back it, and what the
    audit must show for the claim to hold (``exact``: on-policy rel. error vs ∇RKL < 1e-12; ``local_rkl``: equals
    the per-step reverse KL; ``exact_fkl``: off-policy, the forward KL to π_old exactly; ``none``: no claim)."""

    framework: str
    paste: tuple[str, ...]
    """The framework's own flags or code, a line each; ``# `` starts a comment line (a condition, an alternative)."""
    preset: str | None
    aggregation: str | None
    claim: str
    syntax: str = ""
    """What ``paste`` is, for the reader: ``Python``, ``Hydra overrides``, ``command-line flags``, ``YAML``."""

    @property
    def code(self) -> tuple[str, ...]:
        """The lines of ``paste`` that are not comments."""
        return tuple(line for line in self.paste if not line.startswith("#"))


def _trl_grpo(beta: float) -> str:
    return (
        f"KLGradGRPOTrainer(model, reward_funcs, args=GRPOConfig(beta={beta}), train_dataset=dataset, "
        'klgrad_config=KLGradTRLConfig(head="k2_as_loss", level="sequence"))'
    )


REMEDIES: tuple[Remedy, ...] = (
    Remedy(
        "trl",
        (
            "# RLOOTrainer: k1 summed in the reward, exact with one update per generation (num_iterations=1)",
            "RLOOConfig(beta=0.05, num_iterations=1)",
            "# GRPOTrainer: klgrad's k2_as_loss at sequence level in TRL's loss, exact on- and off-policy "
            "(docs/trl.md)",
            "from klgrad.integrations.trl import KLGradGRPOTrainer, KLGradTRLConfig",
            _trl_grpo(0.05),
        ),
        "trl/rloo-k1-reward",
        "token_sum",
        "exact",
        "Python",
    ),
    Remedy(
        "verl",
        (
            "# k1 in the reward through GAE (γ = λ = 1, the defaults), no KL loss, token-mean, one mini-batch per "
            "rollout",
            "algorithm.use_kl_in_reward=True algorithm.kl_penalty=kl algorithm.adv_estimator=gae "
            "actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.loss_agg_mode=token-mean "
            "actor_rollout_ref.actor.ppo_epochs=1 "
            "actor_rollout_ref.actor.ppo_mini_batch_size='${data.train_batch_size}'",
            "# algorithm.adv_estimator=grpo is exact too; off-policy (several mini-batches): klgrad's policy loss,",
            "# actor.policy_loss.loss_mode: klgrad (docs/verl.md)",
        ),
        "verl/kl-reward-gae",
        "token_mean",
        "exact",
        "Hydra overrides",
    ),
    Remedy(
        "openrlhf",
        (
            "# the default: k1 in the reward (without --algo.kl.use_loss), one update per rollout; exact while",
            "# |log π − log π_ref| ≤ 10 per token (0.8.6+ clamps beyond); before 0.11: --init_kl_coef --kl_estimator",
            "--algo.kl.init_coef 0.01 --algo.kl.estimator k1",
            "# as a loss, the per-step reverse KL on-policy (0.11.1+), not the sequence's:",
            "# --algo.kl.use_loss --algo.kl.unbiased_gradient",
        ),
        "openrlhf/k1-reward",
        "token_mean",
        "exact",
        "command-line flags",
    ),
    Remedy(
        "slime",
        (
            "# k1 reward-to-go; per-token loss (the default per-sequence mean weights it by 1/|y|); --kl-coef is β",
            "--advantage-estimator reinforce_plus_plus --kl-coef 0.01 --normalize-advantages "
            "--calculate-per-token-loss",
        ),
        "slime/kl-coef-reinforce-pp",
        "token_sum",
        "exact",
        "command-line flags",
    ),
    Remedy(
        "nemo-rl",
        (
            "# GRPO has none: its KL loss (k3·e^{x − sg x}) is the per-step reverse KL. The GAE estimator is exact:",
            "use_kl_in_reward: true",
            "reference_policy_kl_type: k1",
            "gae_lambda: 1",
        ),
        "nemo-rl/gae-k1-in-reward",
        "token_mean",
        "exact",
        "YAML",
    ),
    Remedy(
        "deepseek-v3.2",
        (
            "# a report, not a framework: its k3·π/π_old is the per-step reverse KL; the sequence-exact forms are k1",
            "# in the reward summed over the response, or klgrad's k2_as_loss at sequence level:",
            "--kl.head k2_as_loss --kl.level sequence",
        ),
        "deepseek-v3.2/unbiased-kl",
        "token_sum",
        "local_rkl",
        "klgrad train flags",
    ),
    Remedy(
        "rpg",
        (
            "# none towards a fixed reference; with its scripts' iterative reference, rpg_fkl (or rpg_ufkl) is the",
            "# exact forward KL to π_old (a trust region):",
            "use_iterative_ref_model: true",
            "kl_loss_type: rpg_fkl",
        ),
        "rpg/fkl-iterative",
        "token_mean",
        "exact_fkl",
        "YAML",
    ),
    Remedy(
        "roll",
        (
            "# token-level k1 in the reward with REINFORCE returns (or adv_estimator: grpo), summed: token-mean",
            "# (0.1.1's default seq-mean-token-mean weights by 1/|y|; 0.1.0's seq-mean-token-sum is a sum too)",
            "add_token_level_kl: true",
            "kl_penalty: kl",
            "adv_estimator: reinforce",
            "loss_agg_mode: token-mean",
            "use_kl_loss: false",
        ),
        "roll/token-level-kl-reinforce",
        "token_sum",
        "exact",
        "YAML",
    ),
    Remedy(
        "areal",
        (
            "# the default: k1 in the reward with a ref model configured; the trainer's own log-probs; exact while",
            "# |u| ≤ 10",
            "actor:",
            "  kl_ctl: 0.1",
            "  recompute_logprob: true",
            "  use_decoupled_loss: false",
        ),
        "areal/k1-reward",
        "token_mean",
        "exact",
        "YAML",
    ),
    Remedy(
        "open-instruct",
        (
            "# none (no KL in the reward): k2 (1) or ρ·k1 (3) is the per-step reverse KL, the nearest it has; the",
            "# default 2 (k3) is the per-step forward KL",
            "--kl_estimator 1",
        ),
        "open-instruct/k2-loss",
        "token_mean",
        "local_rkl",
        "command-line flags",
    ),
    Remedy(
        "torchtune",
        (
            "# none: GRPOSimpleLoss's k3 with a per-sequence mean; exact: klgrad's k2 at sequence level instead of",
            "# its per_token_kl (mask: the response tokens; sum it with the policy loss at weight β)",
            "from klgrad import kl_loss",
            'kl = kl_loss("k2_as_loss", logp, ref_logp, mask, level="sequence")',
        ),
        None,
        None,
        "none",
        "Python",
    ),
    Remedy(
        "prime-rl",
        ("# none: no reference-model KL in its RL loss (the kl_tau term regularises towards the inference policy)",),
        None,
        None,
        "none",
    ),
    Remedy(
        "skyrl",
        (
            "# k1 in the reward, no KL loss (default true), GRPO advantages (default), token mean (default)",
            "trainer.algorithm.use_kl_in_reward=true trainer.algorithm.use_kl_loss=false "
            "trainer.algorithm.kl_estimator_type=k1 trainer.algorithm.advantage_estimator=grpo "
            "trainer.algorithm.loss_reduction=token_mean",
        ),
        "skyrl/kl-reward-grpo-k1",
        "token_mean",
        "exact",
        "Hydra overrides",
    ),
    Remedy(
        "ms-swift",
        (
            "# k1 summed in the reward (the default for rloo and reinforce_plus_plus) with a token-level loss (the",
            "# default loss_type grpo weights by 1/|y|; dapo works too)",
            "--advantage_estimator rloo --kl_in_reward true --loss_type bnpo",
        ),
        "ms-swift/kl-in-reward",
        "token_sum",
        "exact",
        "command-line flags",
    ),
    Remedy(
        "tinker",
        (
            "# none: kl_penalty_coef adds k1 per token (the per-step reverse KL); kl_discount_factor: 1 sums it with",
            "# its batch-mean baseline, which then depends on the length",
        ),
        "tinker/kl-advantage",
        "token_sum",
        "local_rkl",
    ),
    Remedy(
        "klgrad",
        (
            "# exact on- and off-policy; --kl.level token_to_go and --kl.head k1_in_reward are exact too",
            "--kl.head k2_as_loss --kl.level sequence",
        ),
        None,
        None,
        "none",
        "klgrad train flags",
    ),
)
"""One remedy per framework of ``klgrad audit --framework``, and klgrad's own."""


def remedy_lines(remedy: Remedy, row: dict | None) -> list[str]:
    """What ``klgrad audit --framework NAME`` prints: a header naming the syntax and the audited preset, then the
    lines to paste, indented by 4 (``row``: the audit row behind the claim, :func:`remedy_row`)."""
    audited = ""
    if row is not None:
        err = fmt_error(row["err_fkl"] if remedy.claim == "exact_fkl" else row["err_rkl"])
        versus = "∇FKL, off-policy" if remedy.claim == "exact_fkl" else "∇RKL, on-policy"
        audited = f"; audited: {remedy.preset} ({remedy.aggregation}), rel. err vs {versus} {err}"
    syntax = f" ({remedy.syntax})" if remedy.syntax else ""
    return [
        f"The exact reverse-KL gradient in {remedy.framework}{syntax}{audited}:",
        *("    " + p for p in remedy.paste),
    ]


def print_remedy(framework: str, rows: list[dict], console) -> None:
    """``framework``'s remedy under ``klgrad audit --framework``'s tables, each line whole (never wrapped to the
    terminal: it is pasted); the audited claim from ``rows`` when its preset is among them."""
    for remedy in REMEDIES:
        if remedy.framework == framework:
            row = remedy_row(remedy, rows) if remedy.preset in {r["id"] for r in rows} else None
            console.print()
            for line in remedy_lines(remedy, row):
                console.print(line, markup=False, soft_wrap=True, highlight=False)


def remedy_markdown(remedy: Remedy) -> str:
    """A Markdown table cell (its ``|`` still to escape): each run of comment lines as one sentence of text, each
    line to paste as code, separated by line breaks."""
    parts: list[str] = []
    comment = False
    for line in remedy.paste:
        if line.startswith("#"):
            text = line.removeprefix("#").strip()
            parts[-1:] = [f"{parts[-1]} {text}"] if comment else [*parts[-1:], text]
            comment = True
        else:
            parts.append(f"`{line}`")
            comment = False
    return "<br>".join(parts)


def remedy_row(remedy: Remedy, rows: list[dict]) -> dict | None:
    """The audit row behind a remedy: its preset at its aggregation, on-policy (off-policy for ``exact_fkl``)."""
    if remedy.preset is None:
        return None
    regime = "off_policy" if remedy.claim == "exact_fkl" else "on_policy"
    (hit,) = [
        r for r in rows if r["id"] == remedy.preset and r["aggregation"] == remedy.aggregation and r["regime"] == regime
    ]
    return hit
