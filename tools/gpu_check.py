"""GPU readiness of klgrad in one run: named steps, each timed, with its peak GPU memory and pass/fail/skipped.

    python tools/gpu_check.py                       # on a CUDA machine (tools/gpu_check.sh sets it up first)
    python tools/gpu_check.py --device cpu --small  # the plumbing on CPU: a tiny model, 2 steps, no vLLM

Steps (docs/gpu.md): ``gpu_tests`` (``pytest -m gpu tests/test_gpu.py``), ``make_model`` (a random Qwen2 of
~0.5B parameters), ``train`` and ``train_lora`` (20 ``klgrad train`` steps on it, without and with LoRA),
``train_accelerate`` (the same under ``accelerate launch`` with one process), ``train_ddp`` (``accelerate launch
--multi_gpu`` with 2 processes, one GPU each; only where torch sees 2 GPUs), ``eval`` (``klgrad eval`` of the
trained run and the base model on a generated addition benchmark), ``vllm`` (a few steps with ``rollout.engine
vllm``, only where vLLM is importable). In the ``--device cpu`` dry mode the accelerate steps launch the same
runs on the CPU (one process with ``--cpu``; 2 processes of CPU DDP over gloo). A step that fails is a fail row,
never the end of the check; a step whose prerequisite did not pass is skipped, naming it. Writes
``OUT/gpu_check.json`` (the table plus the machine: GPU, torch, CUDA, klgrad commit) and ``OUT/logs/STEP.log``;
exits 1 if any step failed, 2 when it cannot start (no CUDA GPU without ``--device cpu``, a bad argument, an
output folder that is not its own).

Peak GPU memory is ``torch.cuda.max_memory_allocated`` over the step: commands run under this script's
``--measure FILE`` wrapper (the command in-process, the peak written to FILE at exit; under ``accelerate launch``
the wrapper is the launched script, and rank 0's peak is the one written); in-process steps reset the counter
first. It counts what torch's allocator handed out, not the CUDA context or other processes.

Only the standard library is imported at the top: ``--requirements`` and ``--missing`` (used by
tools/fill_wheelhouse.sh and tools/gpu_check.sh before anything is installed) need no torch.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JSON_NAME = "gpu_check.json"

REQUIREMENTS: dict[str, tuple[str, bool]] = {
    # import name: (pip requirement, whether that package's own requirements include torch)
    "transformers": ("transformers>=4.56", False),
    "safetensors": ("safetensors>=0.4", False),
    "tokenizers": ("tokenizers>=0.20", False),
    "yaml": ("pyyaml>=6", False),
    "numpy": ("numpy>=1.26", False),
    "rich": ("rich>=13", False),
    "matplotlib": ("matplotlib>=3.8", False),
    "math_verify": ("math-verify>=0.7", False),
    "latex2sympy2_extended": ("latex2sympy2_extended", False),
    "datasets": ("datasets>=3", False),
    "pyarrow": ("pyarrow>=15", False),
    "tqdm": ("tqdm>=4.66", False),
    "tensorboard": ("tensorboard>=2.15", False),
    "scipy": ("scipy>=1.11", False),
    "pydantic": ("pydantic>=2.7", False),
    "pytest": ("pytest>=8", False),
    "hypothesis": ("hypothesis>=6.100", False),
    "jsonschema": ("jsonschema>=4", False),
    "psutil": ("psutil", False),  # accelerate's and peft's, fetched here because they are fetched without deps
    "huggingface_hub": ("huggingface_hub", False),
    "accelerate": ("accelerate>=1.0", True),
    "peft": ("peft", True),
}
"""What the check imports (klgrad's dependencies, its tests' and LoRA's), for the wheel folder of an offline
machine. torch is not here: the check uses the machine's own CUDA build and never installs one."""


def requirements(kind: str) -> list[str]:
    """pip requirements: ``all``, ``with-deps`` (fetched with their dependencies) or ``no-deps`` (their own
    requirements include torch: fetched alone, so that a wheel folder never holds a torch)."""
    keep = {"all": (False, True), "with-deps": (False,), "no-deps": (True,)}[kind]
    return [req for req, needs_torch in REQUIREMENTS.values() if needs_torch in keep]


def missing_requirements() -> list[str]:
    """The requirements of :data:`REQUIREMENTS` whose module does not import here, plus a setuptools able to
    build the editable install (PEP 660: setuptools >= 68, and >= 70.1 or ``wheel`` for its bdist_wheel)."""
    missing = []
    for module, (req, _) in REQUIREMENTS.items():
        try:
            __import__(module)
        except Exception:  # not installed, or installed but broken: either way it needs the wheel
            missing.append(req)
    try:
        import setuptools

        version = tuple(int(x) for x in setuptools.__version__.split(".")[:2] if x.isdigit())
        ok = version >= (70, 1) or (version >= (68, 0) and importlib.util.find_spec("wheel") is not None)
    except Exception:
        ok = False
    if not ok:
        missing.append("setuptools>=70.1")
    return missing


# ----------------------------------------------------------------------------------------------------------
# steps


@dataclass
class Result:
    """One row of the table."""

    name: str
    status: str
    """pass | fail | skipped"""
    detail: str
    seconds: float = 0.0
    peak_gpu_bytes: int | None = None
    command: str | None = None
    log: str | None = None


class Skip(Exception):
    """Raised by a step that does not apply here; the message is the reason."""


class Fail(Exception):
    """Raised by a step whose check did not hold; the message says what."""


@dataclass
class Step:
    name: str
    what: str
    run: Callable[[Context], str]
    """Returns the row's detail; raises Skip, Fail or anything else (a fail row)."""
    needs: tuple[str, ...] = ()
    timeout_s: float = 600.0
    applies: Callable[[Context], str | None] = lambda ctx: None
    """Why the step does not apply on this machine (its row is skipped with that reason), checked first; None."""


@dataclass
class Context:
    out: Path
    device: str
    small: bool
    python: str = sys.executable
    results: dict[str, Result] = field(default_factory=dict)
    current: Step | None = None
    command: str | None = None
    """The current step's command (set by :func:`run_measured`)."""
    peak: int | None = None
    """Its peak GPU bytes as the command reported them (None: it did not use CUDA)."""

    @property
    def model_dir(self) -> Path:
        return self.out / "model"

    def run_dir(self, name: str) -> Path:
        return self.out / "runs" / name

    def log_path(self, name: str) -> Path:
        return self.out / "logs" / f"{name}.log"


def child_env() -> dict[str, str]:
    """The environment of every command: this checkout's klgrad first on the path (whatever else is installed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_measured(
    ctx: Context, target: list[str], args: list[str], launcher: list[str] | None = None
) -> tuple[int, str]:
    """``python TARGET ARGS`` (``target``: ``["-m", "klgrad"]`` or ``["tools/x.py"]``, run in the checkout) under
    the peak-memory wrapper, its output in the step's log; sets ``ctx.command`` and ``ctx.peak``. With
    ``launcher`` (``["-m", "accelerate.commands.launch", OPTIONS...]``): ``python LAUNCHER TARGET ARGS``, the
    launcher starting the wrapper as its script.

    Returns (exit code, the last lines of its output). Raises :class:`Fail` when it runs past the step's time
    limit (its whole process group is killed).
    """
    step = ctx.current
    assert step is not None
    log = ctx.log_path(step.name)
    log.parent.mkdir(parents=True, exist_ok=True)
    report = ctx.out / "logs" / f"{step.name}.peak.json"
    report.unlink(missing_ok=True)
    launcher = launcher or []
    argv = [ctx.python, *launcher, str(Path(__file__).resolve()), "--measure", str(report), *target, *args]
    ctx.command = shlex.join(["python", *launcher, *target, *args])
    with log.open("w", encoding="utf-8") as f:
        f.write(f"$ {ctx.command}\n")
        f.flush()
        proc = subprocess.Popen(
            argv, cwd=REPO, env=child_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=step.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise Fail(f"timed out after {step.timeout_s:.0f} s (log: {log})") from None
        except BaseException:  # Ctrl-C reaches this process only (the command runs in its own session)
            _kill_group(proc)
            raise
    if report.is_file():
        ctx.peak = json.loads(report.read_text()).get("peak_gpu_bytes")
    return code, _tail(log)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the command and everything it started (its session's process group), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _tail(path: Path, lines: int = 15) -> str:
    """The last non-empty lines of a log (progress bars' carriage returns as line breaks)."""
    text = path.read_text(encoding="utf-8", errors="replace").replace("\r", "\n")
    return "\n".join([line for line in text.splitlines() if line.strip()][-lines:])


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else "(no output)"


GPU_TESTS = "tests/test_gpu.py"
"""Where the GPU-marked tests live. The step names the file rather than collecting the whole suite: modules
for optional integrations (tests/integrations/test_trl.py imports trl at the top) would fail collection on a GPU
machine without them."""


def step_gpu_tests(ctx: Context) -> str:
    """``python -m pytest -q -m gpu tests/test_gpu.py``: the GPU-marked tests, counted from a JUnit XML report."""
    xml = ctx.out / "logs" / "gpu_tests.xml"
    args = ["-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={xml}", GPU_TESTS]
    code, tail = run_measured(ctx, ["-m", "pytest"], args)
    if code == 5:
        raise Fail("no gpu-marked tests were collected")
    if not xml.is_file():
        raise Fail(f"pytest exit {code}, no report: {_last_line(tail)}")
    return junit_verdict(ET.parse(xml).getroot(), code, tail)


def junit_verdict(root: ET.Element, code: int, tail: str) -> str:
    """pass detail ``"N passed, M skipped"``; raises Fail (any failure or error, or a non-zero exit) or Skip
    (every test skipped: no CUDA GPU), naming the failed tests / the first skip reason."""
    n = skipped = 0
    failed, reasons = [], []
    for case in root.iter("testcase"):
        n += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(case.get("name", "?"))
        elif (sk := case.find("skipped")) is not None:
            skipped += 1
            reasons.append(sk.get("message", "").removeprefix("Skipped: "))
    if failed or code != 0:
        named = ", ".join(failed[:4]) + (" ..." if len(failed) > 4 else "")
        raise Fail(f"{len(failed)} of {n} failed ({named or f'pytest exit {code}'}): {_last_line(tail)}")
    if n and skipped == n:
        raise Skip(f"all {n} skipped: {reasons[0] or 'no reason given'}")
    return f"{n - skipped} passed, {skipped} skipped"


def step_make_model(ctx: Context) -> str:
    """A random Qwen2 of 0.5B parameters (``--small``: 2M), initialised on the check's device."""
    args = ["--arch", "qwen2", "--params", "2M" if ctx.small else "0.5B", "--out", str(ctx.model_dir)]
    code, tail = run_measured(ctx, ["tools/make_random_model.py"], [*args, "--device", ctx.device])
    if code != 0:
        raise Fail(f"exit {code}: {_last_line(tail)}")
    return _last_line(tail).split(" -> ")[0]


TRAIN_STEPS = {False: 20, True: 2}
"""Steps of the train and train_lora runs (GPU, --small)."""


def train_args(ctx: Context, name: str, steps: int, extra: list[str]) -> list[str]:
    """``klgrad train`` on the random model: the tiny_add config, evaluation at the start and the end only (no
    exact-objective enumeration: a random model spreads its mass over every response), and an entropy bonus so
    that every update has a non-zero gradient (a random model earns no reward, so GRPO's advantages are 0)."""
    args = ["train", "--config", "configs/tiny_add.yaml", "--model.path", str(ctx.model_dir)]
    args += ["--model.device", ctx.device, "--train.steps", str(steps), "--train.out_dir", str(ctx.run_dir(name))]
    args += ["--train.eval_every", "0", "--train.eval_objective_prompts", "0", "--train.save_every", str(steps)]
    args += ["--algo.entropy_coef", "0.01", "--data.n_eval", "8" if ctx.small else "64"]
    if ctx.small:
        args += ["--rollout.prompts_per_step", "4", "--rollout.group_size", "2"]
    return args + extra


def check_run(run_dir: Path, steps: int, need: tuple[str, ...] = ()) -> str:
    """A finished run's metrics: ``steps`` step records, every gradient finite and non-zero, no skipped update,
    the keys ``need`` on every step. Returns a one-line summary; raises :class:`Fail`."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise Fail(f"no {path}")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in records if "reward/mean" in r]
    if [r["step"] for r in rows] != list(range(1, steps + 1)):
        raise Fail(f"metrics.jsonl has steps {[r['step'] for r in rows]}, expected 1..{steps}")
    for r in rows:
        g = r.get("grad_norm")
        if g is None or not math.isfinite(g) or g <= 0 or r.get("skipped_updates"):
            raise Fail(f"step {r['step']}: grad_norm {g}, skipped_updates {r.get('skipped_updates')}")
        absent = [k for k in need if r.get(k) is None]
        if absent:
            raise Fail(f"step {r['step']}: no {', '.join(absent)} in metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    return f"{steps} steps, {summary['mean_step_time_s']:.2f} s/step, last kl/k1 {rows[-1]['kl/k1']:.2e}"


def _train(ctx: Context, name: str, steps: int, extra: list[str], need: tuple[str, ...] = ()) -> str:
    code, tail = run_measured(ctx, ["-m", "klgrad"], train_args(ctx, name, steps, extra))
    if code != 0:
        raise Fail(f"exit {code}: {_last_line(tail)}")
    return check_run(ctx.run_dir(name), steps, need)


def step_train(ctx: Context) -> str:
    """Full fine-tuning: 20 steps (``--small``: 2)."""
    return _train(ctx, "train", TRAIN_STEPS[ctx.small], [])


def step_train_lora(ctx: Context) -> str:
    """LoRA (``model.lora_rank`` 16): 20 steps (``--small``: 2); its checkpoint must hold the adapter, not the
    policy's weights."""
    steps = TRAIN_STEPS[ctx.small]
    summary = _train(ctx, "train_lora", steps, ["--model.lora_rank", "16", "--model.lora_alpha", "32"])
    ckpt = ctx.run_dir("train_lora") / "checkpoints" / f"step_{steps:06d}"
    files = sorted(f.name for f in ckpt.iterdir()) if ckpt.is_dir() else []
    if "adapter.safetensors" not in files or "policy.safetensors" in files:
        raise Fail(f"{ckpt}: expected adapter.safetensors and no policy.safetensors, found {files}")
    return summary + ", adapter-only checkpoint"


ACCELERATE = ["-m", "accelerate.commands.launch"]
"""``accelerate launch`` as a module of the check's interpreter (the same as the ``accelerate`` command)."""


def free_port() -> int:
    """A TCP port of this machine that nothing listens on now (the rendezvous port of a launch)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def accelerate_launcher(device: str, processes: int, port: int) -> list[str]:
    """``accelerate launch`` OPTIONS for ``processes`` processes on this machine, with no mixed precision or dynamo
    (klgrad's precision is ``model.dtype``). One process: the simple launcher (``--cpu`` on the CPU). Several:
    torchrun (``--multi_gpu``; on the CPU too, where klgrad's ``model.device cpu`` makes it DDP over gloo:
    ``--cpu`` with several processes would start one, docs/distributed.md)."""
    options = ["--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", "no"]
    options += ["--dynamo_backend", "no"]
    if processes > 1:
        options = ["--multi_gpu", *options, "--main_process_port", str(port)]
    elif device == "cpu":
        options = ["--cpu", *options]
    return [*ACCELERATE, *options]


def accelerate_missing(ctx: Context) -> str | None:
    return None if module_available("accelerate") else "accelerate not installed"


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


DDP_PROCESSES = 2


def ddp_missing(ctx: Context) -> str | None:
    """Why ``train_ddp`` cannot run here: no accelerate, or fewer GPUs than processes (on the CPU it runs)."""
    if reason := accelerate_missing(ctx):
        return reason
    if ctx.device == "cuda" and (n := gpu_count()) < DDP_PROCESSES:
        return f"needs {DDP_PROCESSES} CUDA GPUs (one per process), torch sees {n}"
    return None


def _launched(ctx: Context, name: str, processes: int) -> str:
    """``klgrad train`` as the train step, under ``accelerate launch`` with ``processes`` processes; run.json
    must record them."""
    steps = TRAIN_STEPS[ctx.small]
    extra = ["--train.threads", "1"] if ctx.device == "cpu" and processes > 1 else []
    launcher = accelerate_launcher(ctx.device, processes, free_port())
    code, tail = run_measured(ctx, ["-m", "klgrad"], train_args(ctx, name, steps, extra), launcher)
    if code != 0:
        raise Fail(f"exit {code}: {_last_line(tail)}")
    summary = check_run(ctx.run_dir(name), steps)
    recorded = json.loads((ctx.run_dir(name) / "run.json").read_text()).get("num_processes")
    if recorded != processes:
        raise Fail(f"run.json num_processes {recorded}, expected {processes}")
    return f"{summary}, {processes} process{'es' if processes > 1 else ''} under accelerate launch"


def step_train_accelerate(ctx: Context) -> str:
    """``accelerate launch --num_processes 1 -m klgrad train`` (``--cpu`` in the dry mode): the train step's run
    through accelerate's launcher, one process on one GPU."""
    return _launched(ctx, "train_accelerate", 1)


def step_train_ddp(ctx: Context) -> str:
    """``accelerate launch --multi_gpu --num_processes 2 -m klgrad train``: DDP, each process on its own GPU
    (``cuda:LOCAL_RANK``, NCCL); in the dry mode 2 CPU processes over gloo."""
    return _launched(ctx, "train_ddp", DDP_PROCESSES)


def write_benchmark(path: Path, n: int) -> Path:
    """``n`` held-out 2-digit addition prompts of klgrad's synthetic task as JSONL (prompt, answer, id)."""
    if str(REPO / "src") not in sys.path:
        sys.path.insert(0, str(REPO / "src"))
    from klgrad.data.tasks import make_splits

    _, heldout = make_splits("addition", 0, n, 20261123, 2)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": e.prompt, "answer": e.answer, "id": e.id}) + "\n" for e in heldout))
    return path


EVAL_KEYS = ("n", "k", "greedy_accuracy", "pass@1", "pass@k", "mean_length")


def step_eval(ctx: Context) -> str:
    """``klgrad eval`` of the base model and the trained runs (the LoRA run too when it finished) on 64 addition
    prompts (``--small``: 8), K = 4 samples of at most 16 tokens: every model's row in ``eval.json`` with every
    key, n = the prompts."""
    n = 8 if ctx.small else 64
    bench = write_benchmark(ctx.out / "bench" / "addition.jsonl", n)
    out = ctx.out / "eval"
    models = {"base": ctx.model_dir, "full": ctx.run_dir("train")}
    if (ctx.run_dir("train_lora") / "checkpoints").is_dir():
        models["lora"] = ctx.run_dir("train_lora")
    args = ["eval", *(x for label, path in models.items() for x in ("--model", f"{label}={path}"))]
    args += ["--data", str(bench), "--samples", "4", "--temperature", "1.0", "--out", str(out), "--device", ctx.device]
    args += ["--max-new-tokens", "16"]  # a random model rarely ends: responses run to the cap
    code, tail = run_measured(ctx, ["-m", "klgrad"], args)
    if code != 0:
        raise Fail(f"exit {code}: {_last_line(tail)}")
    report = out / "eval.json"
    if not report.is_file() or not (out / "results.md").is_file():
        raise Fail(f"exit 0 but no {report} or results.md")
    rows = json.loads(report.read_text()).get("models", {})
    if sorted(rows) != sorted(models):
        raise Fail(f"eval.json models {sorted(rows)}, expected {sorted(models)}")
    for label, row in rows.items():
        got = row.get("benchmarks", {}).get("addition", {})
        absent = [k for k in EVAL_KEYS if k not in got]
        if absent or got["n"] != n:
            raise Fail(f"eval.json {label}: missing {absent} or n = {got.get('n')} (expected {n})")
    return ", ".join(f"{label} greedy {rows[label]['benchmarks']['addition']['greedy_accuracy']:.3f}" for label in rows)


MISMATCH_KEYS = ("mismatch/weight_mean", "mismatch/weight_max", "mismatch/capped_frac")
VLLM_STEPS = 3


def module_available(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def vllm_missing(ctx: Context) -> str | None:
    if not module_available("vllm"):
        return "vllm not installed"
    if ctx.device == "cpu":
        return "vllm needs a CUDA GPU (--device cpu)"
    return None


def step_vllm(ctx: Context) -> str:
    """``rollout.engine vllm`` with the token-level mismatch correction for 3 steps (the weights synced into the
    engine after every update), the mismatch metrics on every step."""
    extra = ["--rollout.engine", "vllm", "--rollout.mismatch_correction", "token"]
    detail = _train(ctx, "vllm", VLLM_STEPS, extra, need=MISMATCH_KEYS)
    rows = [json.loads(x) for x in (ctx.run_dir("vllm") / "metrics.jsonl").read_text().splitlines() if x.strip()]
    means = [f"{r['mismatch/weight_mean']:.4f}" for r in rows if "reward/mean" in r]
    return f"{detail}; mismatch/weight_mean per step {', '.join(means)}"


STEPS: tuple[Step, ...] = (
    Step("gpu_tests", "the GPU-marked tests", step_gpu_tests, timeout_s=300),
    Step("make_model", "a random Qwen2 model", step_make_model, timeout_s=300),
    Step("train", "klgrad train, full fine-tuning", step_train, needs=("make_model",)),
    Step("train_lora", "klgrad train with LoRA", step_train_lora, needs=("make_model",)),
    Step(
        "train_accelerate",
        "klgrad train under accelerate launch, 1 process",
        step_train_accelerate,
        needs=("make_model",),
        applies=accelerate_missing,
    ),
    Step(
        "train_ddp",
        f"klgrad train under accelerate launch --multi_gpu, {DDP_PROCESSES} processes",
        step_train_ddp,
        needs=("make_model",),
        applies=ddp_missing,
    ),
    Step("eval", "klgrad eval of the trained run and the base model", step_eval, needs=("make_model", "train")),
    Step("vllm", "klgrad train with rollout.engine vllm", step_vllm, needs=("make_model",), applies=vllm_missing),
)

_PAST = {"fail": "failed", "skipped": "skipped"}


def run_step(ctx: Context, step: Step) -> Result:
    """One row: the step's outcome, wall time and peak GPU memory. Never raises (but for KeyboardInterrupt)."""
    reason = step.applies(ctx)
    if reason is not None:
        return Result(step.name, "skipped", reason)
    blocked = [n for n in step.needs if n not in ctx.results or ctx.results[n].status != "pass"]
    if blocked:
        why = ", ".join(f"{n} ({_PAST[ctx.results[n].status] if n in ctx.results else 'not run'})" for n in blocked)
        return Result(step.name, "skipped", f"needs {why}")
    ctx.current, ctx.command, ctx.peak = step, None, None
    cuda = _cuda_module()
    if cuda is not None:
        cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        status, detail = "pass", step.run(ctx)
    except Skip as e:
        status, detail = "skipped", str(e)
    except Fail as e:
        status, detail = "fail", str(e)
    except Exception as e:  # a bug or an unexpected error in the step: its row says so and the check goes on
        status, detail = "fail", f"{type(e).__name__}: {e}"
    seconds = time.perf_counter() - t0
    peak = ctx.peak
    if ctx.command is None and cuda is not None:  # an in-process step: this process's own counter
        peak = int(cuda.max_memory_allocated())
    log = ctx.log_path(step.name)
    ctx.current = None
    log_file = str(log) if log.is_file() else None
    return Result(step.name, status, detail, round(seconds, 2), peak, ctx.command, log_file)


def _cuda_module():
    """``torch.cuda`` when torch is imported and CUDA is initialised in this process, else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda


def run_steps(ctx: Context, steps: tuple[Step, ...], echo: Callable[[str], None] = print) -> list[Result]:
    results = []
    for step in steps:
        echo(f"[gpu_check] {step.name}: {step.what} ...")
        r = run_step(ctx, step)
        ctx.results[step.name] = r
        results.append(r)
        echo(f"[gpu_check] {step.name}: {r.status} ({r.seconds:.1f} s) {r.detail}")
    return results


# ----------------------------------------------------------------------------------------------------------
# the machine, the table, the JSON


def machine_facts() -> dict:
    """GPU(s), torch / CUDA / transformers / vLLM versions, Python, platform, klgrad's commit."""
    import torch

    facts: dict = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "gpus": [],
        "bf16_supported": None,
        "nvidia_driver": None,
        "klgrad_commit": git_commit(),
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            facts["gpus"].append(
                {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "capability": f"{p.major}.{p.minor}"}
            )
        facts["bf16_supported"] = bool(torch.cuda.is_bf16_supported())
        smi = shutil.which("nvidia-smi")
        if smi:
            with contextlib.suppress(Exception):
                q = [smi, "--query-gpu=driver_version", "--format=csv,noheader"]
                facts["nvidia_driver"] = subprocess.run(q, capture_output=True, text=True, timeout=30).stdout.strip()
    for dist in ("transformers", "peft", "vllm"):
        facts[dist] = _version(dist)
    return facts


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """HEAD of this checkout, ``+dirty`` when tracked files differ from it; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=30)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def table_rows(results: list[Result]) -> list[tuple[str, str, str, str, str]]:
    return [(r.name, r.status, f"{r.seconds:.1f} s", fmt_bytes(r.peak_gpu_bytes), r.detail) for r in results]


HEADER = ("step", "status", "time", "peak GPU", "detail")


def print_table(results: list[Result], title: str) -> None:
    """rich when installed, else plain fixed-width text."""
    rows = table_rows(results)
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:
        widths = [max(len(x) for x in col) for col in zip(HEADER, *rows, strict=False)]
        print(title)
        for row in (HEADER, *rows):
            print("  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=False)) + "  " + row[-1])
        return
    colour = {"pass": "green", "fail": "bold red", "skipped": "yellow"}
    table = Table(title=title)
    for h in HEADER:
        table.add_column(h, overflow="fold")
    for row in rows:
        table.add_row(row[0], f"[{colour[row[1]]}]{row[1]}[/]", *(escape(cell) for cell in row[2:]))
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    console.print(table)


def exit_code(results: list[Result]) -> int:
    return 1 if any(r.status == "fail" for r in results) else 0


def write_report(path: Path, mode: str, machine: dict, results: list[Result], started: str, seconds: float) -> None:
    data = {
        "mode": mode,
        "started": started,
        "seconds": round(seconds, 1),
        "passed": exit_code(results) == 0,
        "machine": machine,
        "steps": [asdict(r) for r in results],
    }
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------------------------
# entry points


def measure(report: str, argv: list[str]) -> int:
    """``--measure FILE -m MODULE ARGS`` or ``--measure FILE SCRIPT ARGS``: run it as ``python`` would, in this
    process, then write its peak GPU memory (None when it never initialised CUDA) to FILE as JSON."""
    import runpy

    if not argv or (argv[0] == "-m" and len(argv) < 2):
        print("gpu_check.py --measure FILE (-m MODULE | SCRIPT) [ARGS...]", file=sys.stderr)
        return 2
    module = argv[1] if argv[0] == "-m" else None
    rest = argv[2:] if module else argv[1:]
    sys.argv = [module or argv[0], *rest]
    sys.path.insert(0, os.getcwd() if module else str(Path(argv[0]).resolve().parent))  # as python does
    code = 0
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, str):  # sys.exit("message"): python prints it and exits 1
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        torch = sys.modules.get("torch")
        peak = None
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            peak = int(torch.cuda.max_memory_allocated())
        if os.environ.get("RANK", "0") == "0":  # under a launch of several processes: rank 0's
            Path(report).write_text(json.dumps({"peak_gpu_bytes": peak}))
    return code


def refuse_without_gpu(device: str) -> str | None:
    """The refusal message when ``device`` is cuda and torch sees no CUDA GPU (or there is no torch)."""
    try:
        import torch
    except ImportError:
        return (
            "gpu_check: torch is not importable. Install your machine's CUDA build of torch first "
            "(this check never installs torch), then rerun."
        )
    if device == "cuda" and not torch.cuda.is_available():
        return (
            f"gpu_check: no CUDA GPU is visible to torch {torch.__version__} (CUDA build: {torch.version.cuda}). "
            "This check runs on a GPU machine; to test its plumbing on CPU use --device cpu --small."
        )
    return None


def prepare_out(out: Path) -> str | None:
    """Empty ``out`` for a new check when it is this script's (holds gpu_check.json) or empty; else a refusal."""
    if out.exists() and any(out.iterdir()):
        if not (out / JSON_NAME).is_file():
            return f"gpu_check: {out} exists and is not a gpu_check output folder (no {JSON_NAME}); choose --out"
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda (default) or cpu (with --small)")
    p.add_argument("--small", action="store_true", help="a 2M-parameter model, 2 train steps, 8 eval prompts")
    p.add_argument("--out", default="runs/gpu_check", help="output folder (replaced when it is a previous check's)")
    p.add_argument("--steps", default=None, help="comma-separated subset of: " + ", ".join(s.name for s in STEPS))
    p.add_argument("--preflight", action="store_true", help="only check that the run can start (exit 0 or 2)")
    p.add_argument("--requirements", choices=("all", "with-deps", "no-deps"), help="print pip requirements")
    p.add_argument("--missing", action="store_true", help="print the requirements whose module does not import")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    if raw[:1] == ["--measure"]:
        return measure(raw[1], raw[2:]) if len(raw) > 1 else 2
    args = parse_args(raw)
    if args.requirements:
        print("\n".join(requirements(args.requirements)))
        return 0
    if args.missing:
        print(" ".join(missing_requirements()))
        return 0
    if args.device == "cpu" and not args.small:
        print("gpu_check: --device cpu is the plumbing test; add --small", file=sys.stderr)
        return 2
    refusal = refuse_without_gpu(args.device)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    if args.preflight:
        return 0
    steps = STEPS
    if args.steps:
        names = args.steps.split(",")
        unknown = sorted(set(names) - {s.name for s in STEPS})
        if unknown:
            print(f"gpu_check: unknown steps {unknown}; choose from {[s.name for s in STEPS]}", file=sys.stderr)
            return 2
        steps = tuple(s for s in STEPS if s.name in names)
    out = Path(args.out).resolve()
    refusal = prepare_out(out)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    mode = "cpu-small" if args.device == "cpu" else ("gpu-small" if args.small else "gpu")
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    machine = machine_facts()
    write_report(out / JSON_NAME, mode, machine, [], started, 0.0)  # marks the folder as this script's at once
    t0 = time.perf_counter()
    ctx = Context(out=out, device=args.device, small=args.small)
    try:
        results = run_steps(ctx, steps)
    except KeyboardInterrupt:  # what ran so far is reported, the check counts as failed
        results = [*ctx.results.values(), Result(ctx.current.name if ctx.current else "?", "fail", "interrupted")]
    seconds = time.perf_counter() - t0
    write_report(out / JSON_NAME, mode, machine, results, started, seconds)
    gpu = ", ".join(g["name"] for g in machine["gpus"]) or "no GPU"
    title = (
        f"klgrad gpu_check ({mode}): {gpu}, torch {machine['torch']} (CUDA {machine['torch_cuda']}), "
        f"commit {(machine['klgrad_commit'] or '?')[:12]}, {seconds:.0f} s"
    )
    print_table(results, title)
    verdict = "FAILED" if exit_code(results) else "passed (skipped rows are not verified)"
    print(f"{verdict}; wrote {out / JSON_NAME} and {out / 'logs'}/")
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
