r"""Training with a framework's KL: ``kl.head: <preset id>`` trains the term of a :class:`FrameworkKL` record, the
very record ``klgrad audit --framework`` differentiates (:mod:`klgrad.audit.presets`), not a copy of it.

The term of a step is the record's own per-response loss :meth:`FrameworkKL.loss` at ``token_sum`` (Σ_t per
response), on the trainer's log-probs: l (carries gradient), r (reference; the behaviour log-probs for a preset
whose reference is π_old) and o (behaviour: the rollout policy's log-probs, l̄ on-policy). So it keeps the preset's
per-token rule, clamps, ratio handling and entry point:

- ``style="loss"``: Σ_t token_kl(l, r, o) per response;
- ``style="reward"``: the KL penalty k(o, r) computed once from the behaviour log-probs (no gradient), turned into
  its return (``sequence``, ``to_go`` with λ, ``token``), then the record's PPO-clipped policy term with advantage
  −β·return (the record's ratio, token or sequence, and clip ε, or none). It is a term of its own beside the
  task reward's shaped advantage: the framework's reward entry when the shaping passes the return through
  linearly and unnormalised (``algo.shaping: none``; klgrad's ``combined`` form would normalise the KL with the
  task reward, which the record does not model). Its clip acts on the KL part alone, which off-policy differs
  from a clip of the summed advantage; on-policy (one update per rollout) the gradients agree.

Config load makes the preset an ordinary KL term (:func:`resolve_head`, the resolver the package registers in
:data:`klgrad.choices.HEAD_RESOLVERS`): ``kl.head`` becomes the preset's :class:`~klgrad.objective.KLTermHead`
(:func:`preset_head`), whose note says what it set and overrode. The per-response totals are reduced by the preset's
aggregation (:data:`KL_AGGREGATION`), written into the run's ``kl.aggregation``; ``kl.level`` and ``kl.form`` are
set to the preset's (:func:`preset_settings`), so the recorded config shows what trained. ``kl.beta`` is the
preset's KL weight; ``kl.clip_eps``, ``kl.ratio_level`` and ``kl.is_correction`` do not apply (the record has its
own ratio and clip).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools

import torch
from torch import Tensor

from klgrad.audit.framework_kl import FrameworkKL
from klgrad.audit.presets import PRESETS
from klgrad.choices import Aggregation, Level, is_preset_id
from klgrad.config import ConfigError, KLConfig
from klgrad.kl.numerics import at_least_f32
from klgrad.objective import KLTerm, KLTermHead

PRESETS_BY_ID: dict[str, FrameworkKL] = {p.id: p for p in PRESETS}
"""Every preset of ``klgrad audit --framework``, by id."""

LEVEL_OF_RETURNS: dict[str, Level] = {"sequence": "sequence", "to_go": "token_to_go", "token": "token"}
"""The klgrad level that names a reward preset's return (a loss preset's rule is per token: ``token``)."""

KL_AGGREGATION: dict[str, Aggregation] = {
    "token_sum": "seq_mean_token_sum",
    "token_mean": "token_mean",
    "constant": "seq_mean_token_sum",
    "seq_mean": "seq_mean_token_mean",
}
"""klgrad's aggregation of a preset's aggregation (:data:`klgrad.audit.framework_kl.AGGREGATIONS`): a token sum
is Σ_t then a mean over responses (the sum at β/B), the batch token mean and the per-sequence token mean are
klgrad's own; ``constant`` (Σ_t / L_max, no preset uses it) trains as the token sum, β absorbing 1/L_max."""


def find_preset(head: str) -> FrameworkKL:
    """The preset with id ``head``; a ValueError with the close matches (or the framework's ids) when there is
    none."""
    if head in PRESETS_BY_ID:
        return PRESETS_BY_ID[head]
    ids = list(PRESETS_BY_ID)
    near = difflib.get_close_matches(head, ids, n=5, cutoff=0.6)
    same = [i for i in ids if i.split("/", 1)[0] == head.split("/", 1)[0]]
    hint = f"; did you mean {near}?" if near else f"; {head.split('/', 1)[0]}'s presets: {same}" if same else ""
    raise ValueError(
        f"{head!r} is not a framework preset id{hint} (every id: `klgrad audit --framework all`, docs/frameworks.md)"
    )


def preset_level(preset: FrameworkKL) -> Level:
    """``token`` for a loss preset (a per-token rule); a reward preset's return as a level
    (:data:`LEVEL_OF_RETURNS`)."""
    return "token" if preset.style == "loss" else LEVEL_OF_RETURNS[preset.returns]


def preset_settings(preset: FrameworkKL) -> dict[str, str]:
    """The ``kl`` fields a preset sets: ``level`` (:func:`preset_level`), ``form`` (``decoupled``: a term of its
    own, never shaped with the task reward) and ``aggregation`` (:data:`KL_AGGREGATION`)."""
    return {"level": preset_level(preset), "form": "decoupled", "aggregation": KL_AGGREGATION[preset.aggregation]}


def entry_text(preset: FrameworkKL) -> str:
    """Where the preset's KL enters, in words (the printed line)."""
    if preset.style == "loss":
        return "in the loss"
    clip = f"PPO clip ε = {preset.clip}" if preset.clip is not None else "no clip"
    ret = {"sequence": "the response's summed KL", "to_go": f"reward-to-go (λ = {preset.lam})", "token": "per token"}
    base = ", minus the batch's token mean" if preset.batch_baseline else ""
    return f"in the reward: {ret[preset.returns]}{base}, {preset.ratio} ratio, {clip}, unshaped"


def resolve_head(kl: KLConfig) -> KLConfig:
    """``kl`` with the preset's KL term as its head (:func:`preset_head`) and the preset's settings
    (:func:`preset_settings`) when ``kl.head`` is a preset id; any other record unchanged (so idempotent). The term's
    note says what the preset sets and which configured values it overrode. Raises :class:`ConfigError` naming
    ``kl.head`` (with close matches) for an unknown id."""
    if not is_preset_id(kl.head):
        return kl
    try:
        preset = find_preset(kl.head)
    except ValueError as e:
        raise ConfigError(f"kl.head: {e}") from None
    settings = preset_settings(preset)
    shown = lambda v: "null" if v is None else v  # noqa: E731 (as config.yaml writes it)
    overridden = [f"kl.{k} {shown(getattr(kl, k))}" for k, v in settings.items() if getattr(kl, k) != v]
    sets = ", ".join(f"kl.{k} {v}" for k, v in settings.items())
    note = (
        f"kl.head {preset.id} ({preset.variant}): KL {entry_text(preset)}, β = kl.beta {kl.beta}; sets {sets}"
        + (f" (overriding {', '.join(overridden)})" if overridden else "")
        + "; kl.clip_eps, kl.ratio_level and kl.is_correction do not apply"
        + (f"; not modelled: {preset.std_normalised}" if preset.std_normalised else "")
    )
    return dataclasses.replace(kl, head=preset_head(preset, note), **settings)


def preset_head(preset: FrameworkKL, note: str = "") -> KLTermHead:
    """The preset as a :class:`~klgrad.objective.KLTermHead` named by its id: its term (:func:`preset_term`), and for a
    ``batch_baseline`` preset the sums its baseline is taken from (:func:`penalty_sums`)."""
    sums = functools.partial(penalty_sums, preset) if preset.batch_baseline else None
    return KLTermHead(preset.id, functools.partial(preset_term, preset), sums, note)


def preset_term(preset: FrameworkKL, baseline: Tensor | float | None = None) -> KLTerm:
    """The :data:`klgrad.objective.KLTerm` of ``preset``: ``term(logp, ref_logp, mask, old_logp) -> (B,)``, the
    record's :meth:`FrameworkKL.loss` at ``token_sum`` on (l, r, o), shapes (B, T), in float32 or wider, padding
    set to 0 (never read, never NaN in the gradient). o = ``old_logp`` or, on-policy, l̄; r = o for a preset whose
    reference is π_old. ``baseline``: a ``batch_baseline`` preset's b (:func:`penalty_sums`), required for one."""
    if preset.batch_baseline and baseline is None:
        raise ValueError(f"{preset.id}: a batch-baseline preset needs the batch's baseline (penalty_sums)")

    def term(logp: Tensor, ref_logp: Tensor, mask: Tensor, old_logp: Tensor | None) -> Tensor:
        mask = mask.bool()
        l = torch.where(mask, at_least_f32(logp), 0.0)  # (B, T)
        o = l.detach() if old_logp is None else torch.where(mask, at_least_f32(old_logp.detach()), 0.0)  # (B, T)
        r = o if preset.reference_is_behaviour else torch.where(mask, at_least_f32(ref_logp.detach()), 0.0)
        return preset.loss(r, mask, "token_sum", baseline=baseline)(l, o)  # (B,)

    return term


def penalty_sums(preset: FrameworkKL, behaviour: Tensor, ref_logp: Tensor, mask: Tensor) -> tuple[float, float]:
    """(Σ_i Σ_t m_it k_it, Σ_i |y_i|) of the preset's per-token penalty k(o, r) (:meth:`FrameworkKL.penalty`) over
    rows (B, T): summed over every row of a step (all ranks), their ratio is a ``batch_baseline`` preset's b, the
    batch's token mean as the framework takes it (the audit takes its expectation)."""
    mask = mask.bool()
    o = torch.where(mask, at_least_f32(behaviour.detach()), 0.0)  # (B, T)
    r = o if preset.reference_is_behaviour else torch.where(mask, at_least_f32(ref_logp.detach()), 0.0)
    return float(preset.penalty(o, r, mask).sum()), float(mask.sum())
