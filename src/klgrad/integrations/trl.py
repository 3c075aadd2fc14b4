r"""klgrad's KL heads inside TRL's ``GRPOTrainer`` (TRL 1.10–1.16: :mod:`klgrad.integrations.trl_support`).

:class:`KLGradGRPOTrainer` is a ``GRPOTrainer`` whose KL term is any klgrad head (:data:`klgrad.KL_HEADS` or a
:func:`klgrad.custom_kl_head`), at any level (``sequence`` | ``token_to_go`` | ``token``), in either form
(docs/math.md, sections “Where a head acts: level”, “How a head joins the reward: form” and “Off-policy:
importance sampling and the clip side”), or a framework's KL term (a preset id of ``klgrad audit --framework``,
below). Everything else (generation, rewards, TRL's clipped policy loss and its ``loss_type`` aggregation,
logging) stays TRL's own code: the subclass overrides four hooks and calls ``super()`` in each.

β. The KL weight is TRL's own ``args.beta`` (``GRPOConfig(beta=...)``), the only β there is:
:class:`KLGradTRLConfig` has no β. With ``beta != 0`` TRL builds the reference model and computes the reference
log-probs as usual; inside the loss TRL's own k3 term is switched off (``self.beta`` reads 0 while TRL's
``_compute_loss`` runs), so the KL is counted once, as klgrad's. TRL's ``use_bias_correction_kl`` is therefore
ignored; :class:`KLGradTRLConfig` says how the KL head is corrected off-policy.

Decoupled form (loss = TRL's policy loss + β · KL loss): the KL loss is
:func:`klgrad.kl.kl_loss_per_sequence` on the log-probs TRL computed for its own policy loss (one forward),
aggregated over sequences exactly as TRL aggregates its per-token loss for the configured ``loss_type``
(:func:`aggregate_like_trl`). Off-policy, i.e. when TRL provides ``old_per_token_logps`` (``num_iterations > 1``,
or ``steps_per_generation`` not a multiple of ``gradient_accumulation_steps``, or vLLM), the head is converted to
its coefficient c, recomputed from the current log-probs, and applied as β·max(ρc, clip(ρ, 1-ε, 1+ε)c) with
ρ the ``ratio_level`` importance ratio (docs/math.md, “Off-policy: importance sampling and the clip side”).

A framework preset (``head="verl/kl-loss-low-var-kl"``): the term is the preset's own record,
:func:`klgrad.audit.framework_head.preset_term`, the very term ``klgrad train --kl.head <id>`` trains and the audit
differentiates, on TRL's log-probs (behaviour: TRL's ``old_per_token_logps``, on-policy the policy's own,
detached), reduced by the preset framework's aggregation (:data:`klgrad.audit.framework_head.KL_AGGREGATION`),
not by TRL's ``loss_type``: ``GRPOConfig.beta`` is that framework's KL coefficient on its own reduction (verl's
``kl_loss_coef`` on its token mean, OpenRLHF's ``init_kl_coef`` on its reward-to-go). A batch-baseline preset's
baseline is the penalty's token mean over the generation batch (all processes). The preset sets its level, form
and ratio handling: :class:`KLGradTRLConfig` refuses any other of its options at a non-default value.

Combined form (A = shape(R - β·C)): after TRL has generated and scored a batch, the advantages TRL computed
from R are replaced by :func:`klgrad.objective.combined_advantages` of the raw summed reward R (TRL's
``reward_weights``, unscorable completions count as 0), the reference log-probs and the policy log-probs at
generation time (TRL's ``old_per_token_logps`` when it has them, else one extra no-grad forward). The shaping
is klgrad's ``shaping`` method (default from TRL's ``scale_rewards``: ``group`` -> ``grpo``, ``none`` ->
``dr_grpo``). The advantages are stored as a (B, T) tensor, which TRL's ``_compute_loss`` accepts as is, so
``token_to_go`` gives every token its own advantage A_{i,t} = shape(R - β·C)_i + s_{-i}·β·Σ_{t'<t} c_{t'}, with
s_{-i} the shaping's normalisation computed without completion i, so the prefix terms have zero expected
gradient: for heads whose per-token coefficients add up to the sequence's (k1_in_reward, k2_as_loss) the
expected gradient is exactly the sequence level's (sequence level: the same value on every token); for k3 it
is not (Σ_t c(u_t) ≠ c(Σ_t u_t)). The coefficients are computed once per
generation batch (groups are split into micro-batches later) with the behaviour policy's log-probs, as PPO does;
TRL's clipped importance ratio corrects later iterations. ``klgrad train`` recomputes them from the current
log-probs at every epoch (docs/math.md, “Off-policy: importance sampling and the clip side”); this
integration does not.

Metrics, in TRL's logs (``trainer.state.log_history``): ``kl/k1``, ``kl/k2``, ``kl/k3`` (estimates of the
sequence KL from the summed log-ratio), ``kl/logp_gap`` (mean l - r per token), ``kl/logp_gap_abs``; decoupled:
``loss/kl`` (the KL loss as :func:`klgrad.kl_loss` gives it: mean over sequences, tokens summed, no β; off-policy
the surrogate's value, docs/metrics.md) and, off-policy, ``clip/kl_frac`` (share of tokens whose KL gradient the
clip removed; not for a preset, which clips by its own rule); combined: ``kl/reward_penalty`` (mean β·C
subtracted from R).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from pydantic import model_validator
from torch import Tensor

from klgrad.integrations.trl_support import INSTALL, installed_trl_problem

try:
    from trl import GRPOTrainer
    from trl.models.utils import disable_gradient_checkpointing
except ImportError as err:  # pragma: no cover - exercised by a test that hides trl
    raise ImportError(f"klgrad.integrations.trl needs TRL, which is not installed: {INSTALL}") from err
if (_problem := installed_trl_problem()) is not None:
    raise ImportError(_problem)

from klgrad.audit.framework_head import (
    KL_AGGREGATION,
    entry_text,
    find_preset,
    penalty_sums,
    preset_settings,
    preset_term,
)
from klgrad.audit.framework_kl import FrameworkKL
from klgrad.choices import ShapingMethod, is_preset_id
from klgrad.config import KLConfig, KLHeadOptions
from klgrad.config.sections import Positive, record, require
from klgrad.kl import KLHead, get_kl_head, kl_loss_per_sequence, level_coefficients
from klgrad.objective import ObjectiveSpec, combined_advantages, objective_diagnostics

logger = logging.getLogger(__name__)

__all__ = ["TRL_LOSS_TYPES", "KLGradGRPOTrainer", "KLGradTRLConfig", "aggregate_like_trl"]

TRL_LOSS_TYPES: tuple[str, ...] = ("grpo", "sapo", "bnpo", "dr_grpo", "dapo", "cispo", "vespo", "luspo")
"""TRL ``loss_type`` values whose aggregation :func:`aggregate_like_trl` reproduces."""

_SHAPING_FROM_SCALE_REWARDS: dict[str, str] = {"group": "grpo", "none": "dr_grpo"}
"""TRL ``scale_rewards`` -> klgrad shaping for the combined form (``batch`` has no exact klgrad twin)."""


@record
class KLGradTRLConfig(KLHeadOptions):
    """The KL term :class:`KLGradGRPOTrainer` uses in place of TRL's: the KL options of a klgrad run's ``kl``
    section (:class:`klgrad.config.KLHeadOptions`: head, level, form, clip_eps, ratio_level, is_correction; the
    same record, fields and rules), plus the combined form's shaping. β is TRL's ``args.beta``.

    ``head`` may be a framework preset id (``openrlhf/k1-reward``): that framework's KL term trains (module
    docstring); the preset sets level, form, ratio and clip itself, so those options, and the combined form's
    shaping, must stay at their defaults, and an unknown id is refused with the closest ones.

    A pydantic dataclass: a bad value raises a ``ValueError`` (pydantic's ``ValidationError``) naming the field,
    and TRL's own ``TrlParser`` reads it beside ``GRPOConfig`` (``head`` is typed ``str``; a head object of yours:
    :func:`klgrad.register_kl_head` it and pass its name)."""

    shaping: ShapingMethod | None = None
    """Combined form: klgrad shaping method of R - β·C; None derives it from TRL's scale_rewards."""
    std_min: Positive | None = None
    """Combined form: lower clip of the shaping's normalising stds (klgrad's algo.std_min; None: no clip)."""
    std_max: Positive | None = None
    """Combined form: upper clip of the shaping's normalising stds (klgrad's algo.std_max; None: no clip)."""

    @model_validator(mode="after")
    def _preset_rules(self) -> KLGradTRLConfig:
        if not is_preset_id(self.head):
            return self
        preset = find_preset(self.head)  # an unknown id: ValueError with the closest ids
        defaults = {f.name: f.default for f in dataclasses.fields(KLGradTRLConfig) if f.name != "head"}
        sets = ", ".join(f"{k} {v}" for k, v in preset_settings(preset).items())
        require([
            (getattr(self, name) == default, name,
             f"{getattr(self, name)!r} does not apply to a framework preset: {preset.id} sets {sets} and its own "
             f"ratio and clip; leave {name} at its default ({default!r})")
            for name, default in defaults.items()
        ])  # fmt: skip
        return self

    @property
    def preset(self) -> FrameworkKL | None:
        """The framework preset ``head`` names, or None for a klgrad head."""
        return find_preset(self.head) if is_preset_id(self.head) else None

    @property
    def kl_head(self) -> KLHead:
        """The klgrad head ``head`` names (a ValueError for a preset id: :attr:`preset` is its term)."""
        return get_kl_head(self.head)

    @property
    def active(self) -> bool:
        """Whether there is a KL term at all (a preset, or a head other than ``none``)."""
        return self.preset is not None or self.kl_head.style != "none"

    def kl_options(self, beta: float) -> KLConfig:
        """The run-config ``kl`` record of these options at TRL's ``beta`` (a preset's with its settings, as
        ``klgrad train`` records it)."""
        head = {f.name: getattr(self, f.name) for f in dataclasses.fields(KLHeadOptions)}
        settings = preset_settings(self.preset) if self.preset is not None else {}
        return KLConfig(**{**head, **settings}, beta=beta)


TRL_REDUCTION_OF: dict[str, str] = {"seq_mean_token_sum": "luspo", "token_mean": "dapo", "seq_mean_token_mean": "grpo"}
"""The TRL ``loss_type`` whose reduction (:func:`aggregate_like_trl`) is klgrad's aggregation of a preset's term
(:data:`klgrad.audit.framework_head.KL_AGGREGATION`): luspo's is the mean over sequences of token sums, dapo's the
generation batch's token mean, grpo's the mean over sequences of per-sequence token means."""

AGGREGATION_OF_LOSS_TYPE: dict[str, str] = {
    "grpo": "seq_mean_token_mean", "sapo": "seq_mean_token_mean", "bnpo": "token_mean", "dapo": "token_mean",
    "cispo": "token_mean", "vespo": "token_mean", "luspo": "seq_mean_token_sum", "dr_grpo": "constant",
}  # fmt: skip
"""How each TRL ``loss_type`` reduces per-token terms, as klgrad names it (``constant``: Σ_t / (B·L_max))."""


def beta_conversion(preset: FrameworkKL, loss_type: str) -> str:
    """What ``GRPOConfig.beta`` means for ``preset``'s term, and how it compares with TRL's own KL at the same
    beta under ``loss_type`` (L̄: the batch's mean response length, L_max: ``max_completion_length``)."""
    ours = KL_AGGREGATION[preset.aggregation]
    coef = f" ({preset.coef_default[0]}, default {preset.coef_default[1]:g})" if preset.coef_default else ""
    head = (
        f"β = GRPOConfig.beta is {preset.framework}'s KL coefficient{coef} on its own reduction, {ours}; "
        f"TRL's loss_type {loss_type!r} reduces the policy loss only"
    )
    trl = AGGREGATION_OF_LOSS_TYPE[loss_type]
    factor = {
        ("seq_mean_token_sum", "token_mean"): "L̄ times TRL's own KL at the same beta (beta/L̄ matches it)",
        ("token_mean", "seq_mean_token_sum"): "1/L̄ times TRL's own KL at the same beta (beta·L̄ matches it)",
        ("seq_mean_token_sum", "constant"): "L_max times TRL's own KL at the same beta (beta/L_max matches it)",
        ("token_mean", "constant"): "about L_max/L̄ times TRL's own KL at the same beta",
    }.get((ours, trl))
    if ours == trl:
        factor = "the weight of TRL's own KL at the same beta"
    elif factor is None:  # one side weights each response by 1/|y|: no constant converts it
        factor = "no constant multiple of TRL's own KL (a per-sequence mean weights each response by 1/|y|)"
    return f"{head}: {factor}"


def aggregate_like_trl(
    totals: Tensor,
    mask: Tensor,
    loss_type: str,
    *,
    num_items_in_batch: Tensor | float,
    max_completion_length: int,
    accumulation_steps: int,
    steps_per_generation: int,
    num_processes: int,
    train: bool,
) -> Tensor:
    r"""Per-sequence token sums S_i (B,) -> the scalar TRL's ``loss_type`` makes of a per-token loss.

    With n_i = Σ_t m_{i,t}, B sequences, G = ``accumulation_steps`` in training (1 in eval), L = max completion
    length, N = ``num_items_in_batch`` (tokens of the whole generation batch), P processes, S = steps per
    generation:
      - grpo, sapo: (1/B) Σ_i S_i / max(n_i, 1) / G
      - bnpo: Σ_i S_i / max(Σ_i n_i, 1) / G
      - dr_grpo: Σ_i S_i / (B·L) / G
      - dapo, cispo, vespo: Σ_i S_i / (max(N, 1)/P · G/S) in training, Σ_i S_i / (max(N, 1)/P) in eval
      - luspo: (1/B) Σ_i S_i / G
    A per-token term added to TRL's per-token loss before aggregation, as TRL adds its own KL, gives the same
    scalar. ``mask``: (B, T) 0/1.
    """
    acc = accumulation_steps if train else 1
    n = mask.to(totals.dtype).sum(-1)  # (B,)
    if loss_type in ("grpo", "sapo"):
        return (totals / n.clamp(min=1.0)).mean() / acc
    if loss_type == "bnpo":
        return totals.sum() / n.sum().clamp(min=1.0) / acc
    if loss_type == "dr_grpo":
        return totals.sum() / (totals.shape[0] * max_completion_length) / acc
    if loss_type in ("dapo", "cispo", "vespo"):
        items = torch.as_tensor(num_items_in_batch, dtype=totals.dtype, device=totals.device).clamp(min=1.0)
        normalizer = items / num_processes
        if train:
            normalizer = normalizer * accumulation_steps / steps_per_generation
        return totals.sum() / normalizer
    if loss_type == "luspo":
        return totals.mean() / acc
    raise ValueError(f"loss_type must be one of {TRL_LOSS_TYPES}, got {loss_type!r}")


class KLGradGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` with klgrad's KL term (module docstring).

    Takes every ``GRPOTrainer`` argument plus ``klgrad_config`` (default: k2 as loss, sequence level,
    decoupled: the exact reverse-KL gradient). β is ``args.beta``.
    """

    def __init__(self, *args: Any, klgrad_config: KLGradTRLConfig | None = None, **kwargs: Any) -> None:
        self.klgrad_config = klgrad_config if klgrad_config is not None else KLGradTRLConfig()
        if not isinstance(self.klgrad_config, KLGradTRLConfig):
            raise TypeError(f"klgrad_config must be a KLGradTRLConfig, got {type(self.klgrad_config).__name__}")
        self._klgrad_capture: list[Tensor] | None = None
        self._klgrad_rewards_per_func: Tensor | None = None
        self.klgrad_preset = self.klgrad_config.preset
        with _quiet_trl_deprecations():
            super().__init__(*args, **kwargs)
        self._klgrad_check_trl_settings()
        self.klgrad_kl = self.klgrad_config.kl_options(float(self.beta))  # the KL record at TRL's β, made once
        self.klgrad_summary = self._klgrad_describe()
        logger.info(self.klgrad_summary)

    # ------------------------------------------------------------------------------------------------------
    # settings

    def _klgrad_check_trl_settings(self) -> None:
        cfg = self.klgrad_config
        if self.loss_type not in TRL_LOSS_TYPES:
            raise ValueError(f"GRPOConfig.loss_type {self.loss_type!r} is not supported; use one of {TRL_LOSS_TYPES}")
        if self.beta == 0.0 and cfg.active:
            warnings.warn(
                f"GRPOConfig.beta is 0: TRL builds no reference model, so the klgrad head {cfg.head!r} is "
                "inactive and no KL metrics are logged. Set GRPOConfig.beta (it is klgrad's β).",
                UserWarning,
                stacklevel=3,
            )
        if cfg.form == "combined":
            if self.multi_objective_aggregation != "sum_then_normalize":
                raise ValueError(
                    "GRPOConfig.multi_objective_aggregation must be 'sum_then_normalize' with the combined form "
                    f"(β·C is subtracted from the summed reward), got {self.multi_objective_aggregation!r}"
                )
            if cfg.shaping is None and self.scale_rewards not in _SHAPING_FROM_SCALE_REWARDS:
                raise ValueError(
                    f"KLGradTRLConfig.shaping must be set for GRPOConfig.scale_rewards={self.scale_rewards!r} "
                    "(TRL's batch std of raw rewards has no exact klgrad twin; e.g. 'reinforce_pp_baseline')"
                )

    def _klgrad_describe(self) -> str:
        """One line: what KL term trains, where it enters and what β is (``klgrad train`` prints such a line for a
        preset too)."""
        cfg, beta = self.klgrad_config, float(self.beta)
        preset = self.klgrad_preset
        if preset is None:
            where = f"aggregated like loss_type {self.loss_type!r}" if cfg.form == "decoupled" else "in the reward"
            return f"KL: {cfg.head}, level {cfg.level}, {cfg.form} ({where}), β = GRPOConfig.beta {beta:g}"
        line = f"KL: {preset.id} ({preset.variant}), {entry_text(preset)}; {beta_conversion(preset, self.loss_type)}"
        return line + (f"; not modelled: {preset.std_normalised}" if preset.std_normalised else "")

    @property
    def klgrad_shaping(self) -> str:
        """klgrad shaping method of the combined form (``KLGradTRLConfig.shaping`` or from ``scale_rewards``)."""
        if self.klgrad_config.shaping is not None:
            return self.klgrad_config.shaping
        return _SHAPING_FROM_SCALE_REWARDS[self.scale_rewards]

    # ------------------------------------------------------------------------------------------------------
    # hooks into TRL

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """TRL's forward; inside :meth:`_compute_loss` its log-probs (with gradient) are also kept for the KL."""
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self._klgrad_capture is not None:
            self._klgrad_capture.append(out[0])
        return out

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> Tensor:
        """TRL's rewards (N, n_funcs), all processes; kept for the combined form."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._klgrad_rewards_per_func = rewards_per_func
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        """TRL's rollout and scoring; in the combined form its advantages become shape(R - β·C), (B, T)."""
        with _quiet_trl_deprecations():
            output = super()._generate_and_score_completions(inputs)
        cfg, preset = self.klgrad_config, self.klgrad_preset
        if "ref_per_token_logps" not in output:  # β = 0: no reference, no KL
            return output
        if preset is not None and preset.batch_baseline:
            output["klgrad_kl_baseline"] = self._klgrad_preset_baseline(preset, output)  # 0-dim: never split
        elif preset is None and cfg.form == "combined" and cfg.kl_head.style != "none":
            output["advantages"] = self._klgrad_combined_advantages(output)
        return output

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
        """TRL's loss without its KL term, plus β · klgrad's KL loss (decoupled form), aggregated as TRL's."""
        with self._trl_kl_switched_off(), self._capture_policy_logps() as captured:
            loss = super()._compute_loss(model, inputs)
        if len(captured) != 1:
            raise RuntimeError(f"expected TRL's loss to run one policy forward, saw {len(captured)}")
        if "ref_per_token_logps" not in inputs:  # β = 0: no reference, no KL
            return loss
        logp = captured[0]  # (B, T) with gradient
        ref_logp = inputs["ref_per_token_logps"]  # (B, T)
        old_logp = inputs.get("old_per_token_logps")  # (B, T) or None (on-policy)
        mask = self._klgrad_mask(inputs)  # (B, T) bool
        cfg, preset = self.klgrad_config, self.klgrad_preset
        kl = None
        if preset is not None:
            term = preset_term(preset, inputs.get("klgrad_kl_baseline"))
            totals = term(logp, ref_logp, mask, old_logp)  # (B,)
            reduction = TRL_REDUCTION_OF[KL_AGGREGATION[preset.aggregation]]
            loss = loss + self.beta * self._aggregate_like_trl(totals, mask, inputs, reduction)
            kl = totals.detach().mean()
        elif cfg.form == "decoupled" and cfg.kl_head.style != "none":
            totals = kl_loss_per_sequence(
                cfg.kl_head,
                logp,
                ref_logp,
                mask,
                old_logp=old_logp,
                level=cfg.level,
                clip_eps=cfg.clip_eps,
                ratio_level=cfg.ratio_level,
                is_correction=cfg.is_correction,
            )  # (B,)
            loss = loss + self.beta * self._aggregate_like_trl(totals, mask, inputs)
            kl = totals.detach().mean()
        self._klgrad_log(logp, ref_logp, old_logp, mask, inputs["advantages"], kl)
        return loss

    # ------------------------------------------------------------------------------------------------------
    # helpers

    @contextlib.contextmanager
    def _trl_kl_switched_off(self) -> Iterator[None]:
        """TRL's ``_compute_loss`` adds its k3 term iff ``self.beta != 0``: read 0 there, β everywhere else."""
        beta, self.beta = self.beta, 0.0
        try:
            yield
        finally:
            self.beta = beta

    @contextlib.contextmanager
    def _capture_policy_logps(self) -> Iterator[list[Tensor]]:
        captured: list[Tensor] = []
        self._klgrad_capture = captured
        try:
            yield captured
        finally:
            self._klgrad_capture = None

    @staticmethod
    def _klgrad_mask(inputs: dict[str, Any]) -> Tensor:
        """TRL's loss mask: completion tokens (times ``tool_mask`` when present), (B, T) bool."""
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        return mask.bool()

    def _aggregate_like_trl(
        self, totals: Tensor, mask: Tensor, inputs: dict[str, Any], loss_type: str | None = None
    ) -> Tensor:
        """``totals`` (B,) reduced as TRL reduces its per-token loss for ``loss_type`` (default: the configured)."""
        train = self.model.training
        return aggregate_like_trl(
            totals,
            mask,
            loss_type or self.loss_type,
            num_items_in_batch=inputs["num_items_in_batch"],
            max_completion_length=self.max_completion_length,
            accumulation_steps=self.current_gradient_accumulation_steps if train else 1,
            steps_per_generation=self.args.steps_per_generation,
            num_processes=self.accelerator.num_processes,
            train=train,
        )

    @torch.no_grad()
    def _klgrad_generation_logps(self, output: dict[str, Any]) -> Tensor:
        """Policy log-probs of the completions at generation time, (B, T): TRL's old log-probs or a forward."""
        if output.get("old_per_token_logps") is not None:
            return output["old_per_token_logps"]
        completion_ids = output["completion_ids"]
        input_ids = torch.cat([output["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        train = self.model.training
        batch_size = self.args.per_device_train_batch_size if train else self.args.per_device_eval_batch_size
        checkpointing = self.args.gradient_checkpointing_kwargs
        with _quiet_trl_deprecations(), disable_gradient_checkpointing(self.model, checkpointing):
            logp, _, _ = super()._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, completion_ids.size(1), batch_size=batch_size
            )
        return logp

    @torch.no_grad()
    def _klgrad_preset_baseline(self, preset: FrameworkKL, output: dict[str, Any]) -> Tensor:
        """A batch-baseline preset's b: the penalty's token mean over the generation batch of every process, from
        the behaviour log-probs (:func:`klgrad.audit.framework_head.penalty_sums`), a 0-dim float64 tensor."""
        behaviour = self._klgrad_generation_logps(output)  # (B, T)
        total, tokens = penalty_sums(preset, behaviour, output["ref_per_token_logps"], self._klgrad_mask(output))
        sums = torch.tensor([total, tokens], dtype=torch.float64, device=behaviour.device)
        sums = self.accelerator.reduce(sums, reduction="sum")
        return sums[0] / sums[1].clamp(min=1.0)

    @torch.no_grad()
    def _klgrad_combined_advantages(self, output: dict[str, Any]) -> Tensor:
        """A = shape(R - β·C) for this process's completions, (B, T); statistics over all processes."""
        cfg = self.klgrad_config
        acc = self.accelerator
        train = self.model.training
        group_size = self.num_generations if train else self.num_generations_eval
        rewards_per_func = self._klgrad_rewards_per_func  # (N, n_funcs), all processes
        rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device)).nansum(dim=1)  # (N,)
        mask = self._klgrad_mask(output)  # (B, T)
        local = [self._klgrad_generation_logps(output), output["ref_per_token_logps"], mask.float()]
        logp, ref_logp, gmask = (acc.gather(acc.pad_across_processes(x, dim=1)) for x in local)  # (N, T_max)
        adv = combined_advantages(
            rewards.to(logp.dtype),
            cfg.kl_head,
            logp,
            ref_logp,
            gmask.bool(),
            beta=self.beta,
            level=cfg.level,
            group_size=group_size,
            method=self.klgrad_shaping,
            std_min=cfg.std_min,
            std_max=cfg.std_max,
        )  # (N, T_max)
        coef = level_coefficients(cfg.kl_head, logp, ref_logp, gmask.bool(), cfg.level)  # (N, T_max)
        first = gmask.argmax(-1, keepdim=True)  # (N, 1) first response token: C of the whole response there
        penalty = self.beta * coef.gather(-1, first).squeeze(-1)  # (N,)
        mode = "train" if train else "eval"
        self._metrics[mode]["kl/reward_penalty"].append(penalty.mean().item())
        b = mask.shape[0]
        rows = slice(acc.process_index * b, (acc.process_index + 1) * b)
        return adv[rows, : mask.shape[1]].contiguous()  # (B, T)

    @torch.no_grad()
    def _klgrad_log(
        self,
        logp: Tensor,
        ref_logp: Tensor,
        old_logp: Tensor | None,
        mask: Tensor,
        advantages: Tensor,
        kl: Tensor | None,
    ) -> None:
        """klgrad's KL diagnostics into TRL's ``_metrics`` (averaged over processes); ``kl``: the decoupled KL loss
        as :func:`klgrad.kl_loss` reports it (mean over sequences of the per-sequence loss, β not included)."""
        cfg = self.klgrad_config
        # KL only (TRL logs its own reward-head clip ratios); a preset clips by its own rule: no KL-clip share
        kl_record = self.klgrad_kl if self.klgrad_preset is None else dataclasses.replace(self.klgrad_kl, head="none")
        spec = ObjectiveSpec(kl=kl_record)
        adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logp)  # (B, T)
        diag = objective_diagnostics(logp, ref_logp, mask, adv, spec, old_logp=old_logp)
        names = {"kl_k1": "kl/k1", "kl_k2": "kl/k2", "kl_k3": "kl/k3"}
        names |= {"logp_gap": "kl/logp_gap", "logp_gap_abs": "kl/logp_gap_abs"}
        values = {names[k]: diag[k] for k in names}
        if kl is not None:
            values["loss/kl"] = float(kl.detach())
            if old_logp is not None and cfg.is_correction and self.klgrad_preset is None:
                values["clip/kl_frac"] = diag["kl_clip_frac"]
        stacked = torch.tensor(list(values.values()), dtype=torch.float64, device=logp.device)
        means = self.accelerator.gather(stacked[None]).mean(0).tolist()
        mode = "train" if self.model.training else "eval"
        for name, value in zip(values, means, strict=True):
            self._metrics[mode][name].append(value)


@contextlib.contextmanager
def _quiet_trl_deprecations() -> Iterator[None]:
    """TRL (1.10–1.16) reads ``model.is_gradient_checkpointing``, which transformers >= 5.23 deprecates with a
    FutureWarning on every generation step; the user can change nothing about it (``GRPOConfig`` has no say),
    so it is silenced inside TRL's calls, and only it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield
