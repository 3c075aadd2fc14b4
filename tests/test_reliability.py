"""Reliability: kill/resume bit-identity, torn checkpoints, non-finite steps, reward failure budget, untrusted
files, extreme inputs, and config / dataset fuzzing. docs/reliability.md states each guarantee and these figures.

The slow part is ``python -m klgrad train`` started as a subprocess (about 4 s of imports each). Every such run
(the *scenarios* below) is submitted to a two-worker pool when the module starts, so they run side by side and
alongside the in-process tests; the tests that need one wait for its result. ``KLGRAD_RELIABILITY_COUNTS=PATH``
writes the case counts (kill points, fuzz examples, bad inputs) to PATH as JSON at the end of the module.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
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
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from klgrad.advantages import SHAPING_METHODS
from klgrad.config import Config, ConfigError, load_config
from klgrad.data.loaders import DataError, load_examples
from klgrad.kl import KL_HEADS, LEVELS, RATIO_LEVELS, kl_estimate, kl_loss
from klgrad.objective import (
    FORMS,
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

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
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
CASES: collections.Counter[str] = collections.Counter()
"""Cases run, by kind (docs/reliability.md reports them)."""


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
    report = dict(sorted(CASES.items()))
    print(f"\nreliability case counts: {report}")
    if os.environ.get("KLGRAD_RELIABILITY_COUNTS"):
        Path(os.environ["KLGRAD_RELIABILITY_COUNTS"]).write_text(json.dumps(report, indent=1))


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
        spec = ObjectiveSpec(kl_head=name, beta=0.5, kl_level=level, form=form, kl_ratio_level=kl_ratio_level)
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


# --- config fuzzing: unknown keys, wrong types, out-of-range values -> ConfigError naming the field


def _field_types() -> dict[str, Any]:
    out: dict[str, Any] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
            else:
                out[f"{prefix}{f.name}"] = tp

    walk(Config, "")
    return out


FIELDS = _field_types()
SECTIONS = sorted({k.split(".")[0] for k in FIELDS})
_IDENT = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True)


def _unwrap(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, __import__("types").UnionType):
        rest = [a for a in args if a is not type(None)]
        return rest[0], type(None) in args
    return tp, False


def _valid_float(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _type_ok(base: Any, v: Any) -> bool:
    """Whether ``v`` has the right type for ``base`` (the oracle: wrong-typed values must be refused)."""
    origin = typing.get_origin(base)
    if origin is typing.Literal:
        return v in typing.get_args(base) and isinstance(v, str)
    if origin is tuple:
        return isinstance(v, list | tuple) and len(v) == 2 and all(_valid_float(x) for x in v)
    if origin is list:
        return True  # reward.functions: its own strategy below
    if base is bool:
        return isinstance(v, bool)
    if base is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if base is float:
        return _valid_float(v)
    if base is str:
        return isinstance(v, str)
    raise AssertionError(base)


_ANY_VALUE = st.one_of(
    st.text(max_size=6),
    st.integers(),
    st.sampled_from([10**400, -(10**400), 2.5, float("nan"), float("inf"), -float("inf")]),
    st.floats(),
    st.booleans(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@st.composite
def wrong_type(draw):
    key = draw(st.sampled_from(sorted(k for k in FIELDS if k != "reward.functions")))
    base, _ = _unwrap(FIELDS[key])
    value = draw(_ANY_VALUE.filter(lambda v: not _type_ok(base, v) and v is not None))
    return "wrong_type", {key: value}


@st.composite
def unknown_key(draw):
    if draw(st.booleans()):
        section = draw(st.sampled_from(SECTIONS))
        name = draw(_IDENT.filter(lambda n: f"{section}.{n}" not in FIELDS))
        return "unknown_key", {f"{section}.{name}": draw(_ANY_VALUE)}
    section = draw(_IDENT.filter(lambda n: n not in SECTIONS))
    return "unknown_key", {f"{section}.{draw(_IDENT)}": draw(_ANY_VALUE)}


def _neg(strict: bool = True):
    """Floats <= 0 (``strict``: the field must be > 0) or < 0 (the field must be >= 0)."""
    return st.floats(max_value=0.0 if strict else -1e-12, allow_nan=False, allow_infinity=False)


def _int_below(n: int):
    return st.integers(max_value=n - 1)


GROUP_METHODS = [
    m for m in SHAPING_METHODS if m not in ("none", "batch_baseline", "batch_norm", "reinforce", "reinforce_pp")
]
OUT_OF_RANGE = {
    "kl.beta": st.floats(max_value=-1e-12, allow_nan=False, allow_infinity=False),
    "algo.clip_eps_low": st.one_of(_neg(), st.floats(min_value=1.0, allow_nan=False, allow_infinity=False)),
    "algo.clip_eps_high": _neg(),
    "kl.clip_eps": st.one_of(_neg(), st.floats(min_value=1.0, allow_nan=False, allow_infinity=False)),
    "optim.lr": _neg(),
    "optim.weight_decay": _neg(strict=False),
    "optim.grad_clip": _neg(),
    "optim.warmup_steps": _int_below(0),
    "rollout.temperature": _neg(),
    "rollout.top_p": st.one_of(_neg(), st.floats(min_value=1.0 + 1e-9, allow_nan=False, allow_infinity=False)),
    "rollout.prompts_per_step": _int_below(1),
    "rollout.group_size": _int_below(1),
    "rollout.max_new_tokens": _int_below(1),
    "reward.timeout_s": _neg(),
    "reward.max_failure_fraction": st.one_of(
        _neg(strict=False), st.floats(min_value=1.0, allow_nan=False, allow_infinity=False)
    ),
    "kl.target_kl": _neg(),
    "kl.reset_ref_every": _int_below(1),
    "kl.head": _IDENT.filter(lambda n: n not in KL_HEADS),
    "algo.shaping": _IDENT.filter(lambda n: n not in SHAPING_METHODS),
    "algo.dual_clip": st.floats(max_value=1.0, allow_nan=False, allow_infinity=False),
    "algo.entropy_coef": _neg(strict=False),
    "algo.std_min": _neg(),
    "algo.std_max": _neg(),
    "algo.ppo_epochs": _int_below(1),
    "algo.mini_batches": _int_below(1),
    "algo.micro_batch_size": _int_below(1),
    "train.steps": _int_below(1),
    "train.save_every": _int_below(1),
    "train.eval_every": _int_below(0),
    "train.max_skipped_steps": _int_below(1),
    "train.threads": _int_below(0),
    "data.digits": _int_below(1),
    "data.n_train": _int_below(1),
    "data.n_eval": _int_below(1),
}


@st.composite
def out_of_range(draw):
    kind = draw(st.sampled_from(["single", "group_size_1", "not_divisible", "combined_token", "betas", "file"]))
    if kind == "single":
        key = draw(st.sampled_from(sorted(OUT_OF_RANGE)))
        return "out_of_range", {key: draw(OUT_OF_RANGE[key])}
    if kind == "group_size_1":
        return "out_of_range", {"rollout.group_size": 1, "algo.shaping": draw(st.sampled_from(GROUP_METHODS))}
    if kind == "not_divisible":
        p, g = draw(st.integers(1, 12)), draw(st.integers(2, 8))
        m = draw(st.integers(2, 64).filter(lambda m: (p * g) % m != 0 or ((p * g) // m) % g != 0))
        return "out_of_range", {"rollout.prompts_per_step": p, "rollout.group_size": g, "algo.mini_batches": m}
    if kind == "combined_token":
        return "out_of_range", {"kl.form": "combined", "kl.level": "token"}
    if kind == "betas":
        bad = draw(st.one_of(st.floats(max_value=-1e-12, allow_nan=False), st.floats(min_value=1.0, allow_nan=False)))
        return "out_of_range", {"optim.betas": draw(st.permutations([0.9, bad]))}
    return "out_of_range", {"data.task": "file", "data.path": draw(st.sampled_from([None, ""]))}


@st.composite
def bad_reward_functions(draw):
    value = draw(
        st.one_of(
            st.just([]),
            st.text(max_size=5),
            st.integers(),
            st.lists(st.integers(), min_size=1, max_size=2),
            st.lists(
                st.fixed_dictionaries({"name": st.integers() | st.none() | st.lists(st.text(max_size=2))}),
                min_size=1,
                max_size=2,
            ),
            st.lists(
                st.fixed_dictionaries(
                    {"name": st.just("accuracy"), "weight": st.sampled_from(["1", float("nan"), 10**400, None])}
                ),
                min_size=1,
                max_size=2,
            ),
            st.lists(
                st.fixed_dictionaries({"name": st.just("accuracy"), "wieght": st.floats()}), min_size=1, max_size=1
            ),
        )
    )
    return "wrong_type", {"reward.functions": value}


@st.composite
def section_not_mapping(draw):
    return "wrong_type", {draw(st.sampled_from(SECTIONS)): draw(_ANY_VALUE.filter(lambda v: not isinstance(v, dict)))}


_PATH_RE = re.compile(r"[A-Za-z_]\w*(?:\[\d+\])*(?:\.[A-Za-z_]\w*(?:\[\d+\])*)*")


def _names_a_field(message: str, overrides: dict[str, Any]) -> bool:
    m = _PATH_RE.match(message)
    if not m:
        return False
    name = re.sub(r"\[\d+\]", "", m.group(0))
    known = set(FIELDS) | set(SECTIONS) | {f"reward.functions.{f}" for f in ("name", "weight")}
    prefixes = {".".join(k.split(".")[: i + 1]) for k in overrides for i in range(k.count(".") + 1)}
    allowed = known | prefixes
    return name in allowed or name.rpartition(".")[0] in allowed  # the field, or an unknown key under one


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(case=st.one_of(wrong_type(), unknown_key(), out_of_range(), bad_reward_functions(), section_not_mapping()))
@example(case=("wrong_type", {"kl.beta": 10**400}))  # a 401-digit YAML integer for a float field
@example(case=("wrong_type", {"optim.betas": [0.9, 10**400]}))
@example(case=("out_of_range", {"train.threads": -1}))
@example(case=("out_of_range", {"rollout.group_size": 1, "algo.shaping": "grpo"}))
@example(case=("out_of_range", {"rollout.prompts_per_step": 3, "rollout.group_size": 2, "algo.mini_batches": 4}))
@example(case=("out_of_range", {"algo.clip_eps_low": 0.0}))
def test_config_fuzz_always_raises_config_error_naming_the_field(case):
    kind, overrides = case
    CASES["config_fuzz"] += 1
    CASES[f"config_fuzz_{kind}"] += 1
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    message = str(info.value)
    assert _names_a_field(message, overrides), (overrides, message)


# --- dataset fuzzing: bad rows -> DataError naming the file and the row, or skipped and counted

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
