"""``klgrad eval``: the unbiased pass@k estimator, model and benchmark resolution, and the command end to end on
the embedded model (its greedy accuracy against transformers ``generate`` scored independently here)."""

from __future__ import annotations

import json
import math
import types
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from klgrad.config import Config, to_dict
from klgrad.data import make_splits
from klgrad.eval.benchmarks import encode_eval_prompts, load_benchmarks
from klgrad.eval.models import EMBEDDED_DEFAULT, load_eval_model, locate_model, split_label
from klgrad.eval.passk import mean_pass_at_k, pass_at_k
from klgrad.eval.run import DEFAULT_MAX_NEW_TOKENS, default_max_new_tokens, unique_labels
from klgrad.machine import vllm_unavailable_reason
from klgrad.models import load_model_and_tokenizer
from klgrad.models.sources import EMBEDDED_DIR
from tests.helpers.run_dirs import make_run

# --------------------------------------------------------------------------------------------------------------
# pass@k


def _exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """1 − C(n−c, k)/C(n, k) in exact rationals (math.comb is 0 when k > n − c)."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_pass_at_k_equals_the_binomial_formula_for_every_small_case():
    for n in range(1, 16):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(_exact_pass_at_k(n, c, k)), rel=1e-13, abs=1e-15)


def test_pass_at_k_hand_cases():
    assert pass_at_k(2, 1, 1) == pytest.approx(0.5)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 − C(3,2)/C(5,2)
    assert pass_at_k(10, 1, 5) == pytest.approx(0.5)  # one correct sample among 10, half the 5-subsets hold it
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 2, 3) == 1.0  # n − c = 2 < k = 3: every 3-subset holds a correct sample


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 500), st.data())
def test_pass_at_1_is_the_fraction_correct(n, data):
    c = data.draw(st.integers(0, n))
    assert pass_at_k(n, c, 1) == pytest.approx(c / n, rel=1e-12, abs=1e-15)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 300), st.data())
def test_pass_at_k_is_monotone_in_k_and_c_and_a_probability(n, data):
    c = data.draw(st.integers(0, n))
    k = data.draw(st.integers(1, n))
    p = pass_at_k(n, c, k)
    assert 0.0 <= p <= 1.0
    if k < n:
        assert pass_at_k(n, c, k + 1) >= p - 1e-15
    if c < n:
        assert pass_at_k(n, c + 1, k) >= p - 1e-15
    assert (p == 0.0) == (c == 0)
    if n - c < k:  # every k-subset holds a correct sample
        assert p == 1.0


@settings(max_examples=200, deadline=None)
@given(st.integers(1_000, 10**6), st.floats(0.0, 1.0), st.integers(1, 64))
def test_pass_at_k_tends_to_sampling_with_replacement(n, p, k):
    """C(n−c,k)/C(n,k) = ∏_{j<k} (n−c−j)/(n−j) lies between ((n−c−k+1)/(n−k+1))^k and (1 − c/n)^k, so
    pass@k → 1 − (1 − p)^k as n grows with c/n = p (k independent draws)."""
    c = round(p * n)
    value = pass_at_k(n, c, k)
    lower = 1 - (1 - c / n) ** k
    upper = 1 - max(0.0, (n - c - k + 1) / (n - k + 1)) ** k
    assert lower - 1e-12 <= value <= upper + 1e-12
    assert value == pytest.approx(1 - (1 - c / n) ** k, abs=k * k / n + 1e-12)


def test_pass_at_k_has_no_overflow_at_large_n():
    assert pass_at_k(10**7, 10**6, 100) == pytest.approx(1 - 0.9**100, rel=1e-4)
    assert pass_at_k(10**7, 1, 1) == pytest.approx(1e-7, rel=1e-9)  # small values keep their digits


@pytest.mark.parametrize(("n", "c", "k", "name"), [(4, 5, 1, "c"), (4, -1, 1, "c"), (4, 2, 0, "k"), (4, 2, 5, "k")])
def test_pass_at_k_refuses_impossible_counts(n, c, k, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        pass_at_k(n, c, k)


def test_mean_pass_at_k_is_the_mean_over_problems():
    assert mean_pass_at_k([0, 2, 4], 4, 1) == pytest.approx((0 + 0.5 + 1) / 3)
    assert mean_pass_at_k([0, 1, 4], 4, 4) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="no problems"):
        mean_pass_at_k([], 4, 1)


# --------------------------------------------------------------------------------------------------------------
# fixtures: benchmark files and a klgrad run directory


def _addition_rows(n: int = 40, prompt: str = "prompt", answer: str = "answer") -> list[dict]:
    _, heldout = make_splits("addition", 0, n, seed=0)
    return [{prompt: e.prompt, answer: e.answer} for e in heldout]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def add40(tmp_path_factory) -> Path:
    return _write_jsonl(tmp_path_factory.mktemp("data") / "add40.jsonl", _addition_rows())


def _run_eval(argv: list[str]) -> int:
    from klgrad.cli import main

    return main(["eval", *argv])


def test_eval_takes_its_cpu_share_or_the_threads_given(add40, tmp_path, monkeypatch):
    """``klgrad eval`` beside a training run: it samples registered as a klgrad process (``--threads auto``, the
    default), so the two split the cores (klgrad.threads), or with ``--threads N``; torch's count is given back;
    a bad ``--threads`` is refused against the flag."""
    import os

    import klgrad.eval.run as eval_run
    from klgrad.threads import registry_dir

    seen = []

    def evaluate_all(*args, **kwargs):
        seen.append(((registry_dir() / str(os.getpid())).is_file(), torch.get_num_threads()))
        raise ValueError("stopped by the test")

    monkeypatch.setattr(eval_run, "evaluate_all", evaluate_all)
    before = torch.get_num_threads()
    argv = ["--data", str(add40), "--device", "cpu", "--out", str(tmp_path / "o")]
    assert _run_eval(argv) == 2
    assert _run_eval([*argv, "--threads", "1"]) == 2
    assert seen[0][0]
    assert seen[1] == (False, 1)
    assert torch.get_num_threads() == before
    with pytest.raises(SystemExit):
        _run_eval([*argv, "--threads", "0"])


# --------------------------------------------------------------------------------------------------------------
# end to end on the embedded model


def _greedy_by_generate(rows: list[dict], max_new_tokens: int) -> list[str]:
    """Each prompt alone (no padding) through transformers ``generate(do_sample=False)``: BOS + prompt, the
    input klgrad train gives the embedded model."""
    model, tok = load_model_and_tokenizer(EMBEDDED_DIR / EMBEDDED_DEFAULT)
    out = []
    for r in rows:
        ids = torch.tensor([[tok.bos_token_id, *tok(r["prompt"], add_special_tokens=False)["input_ids"]]])
        seq = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        out.append(tok.decode(seq[0, ids.shape[1] :], skip_special_tokens=True))
    return out


def test_eval_end_to_end_matches_generate_and_writes_the_schema(add40, tmp_path):
    out = tmp_path / "out"
    argv = ["--data", str(add40), "--samples", "4", "--max-new-tokens", "8", "--device", "cpu"]
    assert _run_eval([*argv, "--out", str(out)]) == 0  # on the CPU, as the generate it is compared with
    report = json.loads((out / "eval.json").read_text())
    assert set(report) == {"model", "settings", "benchmarks"}
    assert report["model"]["label"] == "embedded"
    assert report["model"]["chat_template"] is False  # the embedded tokenizer has none: raw prompts, as in training
    bench = report["benchmarks"]["add40"]
    assert set(bench) == {"n", "k", "greedy_accuracy", "pass@1", "pass@k", "mean_length"}
    assert (bench["n"], bench["k"]) == (40, 4)

    # greedy accuracy against transformers generate, scored here by integer equality (no Math-Verify)
    rows = [json.loads(line) for line in add40.read_text().splitlines()]
    texts = _greedy_by_generate(rows, 8)
    expected = sum(t.strip().isdigit() and int(t) == int(r["answer"]) for t, r in zip(texts, rows, strict=True)) / 40
    assert 0.2 < expected < 0.9  # the check means something: neither all right nor all wrong
    assert bench["greedy_accuracy"] == expected

    # pass@1 / pass@k / mean length from the completions written beside it
    lines = [json.loads(x) for x in (out / "completions" / "embedded" / "add40.jsonl").read_text().splitlines()]
    assert [x["greedy"] for x in lines] == texts
    correct = [sum(x["correct"]) for x in lines]
    assert all(x["correct"] == [s.strip() == x["answer"] for s in x["samples"]] for x in lines)
    assert bench["pass@1"] == pytest.approx(sum(correct) / (40 * 4))
    assert bench["pass@k"] == pytest.approx(sum(c > 0 for c in correct) / 40)
    assert bench["mean_length"] == pytest.approx(sum(sum(x["lengths"]) for x in lines) / (40 * 4))
    assert bench["pass@1"] <= bench["pass@k"]


def test_two_models_write_results_md_with_a_row_each(add40, tmp_path):
    run, _ = make_run(tmp_path, noise=0.02)
    out = tmp_path / "out"
    argv = ["--model", "reference=embedded", "--model", f"trained={run}", "--data", str(add40), "--samples", "2"]
    assert _run_eval([*argv, "--max-new-tokens", "6", "--limit", "10", "--out", str(out)]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert set(report) == {"settings", "models"}
    assert list(report["models"]) == ["reference", "trained"]
    assert report["models"]["trained"]["checkpoint"].endswith("step_000003")
    assert report["models"]["reference"]["benchmarks"]["add40"]["n"] == 10
    md = (out / "results.md").read_text()
    for label in ("reference", "trained"):
        b = report["models"][label]["benchmarks"]["add40"]
        cell = f"{100 * b['greedy_accuracy']:.1f} / {100 * b['pass@1']:.1f}"
        assert f"| {label} | {cell} | {cell} |" in md  # one benchmark: its average is itself
    assert "| model | add40 | Average |" in md
    assert (out / "completions" / "trained" / "add40.jsonl").is_file()


def test_parquet_and_datasets_folder_read_like_jsonl(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _addition_rows(12, prompt="problem", answer="solution")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "as_parquet.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "as_folder"))
    _write_jsonl(tmp_path / "as_jsonl.jsonl", rows)
    out = tmp_path / "out"
    data = [str(tmp_path / n) for n in ("as_jsonl.jsonl", "as_parquet.parquet", "as_folder")]
    argv = ["--prompt-column", "problem", "--answer-column", "solution", "--samples", "2", "--max-new-tokens", "6"]
    assert _run_eval([*argv, *(x for d in data for x in ("--data", d)), "--out", str(out)]) == 0
    benches = json.loads((out / "eval.json").read_text())["benchmarks"]
    assert list(benches) == ["as_jsonl", "as_parquet", "as_folder"]
    assert benches["as_jsonl"] == benches["as_parquet"] == benches["as_folder"]  # same problems, same seed


def test_answers_math_verify_misreads_are_named_in_a_warning(tmp_path, capsys):
    rows = [*_addition_rows(3), {"prompt": "1+1=", "answer": "\\text{}"}, {"prompt": "2+2=", "answer": "\\sqrt{2}"}]
    data = _write_jsonl(tmp_path / "mixed.jsonl", rows)
    out = tmp_path / "out"
    assert _run_eval(["--data", str(data), "--samples", "1", "--max-new-tokens", "4", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "warning: mixed: 1 of 5 answers are not read as written" in err
    assert "mixed-4" in err  # the row Math-Verify cannot parse; the bare sqrt(2) beside it reads as written
    assert json.loads((out / "eval.json").read_text())["settings"]["warnings"] == [err.split("warning: ")[1].strip()]


# --------------------------------------------------------------------------------------------------------------
# bad input fails fast, exit code 2, with a message naming what is wrong


def test_missing_column_names_the_column_and_the_file(add40, tmp_path, capsys):
    assert _run_eval(["--data", str(add40), "--answer-column", "solution", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "'solution'" in err
    assert str(add40) in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data", "NOPE/missing.jsonl"], "missing.jsonl"),
        (["--samples", "0"], "--samples must be >= 1"),
        (["--temperature", "0"], "--temperature must be > 0"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--model", "no_such_model_dir"], "no_such_model_dir"),
    ],
)
def test_bad_arguments_exit_2_naming_the_problem(argv, message, add40, tmp_path, capsys):
    if "--data" not in argv:
        argv = [*argv, "--data", str(add40)]
    assert _run_eval([*argv, "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_two_files_with_one_stem_are_refused(add40, tmp_path):
    other = tmp_path / "add40.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(_addition_rows(3)), other)
    with pytest.raises(ValueError, match="share the benchmark name 'add40'"):
        load_benchmarks([add40, other])


@pytest.mark.skipif(vllm_unavailable_reason() is None, reason="vLLM and a GPU are available here")
def test_engine_vllm_without_vllm_says_what_is_missing(add40, tmp_path, capsys):
    assert _run_eval(["--engine", "vllm", "--data", str(add40), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--engine vllm" in err
    assert vllm_unavailable_reason() in err


# --------------------------------------------------------------------------------------------------------------
# --model resolution


def test_a_run_directory_loads_its_newest_valid_checkpoint(tmp_path):
    run, weights = make_run(tmp_path, noise=0.01, steps=(2, 4))
    m = load_eval_model(str(run), device=torch.device("cpu"))
    assert m.label == "run@step_000004"
    assert m.checkpoint == run / "checkpoints" / "step_000004"
    assert m.source == EMBEDDED_DIR / EMBEDDED_DEFAULT  # config model.path null: the embedded reference
    assert all(torch.equal(v, weights[k]) for k, v in m.model.state_dict().items())
    # tear the newest: the previous one is taken
    (run / "checkpoints" / "step_000004" / "policy.safetensors").write_bytes(b"torn")
    assert locate_model(str(run)).checkpoint == run / "checkpoints" / "step_000002"
    # a checkpoint folder by itself, with a label
    src = locate_model(f"mine={run / 'checkpoints' / 'step_000002'}")
    assert (src.label, src.path, src.checkpoint) == ("mine", run, run / "checkpoints" / "step_000002")
    with pytest.raises(ValueError, match="checksums"):
        locate_model(str(run / "checkpoints" / "step_000004"))


def test_a_run_without_a_valid_checkpoint_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(Config())))
    with pytest.raises(ValueError, match="without a valid checkpoint"):
        locate_model(str(run))


def test_default_response_cap_fits_the_context():
    model, _ = load_model_and_tokenizer(EMBEDDED_DIR / EMBEDDED_DEFAULT)  # max_position_embeddings 256
    assert default_max_new_tokens(model, 7) == 249
    assert default_max_new_tokens(types.SimpleNamespace(config=types.SimpleNamespace()), 7) == DEFAULT_MAX_NEW_TOKENS
    with pytest.raises(ValueError, match="fills the model's context"):
        default_max_new_tokens(model, 256)


def test_model_names_and_labels():
    assert locate_model("embedded").path == EMBEDDED_DIR / EMBEDDED_DEFAULT
    assert locate_model("tiny_scratchpad").label == "tiny_scratchpad"
    assert locate_model("ref=tiny_scratchpad").label == "ref"
    assert split_label("a/b=c") == (None, "a/b=c")  # not a plain name before '='
    assert unique_labels(["a", "b", "a", "a"]) == ["a", "b", "a#2", "a#3"]


# --------------------------------------------------------------------------------------------------------------
# prompts: the chat template when the tokenizer has one


def test_chat_template_wraps_prompts_unless_turned_off():
    _, tok = load_model_and_tokenizer(EMBEDDED_DIR / EMBEDDED_DEFAULT)
    raw, _ = encode_eval_prompts(tok, ["1+2="], chat_template=True)
    assert tok.decode(raw[0]) == "<bos>1+2="  # no template: BOS + raw prompt, as klgrad train feeds it
    tok.chat_template = (
        "<bos>{% for m in messages %}Q:{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    ids, mask = encode_eval_prompts(tok, ["1+2=", "10+20="], chat_template=True)
    assert tok.decode(ids[0][mask[0]]) == "<bos>Q:1+2=A:"  # one BOS: the template's own
    assert tok.decode(ids[1]) == "<bos>Q:10+20=A:"
    off, _ = encode_eval_prompts(tok, ["1+2="], chat_template=False)
    assert torch.equal(off, raw)
