"""Reliability of runs: kill/resume bit-identity, torn checkpoints, non-finite steps, reward failure budget,
untrusted files, extreme inputs, bad data through the CLI. docs/reliability.md states each guarantee and these
figures; the config and dataset fuzzing it cites live with their modules' tests (tests/config/test_config.py,
tests/data/test_data.py).

The slow part is ``python -m klgrad train`` started as a subprocess (about 4 s of imports each). Every such run
(the *scenarios* below) is submitted to a two-worker pool when the module starts, so they run side by side and
alongside the in-process tests; the tests that need one wait for its result. ``KLGRAD_RELIABILITY_COUNTS=PATH``
writes the case counts (kill points, fuzz examples, bad inputs) to PATH as JSON at the end of the module
(tests/helpers/case_counts.py).
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from klgrad.choices import FORMS, LEVELS, RATIO_LEVELS
from klgrad.config import ConfigError, KLConfig, load_config
from klgrad.kl import KL_HEADS, kl_estimate, kl_loss
from klgrad.objective import (
    ObjectiveSpec,
    combined_advantages,
    decoupled_advantages,
    objective_diagnostics,
    policy_objective,
)
from klgrad.rewards import RewardSpec, compute_rewards
from klgrad.rewards.accuracy import math_verify_reward
from klgrad.runlock import LOCK_NAME
from klgrad.trainer import EMBEDDED_DIR, latest_checkpoint, load_checkpoint, read_jsonl
from tests.helpers.case_counts import CASES, report_counts

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/tiny_add.yaml"
STEPS, SAVE_EVERY = 4, 2
N_SAMPLES = 4 * 4  # prompts_per_step x group_size below
SMALL = (
    "--rollout.prompts_per_step", "4",
    "--rollout.group_size", "4",
    "--data.n_eval", "8",
    "--data.n_train", "200",
    "--train.eval_every", "2",
    "--train.tensorboard", "false",
    "--algo.micro_batch_size", "8",
    "--train.threads", "1",  # deterministic and fast; two runs share the two cores
)  # fmt: skip
KILL_POINTS = (("rollout", 1), ("update", 3), ("log", 2), ("checkpoint_file", 2), ("checkpoint_rename", 4))
N_KILL = len(KILL_POINTS)
VOLATILE = ("time/", "tokens_per_s")


# ----------------------------------------------------------------------------------------------------------
# helpers


def train_args(run_dir: Path, *extra: str, steps: int = STEPS, save_every: int = SAVE_EVERY) -> list[str]:
    return [
        "--config", CONFIG, *SMALL,
        "--train.steps", str(steps),
        "--train.save_every", str(save_every),
        "--train.out_dir", str(run_dir),
        *extra,
    ]  # fmt: skip


def klgrad_train(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``python -m klgrad train ARGS`` in the repository root, without inherited fault-injection variables."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KLGRAD_")}
    full_env.update(env or {})
    CASES["subprocess_runs"] += 1
    return subprocess.run(
        [sys.executable, "-m", "klgrad", "train", *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def stable(records: list[dict]) -> list[dict]:
    """Metrics without the wall-clock ones."""
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "metrics.jsonl")


def checksums_verify(ckpt: Path) -> bool:
    """Independent check of a checkpoint folder: checksums.json lists every other file, each sha256 matches."""
    import hashlib

    try:
        sums = json.loads((ckpt / "checksums.json").read_text())
    except (OSError, ValueError):
        return False
    files = {p.name for p in ckpt.iterdir() if p.is_file() and p.name != "checksums.json"}
    if not isinstance(sums, dict) or set(sums) != files or not {"policy.safetensors", "optim.pt"} <= files:
        return False
    return all(hashlib.sha256((ckpt / name).read_bytes()).hexdigest() == digest for name, digest in sums.items())


def step_dirs(run_dir: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted((run_dir / "checkpoints").glob("step_*"))}


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a)), load_file(str(b))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].dtype == wb[k].dtype, k
        assert torch.equal(wa[k], wb[k]), k  # bit for bit (no tolerance)


def expected_latest(point: str, step: int, steps: int = STEPS, save_every: int = SAVE_EVERY) -> str | None:
    """The checkpoint a kill at ``point:step`` must leave as the newest valid one."""
    saved = [
        s
        for s in range(1, steps + 1)
        if (s % save_every == 0 or s == steps) and (s < step or (s == step and point == "checkpoint_rename"))
    ]
    return f"step_{saved[-1]:06d}" if saved else None


def until_success(run_dir: Path, attempts: int = 3) -> list[subprocess.CompletedProcess]:
    """``--resume RUN_DIR`` (no fault injection) until it exits 0, at most ``attempts`` times."""
    out = []
    for _ in range(attempts):
        out.append(klgrad_train(["--resume", str(run_dir)]))
        if out[-1].returncode == 0:
            break
    return out


class EvilPickle:
    """Unpickling this would run ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def write_evil_optim(path: Path, marker: Path, raw: bool = False) -> None:
    payload = {"optimizer": EvilPickle(marker), "scheduler": {}, "torch_rng": torch.get_rng_state()}
    if raw:  # a plain pickle stream (torch's legacy format)
        path.write_bytes(pickle.dumps(payload))
    else:  # torch's zip format
        torch.save(payload, path)


# ----------------------------------------------------------------------------------------------------------
# subprocess scenarios, run in a pool


class Runs:
    """Named scenarios submitted together to a two-worker pool; ``get`` waits for one."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="klgrad-run")
        self.futures: dict[str, concurrent.futures.Future] = {}

    def start(self) -> None:
        scenarios: dict[str, Any] = {"baseline": scenario_baseline}
        for point, step in KILL_POINTS:
            scenarios[f"kill-{point}:{step}"] = lambda runs, p=point, s=step: scenario_kill(runs, p, s)
        scenarios |= {
            "nan-one": scenario_nan_one,
            "nan-stop": scenario_nan_stop,
            "reward-budget": scenario_reward_budget,
            "torn": scenario_torn,  # waits for the baseline, which is already running
        }
        for name, fn in scenarios.items():
            self.futures[name] = self.pool.submit(fn, self)

    def get(self, name: str) -> Any:
        return self.futures[name].result(timeout=900)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def scenario_baseline(runs: Runs) -> dict:
    run = runs.root / "baseline"
    proc = klgrad_train(train_args(run))
    return {"run": run, "proc": proc}


def scenario_kill(runs: Runs, point: str, step: int) -> dict:
    run = runs.root / f"kill-{point}-{step}"
    killed = klgrad_train(train_args(run), env={"KLGRAD_KILL_AT": f"{point}:{step}"})
    after = latest_checkpoint(run)
    pointer = run / "checkpoints" / "latest"
    state = {
        "run": run,
        "killed": killed,
        "latest": after.name if after is not None else None,
        "latest_verifies": after is None or checksums_verify(after),
        "pointer": pointer.read_text().strip() if pointer.is_file() else None,
        "records_after_kill": metrics(run),
        "lock_after_kill": (run / LOCK_NAME).read_text() if (run / LOCK_NAME).is_file() else None,
    }
    state["resumes"] = until_success(run)
    return state


def scenario_nan_one(runs: Runs) -> dict:
    run = runs.root / "nan-one"
    proc = klgrad_train(train_args(run, save_every=1), env={"KLGRAD_NAN_AT": "2"})
    return {"run": run, "proc": proc}


def scenario_nan_stop(runs: Runs) -> dict:
    run = runs.root / "nan-stop"
    proc = klgrad_train(train_args(run, "--train.max_skipped_steps", "3"), env={"KLGRAD_NAN_AT": "1,2,3"})
    after = latest_checkpoint(run)
    state = {
        "run": run,
        "proc": proc,
        "latest": after,
        "latest_verifies": after is not None and checksums_verify(after),
        "stop_weights": load_file(str(after / "policy.safetensors")) if after is not None else None,
    }
    state["resumes"] = until_success(run, attempts=1)
    return state


REWARD_MODULE = """
def always_raises(prompts, completions, **columns):
    raise RuntimeError("reward backend unavailable")
"""


def write_reward_module(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "klgrad_rel_rewards.py").write_text(REWARD_MODULE)
    return folder


REWARD_FUNCTIONS = json.dumps([{"name": "accuracy", "weight": 1.0}, {"name": "klgrad_rel_rewards:always_raises"}])


def scenario_reward_budget(runs: Runs) -> dict:
    mods = write_reward_module(runs.root / "mods")
    run = runs.root / "reward-budget"
    path = os.pathsep.join(p for p in (str(mods), os.environ.get("PYTHONPATH", "")) if p)
    args = train_args(run, "--reward.functions", REWARD_FUNCTIONS, "--reward.max_failure_fraction", "0.5", steps=2)
    return {"run": run, "proc": klgrad_train(args, env={"PYTHONPATH": path})}


def scenario_torn(runs: Runs) -> dict:
    base = runs.get("baseline")["run"]
    run = runs.root / "torn"
    shutil.copytree(base, run)
    policy = run / "checkpoints" / "step_000004" / "policy.safetensors"
    size = policy.stat().st_size
    with policy.open("r+b") as f:
        f.truncate(size // 2)  # a torn write
    pointer = (run / "checkpoints" / "latest").read_text().strip()
    before = latest_checkpoint(run)
    return {"run": run, "pointer": pointer, "latest": before, "resumes": until_success(run, attempts=1)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    r = Runs(tmp_path_factory.mktemp("reliability"))
    r.start()
    yield r
    r.close()


@pytest.fixture(scope="module", autouse=True)
def _start_runs_first_and_report_counts(request):
    """Start the subprocess pool before the in-process tests (when any selected test needs it), so both overlap."""
    items = [i for i in request.session.items if getattr(i, "module", None) is request.module]
    if any("runs" in getattr(i, "fixturenames", ()) for i in items):
        request.getfixturevalue("runs")
    yield
    CASES["kill_points"] = N_KILL
    print(f"\nreliability case counts: {report_counts()}")


def fail_msg(proc: subprocess.CompletedProcess) -> str:
    return f"rc={proc.returncode}\nstdout tail:\n{proc.stdout[-1500:]}\nstderr tail:\n{proc.stderr[-3000:]}"


# ----------------------------------------------------------------------------------------------------------
# in-process tests first (they run while the pool works)

# --- extreme log-ratios: every head, level, form, on/off-policy, finite loss, gradient and metrics


COMBOS = [
    (name, level, form, off)
    for name in KL_HEADS
    for level in LEVELS
    for form in FORMS
    if not (form == "combined" and level == "token")
    for off in (False, True)
]
"""Every (head, level, form, off-policy) the objective accepts."""


def _check_heads(logp, ref, old, mask, rewards, kl_ratio_level: str, combos) -> None:
    """Finite coefficients, penalties, advantages, loss parts, gradients and diagnostics for ``combos``."""
    for name, head in KL_HEADS.items():
        penalty = head.penalty(logp, ref)
        assert torch.isfinite(head.coefficient(logp, ref)).all(), name
        assert penalty is None or torch.isfinite(penalty).all(), name
    for name, level, form, off in combos:
        CASES["logratio_combinations"] += 1
        ctx = (name, level, form, off)
        behaviour = old if off else None
        spec = ObjectiveSpec(KLConfig(head=name, beta=0.5, level=level, form=form, ratio_level=kl_ratio_level))
        if form == "combined":
            adv = combined_advantages(
                rewards, name, logp, ref, mask, beta=0.5, level=level, group_size=2, method="grpo"
            )
        else:
            adv = decoupled_advantages(rewards, mask, 2, "grpo")
        assert torch.isfinite(adv).all(), (ctx, adv)
        l = logp.clone().requires_grad_(True)
        terms = policy_objective(l, ref, mask, adv, spec, old_logp=behaviour)
        terms.loss.backward()
        for part in (terms.loss, terms.policy_loss, terms.kl_loss):
            assert torch.isfinite(part), ctx
        assert torch.isfinite(l.grad).all(), ctx
        diag = objective_diagnostics(logp, ref, mask, adv, spec, old_logp=behaviour)
        assert all(math.isfinite(v) for v in diag.values()), (ctx, diag)
        plain = kl_loss(name, logp, ref, mask, old_logp=behaviour, level=level, clip_eps=0.2)
        assert torch.isfinite(plain), ctx
    u = torch.where(mask, logp - ref, 0.0).sum(-1)
    for kind in ("k1", "k2", "k3"):
        assert torch.isfinite(kl_estimate(u, torch.zeros_like(u), kind)).all(), kind


def test_extreme_log_ratio_corners_give_no_nan():
    logp = torch.tensor([[-1e4, 0.0, -1e4], [0.0, -1e4, 0.0], [-1e4, -1e4, -1e4], [0.0, 0.0, 0.0]])
    ref = -1e4 - logp  # |l - r| = 1e4 at every token, both signs
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 1], [1, 0, 0]], dtype=torch.bool)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    for kl_ratio_level in RATIO_LEVELS:
        CASES["logratio_examples"] += 1
        _check_heads(logp, ref, logp.flip(0), mask, rewards, kl_ratio_level, COMBOS)


def test_combined_advantages_stay_finite_when_kl_coefficients_are_subnormal():
    """Found by the fuzz below: mse_in_reward's token coefficients exp(-88) - exp(-89) are float32 subnormals, the
    group std of R - beta*C is ~1e-39, and 1/std overflows float32 in the token_to_go shaping scale (inf * 0)."""
    logp = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, -88.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    ref = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, -89.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 0, 0], [0, 0, 1], [1, 0, 0], [1, 0, 0]], dtype=torch.bool)
    CASES["logratio_examples"] += 1
    _check_heads(logp, ref, logp, mask, torch.zeros(4), "sequence", COMBOS)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_extreme_log_ratios_never_give_nan_in_any_head_or_metric(data):
    b, t = 4, 3
    floats = st.lists(st.floats(-1e4, 0.0, width=32), min_size=b * t, max_size=b * t)
    logp, ref, old = (torch.tensor(data.draw(floats)).view(b, t) for _ in range(3))
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))).view(b, t)
    mask[:, 0] |= ~mask.any(-1)  # every response has at least one token (as every sampled one does)
    rewards = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=b, max_size=b)))
    combos = data.draw(st.lists(st.sampled_from(COMBOS), min_size=1, max_size=6, unique=True))
    CASES["logratio_examples"] += 1
    _check_heads(logp, ref, old, mask, rewards, data.draw(st.sampled_from(RATIO_LEVELS)), combos)


# --- pathological LaTeX: the accuracy reward returns within 3 x its bound

PATHOLOGICAL = {
    "nested_frac_x5000": "\\frac{" * 5000,
    "power_tower": "2^2^2^2^2^2^2^2^2^2",
    "boxed_power_tower": "\\boxed{2^{2^{2^{2^{2^{2^{2^{2^{2^{2}}}}}}}}}}",
    "huge_factorial": "\\boxed{(10^{10})!}",
    "nested_sqrt_x3000": "\\sqrt{" * 3000,
    "long_sum_200k_chars": "1+" * 100_000 + "1",
    "open_parens_x10000": "(" * 10_000,
}


@pytest.mark.parametrize("name", list(PATHOLOGICAL))
def test_pathological_latex_completion_returns_within_three_times_the_bound(name):
    bound = 0.3
    math_verify_reward(["4"], ["4"], timeout_s=bound)  # imports done outside the timing
    t0 = time.perf_counter()
    out = math_verify_reward([PATHOLOGICAL[name]], ["4"], timeout_s=bound)
    elapsed = time.perf_counter() - t0
    CASES["bad_inputs_latex"] += 1
    assert out == [0.0]
    assert elapsed < 3 * bound, f"{name}: {elapsed:.2f} s for a {bound} s bound"


def test_pathological_gold_answer_and_worker_thread_path_are_bounded():
    bound = 0.3
    t0 = time.perf_counter()
    assert math_verify_reward(["4"], [PATHOLOGICAL["boxed_power_tower"]], timeout_s=bound) == [0.0]
    assert time.perf_counter() - t0 < 3 * bound
    CASES["bad_inputs_latex"] += 1
    # the trainer calls rewards from a worker thread (compute_rewards' timeout): the child-process path
    spec = RewardSpec.load("accuracy")
    box: dict[str, Any] = {}

    def work() -> None:
        compute_rewards([spec], ["q"], ["4"], {"answer": ["4"]})  # starts the scoring child (not counted)
        t0 = time.perf_counter()
        box["slow"] = compute_rewards([spec], ["q"], [PATHOLOGICAL["power_tower"]], {"answer": ["4"]})
        box["elapsed"] = time.perf_counter() - t0
        box["next"] = compute_rewards([spec], ["q"], ["4"], {"answer": ["4"]})  # the scorer still works

    worker = threading.Thread(target=work)
    worker.start()
    worker.join(60)
    CASES["bad_inputs_latex"] += 1
    assert box["slow"].per_function["accuracy"] == [0.0]
    assert box["slow"].failures["accuracy"] == 0  # a timed-out item scores 0; it is not a reward failure
    assert box["elapsed"] < 3 * 1.0, box  # the built-in accuracy reward's bound is 1 s per completion
    assert box["next"].per_function["accuracy"] == [1.0]


# --- untrusted files


def _tiny_training_objects():
    from klgrad.models import load_model_and_tokenizer

    policy, _ = load_model_and_tokenizer(EMBEDDED_DIR / "tiny_addition")
    ref, _ = load_model_and_tokenizer(EMBEDDED_DIR / "tiny_addition")
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)
    return policy, ref, opt, sched


@pytest.mark.parametrize("raw", [False, True], ids=["torch_zip_pickle", "raw_pickle_stream"])
def test_malicious_optim_pt_is_refused_by_load_checkpoint(tmp_path, raw):
    from safetensors.torch import save_model

    policy, ref, opt, sched = _tiny_training_objects()
    ckpt = tmp_path / "step_000001"
    ckpt.mkdir()
    save_model(policy, str(ckpt / "policy.safetensors"))
    (ckpt / "state.json").write_text(json.dumps({"step": 1, "beta": 0.5}))
    marker = tmp_path / "pwned"
    write_evil_optim(ckpt / "optim.pt", marker, raw=raw)
    CASES["bad_inputs_untrusted"] += 1
    with pytest.raises((pickle.UnpicklingError, ValueError)) as info:
        load_checkpoint(ckpt, policy, ref, opt, sched)
    assert not marker.exists(), "the pickle's payload ran"
    refused = info.value if isinstance(info.value, pickle.UnpicklingError) else info.value.__cause__
    assert isinstance(refused, pickle.UnpicklingError), repr(info.value)  # refused by the weights-only unpickler


def test_yaml_config_with_python_tags_is_refused(tmp_path, capsys):
    from klgrad.cli import main

    marker = tmp_path / "pwned"
    for i, text in enumerate(
        (
            f'train: !!python/object/apply:os.system ["touch {marker}"]\n',
            f'!!python/object/apply:os.system ["touch {marker}"]\n',
            f'kl:\n  beta: !!python/object/new:os.system ["touch {marker}"]\n',
        )
    ):
        p = tmp_path / f"evil{i}.yaml"
        p.write_text(text)
        CASES["bad_inputs_untrusted"] += 1
        with pytest.raises(ConfigError, match=re.escape(str(p))):
            load_config(p)
        assert (
            main(["train", "--config", str(p), "--train.out_dir", str(tmp_path / f"run{i}"), "--train.threads", "null"])
            == 2
        )
        err = capsys.readouterr().err
        assert str(p) in err
        assert "not valid YAML" in err
        assert not (tmp_path / f"run{i}").exists()
    assert not marker.exists()


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("missing_answer.jsonl", b'{"prompt": "1+1="}\n'),
        ("non_utf8.jsonl", b'{"prompt": "\xff", "answer": "2"}\n'),
        ("empty.jsonl", b""),
        ("not_jsonl.txt", b"1+1=2\n"),
        ("absent.jsonl", None),
    ],
)
def test_cli_refuses_bad_data_before_writing_anything(tmp_path, capsys, name, content):
    from klgrad.cli import main

    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    run = tmp_path / "run"
    CASES["bad_inputs_data_cli"] += 1
    args = ["--data.task", "file", "--data.path", str(path), "--train.out_dir", str(run), "--train.threads", "null"]
    rc = main(["train", "--config", CONFIG, *args])  # threads null: leave this process's torch threads alone
    assert rc == 2
    assert str(path) in capsys.readouterr().err
    assert not run.exists()


# ----------------------------------------------------------------------------------------------------------
# subprocess scenarios


def test_uninterrupted_baseline_run(runs):
    base = runs.get("baseline")
    assert base["proc"].returncode == 0, fail_msg(base["proc"])
    run = base["run"]
    assert list(step_dirs(run)) == ["step_000002", "step_000004"]
    assert all(checksums_verify(p) for p in step_dirs(run).values())
    assert [r["step"] for r in metrics(run)] == list(range(STEPS + 1))


@pytest.mark.parametrize(
    ("point", "step"), KILL_POINTS, ids=[f"kill{i + 1}of{N_KILL}-{p}:{s}" for i, (p, s) in enumerate(KILL_POINTS)]
)
def test_sigkill_then_resume_reproduces_the_uninterrupted_run_bit_for_bit(runs, point, step):
    base = runs.get("baseline")
    assert base["proc"].returncode == 0, fail_msg(base["proc"])
    res = runs.get(f"kill-{point}:{step}")
    CASES["kill_points_tried"] += 1
    killed = res["killed"]
    assert killed.returncode == -signal.SIGKILL, fail_msg(killed)  # died by its own SIGKILL at that point
    # after the kill: the newest valid checkpoint is the one expected, and it verifies
    assert res["latest_verifies"]
    assert res["latest"] == expected_latest(point, step), res["latest"]
    if point == "checkpoint_rename":
        assert res["pointer"] != res["latest"]  # the pointer lags behind: latest_checkpoint must not trust it
    before = stable(res["records_after_kill"])
    assert before == stable(metrics(base["run"]))[: len(before)]  # what was written before the kill is right
    # the killed run died holding the run directory's lock (its pid is still in the file, never cleared) ...
    assert (res["lock_after_kill"] or "").strip().isdigit(), res["lock_after_kill"]
    # resume (no fault injection) until it finishes
    assert res["resumes"][-1].returncode == 0, fail_msg(res["resumes"][-1])
    assert len(res["resumes"]) == 1  # one resume is enough
    run = res["run"]
    assert (run / LOCK_NAME).read_text() == ""  # ... and resume took it at once (no stale lock) and released it
    assert stable(metrics(run)) == stable(metrics(base["run"]))
    assert list(step_dirs(run)) == list(step_dirs(base["run"]))
    for name, ckpt in step_dirs(run).items():
        assert checksums_verify(ckpt), name
        assert_same_weights(ckpt / "policy.safetensors", base["run"] / "checkpoints" / name / "policy.safetensors")
    assert not list((run / "checkpoints").glob(".tmp_*")), "a temporary checkpoint folder was left behind"
    pointer = (run / "checkpoints" / "latest").read_text().strip()
    assert checksums_verify(run / "checkpoints" / pointer)  # the pointer may lag, but never dangles


def test_torn_newest_checkpoint_falls_back_to_the_previous_one(runs):
    base = runs.get("baseline")
    res = runs.get("torn")
    CASES["bad_inputs_checkpoint"] += 1
    assert res["pointer"] == "step_000004"  # the pointer names the torn one
    assert res["latest"] is not None
    assert res["latest"].name == "step_000002"
    proc = res["resumes"][-1]
    assert proc.returncode == 0, fail_msg(proc)
    assert stable(metrics(res["run"])) == stable(metrics(base["run"]))
    assert_same_weights(
        res["run"] / "checkpoints" / "step_000004" / "policy.safetensors",
        base["run"] / "checkpoints" / "step_000004" / "policy.safetensors",
    )


def _corrupt_truncate(ckpt: Path) -> None:
    (ckpt / "policy.safetensors").write_bytes((ckpt / "policy.safetensors").read_bytes()[:100])


def _corrupt_flip_byte(ckpt: Path) -> None:
    data = bytearray((ckpt / "optim.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (ckpt / "optim.pt").write_bytes(bytes(data))


def _corrupt_no_checksums(ckpt: Path) -> None:
    (ckpt / "checksums.json").unlink()


def _corrupt_torn_checksums(ckpt: Path) -> None:
    (ckpt / "checksums.json").write_text('{"policy.safe')


def _corrupt_missing_state(ckpt: Path) -> None:
    (ckpt / "state.json").unlink()


def _corrupt_empty_checksums(ckpt: Path) -> None:
    (ckpt / "checksums.json").write_text("{}")


@pytest.mark.parametrize(
    "corrupt",
    [
        _corrupt_truncate,
        _corrupt_flip_byte,
        _corrupt_no_checksums,
        _corrupt_torn_checksums,
        _corrupt_missing_state,
        _corrupt_empty_checksums,
    ],
)
def test_corrupt_checkpoints_are_skipped_whatever_the_pointer_says(runs, tmp_path, corrupt):
    base = runs.get("baseline")
    assert base["proc"].returncode == 0, fail_msg(base["proc"])
    run = tmp_path / "run"
    shutil.copytree(base["run"], run)
    CASES["bad_inputs_checkpoint"] += 1
    corrupt(run / "checkpoints" / "step_000004")
    assert latest_checkpoint(run).name == "step_000002"
    corrupt(run / "checkpoints" / "step_000002")
    assert latest_checkpoint(run) is None
    (run / "checkpoints" / "latest").unlink()
    assert latest_checkpoint(run) is None


def test_pointer_missing_or_wrong_is_ignored(runs, tmp_path):
    base = runs.get("baseline")
    run = tmp_path / "run"
    shutil.copytree(base["run"], run)
    (run / "checkpoints" / "latest").write_text("step_000002")
    assert latest_checkpoint(run).name == "step_000004"
    (run / "checkpoints" / "latest").write_text("../../etc")
    assert latest_checkpoint(run).name == "step_000004"
    (run / "checkpoints" / "latest").unlink()
    assert latest_checkpoint(run).name == "step_000004"


def _optim_state(ckpt: Path) -> dict:
    return torch.load(ckpt / "optim.pt", weights_only=True)["optimizer"]["state"]


def test_nan_step_is_skipped_and_leaves_weights_and_optimizer_untouched(runs):
    res = runs.get("nan-one")
    proc, run = res["proc"], res["run"]
    assert proc.returncode == 0, fail_msg(proc)
    recs = {r["step"]: r for r in metrics(run)}
    assert sorted(recs) == list(range(STEPS + 1))
    assert recs[2]["skipped_updates"] > 0
    assert re.search(r"non-finite|skipp", proc.stderr, re.IGNORECASE), fail_msg(proc)  # logged, not only counted
    assert recs[1]["skipped_updates"] == 0
    assert recs[3]["skipped_updates"] == 0
    ck = step_dirs(run)
    assert list(ck) == [f"step_{s:06d}" for s in range(1, STEPS + 1)]
    assert_same_weights(ck["step_000001"] / "policy.safetensors", ck["step_000002"] / "policy.safetensors")
    s1, s2 = _optim_state(ck["step_000001"]), _optim_state(ck["step_000002"])
    assert s1.keys() == s2.keys()
    for k in s1:
        for name in s1[k]:
            assert torch.equal(s1[k][name], s2[k][name]), (k, name)  # AdamW moments and step count
    w2, w3 = (
        load_file(str(ck["step_000002"] / "policy.safetensors")),
        load_file(str(ck["step_000003"] / "policy.safetensors")),
    )
    assert any(not torch.equal(w2[k], w3[k]) for k in w2)  # training went on after the skipped step
    for r in recs.values():
        for k, v in r.items():
            assert v is None or not isinstance(v, float) or math.isfinite(v), (r["step"], k)


def test_consecutive_nan_steps_stop_with_a_resumable_checkpoint(runs):
    res = runs.get("nan-stop")
    proc = res["proc"]
    assert proc.returncode not in (0, -signal.SIGKILL), fail_msg(proc)
    assert "non-finite" in proc.stderr, fail_msg(proc)
    assert res["latest"] is not None, "no usable checkpoint after the stop"
    assert res["latest_verifies"]
    assert res["latest"].name in proc.stderr, "the message must name the last good checkpoint"
    reference = load_file(str(EMBEDDED_DIR / "tiny_addition" / "model.safetensors"))
    common = [k for k in res["stop_weights"] if k in reference]
    assert len(common) > 10
    for k in common:  # every update was skipped: the saved weights are the reference's
        assert torch.equal(res["stop_weights"][k], reference[k]), k
    resumed = res["resumes"][-1]
    assert resumed.returncode == 0, fail_msg(resumed)
    recs = metrics(res["run"])
    assert [r["step"] for r in recs] == list(range(STEPS + 1))
    assert recs[-1]["skipped_updates"] == 0


def test_reward_failure_budget_stops_the_run(runs):
    proc = runs.get("reward-budget")["proc"]
    CASES["bad_inputs_reward"] += 1
    assert proc.returncode not in (0, -signal.SIGKILL), fail_msg(proc)
    assert "reward.max_failure_fraction" in proc.stderr, fail_msg(proc)


@pytest.fixture
def in_process_cli(capsys):
    """``klgrad train`` in this process (no import cost); restores torch's thread count, which the run sets."""
    from klgrad.cli import main

    threads = torch.get_num_threads()

    def call(*args: str) -> tuple[int, str]:
        CASES["in_process_runs"] += 1
        rc = main(["train", *args])
        return rc, capsys.readouterr().err

    yield call
    torch.set_num_threads(threads)


def test_failing_reward_without_budget_is_isolated_and_counted(tmp_path, monkeypatch, in_process_cli):
    monkeypatch.syspath_prepend(str(write_reward_module(tmp_path / "mods")))
    run = tmp_path / "run"
    rc, err = in_process_cli(*train_args(run, "--reward.functions", REWARD_FUNCTIONS, steps=2))
    CASES["bad_inputs_reward"] += 1
    assert rc == 0, err[-3000:]
    steps = [r for r in metrics(run) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["reward/failures"] == N_SAMPLES  # the raising function failed on every sample
        assert r["reward/accuracy"] is not None  # the other function still scored


def test_malicious_optim_pt_is_refused_on_resume(runs, tmp_path, in_process_cli):
    base = runs.get("baseline")
    assert base["proc"].returncode == 0, fail_msg(base["proc"])
    run = tmp_path / "run"
    shutil.copytree(base["run"], run)
    marker = tmp_path / "pwned"
    ckpt = run / "checkpoints" / "step_000004"
    write_evil_optim(ckpt / "optim.pt", marker)
    # the attacker also fixes checksums.json, so the checkpoint is not merely skipped as corrupt
    sums = {p.name: __import__("hashlib").sha256(p.read_bytes()).hexdigest() for p in sorted(ckpt.iterdir())}
    sums.pop("checksums.json")
    (ckpt / "checksums.json").write_text(json.dumps(sums))
    assert latest_checkpoint(run) == ckpt  # it verifies, so resume loads it
    CASES["bad_inputs_untrusted"] += 1
    try:
        rc, err = in_process_cli("--resume", str(run))
    except pickle.UnpicklingError:  # refused by the weights-only unpickler, not turned into a CLI error
        rc, err = None, "UnpicklingError"
    assert not marker.exists(), "the pickle's payload ran"
    assert rc != 0, err[-3000:]
    if rc is not None:
        assert "optim.pt" in err, err[-3000:]
        assert "Weights only load failed" in err or "Unpickl" in err, err[-3000:]


def test_cli_bad_dataset_exits_2_and_writes_nothing(tmp_path, in_process_cli):
    bad = tmp_path / "BAD.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n', encoding="utf-8")
    run = tmp_path / "run"
    CASES["bad_inputs_data_cli"] += 1
    rc, err = in_process_cli(*train_args(run, "--data.task", "file", "--data.path", str(bad)))
    assert rc == 2, err[-3000:]
    assert f"{bad}: row 2" in err
    assert not run.exists()
