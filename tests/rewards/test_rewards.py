"""Tests for klgrad.rewards: Math-Verify accuracy (a table of completions x answers, time and size bounds in
the main thread and in worker threads), format regexes, the reward registry and failure isolation.

Timing assertions use the bound the brief fixes: elapsed < 3 x the per-completion bound.
"""

from __future__ import annotations

import math
import re
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from klgrad.data import examples_to_columns, make_splits, sft_target
from klgrad.rewards import (
    BUILTIN_REWARDS,
    FORMAT_PATTERNS,
    RewardSpec,
    accuracy,
    compute_rewards,
    load_reward_fn,
    make_format_reward,
    math_verify_reward,
    regex_format_reward,
)

HANG = "2^2^2^2^2^2^2^2^2^2"  # parses to a power tower; sympy's comparison with 81 never finishes
PATHOLOGICAL = ["\\frac{" * 5000, "9" * 10**6, "\\boxed{" * 5000, "(" * 10**6, HANG, "\\boxed{9^{9^{9}}}"]


def in_thread(fn, *args, **kwargs):
    box = {}
    thread = threading.Thread(target=lambda: box.update(value=fn(*args, **kwargs)))
    thread.start()
    thread.join()
    return box["value"]


@pytest.fixture(scope="module", autouse=True)
def warm():
    """Pay the one-time costs (Math-Verify's first parse, starting the worker process) outside the timings."""
    math_verify_reward(["1"], ["1"])
    in_thread(math_verify_reward, ["1"], ["1"])


# ---------------------------------------------------------------------------------------------------------
# Accuracy
# ---------------------------------------------------------------------------------------------------------

ACCURACY_TABLE = [
    # (completion, gold answer, expected reward)
    ("81", "81", 1.0),
    ("80", "81", 0.0),
    ("81.0", "81", 1.0),
    ("81", "81.0", 1.0),
    ("\\boxed{81}", "81", 1.0),
    ("The answer is \\boxed{81}.", "81", 1.0),
    ("\\boxed{80} although 81 appears last", "81", 0.0),  # \boxed wins over the last number
    ("\\boxed{81}. The final answer is 80", "81", 1.0),  # ... and over a "final answer is" anchor
    ("I think 80, no wait, 81", "81", 1.0),  # otherwise the last number
    ("The answer is 81 apples.", "81", 1.0),
    ("7+5=12c1;4+8+1=13c1;=132", "132", 1.0),  # scratchpad: the number after the last '='
    ("7+5=12c1;4+8+1=13c1;=131", "132", 0.0),
    ("7+5=12c1;4+8+1=13c1", "132", 0.0),  # truncated scratchpad: last number is 13
    ("$\\frac{162}{2}$", "81", 1.0),
    ("-81", "81", 0.0),
    ("8 1", "81", 0.0),
    ("", "81", 0.0),
    ("   ", "81", 0.0),
    ("garbage ### ???", "81", 0.0),
    ("\\boxed{", "81", 0.0),  # malformed
    ("}}{{\\frac", "81", 0.0),
    ("x81", "81", 0.0),  # a number glued to a word is not extracted
    ("2.5", "2.5", 1.0),
    ("\\boxed{\\frac{5}{2}}", "2.5", 1.0),
    ("The answer is 0.5", "\\frac{1}{2}", 1.0),
    ("81", "", 0.0),  # empty gold: never a match
    # gold answers written bare, as MATH-500's are: read as the value written, not as one of their numbers
    ("The answer is $\\sqrt{2}$", "\\sqrt{2}", 1.0),  # bare, \sqrt{2} alone would parse to nothing
    ("2", "1, 2", 0.0),  # bare, 1, 2 alone would parse to its last number
    ("$1, 2$", "1, 2", 1.0),
    ("3", "\\left( 3, \\frac{\\pi}{2} \\right)", 0.0),  # ... and this one to its first
    ("\\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("$x^2 + 1$", "x^2+1", 1.0),
    ("The cost is $\\$18.90$", "\\$18.90", 1.0),  # an escaped dollar is not a delimiter
]


@pytest.mark.parametrize(("completion", "answer", "expected"), ACCURACY_TABLE)
def test_accuracy_table(completion, answer, expected):
    assert math_verify_reward([completion], [answer]) == [expected]


def test_accuracy_batch_and_worker_thread_agree_with_table():
    completions = [c for c, _, _ in ACCURACY_TABLE]
    answers = [a for _, a, _ in ACCURACY_TABLE]
    expected = [r for _, _, r in ACCURACY_TABLE]
    assert math_verify_reward(completions, answers) == expected
    assert in_thread(math_verify_reward, completions, answers) == expected  # the worker-process path


def test_accuracy_checks_each_distinct_pair_once_and_gives_every_copy_its_verdict(monkeypatch):
    """A batch with repeats (a group's identical samples, and the same text against another answer) scores as
    its items one by one, with one Math-Verify check per distinct (completion, answer) pair."""
    import klgrad.rewards.accuracy as accuracy

    table = [(c, a, r) for c, a, r in ACCURACY_TABLE if c.strip() and a.strip()]
    rows = [table[i % len(table)] for i in (0, 1, 0, 2, 1, 0, 3, 3)] + [(table[0][0], "not the answer", 0.0)]
    accuracy._warm_up()  # its own check of ("1", "1") happens once per process, before the count
    checked: list[tuple[str, str]] = []
    real = accuracy._score

    def counting(completion: str, answer: str) -> float:
        checked.append((completion, answer))
        return real(completion, answer)

    monkeypatch.setattr(accuracy, "_score", counting)
    out = math_verify_reward([c for c, _, _ in rows], [a for _, a, _ in rows])
    assert out == [r for _, _, r in rows]
    needs_check = {(c, a) for c, a, _ in rows if accuracy.plain_integer_verdict(c, a) is None}
    assert sorted(checked) == sorted(needs_check)  # each distinct pair once, none twice


def test_accuracy_bad_arguments():
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        math_verify_reward(["1", "2"], ["1"])
    with pytest.raises(ValueError, match="timeout_s"):
        math_verify_reward(["1"], ["1"], timeout_s=0)
    assert math_verify_reward([None, 81], ["81", "81"]) == [0.0, 0.0]  # non-strings score 0


def test_truncation_keeps_the_tail():
    long = "x " * 5000 + "so the answer is 81"
    assert math_verify_reward([long], ["81"], max_chars=100) == [1.0]
    assert math_verify_reward(["81" + " x" * 5000], ["81"], max_chars=100) == [0.0]


@pytest.mark.parametrize("where", ["main", "thread"])
@pytest.mark.parametrize("completion", PATHOLOGICAL, ids=lambda c: f"{c[:12]!r}x{len(c)}")
def test_pathological_completion_is_bounded(where, completion):
    bound = 0.5
    t0 = time.perf_counter()
    call = math_verify_reward if where == "main" else lambda *a, **k: in_thread(math_verify_reward, *a, **k)
    assert call([completion], ["81"], timeout_s=bound) == [0.0]
    assert time.perf_counter() - t0 < 3 * bound


def test_hang_is_really_cut_at_the_bound():
    # The power tower truly runs past the bound (so the test above is not vacuous) and is cut near it.
    t0 = time.perf_counter()
    assert math_verify_reward([HANG, "81"], ["81", "81"], timeout_s=0.3) == [0.0, 1.0]
    assert 0.3 <= time.perf_counter() - t0 < 0.9


def test_worker_killed_and_replaced_when_it_misses_its_deadline(monkeypatch, caplog):
    # Make the parent's deadline expire before the child's own alarm: the child is killed, the item gets 0.0
    # and a fresh child serves the next call.
    monkeypatch.setattr(accuracy, "_WORKER_GRACE_S", -0.4)
    t0 = time.perf_counter()
    assert in_thread(math_verify_reward, [HANG], ["81"], timeout_s=0.5) == [0.0]
    # HANG never finishes on its own, so returning at all means the child was killed; the bound only has to catch a
    # parent that waits on it. 0.1 s deadline + the child's restart (a fresh interpreter importing Math-Verify and
    # sympy: 1.9 s seen beside two training processes on a 2-core machine) fits many times over.
    assert time.perf_counter() - t0 < 30.0
    assert "worker process replaced" in caplog.text
    monkeypatch.setattr(accuracy, "_WORKER_GRACE_S", 0.5)
    assert in_thread(math_verify_reward, ["81", "80"], ["81", "81"]) == [1.0, 0.0]


def test_alarm_repeats_when_library_code_swallows_it(monkeypatch):
    def swallows_the_first_interrupt(completion, answer):
        try:
            while True:
                pass
        except BaseException:  # what a careless `except BaseException` deep in a library would do
            pass
        while True:
            pass

    monkeypatch.setattr(accuracy, "_score", swallows_the_first_interrupt)
    t0 = time.perf_counter()
    assert accuracy._score_under_alarm("x", "1", 0.2) == 0.0
    assert time.perf_counter() - t0 < 0.6


def test_alarm_path_leaves_no_timer_or_handler_behind():
    import signal

    handler = signal.getsignal(signal.SIGALRM)
    math_verify_reward([HANG], ["81"], timeout_s=0.2)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is handler
    time.sleep(0.15)  # a leftover repeating timer would raise here


# ---------------------------------------------------------------------------------------------------------
# Format
# ---------------------------------------------------------------------------------------------------------

FORMAT_TABLE = [
    ("addition", "81", 1.0),
    ("addition", " 81\n", 1.0),
    ("addition", "81.", 0.0),
    ("addition", "8 1", 0.0),
    ("addition", "", 0.0),
    ("addition", "-81", 0.0),
    ("scratchpad", "7+5=12c1;4+8+1=13c1;=132", 1.0),
    ("scratchpad", "7+2=9c0;=9", 1.0),
    ("scratchpad", "7+5=12c1;4+8+1=13c1", 0.0),  # no final answer
    ("scratchpad", "7+5=12c1;4+8+1=13c1;=132;", 0.0),
    ("scratchpad", "7+5=22c1;=2", 0.0),  # a column sum above 19 is not the format
    ("scratchpad", "132", 0.0),
    ("boxed", "so \\boxed{81}.", 1.0),
    ("boxed", "line one\n\\boxed{\n81\n}", 1.0),
    ("boxed", "\\boxed{81", 0.0),
    ("boxed", "81", 0.0),
    ("think_answer", "<think>\n7 + 5\n</think>\n<answer>\n12\n</answer>", 1.0),
    ("think_answer", "<think>a</think> <answer>b</answer>", 1.0),
    ("think_answer", "<think>a</think>", 0.0),
    ("think_answer", "<answer>b</answer>", 0.0),
    ("think_answer", "<think>a</think><answer>b</answer> trailing", 0.0),
]


@pytest.mark.parametrize(("name", "completion", "expected"), FORMAT_TABLE)
def test_format_table(name, completion, expected):
    assert regex_format_reward([completion], FORMAT_PATTERNS[name]) == [expected]
    assert make_format_reward(name)([""], [completion]) == [expected]


def test_format_search_mode_and_custom_pattern():
    assert regex_format_reward(["x 81 y", "x y"], r"\d+", full_match=False) == [1.0, 0.0]
    assert regex_format_reward(["x 81 y"], r"\d+") == [0.0]
    assert regex_format_reward(["ab", 3], re.compile("ab")) == [1.0, 0.0]


@pytest.mark.parametrize("name", sorted(FORMAT_PATTERNS))
def test_format_patterns_are_linear_time(name):
    worst = ["\\boxed{" * 150_000, "</think><answer>" * 60_000, "<think>" + "</think><answer>" * 60_000]
    t0 = time.perf_counter()
    assert regex_format_reward([*worst, "1+1=2c0;" * 100_000 + "x"], FORMAT_PATTERNS[name]) == [0.0] * 4
    assert time.perf_counter() - t0 < 1.0


# ---------------------------------------------------------------------------------------------------------
# Registry and isolation
# ---------------------------------------------------------------------------------------------------------


def const(value):
    def fn(prompts, completions, **columns):
        return [value] * len(completions)

    return fn


def raising(prompts, completions, **columns):
    raise RuntimeError("boom")


def slow(prompts, completions, **columns):
    time.sleep(1.0)
    return [1.0] * len(completions)


def short(prompts, completions, **columns):
    return [1.0] * (len(completions) - 1)


def with_nan(prompts, completions, **columns):
    return [1.0, math.nan, math.inf, "0.5"]


def no_opinion_on_odd(prompts, completions, **columns):
    return [None if i % 2 else 0.5 for i in range(len(completions))]


PROMPTS = ["p"] * 4
COMPLETIONS = ["81", "80", "81", "x"]
COLUMNS = {"answer": ["81"] * 4, "task": ["addition"] * 4}


@pytest.mark.parametrize(
    ("bad", "reason", "n_failed"),
    [
        (raising, "raised RuntimeError: boom", 4),
        (slow, "timed out after 0.2 s", 4),
        (short, "returned 3 values for 4 completions", 4),
        (const("1.0"), "sample 0: non-number str", 4),
        (lambda p, c, **k: "1111", "returned str", 4),
        (lambda p, c, **k: None, "returned NoneType", 4),
        (with_nan, "sample 1: non-finite nan", 3),  # samples 1 (nan), 2 (inf), 3 (str) fail; sample 0 is fine
    ],
)
def test_failures_are_isolated(bad, reason, n_failed):
    specs = [RewardSpec("good", const(1.0), 2.0), RewardSpec("bad", bad, 1.0)]
    t0 = time.perf_counter()
    result = compute_rewards(specs, PROMPTS, COMPLETIONS, COLUMNS, failure_value=-1.0, timeout_s=0.2)
    assert time.perf_counter() - t0 < 0.6
    assert result.per_function["good"] == [1.0] * 4
    assert result.failures == {"good": 0, "bad": n_failed}
    assert result.errors["good"] == []
    assert any(reason in message for message in result.errors["bad"]), result.errors
    bad_values = result.per_function["bad"]
    assert sum(v == -1.0 for v in bad_values) == n_failed
    assert result.total == [2.0 * 1.0 + 1.0 * v for v in bad_values]
    if bad is with_nan:
        assert bad_values == [1.0, -1.0, -1.0, -1.0]


def test_none_is_no_opinion():
    specs = [RewardSpec("half", no_opinion_on_odd, 2.0), RewardSpec("one", const(1.0), 1.0)]
    result = compute_rewards(specs, PROMPTS, COMPLETIONS, COLUMNS)
    assert result.per_function["half"] == [0.5, None, 0.5, None]
    assert result.total == [2.0, 1.0, 2.0, 1.0]  # 2 * 0.5 + 1, and 0 + 1 where no opinion
    assert result.failures == {"half": 0, "one": 0}
    assert result.means() == {"half": 0.5, "one": 1.0}


def test_functions_get_copies_and_columns():
    seen = {}

    def spy(prompts, completions, **columns):
        seen.update(columns, prompts=prompts)
        completions.clear()  # mutating its inputs must not affect the next function
        return [0.0] * 4

    result = compute_rewards(
        [RewardSpec("spy", spy), RewardSpec("accuracy", BUILTIN_REWARDS["accuracy"])],
        PROMPTS,
        COMPLETIONS,
        COLUMNS,
    )
    assert seen == {"prompts": PROMPTS, **COLUMNS}
    assert result.per_function["accuracy"] == [1.0, 0.0, 1.0, 0.0]


def test_builtin_rewards_end_to_end():
    train, _ = make_splits("scratchpad", 4, 1, seed=3)
    columns = examples_to_columns(train)
    completions = [sft_target("scratchpad", e) for e in train]
    completions[1] = completions[1].rsplit("=", 1)[0] + "=0"  # right format, wrong answer
    completions[2] = train[2].answer  # right answer, wrong format
    specs = [RewardSpec.load("accuracy"), RewardSpec.load("format", weight=0.1)]
    result = compute_rewards(specs, [e.prompt for e in train], completions, columns)
    assert result.per_function == {"accuracy": [1.0, 0.0, 1.0, 1.0], "format": [1.0, 1.0, 0.0, 1.0]}
    assert result.total == pytest.approx([1.1, 0.1, 1.0, 1.1], abs=1e-12)
    assert result.failures == {"accuracy": 0, "format": 0}


def test_builtins_without_their_column_fail_isolated():
    specs = [RewardSpec.load("format"), RewardSpec.load("accuracy")]
    result = compute_rewards(specs, PROMPTS, COMPLETIONS, {"answer": COLUMNS["answer"]})
    assert result.failures == {"format": 4, "accuracy": 0}
    assert "needs a 'task' column" in result.errors["format"][0]


def test_compute_rewards_rejects_caller_bugs():
    with pytest.raises(ValueError, match="unique"):
        compute_rewards([RewardSpec("a", const(1.0)), RewardSpec("a", const(1.0))], PROMPTS, COMPLETIONS, {})
    with pytest.raises(ValueError, match="column 'answer' has 1 values"):
        compute_rewards([RewardSpec("a", const(1.0))], PROMPTS, COMPLETIONS, {"answer": ["1"]})
    with pytest.raises(ValueError, match="weight must be finite"):
        RewardSpec("a", const(1.0), math.nan)


def test_load_reward_fn():
    assert load_reward_fn("accuracy") is BUILTIN_REWARDS["accuracy"]
    assert load_reward_fn("klgrad.rewards.registry:format_reward") is BUILTIN_REWARDS["format"]
    assert load_reward_fn("klgrad.rewards.registry:accuracy_reward") is BUILTIN_REWARDS["accuracy"]
    spec = RewardSpec.load("klgrad.rewards.registry:format_reward", weight=0.5)
    assert (spec.name, spec.fn, spec.weight) == (
        "klgrad.rewards.registry:format_reward",
        BUILTIN_REWARDS["format"],
        0.5,
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("accuracyy", "expected a built-in name"),
        ("no_colon.module", "expected a built-in name"),
        ("a:b:c", "expected a built-in name"),
        ("os:system; rm -rf /", "expected a built-in name"),
        ("klgrad.no_such_module:fn", "cannot import 'klgrad.no_such_module'"),
        ("klgrad.rewards.registry:no_such_fn", "has no attribute 'no_such_fn'"),
        ("klgrad.rewards.format:FORMAT_PATTERNS", "dict object is not callable"),
        ("klgrad.rewards.format:make_format_reward", "must accept \\(prompts, completions, \\*\\*columns\\)"),
    ],
)
def test_load_reward_fn_errors_name_the_spec(spec, message):
    with pytest.raises(ValueError, match=re.escape(repr(spec)) + ".*" + message):
        load_reward_fn(spec)


@given(
    c=st.from_regex(r"\A[ ]?0{0,2}[0-9]{1,28}[ \n]?\Z"),
    a=st.from_regex(r"\A0{0,2}[0-9]{1,28}\Z"),
)
@settings(max_examples=150, deadline=None)
def test_plain_integer_fast_path_agrees_with_math_verify(c, a):
    """The fast path must give exactly Math-Verify's verdict wherever it answers (leading zeros, signs)."""
    from klgrad.rewards.accuracy import _score, plain_integer_verdict

    fast = plain_integer_verdict(c, a)
    assert fast is not None
    assert fast == _score(c, a)


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        ("81.0", "81"),
        ("80+1", "81"),
        ("+81", "81"),
        ("-7", "-7"),
        ("\\boxed{81}", "81"),
        ("81", "\\frac{162}{2}"),
        ("x=81", "81"),
        ("", "1"),
    ],
)
def test_plain_integer_fast_path_declines_anything_else(completion, answer):
    from klgrad.rewards.accuracy import plain_integer_verdict

    assert plain_integer_verdict(completion, answer) is None


def test_merging_the_results_of_row_blocks_equals_scoring_all_rows_at_once():
    """merge_rewards joins the results of consecutive row blocks (ranks) into the result of all rows: totals,
    per-function values, failure counts and error messages in row order. A function that raises fails the
    call it was given (all of that block's rows), so its failures are counted per block and add up."""
    from klgrad.rewards import RewardSpec, merge_rewards

    def length(prompts, completions, **kw):
        if any("x" in c for c in completions):
            raise ValueError("x seen")
        return [float(len(c)) for c in completions]

    specs = [RewardSpec.load("accuracy", 1.0), RewardSpec("length", length, 0.5)]
    examples = make_splits("addition", 20, 2, 0, 2)[0][:6]
    prompts = [e.prompt for e in examples]

    def score(completions: list[str], rows: slice):
        return compute_rewards(
            specs, prompts[rows], completions[rows], examples_to_columns(examples[rows]), failure_value=-1.0
        )

    completions = [sft_target("addition", e) for e in examples]
    completions[1] = "wrong"
    whole = score(completions, slice(0, 6))
    merged = merge_rewards([score(completions, slice(i, i + 2)) for i in range(0, 6, 2)])
    assert merged.total == whole.total
    assert merged.per_function == whole.per_function
    assert merged.failures == whole.failures == {"accuracy": 0, "length": 0}
    assert 0 < sum(whole.per_function["accuracy"]) < 6  # rows differ: an out-of-order merge would show

    completions[4] = "x"  # the length function now raises in the third block only
    blocks = [score(completions, slice(i, i + 2)) for i in range(0, 6, 2)]
    merged = merge_rewards(blocks)
    assert merged.failures == {"accuracy": 0, "length": 2}
    assert len(merged.errors["length"]) == 1
    assert merged.per_function["length"][:4] == whole.per_function["length"][:4]  # the other blocks' values
    assert merged.per_function["length"][4:] == [-1.0, -1.0]
    assert merge_rewards(blocks[:1]) is blocks[0]
