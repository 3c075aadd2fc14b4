"""The step's optional passes, each one named stage chosen once, at setup (:func:`klgrad.trainer.loop.choose_stages`).

A stage that a config switches off is the no-op :func:`skip` (or :data:`NEVER` for ``train.stop_when``), so a step
runs the same list of stages whatever the config, and no helper tests an option. The stages: the behaviour policy
(``rollout.staleness``), its log-probs (off-policy or a sampler mismatch), the stepwise KL
(``train.log_stepwise_kl``), the mismatch weights (``rollout.mismatch_correction``), adaptive β (``kl.target_kl``),
the reference reset (``kl.reset_ref_every``) and ``train.stop_when``; the fault hooks are the run's
:class:`~klgrad.trainer.faults.Hooks`, chosen the same way (no-ops unless a test installs some).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from klgrad.distributed import Dist
from klgrad.stopping import StopRule, stop_point


def skip(*args: Any) -> None:
    """A stage the config leaves out: nothing done, nothing returned."""
    return None


def current_policy() -> contextlib.AbstractContextManager[None]:
    """The behaviour policy is the current one (``rollout.staleness`` 0): nothing to swap in."""
    return contextlib.nullcontext()


@dataclass
class StopWhen:
    """``train.stop_when``'s stage: its rule and the logged values of its metric (``history``, rank 0's; a resumed
    run's records first). A batch metric is checked before the step's evaluation (so a stop evaluates), an ``eval/``
    one after it; rank 0 decides, and its decision goes to every rank."""

    rule: StopRule
    dist: Dist
    history: list[dict] = field(default_factory=list)

    def due(self, record: dict, step: int) -> bool:
        """Append ``record``'s value of the metric (when it logs it) and say whether the rule first holds at
        ``step`` (:func:`klgrad.stopping.stop_point`)."""
        if self.rule.metric not in record:
            return False
        self.history.append({"step": step, self.rule.metric: record[self.rule.metric]})
        hit = stop_point(self.history, self.rule)
        return hit is not None and hit["step"] == step

    def before_evaluation(self, record: dict, step: int) -> bool:
        return self.dist.is_main and not self.rule.metric.startswith("eval/") and self.due(record, step)

    def after_evaluation(self, record: dict, step: int, stop: bool) -> bool:
        if self.dist.is_main and self.rule.metric.startswith("eval/"):
            stop = self.due(record, step)
        return bool(self.dist.gather_objects(stop)[0])  # rank 0's decision, on every rank


class NeverStop:
    """No ``train.stop_when``: never stops, and no rank waits for another's decision."""

    def before_evaluation(self, record: dict, step: int) -> bool:
        return False

    def after_evaluation(self, record: dict, step: int, stop: bool) -> bool:
        return stop


NEVER = NeverStop()


def stop_history(records: list[dict], rule: StopRule) -> list[dict]:
    """The records a resumed run's ``train.stop_when`` continues from: step and metric of those logging it."""
    return [{"step": r["step"], rule.metric: r[rule.metric]} for r in records if rule.metric in r]


@dataclass(frozen=True)
class Stages:
    """The optional passes of a run, in the order a step meets them; each a function the config chose at setup."""

    behaviour_policy: Callable[[], contextlib.AbstractContextManager[None]] = current_policy
    """For the rollout and its passes: π_{t−k} in the policy's place (``rollout.staleness`` k > 0)."""
    behaviour_logprobs: Callable = skip
    """``(run, rollout, L) -> (n, T)``: the trainer's forward of the policy that drew the rollout, when the update is
    off-policy (its ``old_logp``) or the sampler's log-probs are corrected or measured (its ``trainer_logp``)."""
    stepwise_kl: Callable = skip
    """``(run, rollout, L) -> (n,)``: each response's stepwise sequence KL (``train.log_stepwise_kl``)."""
    mismatch_weights: Callable = skip
    """``(run, rollout, trainer_logp) -> (n, T)``: IS weights of the sampler's mismatch
    (``rollout.mismatch_correction``)."""
    adapt_beta: Callable = skip
    """``(run, record)``: the β in force moved by the step's KL (``kl.target_kl``)."""
    reset_reference: Callable = skip
    """``(run, step)``: π_ref := π when the step is due (``kl.reset_ref_every``)."""
    stop: StopWhen | NeverStop = NEVER
    """``train.stop_when``."""
    keeps_old_logp: bool = False
    """The update is off-policy: the behaviour log-probs are its ``old_logp``."""
    keeps_trainer_logp: bool = False
    """The sampler's mismatch is corrected or measured: the behaviour log-probs are the record's ``trainer_logp``."""
