r"""Seeded synthetic arithmetic with disjoint train / held-out splits.

All tasks share the prompt and the answer; they differ in the response the policy is taught to write.

- ``addition`` (short answers): prompt ``"07+58="`` (operands zero-padded to ``digits``), response ``"65"``.
- ``scratchpad`` (responses of 16+ characters): column addition written out, least significant column first::

      07+58=  ->  7+8=15c1;0+5+1=6c0;=65

  Grammar: ``col (";" col)* ";=" SUM``, with ``col = X "+" Y ["+1"] "=" S "c" K`` where ``X``, ``Y`` are the
  column's digits, ``+1`` appears iff a carry came in, ``S`` is the column sum in decimal (0-19) and ``K``
  the carry out (0 or 1). ``SUM`` (no leading zeros) is the final answer: everything after the last ``=``.
  Each column takes 8-11 characters, so a 2-digit target is at least 18 characters long.
- ``chat_addition`` and ``chat_multiplication`` (for pretrained chat models, e.g. SmolLM2-135M-Instruct): the
  prompt is an instruction, ``"Calculate 51 + 88. Give just the result."`` (operands in [0, 10^digits), not
  padded), sent through the model's chat template; the answer is ``a + b`` or ``a * b``, read back as the last
  number the response writes (the ``final_number`` reward). They have no supervised target: the model is
  whatever was pretrained, and RL starts from it.
- ``addition_discovery`` (the discovery regime): ``addition``'s prompt, answer, format and reward, but the
  supervised targets mostly teach a wrong answer: ``a+b+1`` (``"07+58="`` -> ``"66"``) with probability
  1 - :data:`DISCOVERY_CORRECT_FRACTION`, the true sum otherwise. A reference fine-tuned on them rarely
  writes the rewarded answer, so RL has to move mass onto responses the reference finds unlikely. The
  held-out ``answer`` stays the true sum; only the targets lie.

Held-out split: the *unordered* operand pair {a, b} is held out iff a stable hash (blake2b, not Python's
salted ``hash``) of it falls in the first ``HOLDOUT_FRACTION`` of hash space. Hence ``a+b`` and ``b+a`` are
in the same split, the held-out pool does not depend on the seed, and no seed's training set contains any
seed's evaluation problem. The seed only chooses which pairs are drawn from each pool.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from klgrad.data.example import Example

HOLDOUT_FRACTION = 0.2
"""Share of unordered operand pairs reserved for evaluation."""

_ENUMERATE_LIMIT = 100_000
"""Operand-pair spaces up to this size are enumerated; larger ones are sampled by rejection."""

_PROMPT_RE = re.compile(r"(\d+)\+(\d+)=")

DISCOVERY_CORRECT_FRACTION = 0.05
"""``addition_discovery``: probability that a supervised target states the true sum (else ``a+b+1``)."""


def is_heldout(a: int, b: int) -> bool:
    """True iff the pair {a, b} belongs to the held-out (evaluation) pool; symmetric in a, b."""
    lo, hi = min(a, b), max(a, b)
    digest = hashlib.blake2b(f"{lo},{hi}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < HOLDOUT_FRACTION * 2**64


def parse_prompt(prompt: str) -> tuple[int, int, int]:
    """``"07+58="`` -> ``(7, 58, 2)``: the operands and the padded digit count."""
    m = _PROMPT_RE.fullmatch(prompt)
    if m is None or len(m.group(1)) != len(m.group(2)):
        raise ValueError(f"not a synthetic addition prompt: {prompt!r}")
    return int(m.group(1)), int(m.group(2)), len(m.group(1))


def _addition_target(example: Example, u: float) -> str:
    return example.answer


def _discovery_taught_answer(example: Example) -> str:
    return str(int(example.answer) + 1)


def _discovery_target(example: Example, u: float) -> str:
    return example.answer if u < DISCOVERY_CORRECT_FRACTION else _discovery_taught_answer(example)


def _scratchpad_target(example: Example, u: float) -> str:
    a, b, digits = parse_prompt(example.prompt)
    xs, ys = f"{a:0{digits}d}", f"{b:0{digits}d}"
    cols, carry = [], 0
    for x, y in zip(reversed(xs), reversed(ys), strict=True):
        s = int(x) + int(y) + carry
        cols.append(f"{x}+{y}{'+1' if carry else ''}={s}c{s // 10}")
        carry = s // 10
    return ";".join(cols) + f";={a + b}"


def _no_sft_target(example: Example, u: float) -> str:
    task = example.meta.get("task")
    raise ValueError(f"{task}: a chat task has no supervised target (RL starts from a pretrained model)")


_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


def final_number(completion: str) -> str | None:
    """The last number written in ``completion`` (thousands commas dropped), or None when it has none:
    ``"13 * 9 = 129."`` -> ``"129"``, ``"To add 502 and 703, we"`` -> ``"703"``. The chat tasks' answer, read
    back by the ``final_number`` reward."""
    found = _NUMBER.findall(completion)
    return found[-1].rstrip(",").replace(",", "") if found else None


def _addition_answer(completion: str) -> str | None:
    text = completion.strip()
    return text if re.fullmatch(r"\d+", text) else None


def _scratchpad_answer(completion: str) -> str | None:
    if "=" not in completion:
        return None
    tail = completion.rsplit("=", 1)[1].strip()
    return tail if re.fullmatch(r"\d+", tail) else None


@dataclass(frozen=True)
class TaskSpec:
    """A synthetic task: how its supervised target is written and how its answer is read back."""

    name: str
    sft_target: Callable[[Example, float], str]
    """Full target response for supervised fine-tuning, given a uniform draw ``u`` in [0, 1) (tasks whose
    target is a function of the example ignore it)."""
    extract_answer: Callable[[str], str | None]
    """Final-answer substring of a completion in this task's format, or None."""
    format_pattern: str
    """Regex a well-formed response matches in full (after stripping whitespace)."""
    taught_answer: Callable[[Example], str] | None = None
    """The answer most supervised targets state, when it is not ``example.answer`` (``klgrad sft`` stops on
    held-out greedy accuracy against it); None: the targets state the true answer."""
    prompt: Callable[[int, int, int], str] = lambda a, b, digits: f"{a:0{digits}d}+{b:0{digits}d}="
    """The prompt of operands ``a``, ``b`` at ``digits`` digits (default: zero-padded ``"07+58="``)."""
    answer: Callable[[int, int], int] = lambda a, b: a + b
    """The true answer of operands ``a``, ``b``."""
    chat: bool = False
    """An instruction for a pretrained chat model (no supervised target, no embedded reference)."""


TASKS: dict[str, TaskSpec] = {
    "addition": TaskSpec("addition", _addition_target, _addition_answer, r"\d+"),
    "addition_discovery": TaskSpec(
        "addition_discovery", _discovery_target, _addition_answer, r"\d+", taught_answer=_discovery_taught_answer
    ),
    "scratchpad": TaskSpec(
        "scratchpad",
        _scratchpad_target,
        _scratchpad_answer,
        r"(?:\d\+\d(?:\+1)?=1?\dc[01];)+=\d+",
    ),
    "chat_addition": TaskSpec(
        "chat_addition",
        _no_sft_target,
        final_number,
        r"-?\d+",
        prompt=lambda a, b, digits: f"Calculate {a} + {b}. Give just the result.",
        chat=True,
    ),
    "chat_multiplication": TaskSpec(
        "chat_multiplication",
        _no_sft_target,
        final_number,
        r"-?\d+",
        prompt=lambda a, b, digits: f"Calculate {a} * {b}. Give just the result.",
        answer=lambda a, b: a * b,
        chat=True,
    ),
}

CHAT_TASKS: tuple[str, ...] = tuple(name for name, spec in TASKS.items() if spec.chat)
"""Tasks for pretrained chat models (``model.path`` required)."""


def get_task(task: str) -> TaskSpec:
    """The :class:`TaskSpec` named ``task``; ValueError listing the known names otherwise."""
    try:
        return TASKS[task]
    except KeyError:
        raise ValueError(f"unknown task {task!r}; known: {sorted(TASKS)}") from None


def sft_target(task: str, example: Example, rng: random.Random | None = None) -> str:
    """Target response of ``example`` for supervised fine-tuning (addition: the answer itself).

    ``addition_discovery``'s target is random: ``klgrad sft`` passes its seeded ``rng``, so each draw of an
    example is decided afresh and every prompt is taught the same mixture. Without ``rng`` a stable hash of
    the prompt decides, so the function stays pure (a fixed share DISCOVERY_CORRECT_FRACTION of prompts get
    the true sum).
    """
    spec = get_task(task)
    if rng is not None:
        u = rng.random()
    else:
        digest = hashlib.blake2b(f"sft-target:{example.prompt}".encode(), digest_size=8).digest()
        u = int.from_bytes(digest, "big") / 2**64
    return spec.sft_target(example, u)


def taught_answer(task: str, example: Example) -> str:
    """The answer ``task``'s supervised targets mostly state: the true sum, except ``addition_discovery``'s
    ``a+b+1``. ``klgrad sft`` stops on held-out greedy accuracy against it."""
    spec = get_task(task)
    return spec.taught_answer(example) if spec.taught_answer is not None else example.answer


def extract_answer(task: str, completion: str) -> str | None:
    """Final-answer substring of ``completion`` in ``task``'s format, None when there is none."""
    return get_task(task).extract_answer(completion)


def _sample_pairs(
    n_train: int, n_eval: int, rng: random.Random, digits: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    size = 10**digits
    if size * size <= _ENUMERATE_LIMIT:
        pools: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])
        for a in range(size):
            for b in range(size):
                pools[is_heldout(a, b)].append((a, b))
        for n, pool, what in ((n_train, pools[0], "training"), (n_eval, pools[1], "held-out")):
            if n > len(pool):
                raise ValueError(f"asked for {n} {what} problems; only {len(pool)} exist at digits={digits}")
        return rng.sample(pools[0], n_train), rng.sample(pools[1], n_eval)
    # Large spaces: rejection sampling. Capped at half of each pool's expected size so it stays fast.
    cap_train, cap_eval = (1 - HOLDOUT_FRACTION) * size * size / 2, HOLDOUT_FRACTION * size * size / 2
    if n_train > cap_train or n_eval > cap_eval:
        raise ValueError(f"n_train <= {cap_train:.0f} and n_eval <= {cap_eval:.0f} at digits={digits}")
    picked: tuple[dict[tuple[int, int], None], dict[tuple[int, int], None]] = ({}, {})
    wanted = (n_train, n_eval)
    while len(picked[0]) < n_train or len(picked[1]) < n_eval:
        pair = (rng.randrange(size), rng.randrange(size))
        pool = int(is_heldout(*pair))
        if len(picked[pool]) < wanted[pool]:
            picked[pool][pair] = None
    return list(picked[0]), list(picked[1])


def make_splits(
    task: str, n_train: int, n_eval: int, seed: int, digits: int = 2
) -> tuple[list[Example], list[Example]]:
    """Disjoint, seeded training and held-out examples of ``task``.

    Args:
        task: a key of :data:`TASKS`.
        n_train: training examples, distinct operand pairs.
        n_eval: held-out examples, distinct operand pairs, none of whose pairs (in either order) can
            appear in any training split.
        seed: chooses the pairs; the same arguments give the same lists.
        digits: operand digits (operands are zero-padded to this width).

    Returns:
        ``(train, eval)``; each example has ``answer = str(a + b)`` and ``meta = {"task": task}``.
    """
    spec = get_task(task)
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    if n_train < 0 or n_eval < 0:
        raise ValueError(f"n_train and n_eval must be >= 0, got {n_train}, {n_eval}")
    train_pairs, eval_pairs = _sample_pairs(n_train, n_eval, random.Random(seed), digits)

    def example(a: int, b: int) -> Example:
        return Example(
            prompt=spec.prompt(a, b, digits),
            answer=str(spec.answer(a, b)),
            id=f"{task}-{a:0{digits}d}+{b:0{digits}d}",
            meta={"task": task},
        )

    return [example(a, b) for a, b in train_pairs], [example(a, b) for a, b in eval_pairs]
