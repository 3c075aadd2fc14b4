r"""Math-Verify accuracy reward, bounded in time and size per completion.

``math_verify_reward(completions, answers)`` gives 1.0 where the completion's final answer is mathematically
equal to the gold answer, else 0.0. Extraction (Math-Verify's own configs): a ``\boxed{...}`` anywhere wins
(priority 0); else an "answer is ..." / "final answer ..." anchor; else the rightmost LaTeX expression or
plain number / expression (``81``, ``81.0``, ``80+1``, ``=132``). Gold answers are parsed the same way.

Bounds, per completion:
- size: completions longer than ``max_chars`` keep only their last ``max_chars`` characters (the final
  answer sits at the end);
- time: parsing the gold, parsing the completion and comparing them get ``timeout_s`` in all; past it the
  reward is 0.0.

How the time bound works. Math-Verify's own ``parsing_timeout`` / ``timeout_seconds`` use
``signal.alarm``: whole seconds, main thread only (``ValueError`` elsewhere), and a timeout it catches
internally lets the remaining comparisons run unbounded. We switch them off and bound the whole item
ourselves:
- in the main thread (POSIX, no interval timer already pending): ``signal.setitimer`` with a float
  deadline and then a repeat every 50 ms, so a timeout swallowed by library code is raised again;
- anywhere else (a worker thread, as in :func:`klgrad.rewards.compute_rewards`; Windows): a persistent
  child process (this file run as a script, importing only Math-Verify) scores items one at a time under the
  same alarm; the parent waits ``timeout_s + 0.5 s`` per item and kills and replaces a child that does not
  answer (for example one stuck in C code, where Python signal handlers cannot run). The first use starts
  the child (about half a second, not counted in the bound).
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import queue
import re
import subprocess
import sys
import threading
from functools import lru_cache
from typing import IO, Any

logger = logging.getLogger(__name__)

_ALARM_REPEAT_S = 0.05
_WORKER_GRACE_S = 0.5
_WORKER_START_TIMEOUT_S = 60.0


class _Deadline(BaseException):
    """Raised by our SIGALRM handler; a BaseException so ``except Exception`` in library code lets it pass."""


class _QuietMathVerify(logging.Filter):
    """Drops Math-Verify's warning that its own timeout is off: we bound the call ourselves."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@lru_cache(maxsize=1)
def _math_verify() -> Any:
    import math_verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_QuietMathVerify())
    return math_verify


@lru_cache(maxsize=1)
def _pred_config() -> list[Any]:
    mv = _math_verify()
    return [mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()]


def gold_as_math(answer: str) -> str:
    """The gold answer as LaTeX math: unchanged when it holds a ``$`` delimiter (not an escaped ``\\$``) or
    ``\\boxed``, else wrapped in ``$...$``.

    Math-Verify's LaTeX extraction needs delimiters, and gold files (MATH-500's, for one) write answers bare:
    read bare, ``\\sqrt{2}`` parses to nothing (no response could score) and ``1, 2`` or
    ``\\left( 3, \\frac{\\pi}{2} \\right)`` to their last or first number (a response of that number alone
    would score). Wrapped, they parse to the value written; plain numbers parse the same either way.
    """
    delimited = "$" in answer.replace("\\$", "") or "\\boxed" in answer
    return answer if delimited else f"${answer}$"


@lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> list[Any]:
    mv = _math_verify()
    return mv.parse(gold_as_math(answer), extraction_config=_pred_config(), parsing_timeout=None)


_PLAIN_INT = re.compile(r"[0-9]{1,30}")


def plain_integer_verdict(completion: str, answer: str) -> float | None:
    """Math-Verify's verdict without Math-Verify when both sides are plain integers, else None.

    When the stripped completion and the stripped gold are each a lone unsigned integer (digits only, at most
    30), Math-Verify extracts exactly that number from each and compares the values, so the reward is
    ``1.0 if int(completion) == int(answer) else 0.0`` (``"081"`` equals ``"81"``). Signs are left to
    Math-Verify, whose verdicts there are not plain integer equality (measured with math-verify 0.9:
    ``"+5"`` vs ``"5"`` and ``"-007"`` vs ``"-7"`` score 0). Anything else (signs, text, LaTeX, decimals,
    expressions) returns None and goes to Math-Verify.
    Measured: about 1 µs per item against a few hundred µs for Math-Verify's parse and verify.
    """
    c, a = completion.strip(), answer.strip()
    if _PLAIN_INT.fullmatch(c) and _PLAIN_INT.fullmatch(a):
        return 1.0 if int(c) == int(a) else 0.0
    return None


@lru_cache(maxsize=1)
def _warm_up() -> None:
    """Import Math-Verify and run one trivial check outside any deadline: the first call pays for importing
    sympy and building the LaTeX grammar (about a second, more on a loaded machine), which must not count
    against the first completion's time bound."""
    _score("1", "1")


def _score(completion: str, answer: str) -> float:
    """Unbounded Math-Verify check of one (already truncated) completion; errors score 0.0."""
    mv = _math_verify()
    try:
        gold = _parse_gold(answer)
        pred = mv.parse(completion, extraction_config=_pred_config(), parsing_timeout=None) if gold else []
        return 1.0 if pred and mv.verify(gold, pred, timeout_seconds=None) else 0.0
    except Exception:  # Math-Verify catches its own errors; this guards one bad item from failing a batch
        logger.warning("Math-Verify raised on an item; reward 0.0", exc_info=True)
        return 0.0


def _score_under_alarm(completion: str, answer: str, timeout_s: float) -> float:
    """:func:`_score` under a SIGALRM deadline; main thread of a POSIX process only."""
    import signal

    state = {"armed": True}

    def on_alarm(signum: int, frame: Any) -> None:
        if state["armed"]:
            raise _Deadline

    previous = signal.signal(signal.SIGALRM, on_alarm)
    # Two finally blocks: the inner one disarms as soon as the work ends; the outer one also runs when a
    # repeat of the alarm lands inside the inner one, so no timer or handler outlives this call.
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s, _ALARM_REPEAT_S)
            return _score(completion, answer)
        finally:
            state["armed"] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Deadline:
        return 0.0
    finally:
        state["armed"] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _alarm_usable() -> bool:
    try:
        import signal

        return (
            hasattr(signal, "setitimer")
            and threading.current_thread() is threading.main_thread()
            and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # never clobber someone else's timer
        )
    except (ImportError, ValueError):
        return False


class _Worker:
    """A child process scoring one ``[completion, answer, timeout_s]`` JSON line at a time."""

    def __init__(self) -> None:
        self.owner_pid = os.getpid()  # a forked copy of this object must not talk to the parent's child
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-u", __file__, "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            encoding="utf-8",
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        assert self.proc.stdout is not None
        threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True).start()
        if self._read(_WORKER_START_TIMEOUT_S) != "ready":
            self.kill()
            raise RuntimeError("the Math-Verify worker process did not start")

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line.strip())
        self.lines.put(None)

    def _read(self, timeout_s: float) -> str | None:
        try:
            return self.lines.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def score(self, completion: str, answer: str, timeout_s: float) -> float | None:
        """The reward, or None when the child died or missed its deadline (it is then killed)."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps([completion, answer, timeout_s]) + "\n")
            self.proc.stdin.flush()
        except OSError:
            return None
        reply = self._read(timeout_s + _WORKER_GRACE_S)
        try:
            return float(reply) if reply is not None else None
        except ValueError:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


_idle_workers: list[_Worker] = []
_workers_lock = threading.Lock()


def _take_worker() -> _Worker:
    with _workers_lock:
        while _idle_workers:
            worker = _idle_workers.pop()
            if worker.owner_pid == os.getpid():
                return worker
    return _Worker()


def _return_worker(worker: _Worker) -> None:
    with _workers_lock:
        _idle_workers.append(worker)


@atexit.register
def _stop_workers() -> None:
    with _workers_lock:
        while _idle_workers:
            worker = _idle_workers.pop()
            if worker.owner_pid == os.getpid():
                worker.kill()


def _score_in_worker(items: list[tuple[str, str]], timeout_s: float) -> list[float]:
    worker = _take_worker()
    out = []
    try:
        for completion, answer in items:
            value = worker.score(completion, answer, timeout_s)
            if value is None:
                worker.kill()
                logger.warning("Math-Verify item exceeded %.2f s; worker process replaced", timeout_s)
                worker = _Worker()
                value = 0.0
            out.append(value)
    except BaseException:
        worker.kill()
        raise
    _return_worker(worker)
    return out


def math_verify_reward(
    completions: list[str], answers: list[str], *, timeout_s: float = 1.0, max_chars: int = 2000
) -> list[float]:
    """1.0 where Math-Verify finds the completion's final answer equal to the gold answer, else 0.0.

    Args:
        completions: model outputs.
        answers: gold answers, same length (strings Math-Verify parses: ``"81"``, ``"\\frac{1}{2}"``).
        timeout_s: time allowed per completion (parsing both sides and comparing); past it, 0.0.
        max_chars: longer completions keep only their last ``max_chars`` characters before parsing.

    Returns:
        One float in {0.0, 1.0} per completion. Non-string completions and answers score 0.0.

    Identical (completion, answer) pairs, common among a group's samples (91 distinct of 256 in a scratchpad
    rollout of the shipped reference, measured), are checked once and share the verdict.
    """
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    rewards = [0.0] * len(completions)
    todo: dict[tuple[str, str], list[int]] = {}  # each distinct (completion, answer) -> the items holding it
    for i, (completion, answer) in enumerate(zip(completions, answers, strict=True)):
        if isinstance(completion, str) and isinstance(answer, str) and completion.strip() and answer.strip():
            fast = plain_integer_verdict(completion, answer)
            if fast is not None:  # both plain integers: the verdict Math-Verify would give, without it
                rewards[i] = fast
                continue
            todo.setdefault((completion[-max_chars:], answer), []).append(i)
    items = list(todo)  # checked once each: a group's identical samples share one verdict
    if items:
        _warm_up()
    if _alarm_usable():
        values = [_score_under_alarm(c, a, timeout_s) for c, a in items]
    else:
        values = _score_in_worker(items, timeout_s) if items else []
    for item, value in zip(items, values, strict=True):
        for i in todo[item]:
            rewards[i] = value
    return rewards


def _worker_main() -> None:
    """Child-process loop: one JSON request per stdin line, one reward per stdout line."""
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but replies may reach the parent's pipe
    _warm_up()
    import signal

    alarm = hasattr(signal, "setitimer")
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        completion, answer, timeout_s = json.loads(line)
        value = _score_under_alarm(completion, answer, timeout_s) if alarm else _score(completion, answer)
        out.write(f"{value}\n")
        out.flush()


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker_main()
