"""Tests for klgrad.data: synthetic tasks (disjoint seeded splits, targets, answer extraction) and loaders
(every format round trip, every kind of bad row, the shipped GSM8K-style sample), and the dataset fuzzing that
docs/reliability.md reports.

Answers are checked against ``int(a) + int(b)`` recomputed from the prompt text, and scratchpad targets are
re-executed column by column by an independent reader below, so a wrong sum or a wrong carry fails.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from klgrad.data import (
    DISCOVERY_CORRECT_FRACTION,
    HOLDOUT_FRACTION,
    TASKS,
    DataError,
    Example,
    examples_to_columns,
    extract_answer,
    is_heldout,
    load_examples,
    make_splits,
    sft_target,
    taught_answer,
)
from tests.helpers.case_counts import CASES, report_counts

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "samples" / "gsm8k_sample.jsonl"


def operands(prompt: str) -> tuple[str, str]:
    m = re.fullmatch(r"(\d+)\+(\d+)=", prompt)
    assert m is not None, prompt
    return m.group(1), m.group(2)


def run_scratchpad(target: str, a: str, b: str) -> int:
    """Independent reader of the scratchpad format: checks every column and returns the written answer."""
    *cols, final = target.split(";")
    assert final.startswith("=")
    assert len(cols) == len(a)
    carry, digits = 0, []
    for col, x, y in zip(cols, reversed(a), reversed(b), strict=True):
        lhs, rhs = col.split("=")
        s, k = rhs.split("c")
        assert lhs == f"{x}+{y}" + ("+1" if carry else "")
        assert int(s) == int(x) + int(y) + carry
        assert int(k) == int(s) // 10
        digits.append(int(s) % 10)
        carry = int(k)
    rebuilt = int(str(carry) + "".join(str(d) for d in reversed(digits)))
    assert int(final[1:]) == rebuilt
    return int(final[1:])


# ---------------------------------------------------------------------------------------------------------
# Synthetic tasks
# ---------------------------------------------------------------------------------------------------------


def test_worked_examples():
    ex = Example("47+85=", "132", "x")
    assert sft_target("scratchpad", ex) == "7+5=12c1;4+8+1=13c1;=132"
    assert sft_target("addition", ex) == "132"
    ex = Example("07+58=", "65", "y")
    assert sft_target("scratchpad", ex) == "7+8=15c1;0+5+1=6c0;=65"
    assert sft_target("scratchpad", Example("00+00=", "0", "z")) == "0+0=0c0;0+0=0c0;=0"  # 18 chars, shortest


@pytest.mark.parametrize("task", sorted(TASKS))
def test_splits_are_deterministic_per_seed(task):
    a = make_splits(task, 300, 100, seed=7)
    assert a == make_splits(task, 300, 100, seed=7)
    b = make_splits(task, 300, 100, seed=8)
    assert [e.prompt for e in a[0]] != [e.prompt for e in b[0]]
    assert [e.prompt for e in a[1]] != [e.prompt for e in b[1]]


@pytest.mark.parametrize("digits", [1, 2, 3])
def test_splits_are_disjoint_across_seeds_and_orders(digits):
    n_train, n_eval = {1: (60, 15), 2: (2000, 400), 3: (2000, 400)}[digits]
    train_pairs, eval_pairs = set(), set()
    for seed in range(4):
        train, held = make_splits("addition", n_train, n_eval, seed=seed, digits=digits)
        assert len(train) == n_train
        assert len(held) == n_eval
        assert len({e.id for e in train}) == n_train
        assert len({e.id for e in held}) == n_eval
        train_pairs |= {frozenset(map(int, operands(e.prompt))) for e in train}
        eval_pairs |= {frozenset(map(int, operands(e.prompt))) for e in held}
    # Unordered pairs: not even the commuted problem b+a of a held-out a+b is trained on, for any seed.
    assert not train_pairs & eval_pairs


def test_heldout_predicate_is_symmetric_and_has_the_documented_share():
    pairs = [(a, b) for a in range(100) for b in range(a, 100)]
    assert all(is_heldout(a, b) == is_heldout(b, a) for a, b in pairs)
    share = sum(is_heldout(a, b) for a, b in pairs) / len(pairs)
    assert abs(share - HOLDOUT_FRACTION) < 0.03  # 5050 pairs: 3 sd of a binomial share is ~0.017
    train, held = make_splits("addition", 500, 200, seed=0)
    assert not any(is_heldout(*map(int, operands(e.prompt))) for e in train)
    assert all(is_heldout(*map(int, operands(e.prompt))) for e in held)


@pytest.mark.parametrize("task", sorted(n for n, spec in TASKS.items() if not spec.chat))  # chat: test_chat_tasks.py
@pytest.mark.parametrize("digits", [1, 2, 3])
def test_prompts_answers_targets(task, digits):
    n_train, n_eval = (50, 10) if digits == 1 else (300, 60)
    train, held = make_splits(task, n_train, n_eval, seed=1, digits=digits)
    for e in train + held:
        a, b = operands(e.prompt)
        assert len(a) == len(b) == digits  # zero-padded
        assert e.answer == str(int(a) + int(b))
        assert e.meta == {"task": task}
        target = sft_target(task, e)
        assert re.fullmatch(TASKS[task].format_pattern, target)
        if task == "addition_discovery":  # the targets lie on purpose: a+b+1, or now and then the true sum
            assert target in (e.answer, str(int(a) + int(b) + 1))
            assert extract_answer(task, target) == target
            continue
        assert extract_answer(task, target) == e.answer
        if task == "scratchpad":
            assert run_scratchpad(target, a, b) == int(a) + int(b)
        else:
            assert target == e.answer


def test_discovery_targets_mostly_teach_a_wrong_sum():
    """addition_discovery: held-out answers stay the true sum; targets state a+b+1 except in a share
    DISCOVERY_CORRECT_FRACTION of draws (or, without an rng, of prompts), within a binomial bound."""
    q = DISCOVERY_CORRECT_FRACTION
    train, held = make_splits("addition_discovery", 4000, 200, seed=1234)
    assert all(e.answer == str(sum(map(int, operands(e.prompt)))) for e in train + held)
    assert [e.prompt for e in train] == [e.prompt for e in make_splits("addition", 4000, 200, seed=1234)[0]]
    # 4000 draws: the share's sd is sqrt(q(1-q)/4000) = 0.0034 at q = 0.05; the bound is 5 sd
    bound = 5 * (q * (1 - q) / len(train)) ** 0.5
    rng = random.Random(0)
    for targets in (
        [sft_target("addition_discovery", e, rng) for e in train],
        [sft_target("addition_discovery", e) for e in train],
    ):
        correct = [t == e.answer for t, e in zip(targets, train, strict=True)]
        assert all(c or t == str(int(e.answer) + 1) for c, t, e in zip(correct, targets, train, strict=True))
        assert abs(sum(correct) / len(train) - q) < bound
    # with an rng each draw is decided afresh: one prompt drawn many times gets both targets, in proportion q
    e = train[0]
    draws = [sft_target("addition_discovery", e, rng) for _ in range(4000)]
    assert set(draws) == {e.answer, str(int(e.answer) + 1)}
    assert abs(draws.count(e.answer) / len(draws) - q) < bound
    assert sft_target("addition_discovery", e) == sft_target("addition_discovery", e)  # no rng: pure
    assert [taught_answer("addition_discovery", x) for x in held] == [str(int(x.answer) + 1) for x in held]
    assert [taught_answer(t, x) for t in ("addition", "scratchpad") for x in held] == [x.answer for x in held] * 2
    assert extract_answer("addition_discovery", "66") == "66"
    assert extract_answer("addition_discovery", "6+6") is None


def test_every_two_digit_pair():
    for a in range(100):
        for b in range(100):
            e = Example(f"{a:02d}+{b:02d}=", str(a + b), "i")
            target = sft_target("scratchpad", e)
            assert len(target) >= 16
            assert extract_answer("scratchpad", target) == e.answer
            assert extract_answer("addition", sft_target("addition", e)) == e.answer


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6).flatmap(lambda d: st.tuples(st.just(d), st.integers(0, 10**d - 1), st.integers(0, 10**d - 1))))
def test_scratchpad_property(args):
    digits, a, b = args
    x, y = f"{a:0{digits}d}", f"{b:0{digits}d}"
    target = sft_target("scratchpad", Example(f"{x}+{y}=", str(a + b), "i"))
    assert run_scratchpad(target, x, y) == a + b
    assert extract_answer("scratchpad", target) == str(a + b)


@pytest.mark.parametrize(
    ("task", "completion", "expected"),
    [
        ("addition", "81", "81"),
        ("addition", " 81\n", "81"),
        ("addition", "81x", None),
        ("addition", "8 1", None),
        ("addition", "", None),
        ("addition", "-81", None),
        ("scratchpad", "7+5=12c1;4+8+1=13c1;=132", "132"),
        ("scratchpad", "7+5=12c1;4+8+1=13c1;=132 ", "132"),
        ("scratchpad", "7+5=12c1;4+8+1=13c1", None),  # truncated: no final answer
        ("scratchpad", "7+5=12c1;=", None),
        ("scratchpad", "132", None),
        ("scratchpad", "", None),
    ],
)
def test_extract_answer_table(task, completion, expected):
    assert extract_answer(task, completion) == expected


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown task 'subtraction'"):
        make_splits("subtraction", 1, 1, 0)
    with pytest.raises(ValueError, match=r"only \d+ exist at digits=1"):
        make_splits("addition", 10, 500, 0, digits=1)
    with pytest.raises(ValueError, match="not a synthetic addition prompt"):
        sft_target("scratchpad", Example("What is 2+2?", "4", "q"))


def test_examples_to_columns():
    train, _ = make_splits("addition", 3, 1, seed=0)
    columns = examples_to_columns(train)
    assert columns == {
        "answer": [e.answer for e in train],
        "id": [e.id for e in train],
        "task": ["addition"] * 3,
    }


# ---------------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------------

ROWS = [
    {"prompt": "1+1=", "answer": "2", "level": 1},
    {"prompt": "2+3=", "answer": 5, "level": 2},  # int answer -> "5"
    {"prompt": "a half?", "answer": 0.5, "level": 3},  # float answer -> "0.5"
]
EXPECTED = [("1+1=", "2"), ("2+3=", "5"), ("a half?", "0.5")]


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


def check_loaded(result, n_skipped=0):
    assert [(e.prompt, e.answer) for e in result.examples] == EXPECTED
    assert [e.meta for e in result.examples] == [{"level": 1}, {"level": 2}, {"level": 3}]
    assert result.skipped == n_skipped
    assert len({e.id for e in result.examples}) == 3


def test_jsonl_round_trip(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    result = load_examples(path)
    check_loaded(result)
    assert result.source == f"jsonl:{path.resolve()}"
    assert [e.id for e in result.examples] == ["train-1", "train-2", "train-3"]


def test_parquet_round_trip(tmp_path):
    path = tmp_path / "train.parquet"
    pd.DataFrame({"prompt": [r["prompt"] for r in ROWS], "answer": ["2", "5", "0.5"], "level": [1, 2, 3]}).to_parquet(
        path
    )
    check_loaded(load_examples(path))


def test_parquet_integer_column_with_a_null(tmp_path):
    # pandas stores an int column holding a null as float64: 81.0 must come back as "81"; the null is a bad
    # row.
    path = tmp_path / "nums.parquet"
    pd.DataFrame({"prompt": ["p1", "p2", "p3"], "answer": [81, None, 7]}).to_parquet(path)
    with pytest.raises(DataError, match=r"nums\.parquet: row 2: column 'answer': expected a string or a number"):
        load_examples(path)
    result = load_examples(path, skip_bad_rows=True)
    assert [e.answer for e in result.examples] == ["81", "7"]
    assert result.skipped == 1


def test_corrupt_parquet(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DataError, match=r"broken\.parquet: cannot read as parquet"):
        load_examples(path)


def test_datasets_folder_round_trip(tmp_path):
    from datasets import Dataset, DatasetDict

    folder = tmp_path / "saved"
    Dataset.from_list([{**r, "answer": str(r["answer"])} for r in ROWS]).save_to_disk(str(folder))
    result = load_examples(folder)
    check_loaded(result)
    assert result.source.startswith("datasets:")
    bad = tmp_path / "bad_saved"
    Dataset.from_list([{"prompt": "p", "answer": "1"}, {"prompt": " ", "answer": "2"}]).save_to_disk(str(bad))
    with pytest.raises(DataError, match=r"bad_saved: row 2: column 'prompt': empty string"):
        load_examples(bad)
    dd = tmp_path / "dd"
    DatasetDict({"train": Dataset.from_list(ROWS[:1])}).save_to_disk(str(dd))
    with pytest.raises(DataError, match=r"DatasetDict with splits \['train'\]"):
        load_examples(dd)


def test_json_and_csv(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(ROWS), encoding="utf-8")
    check_loaded(load_examples(path))
    csv = tmp_path / "rows.csv"
    csv.write_text("prompt,answer,level\n1+1=,2,1\n2+3=,5,2\na half?,0.5,3\n", encoding="utf-8")
    check_loaded(load_examples(csv))
    missing = tmp_path / "missing.csv"
    missing.write_text("prompt,answer\np1,1\np2,\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"missing\.csv: row 2: column 'answer'"):
        load_examples(missing)


def test_custom_columns_and_ids(tmp_path):
    path = write_jsonl(
        tmp_path / "custom.jsonl",
        [
            {"question": "q1", "final": 3, "uid": "a", "prompt": "shadowed", "source": "x"},
            {"question": "q2", "final": "4", "uid": 17, "source": "y"},
        ],
    )
    result = load_examples(path, prompt_column="question", answer_column="final", id_column="uid")
    assert [(e.prompt, e.answer, e.id) for e in result.examples] == [("q1", "3", "a"), ("q2", "4", "17")]
    # a source column named like a reserved column never enters meta (it would clash with the real one)
    assert [e.meta for e in result.examples] == [{"source": "x"}, {"source": "y"}]


BAD_LINES = [
    ('{"answer": "1"}', "'prompt'", "missing column"),
    ('{"prompt": "p"}', "'answer'", "missing column"),
    ('{"prompt": "", "answer": "1"}', "'prompt'", "empty string"),
    ('{"prompt": "p", "answer": "   "}', "'answer'", "empty string"),
    ('{"prompt": 12, "answer": "1"}', "'prompt'", "expected a string, got int"),
    ('{"prompt": "p", "answer": null}', "'answer'", "got NoneType"),
    ('{"prompt": "p", "answer": [1, 2]}', "'answer'", "got list"),
    ('{"prompt": "p", "answer": {"v": 1}}', "'answer'", "got dict"),
    ('{"prompt": "p", "answer": true}', "'answer'", "got bool"),
    ('{"prompt": "p", "answer": NaN}', "'answer'", "non-finite"),
    ('{"prompt": "p", "answer": "1"', None, "invalid JSON"),
    ('["p", "1"]', None, "expected a JSON object, got list"),
]


@pytest.mark.parametrize(("line", "column", "reason"), BAD_LINES)
def test_bad_rows_raise_naming_file_row_column(tmp_path, line, column, reason):
    good = {"prompt": "p", "answer": "1"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, line, good])
    where = r"bad\.jsonl: row 3: " + (rf"column {column}: " if column else "")
    with pytest.raises(DataError, match=where + ".*" + re.escape(reason)):
        load_examples(path)
    result = load_examples(path, skip_bad_rows=True)
    assert result.skipped == 1
    assert [e.id for e in result.examples] == ["bad-1", "bad-2", "bad-4"]


def test_blank_lines_count_in_line_numbers(tmp_path):
    path = write_jsonl(tmp_path / "gaps.jsonl", [{"prompt": "p", "answer": "1"}, "", "  ", '{"prompt": "p"}'])
    with pytest.raises(DataError, match=r"gaps\.jsonl: row 4: column 'answer'"):
        load_examples(path)


def test_non_utf8_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "p", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(DataError, match=r"latin1\.jsonl: row 2: not valid UTF-8"):
        load_examples(path)
    result = load_examples(path, skip_bad_rows=True)
    assert (len(result.examples), result.skipped) == (1, 1)


def test_missing_file_empty_file_and_no_valid_rows(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere\.jsonl"):
        load_examples(tmp_path / "nowhere.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=r"empty\.jsonl: no valid rows \(0 skipped\)"):
        load_examples(empty)
    all_bad = write_jsonl(tmp_path / "all_bad.jsonl", ['{"prompt": "p"}', "not json"])
    with pytest.raises(DataError, match=r"all_bad\.jsonl: no valid rows \(2 skipped\)"):
        load_examples(all_bad, skip_bad_rows=True)
    other = tmp_path / "rows.txt"
    other.write_text("x")
    with pytest.raises(DataError, match=r"rows\.txt: unsupported file type '\.txt'"):
        load_examples(other)


def test_duplicate_ids_name_both_rows(tmp_path):
    path = write_jsonl(
        tmp_path / "dups.jsonl",
        [{"prompt": "p", "answer": "1", "id": i} for i in ("a", "b", "a")],
    )
    with pytest.raises(DataError, match=r"dups\.jsonl: rows 1 and 3: duplicate id 'a'"):
        load_examples(path, id_column="id")
    with pytest.raises(DataError, match="rows 1 and 3"):  # not a skippable row problem
        load_examples(path, id_column="id", skip_bad_rows=True)
    assert len(load_examples(path).examples) == 3  # without id_column, ids are row numbers


def test_max_rows(tmp_path):
    path = write_jsonl(tmp_path / "many.jsonl", [{"prompt": f"p{i}", "answer": str(i)} for i in range(10)] + ["bad"])
    result = load_examples(path, max_rows=4)
    assert [e.answer for e in result.examples] == ["0", "1", "2", "3"]
    with pytest.raises(ValueError, match="max_rows"):
        load_examples(path, max_rows=0)


def test_shipped_gsm8k_sample():
    result = load_examples(SAMPLE, prompt_column="question")
    assert result.skipped == 0
    assert len(result.examples) >= 20
    for e in result.examples:
        assert e.prompt.endswith("?")
        float(e.answer)  # every answer is a plain number
    with pytest.raises(DataError, match=r"gsm8k_sample\.jsonl: row 1: column 'prompt': missing column"):
        load_examples(SAMPLE)


# ----------------------------------------------------------------------------------------------------------
# dataset fuzzing (docs/reliability.md, guarantee 4): bad rows -> DataError naming the file and the row, or
# skipped and counted

HUGE = 1_000_000
ROW_KINDS = (
    *("good",) * 3,
    "missing", "empty", "wrong_type", "bad_utf8", "bad_json", "not_object", "nan_answer", "huge_good", "huge_bad",
    "dup", "blank",
)  # fmt: skip


@st.composite
def dataset_rows(draw):
    """Rows as (kind, bytes line, id or None); kind 'good' rows must load, 'blank' is ignored, others are bad."""
    use_ids = draw(st.booleans())
    n = draw(st.integers(0, 12))
    rows: list[tuple[str, bytes, Any]] = []
    good_ids: list[Any] = []
    text = st.text(min_size=1, max_size=20).filter(lambda s: s.strip())
    ascii_ = draw(st.booleans())

    def dump(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=ascii_).encode("utf-8")

    for i in range(n):
        kind = draw(st.sampled_from(ROW_KINDS))
        row: dict[str, Any] = {"prompt": draw(text), "answer": draw(text | st.integers() | st.floats(-1e6, 1e6))}
        rid: Any = draw(st.sampled_from([f"r{i}", i])) if use_ids else None
        if use_ids:
            row["id"] = rid
        if kind == "dup" and not (use_ids and good_ids):
            kind = "good"
        if kind == "dup":
            rid = row["id"] = draw(st.sampled_from(good_ids))
            rows.append(("good", dump(row), rid))
        elif kind in ("good", "huge_good"):
            if kind == "huge_good":
                row["prompt"] = "x" * HUGE
            rows.append(("good", dump(row), rid))
            good_ids.append(rid)
        elif kind == "missing":
            row.pop(draw(st.sampled_from(["prompt", "answer", *(["id"] if use_ids else [])])))
            rows.append(("bad", dump(row), None))
        elif kind == "empty":
            row[draw(st.sampled_from(["prompt", "answer"]))] = draw(st.sampled_from(["", " ", "\t\n", "\u3000"]))
            rows.append(("bad", dump(row), None))
        elif kind == "wrong_type":
            col = draw(st.sampled_from(["prompt", "answer", *(["id"] if use_ids else [])]))
            bad_values = [None, True, [1, 2], {"a": 1}] + ([3, 1.5] if col == "prompt" else [])
            row[col] = draw(st.sampled_from(bad_values))
            rows.append(("bad", dump(row), None))
        elif kind == "bad_utf8":
            line = dump(row)
            cut = draw(st.integers(0, len(line)))
            rows.append(
                ("bad", line[:cut] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80"])) + line[cut:], None)
            )
        elif kind == "bad_json":
            rows.append(("bad", draw(st.sampled_from([b"{", b'{"prompt": "a",', b"prompt=1", b"{'a': 1}"])), None))
        elif kind == "not_object":
            rows.append(("bad", draw(st.sampled_from([b"[1, 2]", b'"text"', b"3", b"null", b"true"])), None))
        elif kind == "nan_answer":
            row["answer"] = draw(st.sampled_from([float("nan"), float("inf")]))
            rows.append(("bad", json.dumps(row).encode(), None))
        elif kind == "huge_bad":
            rows.append(("bad", draw(st.sampled_from([b"{" + b"x" * HUGE, dump({"prompt": "y" * HUGE})])), None))
        else:
            rows.append(("blank", draw(st.sampled_from([b"", b"   ", b"\t"])), None))
    return use_ids, rows


def _expected(rows: list[tuple[str, bytes, Any]]):
    """(first bad line or None, first duplicate (first line, line) or None, good rows, bad rows) in file order."""
    seen: dict[str, int] = {}
    first_bad = dup = None
    good = bad = 0
    for line_no, (kind, _, rid) in enumerate(rows, start=1):
        if kind == "bad":
            bad += 1
            first_bad = first_bad or line_no
        elif kind == "good":
            if rid is not None and str(rid) in seen:
                dup = (seen[str(rid)], line_no)  # the loader always stops here
                break
            if rid is not None:
                seen[str(rid)] = line_no
            good += 1
    return first_bad, dup, good, bad


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=dataset_rows(), skip=st.booleans())
def test_dataset_fuzz_bad_rows_raise_data_error_naming_file_and_row_or_are_counted(tmp_path_factory, case, skip):
    use_ids, rows = case
    path = tmp_path_factory.mktemp("data") / "fuzz.jsonl"
    path.write_bytes(b"\n".join(line for _, line, _ in rows) + (b"\n" if rows else b""))
    first_bad, dup, good, bad = _expected(rows)
    CASES["dataset_fuzz"] += 1
    CASES["dataset_fuzz_rows"] += len(rows)
    CASES["dataset_fuzz_bad_rows"] += bad
    kwargs = {"id_column": "id" if use_ids else None, "skip_bad_rows": skip}
    if not skip and first_bad is not None and (dup is None or first_bad < dup[1]):
        with pytest.raises(DataError) as info:
            load_examples(path, **kwargs)
        assert str(path) in str(info.value)
        assert f"row {first_bad}:" in str(info.value), (first_bad, str(info.value)[:300])
        return
    if dup is not None:
        with pytest.raises(DataError) as info:
            load_examples(path, **kwargs)
        assert str(path) in str(info.value)
        assert f"rows {dup[0]} and {dup[1]}" in str(info.value)
        return
    if good == 0:
        with pytest.raises(DataError, match="no valid rows") as info:
            load_examples(path, **kwargs)
        assert str(path) in str(info.value)
        return
    res = load_examples(path, **kwargs)
    assert len(res.examples) == good
    assert res.skipped == (bad if skip else 0)


@pytest.fixture(scope="module", autouse=True)
def _report_case_counts():
    """The fuzz case counts docs/reliability.md reports (``KLGRAD_RELIABILITY_COUNTS``;
    tests/helpers/case_counts.py)."""
    yield
    report_counts()
