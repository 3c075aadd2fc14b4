"""``klgrad convert-benchmarks``: each known source layout, on hand-written rows shaped like the public files, into
rows ``klgrad eval`` reads, whose answers klgrad's Math-Verify reward reads as written (a response stating the
answer in \\boxed{} scores 1)."""

from __future__ import annotations

import json

import pytest

from klgrad.cli import main as klgrad_main
from klgrad.data import Example, load_examples
from klgrad.eval import convert
from klgrad.eval.benchmarks import misread_answers
from klgrad.rewards import accuracy_reward

SOURCES = {
    "math500": [
        {"problem": "What is $\\sqrt{8}/2$?", "solution": "...", "answer": "\\sqrt{2}", "unique_id": "test/a/1.json"},
        {"problem": "Compute $1+1$.", "solution": "...", "answer": "2", "unique_id": "test/a/2.json"},
    ],
    "aime24": [{"ID": "2024-I-1", "Problem": "Find the remainder ...", "Solution": "...", "Answer": 33}],
    "amc": [{"id": 0, "problem": "What is ...?", "answer": 142.0, "url": "https://..."}],
    "minerva": [{"problem": "Find x.", "solution": "So $x = \\boxed{\\frac{3}{4}}$ m.", "type": "Physics", "idx": 0}],
    "olympiad": [
        {"id": 7, "question": "Find all a.", "final_answer": ["$1$", "$2$"], "is_multiple_answer": True},
        {"id": 8, "question": "Find b.", "final_answer": ["$\\frac{\\pi}{2}$"], "is_multiple_answer": False},
    ],
    "gsm8k": [{"question": "How many?", "answer": "She has 1,000 + 234 = <<1234>>1,234 apples.\n#### 1,234"}],
    "gpqa": [
        {
            "Question": "Which particle?",
            "Correct Answer": "electron",
            "Incorrect Answer 1": "proton",
            "Incorrect Answer 2": "neutron",
            "Incorrect Answer 3": "photon",
        }
    ],
    "mmlu_pro": [{"question_id": 3, "question": "Pick one.", "options": ["w", "x", "y", "z"], "answer": "C"}],
    "arc": [
        {
            "id": "Mercury_1",
            "question": "Which is a gas?",
            "choices": {"text": ["iron", "steam", "wood"], "label": ["1", "2", "3"]},
            "answerKey": "2",
        }
    ],
}
FORMATS = {
    "math500": "problem_answer",
    "aime24": "problem_answer",
    "amc": "problem_answer",
    "minerva": "boxed_solution",
    "olympiad": "olympiadbench",
    "gsm8k": "gsm8k",
    "gpqa": "gpqa",
    "mmlu_pro": "mmlu_pro",
    "arc": "arc",
}
ANSWERS = {  # as written, and what a correct response boxes
    "math500": [("$\\sqrt{2}$", "\\sqrt{2}"), ("2", "2")],
    "aime24": [("33", "33")],
    "amc": [("142", "142")],
    "minerva": [("$\\frac{3}{4}$", "\\frac{3}{4}")],
    "olympiad": [("$1, 2$", "1, 2"), ("$\\frac{\\pi}{2}$", "\\frac{\\pi}{2}")],
    "gsm8k": [("1234", "1234")],
    "mmlu_pro": [("$C$", "C")],
    "arc": [("$B$", "B")],
}


@pytest.fixture
def converted(tmp_path) -> dict[str, tuple[str, list[dict]]]:
    out = {}
    for name, rows in SOURCES.items():
        src = tmp_path / f"{name}.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out[name] = convert.convert_file(src)
    return out


def test_every_layout_is_detected_and_converted(converted):
    for name, (fmt, rows) in converted.items():
        assert fmt == FORMATS[name], name
        assert [set(r) for r in rows] == [{"id", "prompt", "answer"}] * len(SOURCES[name])
        if name in ANSWERS:
            assert [r["answer"] for r in rows] == [a for a, _ in ANSWERS[name]], name
    assert converted["math500"][1][0]["id"] == "test/a/1.json"
    assert converted["aime24"][1][0]["id"] == "2024-I-1"
    assert converted["arc"][1][0]["prompt"].startswith("Which is a gas?\n\nA) iron\nB) steam\nC) wood\n\n")


def test_converted_answers_are_read_as_written_and_a_boxed_answer_scores(converted):
    for name, (_, rows) in converted.items():
        examples = [Example(r["prompt"], r["answer"], r["id"]) for r in rows]
        assert misread_answers(examples) == [], name
        if name in ANSWERS:
            responses = [f"... so the answer is $\\boxed{{{boxed}}}$." for _, boxed in ANSWERS[name]]
            assert accuracy_reward([], responses, answer=[r["answer"] for r in rows]) == [1.0] * len(rows), name
    assert accuracy_reward([], ["\\boxed{B}"], answer=["$C$"]) == [0.0]  # a wrong letter does not score


def test_gpqa_shuffles_per_row_with_the_seed_and_keeps_the_right_letter(tmp_path):
    src = tmp_path / "gpqa.csv"
    header = ["Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"]
    lines = [",".join(header)] + [f"Q{i},right,wrong1,wrong2,wrong3" for i in range(12)]
    src.write_text("\n".join(lines) + "\n")
    _, rows = convert.convert_file(src, "gpqa", seed=0)
    letters = []
    for r in rows:
        options = dict(line.split(") ", 1) for line in r["prompt"].split("\n\n")[1].splitlines())
        letter = r["answer"].strip("$")
        assert options[letter] == "right"
        letters.append(letter)
    assert len(set(letters)) > 1  # shuffled, not always A
    assert convert.convert_file(src, "gpqa", seed=0)[1] == rows
    assert convert.convert_file(src, "gpqa", seed=1)[1] != rows


def test_instruction_default_custom_and_none(tmp_path):
    src = tmp_path / "m.jsonl"
    src.write_text(json.dumps({"problem": "P", "answer": "1"}) + "\n")
    assert convert.convert_file(src)[1][0]["prompt"] == f"P\n\n{convert.MATH_INSTRUCTION}"
    assert convert.convert_file(src, instruction="Think.")[1][0]["prompt"] == "P\n\nThink."
    assert convert.convert_file(src, instruction="")[1][0]["prompt"] == "P"


def test_parquet_source_and_the_command_line(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(SOURCES["math500"]), tmp_path / "test.parquet")
    argv = ["convert-benchmarks", str(tmp_path / "test.parquet"), "--name", "math500", "--out", str(tmp_path / "out")]
    assert klgrad_main(argv) == 0
    assert "problem_answer, 2 rows" in capsys.readouterr().out
    loaded = load_examples(tmp_path / "out" / "math500.jsonl", id_column="id")  # what klgrad eval reads
    assert [e.answer for e in loaded.examples] == ["$\\sqrt{2}$", "2"]


@pytest.mark.parametrize(
    ("rows", "fmt", "message"),
    [
        ([{"question": "Q", "answer": "no marker"}], "gsm8k", "row 1: column 'answer' has no '#### <number>'"),
        ([{"problem": "P", "solution": "no box"}], "auto", "row 1: column 'solution' has no \\boxed"),
        ([{"title": "T"}], "auto", "row 1: unknown layout: columns ['title']"),
        ([{"problem": "P", "answer": "1"}, {"problem": "P"}], "auto", "row 2: missing column answer / Answer"),
    ],
)
def test_bad_rows_name_the_file_row_and_column(rows, fmt, message, tmp_path, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert klgrad_main(["convert-benchmarks", str(src), "--format", fmt, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert str(src) in err
