"""klgrad.trainer.stages: ``train.stop_when`` as a stage (when it checks, what it appends, whose decision counts),
and the no-op stages a config that leaves a pass out gets."""

from __future__ import annotations

from dataclasses import dataclass, field

from klgrad.stopping import parse_stop_rule
from klgrad.trainer.stages import NEVER, Stages, StopWhen, current_policy, skip, stop_history


@dataclass
class FakeDist:
    """A rank of a run: ``is_main`` and the decision rank 0 broadcasts (``shared``), every exchange counted."""

    is_main: bool = True
    shared: bool | None = None
    exchanged: list = field(default_factory=list)

    def gather_objects(self, obj):
        self.exchanged.append(obj)
        return [obj if self.shared is None else self.shared]


def test_a_batch_metric_is_checked_before_the_evaluation_and_the_decision_is_shared():
    dist = FakeDist()
    stop = StopWhen(parse_stop_rule("kl/k1 > 1 for 2"), dist)
    assert not stop.before_evaluation({"kl/k1": 2.0}, 1)  # held once: not yet 2 times
    assert not stop.after_evaluation({"kl/k1": 2.0}, 1, False)
    assert stop.before_evaluation({"kl/k1": 3.0}, 2)  # held in the last 2 records
    assert stop.after_evaluation({"kl/k1": 3.0}, 2, True)
    assert stop.history == [{"step": 1, "kl/k1": 2.0}, {"step": 2, "kl/k1": 3.0}]  # appended once per step
    assert dist.exchanged == [False, True]  # one exchange a step, after the evaluation
    assert not stop.before_evaluation({"reward/mean": 0.5}, 3)  # a record without the metric: nothing appended
    assert len(stop.history) == 2


def test_an_eval_metric_is_checked_after_the_evaluation_only():
    stop = StopWhen(parse_stop_rule("eval/greedy_accuracy >= 0.5"), FakeDist())
    assert not stop.before_evaluation({"eval/greedy_accuracy": 0.9}, 2)  # not read before the evaluation
    assert stop.history == []
    assert stop.after_evaluation({"eval/greedy_accuracy": 0.9}, 2, False)
    assert stop.history == [{"step": 2, "eval/greedy_accuracy": 0.9}]


def test_other_ranks_take_rank_zeros_decision_and_keep_no_history():
    dist = FakeDist(is_main=False, shared=True)
    stop = StopWhen(parse_stop_rule("kl/k1 > 1"), dist)
    assert not stop.before_evaluation({"kl/k1": 5.0}, 1)  # not rank 0: no check of its own
    assert stop.after_evaluation({"kl/k1": 5.0}, 1, False)  # rank 0 said stop
    assert stop.history == []


def test_a_resumed_rule_continues_from_the_records_logging_its_metric():
    rule = parse_stop_rule("kl/k1 > 1 for 2")
    records = [{"step": 0, "eval/J": 0.1}, {"step": 1, "kl/k1": 2.0}, {"step": 2, "reward/mean": 0.3}]
    stop = StopWhen(rule, FakeDist(), stop_history(records, rule))
    assert stop.history == [{"step": 1, "kl/k1": 2.0}]
    assert stop.before_evaluation({"kl/k1": 1.5}, 3)  # with step 1's record: twice in a row


def test_left_out_passes_do_nothing_and_never_stopping_exchanges_nothing():
    assert skip(object(), object(), 3) is None
    with current_policy():
        pass
    assert not NEVER.before_evaluation({"kl/k1": 1e9}, 1)
    assert NEVER.after_evaluation({"kl/k1": 1e9}, 1, False) is False
    assert NEVER.after_evaluation({}, 1, True) is True  # a stop decided elsewhere passes through
    stages = Stages()  # every pass left out
    assert (stages.behaviour_logprobs, stages.stepwise_kl, stages.mismatch_weights) == (skip, skip, skip)
    assert (stages.adapt_beta, stages.reset_reference, stages.stop) == (skip, skip, NEVER)
    assert not stages.keeps_old_logp
    assert not stages.keeps_trainer_logp
