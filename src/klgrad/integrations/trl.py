r"""klgrad's KL heads inside TRL's ``GRPOTrainer`` (TRL >= 1.16).

:class:`KLGradGRPOTrainer` is a ``GRPOTrainer`` whose KL term is any klgrad head (:data:`klgrad.KL_HEADS` or a
:func:`klgrad.custom_kl_head`), at any level (``sequence`` | ``token_to_go`` | ``token``), in either form
(docs/math.md, sections “Where a head acts: level”, “How a head joins the reward: form” and “Off-policy:
importance sampling and the clip side”). Everything else (generation, rewards, TRL's clipped policy loss and its
``loss_type`` aggregation, logging) stays TRL's own code: the subclass overrides four hooks and calls
``super()`` in each.

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
``loss/kl`` (the KL loss as :func:`klgrad.kl_loss` gives it: mean over sequences, tokens summed, no β) and,
off-policy, ``clip/kl_frac`` (share of tokens whose KL gradient the clip removed); combined:
``kl/reward_penalty`` (mean β·C subtracted from R).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

try:
    from trl import GRPOTrainer
    from trl.models.utils import disable_gradient_checkpointing
except ImportError as err:  # pragma: no cover - exercised by a test that hides trl
    raise ImportError(
        "klgrad.integrations.trl needs TRL (>= 1.16), which is not installed: pip install 'klgrad[trl]'"
    ) from err

from klgrad.choices import ShapingMethod
from klgrad.config import KLConfig, KLHeadOptions
from klgrad.config.sections import Positive, record
from klgrad.kl import KLHead, get_kl_head, kl_loss_per_sequence, level_coefficients
from klgrad.objective import ObjectiveSpec, combined_advantages, objective_diagnostics

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

    A pydantic dataclass: a bad value raises a ``ValueError`` (pydantic's ``ValidationError``) naming the field,
    and TRL's own ``TrlParser`` reads it beside ``GRPOConfig`` (``head`` is typed ``str``; a head object of yours:
    :func:`klgrad.register_kl_head` it and pass its name)."""

    shaping: ShapingMethod | None = None
    """Combined form: klgrad shaping method of R - β·C; None derives it from TRL's scale_rewards."""
    std_min: Positive | None = None
    """Combined form: lower clip of the shaping's normalising stds (klgrad's algo.std_min; None: no clip)."""
    std_max: Positive | None = None
    """Combined form: upper clip of the shaping's normalising stds (klgrad's algo.std_max; None: no clip)."""

    @property
    def kl_head(self) -> KLHead:
        return get_kl_head(self.head)

    def kl_options(self, beta: float) -> KLConfig:
        """The run-config ``kl`` record of these options at TRL's ``beta``."""
        head = {f.name: getattr(self, f.name) for f in dataclasses.fields(KLHeadOptions)}
        return KLConfig(**head, beta=beta)


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
        super().__init__(*args, **kwargs)
        self._klgrad_check_trl_settings()
        self.klgrad_kl = self.klgrad_config.kl_options(float(self.beta))  # the KL record at TRL's β, made once

    # ------------------------------------------------------------------------------------------------------
    # settings

    def _klgrad_check_trl_settings(self) -> None:
        cfg = self.klgrad_config
        if self.loss_type not in TRL_LOSS_TYPES:
            raise ValueError(f"GRPOConfig.loss_type {self.loss_type!r} is not supported; use one of {TRL_LOSS_TYPES}")
        if self.beta == 0.0 and cfg.kl_head.style != "none":
            warnings.warn(
                f"GRPOConfig.beta is 0: TRL builds no reference model, so the klgrad head {cfg.kl_head.name!r} is "
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
        output = super()._generate_and_score_completions(inputs)
        cfg = self.klgrad_config
        if cfg.form == "combined" and cfg.kl_head.style != "none" and "ref_per_token_logps" in output:
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
        cfg = self.klgrad_config
        kl = None
        if cfg.form == "decoupled" and cfg.kl_head.style != "none":
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

    def _aggregate_like_trl(self, totals: Tensor, mask: Tensor, inputs: dict[str, Any]) -> Tensor:
        train = self.model.training
        return aggregate_like_trl(
            totals,
            mask,
            self.loss_type,
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
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logp, _, _ = super()._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, completion_ids.size(1), batch_size=batch_size
            )
        return logp

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
        spec = ObjectiveSpec(kl=self.klgrad_kl)  # KL only: TRL logs its own reward-head clip ratios
        adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(logp)  # (B, T)
        diag = objective_diagnostics(logp, ref_logp, mask, adv, spec, old_logp=old_logp)
        names = {"kl_k1": "kl/k1", "kl_k2": "kl/k2", "kl_k3": "kl/k3"}
        names |= {"logp_gap": "kl/logp_gap", "logp_gap_abs": "kl/logp_gap_abs"}
        values = {names[k]: diag[k] for k in names}
        if kl is not None:
            values["loss/kl"] = float(kl.detach())
            if old_logp is not None and cfg.is_correction:
                values["clip/kl_frac"] = diag["kl_clip_frac"]
        stacked = torch.tensor(list(values.values()), dtype=torch.float64, device=logp.device)
        means = self.accelerator.gather(stacked[None]).mean(0).tolist()
        mode = "train" if self.model.training else "eval"
        for name, value in zip(values, means, strict=True):
            self._metrics[mode][name].append(value)
