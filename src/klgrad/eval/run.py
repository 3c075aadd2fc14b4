r"""Sample and score: per model and benchmark, one greedy response and K samples at temperature T per problem.

Per benchmark of n problems, with c_i of the K samples of problem i correct and g_i ∈ {0, 1} the greedy verdict:

    greedy_accuracy = (1/n) Σ_i g_i
    pass@1          = (1/n) Σ_i c_i / K
    pass@k          = (1/n) Σ_i pass_at_k(K, c_i, k = K) = the share of problems with at least one correct sample
    mean_length     = mean over the n·K samples of the response length in tokens (EOS included, as in training)

Correctness is ``klgrad train``'s accuracy reward (:func:`klgrad.rewards.accuracy_reward`: Math-Verify, the same
answer extraction and time bound), or with ``--reward final_number`` its ``final_number`` reward (Math-Verify on the
last number written, as the chat arithmetic tasks are trained). Sampling goes through klgrad's samplers
(:func:`klgrad.rollout.samplers.make_sampler`): the same seed gives every model the same random numbers (uniforms)
for the same problem.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from klgrad.choices import ENGINES
from klgrad.data import Example
from klgrad.eval.benchmarks import Benchmark, encode_eval_prompts, uses_chat_template
from klgrad.eval.models import EvalModel, ModelSource, load_eval_model
from klgrad.eval.passk import mean_pass_at_k
from klgrad.rewards import ACCURACY_REWARDS, BUILTIN_REWARDS
from klgrad.rollout.batch import Sampler
from klgrad.rollout.encoding import decode_responses
from klgrad.rollout.samplers import make_sampler
from klgrad.trainer.setup import resolve_device

DEFAULT_MAX_NEW_TOKENS = 1024
"""Response cap when none is given, lowered to what fits in the model's context (:func:`default_max_new_tokens`)."""
VLLM_GPU_MEMORY = 0.5
"""Share of GPU memory the vLLM engine may take (the Hugging Face copy of the model shares the GPU)."""


@dataclass(frozen=True)
class EvalSettings:
    """How every model is sampled; validated on construction (messages name the command-line flag)."""

    samples: int = 8
    """K, samples per problem at ``temperature`` (pass@1 and pass@K come from them)."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int | None = None
    """None: :func:`default_max_new_tokens` of each model."""
    batch_size: int = 32
    """Problems per sampler call (each call draws batch_size × K responses)."""
    seed: int = 0
    chat_template: bool = True
    engine: str = "klgrad"
    reward: str = "accuracy"
    """Which built-in correctness reward scores responses (:data:`klgrad.rewards.ACCURACY_REWARDS`)."""

    def __post_init__(self) -> None:
        checks = (
            (self.samples >= 1, f"--samples must be >= 1, got {self.samples}"),
            (self.temperature > 0, f"--temperature must be > 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"--top-p must be in (0, 1], got {self.top_p}"),
            (self.max_new_tokens is None or self.max_new_tokens >= 1, "--max-new-tokens must be >= 1"),
            (self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}"),
            (self.engine in ENGINES, f"--engine must be one of {list(ENGINES)}, got {self.engine!r}"),
            (self.reward in ACCURACY_REWARDS, f"--reward must be one of {list(ACCURACY_REWARDS)}, got {self.reward!r}"),
        )
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


@dataclass
class ProblemResult:
    """One problem's responses and verdicts."""

    example: Example
    greedy: str
    greedy_correct: bool
    samples: list[str]
    correct: list[bool]
    lengths: list[int]
    """Token lengths of ``samples``."""


@dataclass
class ModelResult:
    """One model's scores on every benchmark."""

    label: str
    source: Path
    checkpoint: Path | None
    max_new_tokens: int
    chat_template: bool
    """Whether its prompts went through the tokenizer's chat template."""
    benchmarks: dict[str, dict] = field(default_factory=dict)
    """Benchmark name -> :func:`summarize`."""
    seconds: dict[str, float] = field(default_factory=dict)
    problems: dict[str, list[ProblemResult]] = field(default_factory=dict)


def resolve_eval_device(setting: str, engine: str) -> torch.device:
    """``--device`` (auto: cuda when torch sees a GPU, else cpu), refused when it cannot work here: cuda without
    a visible GPU, or ``--engine vllm`` without vLLM or a GPU (the message says which)."""
    if engine == "vllm":
        from klgrad.machine import vllm_unavailable_reason

        reason = vllm_unavailable_reason()
        if reason is not None:
            raise ValueError(f"--engine vllm: {reason}")
        if setting == "cpu":
            raise ValueError("--engine vllm runs on a CUDA GPU; use --device auto or cuda")
    if setting == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible to torch here")
    return resolve_device(setting, 1)


def summarize(problems: Sequence[ProblemResult], k: int) -> dict:
    """``{"n", "k", "greedy_accuracy", "pass@1", "pass@k", "mean_length"}`` of one benchmark (formulas: module
    docstring)."""
    correct = [sum(p.correct) for p in problems]
    lengths = [n for p in problems for n in p.lengths]
    return {
        "n": len(problems),
        "k": k,
        "greedy_accuracy": sum(p.greedy_correct for p in problems) / len(problems),
        "pass@1": mean_pass_at_k(correct, k, 1),
        "pass@k": mean_pass_at_k(correct, k, k),
        "mean_length": sum(lengths) / len(lengths),
    }


def default_max_new_tokens(model: torch.nn.Module, longest_prompt: int) -> int:
    """min(DEFAULT_MAX_NEW_TOKENS, context − longest prompt), context = the model's ``max_position_embeddings``
    (DEFAULT_MAX_NEW_TOKENS when the config has none). ValueError when the longest prompt leaves no room."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(context, int):
        return DEFAULT_MAX_NEW_TOKENS
    if context - longest_prompt < 1:
        raise ValueError(
            f"the longest prompt ({longest_prompt} tokens) fills the model's context ({context}); "
            "shorten it or set --max-new-tokens"
        )
    return min(DEFAULT_MAX_NEW_TOKENS, context - longest_prompt)


def longest_prompt(m: EvalModel, benchmarks: Sequence[Benchmark], settings: EvalSettings) -> int:
    """Tokens of the longest prompt of any benchmark, as ``m`` sees it (template and BOS included)."""
    prompts = [e.prompt for b in benchmarks for e in b.examples]
    return max(
        int(encode_eval_prompts(m.tokenizer, prompts[i : i + 256], chat_template=settings.chat_template)[1].shape[1])
        for i in range(0, len(prompts), 256)
    )


def build_sampler(m: EvalModel, settings: EvalSettings) -> Sampler:
    """The sampler of ``settings.engine`` for ``m`` (vLLM: an engine built from ``m.source``, then given ``m``'s
    weights, so a checkpoint is sampled, not its base model)."""
    tok = m.tokenizer
    options: dict = {}
    if settings.engine == "klgrad":
        options = {"fast_forward": True}
    elif settings.engine == "vllm":
        options = {"model_path": str(m.source), "seed": settings.seed, "gpu_memory_utilization": VLLM_GPU_MEMORY}
    return make_sampler(settings.engine, tok.eos_token_id, tok.pad_token_id, **options)


def sample_batch(
    m: EvalModel, sampler: Sampler, batch: list[Example], settings: EvalSettings, max_new_tokens: int, generator
) -> list[ProblemResult]:
    """Greedy and K samples for a batch of problems, scored."""
    k = settings.samples
    device = next(m.model.parameters()).device
    ids, mask = encode_eval_prompts(m.tokenizer, [e.prompt for e in batch], chat_template=settings.chat_template)
    ids, mask = ids.to(device), mask.to(device)
    greedy = sampler.generate(m.model, ids, mask, group_size=1, max_new_tokens=max_new_tokens, greedy=True)
    sampled = sampler.generate(
        m.model,
        ids,
        mask,
        group_size=k,
        max_new_tokens=max_new_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        generator=generator,
    )
    prompts, answers = [e.prompt for e in batch], [e.answer for e in batch]
    greedy_text = decode_responses(m.tokenizer, greedy)
    sample_text = decode_responses(m.tokenizer, sampled)
    score = BUILTIN_REWARDS[settings.reward]
    greedy_ok = score(prompts, greedy_text, answer=answers)
    sample_ok = score(
        [p for p in prompts for _ in range(k)], sample_text, answer=[a for a in answers for _ in range(k)]
    )
    lengths = sampled.lengths.tolist()
    return [
        ProblemResult(
            e,
            greedy_text[i],
            greedy_ok[i] == 1.0,
            sample_text[i * k : (i + 1) * k],
            [v == 1.0 for v in sample_ok[i * k : (i + 1) * k]],
            [int(n) for n in lengths[i * k : (i + 1) * k]],
        )
        for i, e in enumerate(batch)
    ]


def evaluate_model(
    m: EvalModel, benchmarks: Sequence[Benchmark], settings: EvalSettings, advance: Callable[[str, int], None]
) -> ModelResult:
    """Every benchmark for one model; ``advance(description, problems done)`` after each batch. Each benchmark
    starts a generator seeded with ``settings.seed``, so its samples do not depend on the other files."""
    max_new = settings.max_new_tokens or default_max_new_tokens(m.model, longest_prompt(m, benchmarks, settings))
    templated = uses_chat_template(m.tokenizer, settings.chat_template)
    result = ModelResult(m.label, m.source, m.checkpoint, max_new, templated)
    sampler = build_sampler(m, settings)
    for bench in benchmarks:
        t0 = time.perf_counter()
        generator = torch.Generator().manual_seed(settings.seed)
        problems: list[ProblemResult] = []
        for start in range(0, len(bench.examples), settings.batch_size):
            batch = bench.examples[start : start + settings.batch_size]
            problems += sample_batch(m, sampler, batch, settings, max_new, generator)
            advance(f"{m.label} · {bench.name}", len(batch))
        result.problems[bench.name] = problems
        result.benchmarks[bench.name] = summarize(problems, settings.samples)
        result.seconds[bench.name] = time.perf_counter() - t0
    return result


def unique_labels(labels: Sequence[str]) -> list[str]:
    """Labels made unique by appending ``#2``, ``#3``, ... to repeats."""
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
    return out


def evaluate_all(
    model_args: Sequence[str | ModelSource],
    benchmarks: Sequence[Benchmark],
    settings: EvalSettings,
    *,
    device: torch.device,
    dtype: str = "float32",
    advance: Callable[[str, int], None] = lambda description, n: None,
) -> list[ModelResult]:
    """Load each model in turn (one in memory at a time), evaluate it on every benchmark, free it."""
    results: list[ModelResult] = []
    for arg in model_args:
        m = load_eval_model(arg, device=device, dtype=dtype)
        results.append(evaluate_model(m, benchmarks, settings, advance))
        del m
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for r, label in zip(results, unique_labels([r.label for r in results]), strict=True):
        r.label = label
    return results
