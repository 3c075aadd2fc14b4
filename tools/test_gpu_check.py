"""The GPU readiness check on CPU: the random-model maker's size, the driver's rows, table, JSON and exit codes, its
refusal without a GPU, the shell scripts' syntax, and the CPU dry mode end to end (tools/gpu_check.py,
tools/make_random_model.py, tools/gpu_check.sh, tools/fill_wheelhouse.sh; docs/gpu.md)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from klgrad.models import count_parameters, load_model_and_tokenizer
from klgrad.models.fast_forward import unsupported_reason
from tests.helpers.extras import needs_extras

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tools"
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


mrm = load_script("make_random_model")
gc = load_script("gpu_check")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(mrm.DEFAULT_TOKENIZER, local_files_only=True)


# ----------------------------------------------------------------------------------------------------------
# make_random_model


@pytest.mark.parametrize(
    "shape",
    [
        mrm.Qwen2Shape(vocab=90, hidden=128, layers=2, intermediate=352, heads=2, kv_heads=2),
        mrm.Qwen2Shape(vocab=90, hidden=192, layers=3, intermediate=64, heads=3, kv_heads=1),  # MQA, odd heads
        mrm.Qwen2Shape(vocab=1000, hidden=64, layers=1, intermediate=48, heads=1, kv_heads=1, tie=False),
    ],
)
def test_param_count_formula_equals_an_instantiated_model(tokenizer, shape):
    """The closed form against transformers' own Qwen2 (tied and untied embeddings, GQA and MQA)."""
    config = mrm.qwen2_config(shape, tokenizer)
    config.vocab_size = shape.vocab
    model = Qwen2ForCausalLM(config)
    assert count_parameters(model) == mrm.qwen2_param_count(shape)


def test_half_billion_shape_counts_exactly_on_the_meta_device(tokenizer):
    """The 0.5B shape of the GPU check: the formula equals transformers' count of a model built on the meta
    device (shapes only, nothing allocated), and lands within 0.1% of the request."""
    shape = mrm.qwen2_shape(mrm.parse_size("0.5B"), len(tokenizer))
    assert (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.intermediate) == (1024, 24, 16, 2, 6016)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(mrm.qwen2_config(shape, tokenizer))
    assert count_parameters(model) == mrm.qwen2_param_count(shape) == 500_343_808
    assert abs(mrm.qwen2_param_count(shape) / 5e8 - 1) < 1e-3
    assert unsupported_reason(model) is None  # klgrad's fast forward runs it


@pytest.mark.parametrize("size", ["1M", "2M", "4M", "0.5B", "1.5B", "7B"])
def test_requested_sizes_land_within_one_percent(size):
    target = mrm.parse_size(size)
    shape = mrm.qwen2_shape(target, 90)
    assert abs(mrm.qwen2_param_count(shape) / target - 1) < 0.01, shape
    assert shape.hidden % 128 == 0
    assert shape.heads * mrm.HEAD_DIM == shape.hidden
    assert shape.heads % shape.kv_heads == 0


def test_parse_size():
    assert [mrm.parse_size(s) for s in ("0.5B", "500M", "4m", "120k", "1.5e9", "123456")] == [
        500_000_000,
        500_000_000,
        4_000_000,
        120_000,
        1_500_000_000,
        123_456,
    ]
    for bad in ("", "B", "0", "-1M", "5T", "half"):
        with pytest.raises(ValueError, match="parameter count"):
            mrm.parse_size(bad)
    with pytest.raises(ValueError, match="too small"):
        mrm.qwen2_shape(10_000, 90)


def test_make_random_model_writes_a_loadable_qwen2(tmp_path, capsys):
    assert mrm.main(["--params", "1M", "--dry-run"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["target"] == 1_000_000
    assert planned["vocab"] == 90
    assert mrm.main(["--arch", "qwen2", "--params", "1M", "--out", str(tmp_path / "m")]) == 0
    line = capsys.readouterr().out
    assert f"{planned['params']:,} parameters" in line
    model, tok = load_model_and_tokenizer(tmp_path / "m")
    assert model.config.model_type == "qwen2"
    assert model.config.vocab_size == len(tok) == 90
    assert count_parameters(model) == planned["params"]
    assert (model.config.pad_token_id, model.config.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    assert unsupported_reason(model) is None


# ----------------------------------------------------------------------------------------------------------
# the shell scripts


@pytest.mark.parametrize("script", ["gpu_check.sh", "fill_wheelhouse.sh"])
def test_shell_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True).returncode == 0
    if shutil.which("shellcheck"):
        result = subprocess.run(["shellcheck", str(SCRIPTS / script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout


def test_requirements_cover_every_dependency_but_torch():
    """The wheel folder holds every dependency of pyproject.toml (and the test runner's), never torch."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + [d for d in project["optional-dependencies"]["dev"] if "ruff" not in d]

    def name(req: str) -> str:
        return re.split(r"[<>=!\[; ]", req, maxsplit=1)[0].lower().replace("_", "-")

    have = {name(r) for r in gc.requirements("all")}
    assert {name(r) for r in wanted} - {"torch"} <= have
    assert "torch" not in have
    assert "peft" in have
    assert set(gc.requirements("all")) == set(gc.requirements("with-deps")) | set(gc.requirements("no-deps"))
    assert set(gc.requirements("no-deps")) == {"accelerate>=1.0", "peft"}  # the ones requiring torch


# ----------------------------------------------------------------------------------------------------------
# the driver: rows, table, JSON, exit code


def ctx_in(tmp_path) -> object:
    return gc.Context(out=tmp_path / "out", device="cpu", small=True)


def test_failures_become_rows_and_a_non_zero_exit(tmp_path, monkeypatch, capsys):
    exits_3 = tmp_path / "exits_3.py"
    exits_3.write_text("import sys\nprint('doing things')\nprint('it broke', file=sys.stderr)\nsys.exit(3)\n")
    sleeps = tmp_path / "sleeps.py"
    sleeps.write_text("import time\ntime.sleep(60)\n")

    def command(script):
        def run(ctx):
            code, tail = gc.run_measured(ctx, [str(script)], [])
            if code:
                raise gc.Fail(f"exit {code}: {gc._last_line(tail)}")
            return "ok"

        return run

    def boom(ctx):
        raise ZeroDivisionError("a bug in a step")

    monkeypatch.setattr(gc, "module_available", lambda name: False)
    steps = (
        gc.Step("fine", "passes", lambda ctx: "all good"),
        gc.Step("exits", "a command that fails", command(exits_3)),
        gc.Step("bug", "raises", boom),
        gc.Step("slow", "runs past its limit", command(sleeps), timeout_s=1),
        gc.Step("after", "needs two", lambda ctx: "never", needs=("fine", "exits")),
        gc.Step("vllm", "the vllm step", gc.step_vllm, needs=("exits",), applies=gc.vllm_missing),
    )
    ctx = ctx_in(tmp_path)
    results = gc.run_steps(ctx, steps, echo=lambda line: None)
    rows = {r.name: r for r in results}
    assert [r.name for r in results] == [s.name for s in steps]
    assert (rows["fine"].status, rows["fine"].detail) == ("pass", "all good")
    assert rows["exits"].status == "fail"
    assert rows["exits"].detail == "exit 3: it broke"
    assert rows["exits"].command == f"python {exits_3}"
    assert "doing things" in Path(rows["exits"].log).read_text()
    assert rows["exits"].peak_gpu_bytes is None  # the command never used CUDA
    assert (rows["bug"].status, rows["bug"].detail) == ("fail", "ZeroDivisionError: a bug in a step")
    assert rows["slow"].status == "fail"
    assert rows["slow"].detail.startswith("timed out after 1 s")
    assert rows["slow"].seconds < 30
    assert (rows["after"].status, rows["after"].detail) == ("skipped", "needs exits (failed)")
    assert (rows["vllm"].status, rows["vllm"].detail) == ("skipped", "vllm not installed")
    assert all(r.seconds >= 0 for r in results)
    assert gc.exit_code(results) == 1
    assert gc.exit_code([rows["fine"], rows["vllm"]]) == 0  # skipped rows do not fail the check

    report = tmp_path / "out" / gc.JSON_NAME
    gc.write_report(report, "cpu-small", {"gpus": []}, results, "2026-11-23T00:00:00+00:00", 1.0)
    data = json.loads(report.read_text())
    assert data["passed"] is False
    assert data["mode"] == "cpu-small"
    assert data["machine"] == {"gpus": []}
    assert [s["name"] for s in data["steps"]] == [s.name for s in steps]
    assert set(data["steps"][0]) == {"name", "status", "detail", "seconds", "peak_gpu_bytes", "command", "log"}

    gc.print_table(results, "title")
    table = capsys.readouterr().out
    for r in results:
        assert r.name in table
    assert "exit 3: it broke" in table
    assert "vllm not installed" in table
    monkeypatch.setitem(sys.modules, "rich.console", None)  # rich missing: the plain table
    gc.print_table(results, "plain title")
    plain = capsys.readouterr().out.splitlines()
    assert plain[0] == "plain title"
    assert plain[1].split() == ["step", "status", "time", "peak", "GPU", "detail"]
    assert plain[3].split()[:2] == ["exits", "fail"]


def test_vllm_step_on_cpu_is_skipped_even_when_vllm_is_importable(tmp_path, monkeypatch):
    monkeypatch.setattr(gc, "module_available", lambda name: True)
    row = gc.run_step(ctx_in(tmp_path), next(s for s in gc.STEPS if s.name == "vllm"))
    assert (row.status, row.detail) == ("skipped", "vllm needs a CUDA GPU (--device cpu)")


def test_accelerate_launch_options():
    """One process: accelerate's simple launcher (--cpu in the dry mode); several: torchrun (--multi_gpu), never
    --cpu (accelerate 1.x would start one process), on a port of its own."""
    tail = ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    assert gc.accelerate_launcher("cuda", 1, 29999) == [*gc.ACCELERATE, "--num_processes", "1", *tail]
    assert gc.accelerate_launcher("cpu", 1, 29999) == [*gc.ACCELERATE, "--cpu", "--num_processes", "1", *tail]
    for device in ("cuda", "cpu"):
        ddp = gc.accelerate_launcher(device, 2, 29999)
        assert ddp == [*gc.ACCELERATE, "--multi_gpu", "--num_processes", "2", *tail, "--main_process_port", "29999"]
    assert 0 < gc.free_port() < 65536


def test_ddp_step_needs_two_gpus_but_runs_in_the_dry_mode(tmp_path, monkeypatch):
    monkeypatch.setattr(gc, "module_available", lambda name: True)
    monkeypatch.setattr(gc, "gpu_count", lambda: 1)
    gpu = gc.Context(out=tmp_path / "out", device="cuda", small=True)
    step = next(s for s in gc.STEPS if s.name == "train_ddp")
    assert gc.run_step(gpu, step).detail == "needs 2 CUDA GPUs (one per process), torch sees 1"
    monkeypatch.setattr(gc, "gpu_count", lambda: 2)
    assert gc.ddp_missing(gpu) is None
    assert gc.ddp_missing(ctx_in(tmp_path)) is None  # CPU: 2 processes of gloo
    monkeypatch.setattr(gc, "module_available", lambda name: False)
    for name in ("train_accelerate", "train_ddp"):
        step = next(s for s in gc.STEPS if s.name == name)
        assert step.needs == ("make_model",)
        row = gc.run_step(ctx_in(tmp_path), step)
        assert (row.status, row.detail) == ("skipped", "accelerate not installed")


@needs_extras("accelerate")
def test_launched_command_runs_the_wrapper_under_the_launcher(tmp_path):
    """The launcher starts the peak-memory wrapper as its script; the row's command is the launch itself."""
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('rank', os.environ.get('RANK'))\n")
    ctx = ctx_in(tmp_path)
    ctx.current = gc.Step("launched", "a launched script", lambda ctx: "")
    launcher = gc.accelerate_launcher("cpu", 1, gc.free_port())
    code, tail = gc.run_measured(ctx, [str(script)], ["--flag"], launcher)
    assert code == 0, tail
    assert ctx.command == f"python {' '.join(launcher)} {script} --flag"
    assert "rank None" in tail  # accelerate's simple launcher: one plain process
    assert json.loads((ctx.out / "logs" / "launched.peak.json").read_text()) == {"peak_gpu_bytes": None}


def test_measure_writes_rank_zero_peak_only(tmp_path, monkeypatch):
    script = tmp_path / "nothing.py"
    script.write_text("")
    for rank, written in (("1", False), ("0", True)):
        report = tmp_path / f"peak{rank}.json"
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setattr(sys, "argv", list(sys.argv))
        monkeypatch.setattr(sys, "path", list(sys.path))
        assert gc.measure(str(report), [str(script)]) == 0
        assert report.is_file() == written


def junit(*cases: str) -> ET.Element:
    return ET.fromstring(f"<testsuites><testsuite>{''.join(cases)}</testsuite></testsuites>")


def test_pytest_report_verdicts():
    ok, skip = '<testcase name="a"/>', '<testcase name="b"><skipped message="no CUDA GPU visible to torch"/></testcase>'
    bad = '<testcase name="c"><failure message="assert"/></testcase>'
    assert gc.junit_verdict(junit(ok, ok, skip), 0, "") == "2 passed, 1 skipped"
    with pytest.raises(gc.Skip, match="all 2 skipped: no CUDA GPU visible to torch"):
        gc.junit_verdict(junit(skip, skip), 0, "")
    with pytest.raises(gc.Fail, match=r"1 of 3 failed \(c\): 1 failed"):
        gc.junit_verdict(junit(ok, bad, skip), 1, "...\n1 failed")
    with pytest.raises(gc.Fail, match="pytest exit 2"):  # e.g. an error while collecting
        gc.junit_verdict(junit(), 2, "interrupted")


# ----------------------------------------------------------------------------------------------------------
# refusals


def run_driver(*args: str, script: str = "gpu_check.py", timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = ["bash", str(SCRIPTS / script)] if script.endswith(".sh") else [sys.executable, str(SCRIPTS / script)]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=REPO, env=gc.child_env(), timeout=timeout)


@NO_GPU
@pytest.mark.parametrize("script", ["gpu_check.py", "gpu_check.sh"])
def test_refuses_without_a_gpu_before_doing_anything(tmp_path, script):
    """Exit 2 with a message naming the dry mode; the shell script stops before installing anything."""
    out = tmp_path / "never"
    result = run_driver("--out", str(out), script=script)
    assert result.returncode == 2
    assert "no CUDA GPU is visible to torch" in result.stderr
    assert "--device cpu --small" in result.stderr
    assert "[gpu_check.sh]" not in result.stdout
    assert not out.exists()


def test_bad_invocations_exit_2(tmp_path):
    assert gc.main(["--device", "cpu"]) == 2  # the CPU mode is the small dry run only
    assert gc.main(["--device", "cpu", "--small", "--steps", "train,nope", "--out", str(tmp_path / "o")]) == 2
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("someone's files")
    assert gc.main(["--device", "cpu", "--small", "--steps", "vllm", "--out", str(foreign)]) == 2
    assert (foreign / "notes.txt").is_file()  # a folder that is not a previous check's is never emptied
    previous = tmp_path / "previous"
    (previous / "model").mkdir(parents=True)
    (previous / gc.JSON_NAME).write_text("{}")
    assert gc.prepare_out(previous) is None  # a previous check's folder is replaced
    assert list(previous.iterdir()) == []


# ----------------------------------------------------------------------------------------------------------
# the CPU dry mode, end to end

DRY_STEPS = ("gpu_tests", "make_model", "train", "train_lora", "train_accelerate", "train_ddp", "eval", "vllm")
"""Every step of the check: on CPU the GPU tests and vLLM skip, the rest run on a tiny random Qwen2 (the
accelerate steps: one process with --cpu, and 2 processes of CPU DDP over gloo)."""


@pytest.mark.slow
@needs_extras("peft", "accelerate")  # every CPU step passes: the LoRA and the accelerate runs too
def test_cpu_dry_mode_end_to_end(tmp_path):
    out = tmp_path / "check"
    steps = ",".join(DRY_STEPS)  # over 120 s on 2 shared cores since the accelerate steps (about 40 s) came in
    result = run_driver("--device", "cpu", "--small", "--out", str(out), "--steps", steps, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((out / gc.JSON_NAME).read_text())
    assert data["mode"] == "cpu-small"
    assert data["passed"] is True
    assert data["machine"]["torch"] == torch.__version__
    assert data["machine"]["gpus"] == []
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", data["machine"]["klgrad_commit"])
    rows = {s["name"]: s for s in data["steps"]}
    assert list(rows) == list(DRY_STEPS)
    assert rows["gpu_tests"]["status"] == "skipped"
    assert rows["gpu_tests"]["detail"].endswith("skipped: no CUDA GPU visible to torch")
    assert rows["make_model"]["status"] == "pass"
    assert "qwen2: " in rows["make_model"]["detail"]
    assert rows["train"]["status"] == "pass"
    assert rows["train"]["detail"].startswith("2 steps, ")
    assert rows["train"]["command"].startswith("python -m klgrad train --config configs/tiny_add.yaml")
    assert rows["train_lora"]["status"] == "pass", rows["train_lora"]
    assert rows["train_lora"]["detail"].endswith("adapter-only checkpoint")
    for name, processes in (("train_accelerate", 1), ("train_ddp", 2)):
        assert rows[name]["status"] == "pass", rows[name]
        assert rows[name]["detail"].startswith("2 steps, ")
        assert rows[name]["command"].startswith("python -m accelerate.commands.launch ")
        assert f" --num_processes {processes} " in rows[name]["command"]
        assert " -m klgrad train --config configs/tiny_add.yaml" in rows[name]["command"]
        assert json.loads((out / "runs" / name / "run.json").read_text())["num_processes"] == processes
    assert rows["eval"]["status"] == "pass", rows["eval"]
    assert [x.split(" greedy ")[0] for x in rows["eval"]["detail"].split(", ")] == ["base", "full", "lora"]
    assert rows["vllm"]["status"] == "skipped"
    assert rows["vllm"]["detail"] in ("vllm not installed", "vllm needs a CUDA GPU (--device cpu)")
    assert all(s["peak_gpu_bytes"] is None for s in data["steps"])  # nothing touched CUDA
    model, _ = load_model_and_tokenizer(out / "model")
    assert model.config.model_type == "qwen2"
    assert abs(count_parameters(model) / 2e6 - 1) < 0.01
    metrics = [json.loads(x) for x in (out / "runs" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "reward/mean" in r] == [1, 2]
    for name in DRY_STEPS:
        assert name in result.stdout  # the table
