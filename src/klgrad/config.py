"""Typed, nested, validated configuration: YAML files plus dotted overrides (``--kl.head k3_as_loss``).

Every field has a one-line doc (the string under it) and, where it has one, a unit. The sections are dataclasses
that pydantic validates (strict types, no unknown keys, finite numbers; :func:`parse_config`); then each section's
value rules run (``check``), then the rules across sections. Every problem is reported at once in one
:class:`ConfigError`, a line per problem naming the dotted field, with the allowed values for a choice and a
suggestion for a near miss. YAML is read with a safe loader only (:class:`ConfigLoader`: PyYAML's ``SafeLoader``
that also reads YAML 1.2 floats such as ``1e-6``). The field docs are the source of :func:`config_reference`
(docs/configuration.md) and of :func:`json_schema` (``configs/klgrad.schema.json``), so neither can drift.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib.resources
import importlib.util
import inspect
import itertools
import json
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml

from klgrad import option_rules as rules
from klgrad.choices import (
    LORA_TARGETS,
    Aggregation,
    Engine,
    Form,
    HeadName,
    Level,
    MismatchLevel,
    ModelDtype,
    OrImportPath,
    PromptFormat,
    RatioLevel,
    RewardRatioLevel,
    Schedule,
    ShapingMethod,
    needs_groups,
)


class ConfigError(ValueError):
    """A configuration problem; each line of the message starts with the dotted field name, one line per problem
    (``problems``)."""

    problems: list[str]

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.problems = message.splitlines()

    @classmethod
    def of(cls, problems: list[str]) -> ConfigError:
        """One error reporting every problem, one per line."""
        return cls("\n".join(problems))


@dataclass
class ModelConfig:
    path: str | None = None
    """Model to start from: a local HF folder, a known name (smollm2-135m-instruct), a .gguf file (de-quantized once
    into ~/.cache/klgrad) or a Hugging Face id (HF cache, else downloaded when online); null = the embedded tiny
    reference of data.task (docs/models.md). Never runs the model's own code (trust_remote_code off)."""
    dtype: ModelDtype = "float32"
    """Parameter dtype (CPU: float32)."""
    attn_implementation: Literal["auto", "eager", "sdpa", "flash_attention_2"] = "auto"
    """Attention kernel; auto = eager on CPU (never slower there in our measurement), sdpa on GPU."""
    fast_forward: bool = True
    """Llama/Qwen2/Mistral: klgrad's functional forward for rollout and shared-prompt log-probs (false: HF's)."""
    device: str = "auto"
    """Where klgrad train runs the policy and reference: auto (cuda when available, else cpu), cpu, cuda, cuda:N."""
    lora_rank: int = 0
    """LoRA rank r (peft; pip install 'klgrad[lora]'); 0 = full fine-tuning. With r > 0 only the adapter trains, the
    reference is the same base weights with the adapter off (no second copy) and checkpoints hold the adapter
    (docs/lora.md)."""
    lora_alpha: float = 16.0
    """LoRA α: each targeted weight W becomes W + (α/r)·B·A, i.e. the adapter's scale is α/r (> 0)."""
    lora_targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Projections that get an adapter in every decoder layer: any of q_proj, k_proj, v_proj, o_proj, gate_proj,
    up_proj, down_proj (Llama/Qwen2/Mistral names; default all seven)."""

    def check(self, report: Report) -> None:
        report.require(self.lora_rank >= 0, "lora_rank", f"must be >= 0 (0 = full fine-tuning), got {self.lora_rank}")
        report.require(self.lora_alpha > 0, "lora_alpha", f"must be > 0, got {self.lora_alpha}")
        report.require(len(self.lora_targets) >= 1, "lora_targets", "needs at least one projection")
        unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
        report.require(not unknown, "lora_targets", f"{unknown} unknown: allowed are {list(LORA_TARGETS)}")
        report.require(
            len(set(self.lora_targets)) == len(self.lora_targets), "lora_targets", "lists a projection twice"
        )
        has_peft = self.lora_rank == 0 or importlib.util.find_spec("peft") is not None
        report.require(
            has_peft, "lora_rank", f"{self.lora_rank} needs peft (not installed): pip install 'klgrad[lora]'"
        )
        ok = self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:[0-9]+", self.device) is not None
        report.require(ok, "device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.device.startswith("cuda"):
            import torch

            report.require(
                torch.cuda.is_available(), "device", f"{self.device!r}: no CUDA GPU is visible to torch here"
            )


@dataclass
class DataConfig:
    task: Literal["addition", "addition_discovery", "scratchpad", "chat_addition", "chat_multiplication", "file"] = (
        "addition"
    )
    """Synthetic task (chat_*: instructions for a pretrained chat model, model.path required), or 'file' to read
    prompts and answers from data.path."""
    digits: int = 2
    """Operand digits of the synthetic task."""
    n_train: int = 4000
    """Synthetic training prompts."""
    n_eval: int = 200
    """Held-out prompts (disjoint from training)."""
    seed: int = 1234
    """Seed of the synthetic split (independent of the training seed)."""
    path: str | None = None
    """JSONL / parquet / datasets folder when task = file."""
    prompt_column: str = "prompt"
    """Column holding the prompt text."""
    answer_column: str = "answer"
    """Column holding the ground-truth answer."""
    skip_bad_rows: bool = False
    """Skip and count malformed rows instead of failing."""
    prompt_format: PromptFormat = "auto"
    """How prompts are tokenised: chat = one user message through the tokenizer's chat template (with the
    generation prompt); raw = BOS + prompt text; auto = chat when the model's tokenizer has a template."""
    response_format: Literal["boxed", "think_answer"] = "boxed"
    """task = file: the response format the 'format' reward checks (\\boxed{...} or <think>..<answer>)."""

    def check(self, report: Report) -> None:
        report.require(self.digits >= 1, "digits", "must be >= 1")
        report.require(self.n_train >= 1, "n_train", "must be >= 1")
        report.require(self.n_eval >= 1, "n_eval", "must be >= 1")
        report.require(self.task != "file" or bool(self.path), "path", "is required when data.task = file")
        report.require(self.digits <= 9, "digits", f"must be <= 9, got {self.digits}")


@dataclass
class RolloutConfig:
    engine: Engine = "klgrad"
    """Sampler: klgrad's KV-cache sampler, transformers generate, or vLLM (CUDA GPU + klgrad[vllm]; docs/vllm.md)."""
    prompts_per_step: int = 32
    """Prompts drawn per step, in all (under accelerate launch each process answers an equal share)."""
    group_size: int = 8
    """Responses per prompt (G)."""
    max_new_tokens: int = 8
    """Response length cap (tokens); longer responses are truncated and flagged."""
    temperature: float = 1.0
    """Sampling temperature; log-probs for training are taken at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off); < 1 only with kl.head none and on-policy (log-probs are untruncated)."""
    mismatch_correction: Literal["none", MismatchLevel] = "none"
    """Truncated IS for sampler-vs-trainer log-prob mismatch: w = min(π_trainer/π_sampler, cap) per token/response."""
    mismatch_cap: float = 2.0
    """Truncation cap C of the mismatch weights (> 0)."""

    def check(self, report: Report) -> None:
        report.require(self.prompts_per_step >= 1, "prompts_per_step", "must be >= 1")
        report.require(self.group_size >= 1, "group_size", "must be >= 1")
        report.require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        report.require(self.temperature > 0, "temperature", "must be > 0")
        report.require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        report.require(self.mismatch_cap > 0, "mismatch_cap", "must be > 0")
        if self.engine == "vllm":
            from klgrad.machine import vllm_unavailable_reason

            reason = vllm_unavailable_reason()
            report.require(reason is None, "engine", f"'vllm' cannot run here: {reason}")


@dataclass
class RewardFnConfig:
    name: str = "accuracy"
    """Built-in reward name (accuracy, format) or 'module:function' (TRL signature)."""
    weight: float = 1.0
    """Weight in the summed reward."""


@dataclass
class RewardConfig:
    functions: list[RewardFnConfig] = field(
        default_factory=lambda: [RewardFnConfig("accuracy", 1.0), RewardFnConfig("format", 0.1)]
    )
    """Reward functions and weights, summed."""
    failure_value: float = 0.0
    """Reward given to a sample whose reward function raised, timed out or returned NaN."""
    timeout_s: float = 5.0
    """Time limit of one reward-function call (seconds)."""
    max_failure_fraction: float | None = None
    """Stop the run when more than this fraction of a step's samples had a failed reward (null = never)."""

    def check(self, report: Report) -> None:
        report.require(len(self.functions) >= 1, "functions", "needs at least one reward function")
        report.require(self.timeout_s > 0, "timeout_s", "must be > 0")
        report.require(
            self.max_failure_fraction is None or 0 <= self.max_failure_fraction < 1,
            "max_failure_fraction",
            "must be in [0, 1) or null",
        )


@dataclass
class KLConfig:
    head: Annotated[HeadName, OrImportPath()] = "k2_as_loss"
    """KL head: a built-in (klgrad.KL_HEADS) or your own as 'package.module:name', a penalty ψ(logp, ref_logp) or a
    KLHead (the module is imported when training starts)."""
    beta: float = 0.5
    """KL weight β (initial value when adaptive)."""
    level: Level = "sequence"
    """Where the head acts."""
    form: Form = "decoupled"
    """combined: coefficient in the reward before shaping; decoupled: separate KL loss."""
    clip_eps: float | None = 0.2
    """Off-policy symmetric clip of the decoupled KL head (None: IS only)."""
    ratio_level: RatioLevel = "sequence"
    """Off-policy importance ratio of the KL head (no gspo: exactness needs the true sequence IS weight)."""
    is_correction: bool = True
    """False reproduces the common bug (no IS on an as-loss KL off-policy); comparisons only."""
    target_kl: float | None = None
    """Adaptive β: target sequence KL (nats); None = fixed β."""
    adapt_rate: float = 0.1
    """Adaptive β: proportional gain per step (β *= 1 + rate·clip(KL/target - 1, ±0.2)/0.2)."""
    reset_ref_every: int | None = None
    """Copy the policy into the reference every N steps (ProRL); None = never."""

    def check(self, report: Report) -> None:
        report.add("beta", rules.problem("beta", self.beta))
        report.add("clip_eps", rules.problem("kl_clip_eps", self.clip_eps))
        report.require(self.target_kl is None or self.target_kl > 0, "target_kl", "must be > 0 or null")
        report.require(self.reset_ref_every is None or self.reset_ref_every >= 1, "reset_ref_every", "must be >= 1")
        report.add("level", rules.combined_level_problem(self.form, self.level))


@dataclass
class AlgoConfig:
    shaping: ShapingMethod = "grpo"
    """Reward shaping operator or preset (grpo, dr_grpo, rloo, reinforce_pp, ...)."""
    std_min: float | None = None
    """Lower clip of normalising stds (paper: ~0.1 for [0,1] rewards)."""
    std_max: float | None = None
    """Upper clip of normalising stds."""
    clip_eps_low: float = 0.2
    """Reward head PPO clip ε_low."""
    clip_eps_high: float = 0.2
    """Reward head PPO clip ε_high."""
    dual_clip: float | None = None
    """Dual-clip constant (> 1) for negative advantages; None = off."""
    ratio_level: RewardRatioLevel = "token"
    """Reward head ratio, Δ_t = log π_t - log π_old,t: token exp(Δ_t); sequence exp(Σ_t Δ_t); gspo exp(mean_t Δ_t)."""
    aggregation: Aggregation = "seq_mean_token_sum"
    """Loss aggregation."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (paper: 0)."""
    ppo_epochs: int = 1
    """Update passes over each rollout batch (1 = fully on-policy)."""
    mini_batches: int = 1
    """Optimizer steps per epoch M; mini-batch k holds the step's groups k, k+M, k+2M, ..."""
    micro_batch_size: int = 64
    """Sequences per forward/backward (gradient accumulation); does not change the result."""

    def check(self, report: Report) -> None:
        for name in ("std_min", "std_max", "clip_eps_low", "clip_eps_high", "dual_clip", "entropy_coef"):
            report.add(name, rules.problem(name, getattr(self, name)))
        report.require(self.ppo_epochs >= 1, "ppo_epochs", "must be >= 1")
        report.require(self.mini_batches >= 1, "mini_batches", "must be >= 1")
        report.require(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")


@dataclass
class OptimConfig:
    lr: float = 1e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float | None = 1.0
    """Global grad-norm clip; None = off."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    schedule: Schedule = "constant"
    """LR schedule after warm-up."""

    def check(self, report: Report) -> None:
        report.require(self.lr > 0, "lr", "must be > 0")
        report.require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        report.require(all(0 <= b < 1 for b in self.betas), "betas", "must be in [0, 1)")
        report.require(self.grad_clip is None or self.grad_clip > 0, "grad_clip", "must be > 0 or null")
        report.require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")


@dataclass
class TrainConfig:
    steps: int = 150
    """RL steps (one rollout batch each)."""
    seed: int = 0
    """Training seed (sampling, init of anything random)."""
    eval_every: int = 25
    """Held-out evaluation period (steps); 0 = only at the end."""
    eval_samples: int = 1
    """Samples per held-out prompt behind eval/sampled_accuracy, eval/sampled_reward and the KL estimates (more:
    a finer estimate on a small held-out set)."""
    save_every: int = 50
    """Checkpoint period (steps); the last step is always saved."""
    keep_checkpoints: int | None = None
    """Keep only the newest N checkpoints (older ones are deleted once a newer one is complete); null = keep all."""
    stop_when: str | None = None
    """Stop before ``steps`` on a stated criterion, 'METRIC OP VALUE [for K]' (OP: <, <=, >, >=), e.g.
    'eval/greedy_accuracy >= 0.9' or 'kl/k1 > 5 for 3': the first step where it held in the last K records logging
    METRIC is evaluated, checkpointed and recorded in summary.json ('stopped'); null = run all steps."""
    out_dir: str = "runs/train"
    """Run directory (metrics, curves, checkpoints, resolved config)."""
    tensorboard: bool = True
    """Also write TensorBoard events."""
    wandb: bool = False
    """Also log to Weights & Biases (when installed)."""
    threads: int | Literal["auto"] | None = "auto"
    """torch CPU threads. 'auto' = this process's share of the cores other processes leave free, re-decided
    before every step and split among the klgrad processes training on the machine (docs/performance.md,
    "Shared CPU"); N = exactly N threads for the whole run (for bit-identical reruns); null = torch's own setting
    (OMP_NUM_THREADS, else one thread per core)."""
    max_skipped_steps: int = 3
    """Stop (with a checkpoint) after this many consecutive steps whose update had a non-finite loss/gradient."""
    packing: bool = True
    """Reference, behaviour and update passes compute only real response positions (nothing after EOS; each
    group's prompt once) with the LM head fused into the log-softmax; false = the padded forward, for comparison
    and debugging (docs/performance.md, "Packed log-prob passes")."""
    eval_objective_prompts: int | None = None
    """Held-out prompts (the first ones) on which every evaluation computes the exact objective J_β = E[R] −
    β·KL(π‖π_ref) at β = ``kl.beta``, its optimum J* and KL(π‖π*) by enumerating all responses (``eval/J``,
    ``eval/J_star``, ``eval/kl_to_optimum``, ``eval/exact_kl``); 0 = off; null = 20 for short answers
    (``rollout.max_new_tokens`` ≤ 10) with ``kl.beta`` > 0 and ``rollout.top_p`` = 1, else off."""

    def check(self, report: Report) -> None:
        report.require(self.steps >= 1, "steps", "must be >= 1")
        report.require(self.eval_every >= 0, "eval_every", "must be >= 0")
        report.require(self.save_every >= 1, "save_every", "must be >= 1")
        report.require(
            self.keep_checkpoints is None or self.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1 or null"
        )
        if self.stop_when is not None:
            from klgrad.stopping import parse_stop_rule

            try:
                parse_stop_rule(self.stop_when)
            except ValueError as e:
                report.require(False, "stop_when", str(e))
        report.require(self.eval_samples >= 1, "eval_samples", "must be >= 1")
        report.require(self.max_skipped_steps >= 1, "max_skipped_steps", "must be >= 1")
        ok = self.threads is None or self.threads == "auto" or self.threads >= 1
        report.require(ok, "threads", "must be >= 1, 'auto' or null")
        report.require(
            self.eval_objective_prompts is None or self.eval_objective_prompts >= 0,
            "eval_objective_prompts",
            "must be >= 0 or null",
        )


@dataclass
class Config:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy / reference model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Task and prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward functions."""
    kl: KLConfig = field(default_factory=KLConfig)
    """KL regularisation."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Advantages and the policy loss."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimiser."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Loop, logging and output."""

    def check(self, report: Report) -> None:
        b = self.rollout.prompts_per_step * self.rollout.group_size
        report.require(
            not self.data.task.startswith("chat_") or bool(self.model.path),
            "model.path",
            f"is required with data.task = {self.data.task!r} (a chat task has no embedded reference: e.g. "
            "smollm2-135m-instruct)",
        )
        report.require(
            self.rollout.group_size >= 2 or not needs_groups(self.algo.shaping),
            "rollout.group_size",
            f"must be >= 2 for group shaping {self.algo.shaping!r}",
        )
        # every log-prob klgrad takes (policy, reference, behaviour, exact KL) is of the full distribution at the
        # temperature; a top-p sampler draws from the truncated one, so KL heads and importance ratios would be of
        # a distribution that was not sampled
        off_policy = self.algo.ppo_epochs > 1 or self.algo.mini_batches > 1
        report.require(
            self.rollout.top_p == 1.0 or (self.kl.head == "none" and not off_policy),
            "rollout.top_p",
            f"must be 1.0 with a KL head (kl.head = {self.kl.head!r}) or an off-policy update (algo.ppo_epochs > 1 "
            "or algo.mini_batches > 1), got "
            f"{self.rollout.top_p}: klgrad's log-probs are of the full distribution, and its KL heads and "
            "importance ratios are exact only for the distribution sampled",
        )
        report.require(
            not self.train.eval_objective_prompts or (self.kl.beta > 0 and self.rollout.top_p == 1.0),
            "train.eval_objective_prompts",
            f"needs kl.beta > 0 (J_β is defined for β > 0; got {self.kl.beta}) and rollout.top_p = 1 (the "
            f"objective is of the full distribution; got {self.rollout.top_p}): set it to 0 or null",
        )
        # LoRA: the reference is the base weights under the adapter, and vLLM syncs plain weights
        lora = self.model.lora_rank > 0
        report.require(
            not (lora and self.kl.reset_ref_every is not None),
            "kl.reset_ref_every",
            f"must be null with model.lora_rank = {self.model.lora_rank}: a LoRA run's reference is the frozen base "
            "weights with the adapter off, so it cannot be reset to the policy (docs/lora.md)",
        )
        report.require(
            not (lora and self.rollout.engine == "vllm"),
            "rollout.engine",
            f"'vllm' cannot run with model.lora_rank = {self.model.lora_rank}: its weight sync loads plain weights, "
            "not a LoRA adapter; use 'klgrad' or 'hf'",
        )
        report.require(
            b % self.algo.mini_batches == 0,
            "algo.mini_batches",
            f"must divide the rollout batch prompts_per_step*group_size = {b}",
        )
        report.require(
            (b // self.algo.mini_batches) % self.rollout.group_size == 0,
            "algo.mini_batches",
            "must split the batch into whole groups",
        )


# ----------------------------------------------------------------------------------------------------------
# machinery: dict -> dataclasses (pydantic, every error at once), rules, YAML, overrides, reference

_DATACLASSES = (
    ModelConfig,
    DataConfig,
    RolloutConfig,
    RewardFnConfig,
    RewardConfig,
    KLConfig,
    AlgoConfig,
    OptimConfig,
    TrainConfig,
    Config,
)
for _cls in _DATACLASSES:
    # read by pydantic (a ConfigDict is a plain dict): strict types (no "5" -> 5, no 1 -> true), no unknown
    # keys, finite numbers, and the string under each field as its description in the JSON schema
    _cls.__pydantic_config__ = {  # type: ignore[attr-defined]
        "strict": True,
        "extra": "forbid",
        "allow_inf_nan": False,
        "use_attribute_docstrings": True,
    }


class Report:
    """Collects the problems of one configuration as ``dotted.field message`` lines, so all are reported at once."""

    def __init__(self, prefix: str = "", problems: list[str] | None = None) -> None:
        self.prefix = prefix
        self.problems: list[str] = [] if problems is None else problems

    def require(self, ok: bool, name: str, msg: str) -> None:
        """Record ``prefix + name + " " + msg`` unless ``ok``."""
        if not ok:
            self.problems.append(f"{self.prefix}{name} {msg}")

    def add(self, name: str, problem: str | None) -> None:
        """Record ``prefix + name + " " + problem`` when there is one (a rule of :mod:`klgrad.option_rules`)."""
        if problem is not None:
            self.problems.append(f"{self.prefix}{name} {problem}")

    def section(self, name: str) -> Report:
        """The report of section ``name`` (same list, names prefixed ``name.``)."""
        return Report(f"{self.prefix}{name}.", self.problems)


@functools.cache
def _validator(cls: type = Config) -> Any:
    """pydantic's validator of the config dataclass ``cls`` (built once per class, on first use)."""
    from pydantic import TypeAdapter

    return TypeAdapter(cls)


def json_schema() -> dict[str, Any]:
    """The JSON schema of a config file (draft 2020-12, from pydantic): every field with its type, default,
    choices and doc, unknown keys refused. Shipped as ``configs/klgrad.schema.json`` for YAML editors."""
    schema = _validator().json_schema()
    schema["title"] = "klgrad config"
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema


def _suggest(word: Any, options: Any) -> str:
    """``; did you mean 'beta'?`` for a near miss (difflib ratio ≥ 0.6), else ``""``."""
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, [str(o) for o in options], n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _type_at(loc: tuple) -> Any:
    """The annotation of the field that ``loc`` (a pydantic location, list indices skipped) names."""
    tp: Any = Config
    for part in loc:
        if isinstance(part, int):
            tp = next((a for a in get_args(tp) if dataclasses.is_dataclass(a)), tp)  # list[RewardFnConfig]
            continue
        if not dataclasses.is_dataclass(tp):
            return None
        tp = typing.get_type_hints(tp).get(part)
    return tp


def _fields_at(loc: tuple) -> list[str]:
    """The field names of the config dataclass that ``loc`` points into."""
    tp = _type_at(loc)
    return [f.name for f in dataclasses.fields(tp)] if dataclasses.is_dataclass(tp) else []


def _got(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and len(str(abs(value))) > 30:
        return f"an integer of {len(str(abs(value)))} digits"
    return repr(value)


def _field_loc(loc: tuple) -> tuple:
    """``loc`` up to the field it names: pydantic appends a union member's tag (``int``, ``literal['auto']``)
    to the location of a field typed ``int | Literal['auto'] | None``; those are not fields."""
    tp: Any = Config
    for i, part in enumerate(loc):
        if isinstance(part, int):
            tp = next((a for a in get_args(tp) if dataclasses.is_dataclass(a)), tp)
            continue
        if not dataclasses.is_dataclass(tp):
            return loc[:i]
        tp = typing.get_type_hints(tp).get(part)
    return loc


def _describe(tp: Any) -> str:
    """A union member in words: "an integer", "'auto'", "null"."""
    if tp is type(None):
        return "null"
    if get_origin(tp) is Literal:
        return " or ".join(repr(c) for c in get_args(tp))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _messages(errors: list[dict[str, Any]]) -> list[str]:
    """pydantic's errors as klgrad's lines; a value that fits no member of a union field is one line naming
    every member ("train.threads must be an integer or 'auto' or null, got 'x'"), not one per member."""
    out: list[str] = []
    for err in errors:
        loc = _field_loc(err["loc"])
        if loc == err["loc"]:
            out.append(_message(err))
            continue
        where = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))
        members = " or ".join(_describe(a) for a in get_args(_type_at(loc)))
        line = f"{where} must be {members}, got {_got(err.get('input'))}"
        if line not in out:
            out.append(line)
    return out


def _message(error: dict[str, Any]) -> str:
    """One pydantic error as klgrad's ``dotted.field message`` (the wording of the hand-written checks it
    replaced: "must be one of [...]", "is not a config field; allowed here: [...]")."""
    loc = error["loc"]
    where = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc))
    where = where or "config"
    kind, value, ctx = error["type"], error.get("input"), error.get("ctx") or {}
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        allowed = _fields_at(loc[:-1])
        return f"{where} is not a config field; allowed here: {allowed}{_suggest(loc[-1], allowed)}"
    if kind == "literal_error":
        choices = [c for c in get_args(_type_at(loc)) if c is not None]  # the field's Literal, not pydantic's text
        return f"{where} must be one of {choices}, got {_got(value)}{_suggest(value, choices)}"
    if kind == "choice_or_import_path":
        choices = ctx["expected"]
        return f"{where} must be one of {choices} or 'package.module:name', got {_got(value)}{_suggest(value, choices)}"
    if kind in ("int_type", "int_from_float", "int_parsing"):
        return f"{where} must be an integer, got {_got(value)}"
    if kind in ("float_type", "float_parsing"):
        return f"{where} must be a number, got {_got(value)}"
    if kind == "finite_number":
        return f"{where} must be a finite number, got {_got(value)}"
    if kind in ("bool_type", "bool_parsing"):
        return f"{where} must be true or false, got {_got(value)}"
    if kind == "string_type":
        hint = (
            " (YAML read it as a number or boolean: quote it to keep it text)" if isinstance(value, int | float) else ""
        )
        return f"{where} must be a string, got {_got(value)}{hint}"
    if kind in ("dataclass_type", "dataclass_exact_type", "dict_type", "model_type"):
        return f"{where} must be a mapping, got {type(value).__name__} {_got(value)}"
    if kind in ("list_type", "tuple_type"):
        return f"{where} must be a list, got {type(value).__name__} {_got(value)}"
    if kind in ("too_long", "too_short"):
        n = ctx.get("max_length") if kind == "too_long" else ctx.get("min_length")
        return f"{where} must have {n} items, got {len(value)}"
    if kind == "missing" and loc and isinstance(loc[-1], int):  # a short fixed-length list (optim.betas)
        n = len(get_args(_type_at(loc[:-1])))
        return f"{where.rpartition('[')[0]} must have {n} items, got {loc[-1]}"
    return f"{where}: {error['msg']}"


def _check_rules(cfg: Config) -> list[str]:
    """Every value rule of every section; then, when each section is valid on its own, the rules across sections
    (:meth:`Config.check`, which may divide by a section's value)."""
    report = Report()
    for f in dataclasses.fields(cfg):
        getattr(cfg, f.name).check(report.section(f.name))
    if not report.problems:
        cfg.check(report)
    return report.problems


def parse_config(data: Any) -> Config:
    """A nested mapping -> validated :class:`Config`; raises :class:`ConfigError` listing every problem: wrong
    keys and types first (all of them, from pydantic); when the types are right, every value rule."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping of sections, got {type(data).__name__}")
    data = {k: ({} if v is None else v) for k, v in data.items()}  # an empty YAML section is its defaults
    from pydantic import ValidationError

    try:
        text = json.dumps(data, default=str)  # JSON mode: strict types, yet sections are given as mappings
    except ValueError as e:  # a circular structure (YAML anchors)
        raise ConfigError(f"config cannot be read: {e}") from None
    try:
        cfg = _validator().validate_json(text)
    except ValidationError as e:
        errors = e.errors()
        problems = _messages(errors)
        # the sections without a type error still get their value rules checked, so one read reports them too
        broken = {err["loc"][0] for err in errors if err["loc"]}
        report = Report(problems=problems)
        for f in dataclasses.fields(Config):
            if f.name in data and f.name not in broken and isinstance(data[f.name], dict):
                section = _validator(_type_at((f.name,))).validate_json(json.dumps(data[f.name], default=str))
                section.check(report.section(f.name))
        raise ConfigError.of(problems) from None
    problems = _check_rules(cfg)
    if problems:
        raise ConfigError.of(problems)
    return cfg


def to_dict(cfg: Any) -> dict:
    """Plain nested dict (tuples as lists), ready for YAML/JSON."""

    def conv(x: Any) -> Any:
        if dataclasses.is_dataclass(x):
            return {f.name: conv(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, list | tuple):
            return [conv(v) for v in x]
        return x

    return conv(cfg)


_YAML12_FLOAT = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*|[0-9]+(?=[eE]))(?:[eE][-+]?[0-9]+)?$")
"""The YAML 1.2 core-schema floats that YAML 1.1 reads as strings: ``1e-6``, ``5e-7``, ``1E-4``, ``1e+3``,
``-.5``, ``1.0e6`` (a dot or an exponent; plain integers stay integers)."""


class ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (no Python object tags) that also reads YAML 1.2 floats (``1e-6``) as floats."""


class ConfigDumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that quotes a string :class:`ConfigLoader` would read as a float (``'1e-6'``)."""


ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+.0123456789"))
ConfigDumper.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+.0123456789"))


def load_yaml(text: str) -> Any:
    """Config YAML -> Python (:class:`ConfigLoader`); raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=ConfigLoader)  # safe: ConfigLoader is a SafeLoader


def dump_yaml(data: Any, sort_keys: bool = False) -> str:
    """Python -> config YAML that :func:`load_yaml` reads back unchanged (keys in insertion order unless sorted)."""
    return yaml.dump(data, Dumper=ConfigDumper, sort_keys=sort_keys)


def parse_value(text: str) -> Any:
    """An override's value: YAML scalar/list syntax (``0.5``, ``1e-6``, ``null``, ``true``, ``[0.9, 0.95]``)."""
    try:
        return load_yaml(text)
    except yaml.YAMLError:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text


def apply_overrides(data: dict, overrides: dict[str, Any]) -> dict:
    """Set dotted keys (``kl.beta``) in a nested dict; unknown sections fail later in :func:`parse_config`."""
    out = load_yaml(dump_yaml(data, sort_keys=True)) if data else {}
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node = out
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"{dotted}: {p} is not a section")
            node = nxt
        node[parts[-1]] = value
    return out


def packaged_config(path: str | Path) -> Path | None:
    """The config file shipped in the klgrad package (``klgrad/configs/``) that ``path`` names, or None:
    ``configs/tiny_add.yaml`` and ``tiny_add.yaml`` both name ``klgrad/configs/tiny_add.yaml``."""
    parts = Path(path).parts
    if parts[:1] == ("configs",):
        parts = parts[1:]
    if not parts or ".." in parts:
        return None
    candidate = importlib.resources.files("klgrad").joinpath("configs", *parts)
    return Path(str(candidate)) if candidate.is_file() else None


def resolve_config_path(path: str | Path) -> Path:
    """``path`` itself when it exists (or is absolute); a relative path missing from the working directory is
    looked up among the configs shipped in the package (:func:`packaged_config`), so ``configs/tiny_add.yaml``
    (the default of ``klgrad compare``) works from any directory and from a wheel. Returned unchanged when
    neither exists (the caller reports it)."""
    p = Path(path)
    if p.is_file() or p.is_absolute():
        return p
    return packaged_config(p) or p


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """YAML file (optional; a relative path is also looked up in the package's configs, :func:`resolve_config_path`)
    + dotted overrides -> validated :class:`Config`."""
    data: dict = {}
    if path is not None:
        p = resolve_config_path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = load_yaml(p.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: not valid YAML ({e})") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
    return parse_config(apply_overrides(data, overrides or {}))


def parse_override_args(args: list[str]) -> dict[str, Any]:
    """``["--kl.head", "k3_as_loss", "--kl.beta=0.5"]`` -> ``{"kl.head": "k3_as_loss", "kl.beta": 0.5}``."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or len(a) <= 2:
            raise ConfigError(f"override {a!r} must look like --section.field VALUE")
        key, eq, val = a[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{key} needs a value")
            val, i = args[i + 1], i + 1
        out[key] = parse_value(val)
        i += 1
    return out


def config_reference() -> str:
    """Markdown table of every field: dotted name, type, default, doc. Generated, so it cannot drift."""
    lines = ["| field | type | default | meaning |", "|---|---|---|---|"]

    def walk(cls: type, prefix: str) -> None:
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls, include_extras=True)
        default_obj = cls()
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
                continue
            suffix = ""
            if get_origin(tp) is Annotated:  # Annotated[Literal[...], OrImportPath()]: the choices or an import path
                tp, *meta = get_args(tp)
                suffix = " | 'package.module:name'" if any(isinstance(m, OrImportPath) for m in meta) else ""
            members = get_args(tp) if get_origin(tp) is typing.Union else (tp,)  # int | Literal['auto'] | None
            names = ["None" if a is type(None) else a.__name__ if isinstance(a, type) else str(a) for a in members]
            tname = " | ".join(n.replace("typing.", "") for n in names) + suffix
            tname = tname.replace("klgrad.config.", "").replace("__main__.", "").replace("|", "\\|")
            default = getattr(default_obj, f.name)
            default = to_dict(default) if isinstance(default, list) else default
            lines.append(f"| `{prefix}{f.name}` | `{tname}` | `{default!r}` | {docs.get(f.name, '')} |")

    walk(Config, "")
    return "\n".join(lines)


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field (attribute docstrings), its lines joined into one."""
    src = inspect.getsource(cls)
    tree = ast.parse(src)
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())  # one line: a table cell
    return docs


SCHEMA_FILE = "klgrad.schema.json"
"""The JSON schema's file name beside the shipped configs; each names it on its first line
(``# yaml-language-server: $schema=klgrad.schema.json``), so editors with a YAML language server complete and
check fields (a config elsewhere names the schema's path or URL the same way)."""


def schema_text() -> str:
    """The JSON schema as written to ``klgrad/configs/klgrad.schema.json``."""
    return json.dumps(json_schema(), indent=1, ensure_ascii=False) + "\n"


def write_reference(path: str | Path = "docs/configuration.md") -> None:
    """Regenerate the configuration reference and the configs' JSON schema (``python -m klgrad.config``)."""
    Path(path).write_text(
        "# Configuration reference\n\nGenerated from `src/klgrad/config.py` by `python -m klgrad.config`; "
        "a test fails when it drifts. Set fields in YAML sections or with dotted flags "
        "(`klgrad train --kl.beta 0.1`).\n\n"
        "A config is checked as a whole: every wrong key, type and value is reported at once, one line each, "
        "naming the dotted field (with a suggestion for a near miss: `kl.bta is not a config field; allowed here: "
        "[...]; did you mean 'beta'?`). Editors with a YAML language server (VS Code's YAML extension, Neovim's "
        "yamlls) complete and check fields from the JSON schema `src/klgrad/configs/klgrad.schema.json`, which "
        "the shipped configs name on their first line: `# yaml-language-server: $schema=klgrad.schema.json`.\n\n"
        + config_reference()
        + "\n",
        encoding="utf-8",
    )
    (Path(str(importlib.resources.files("klgrad"))) / "configs" / SCHEMA_FILE).write_text(
        schema_text(), encoding="utf-8"
    )


if __name__ == "__main__":
    write_reference()
