"""Typed, nested, validated configuration: YAML files plus dotted overrides (``--kl.head k3_as_loss``).

Every field has a one-line doc (the string under it) and, where it has one, a unit. A wrong key, type or value
fails at once with :class:`ConfigError` naming the dotted field and, for choices, the allowed values.
YAML is read with a safe loader only (:class:`ConfigLoader`: PyYAML's ``SafeLoader`` that also reads YAML 1.2
floats such as ``1e-6``). :func:`config_reference` renders the schema as Markdown, so the
documentation is generated from this file and cannot drift.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.resources
import importlib.util
import inspect
import itertools
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml

from klgrad.choices import (
    IMPORT_PATH,
    LORA_TARGETS,
    Aggregation,
    Engine,
    Form,
    HeadName,
    Level,
    MismatchLevel,
    OrImportPath,
    PromptFormat,
    RatioLevel,
    RewardRatioLevel,
    Schedule,
    ShapingMethod,
    needs_groups,
)


class ConfigError(ValueError):
    """A configuration problem; the message starts with the dotted field name."""


@dataclass
class ModelConfig:
    path: str | None = None
    """Model to start from: a local HF folder, a known name (smollm2-135m-instruct), a .gguf file (de-quantized once
    into ~/.cache/klgrad) or a Hugging Face id (HF cache, else downloaded when online); null = the embedded tiny
    reference of data.task (docs/models.md). Never runs the model's own code (trust_remote_code off)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
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

    def validate(self, at: str) -> None:
        _check(self.lora_rank >= 0, at, "lora_rank", f"must be >= 0 (0 = full fine-tuning), got {self.lora_rank}")
        _check(self.lora_alpha > 0, at, "lora_alpha", f"must be > 0, got {self.lora_alpha}")
        _check(len(self.lora_targets) >= 1, at, "lora_targets", "needs at least one projection")
        unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
        _check(not unknown, at, "lora_targets", f"{unknown} unknown: allowed are {list(LORA_TARGETS)}")
        _check(len(set(self.lora_targets)) == len(self.lora_targets), at, "lora_targets", "lists a projection twice")
        has_peft = self.lora_rank == 0 or importlib.util.find_spec("peft") is not None
        _check(has_peft, at, "lora_rank", f"{self.lora_rank} needs peft (not installed): pip install 'klgrad[lora]'")
        ok = self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:[0-9]+", self.device) is not None
        _check(ok, at, "device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.device.startswith("cuda"):
            import torch

            _check(torch.cuda.is_available(), at, "device", f"{self.device!r}: no CUDA GPU is visible to torch here")


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

    def validate(self, at: str) -> None:
        _check(self.digits >= 1, at, "digits", "must be >= 1")
        _check(self.n_train >= 1, at, "n_train", "must be >= 1")
        _check(self.n_eval >= 1, at, "n_eval", "must be >= 1")
        _check(self.task != "file" or bool(self.path), at, "path", "is required when data.task = file")
        _check(self.digits <= 9, at, "digits", f"must be <= 9, got {self.digits}")


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

    def validate(self, at: str) -> None:
        _check(self.prompts_per_step >= 1, at, "prompts_per_step", "must be >= 1")
        _check(self.group_size >= 1, at, "group_size", "must be >= 1")
        _check(self.max_new_tokens >= 1, at, "max_new_tokens", "must be >= 1")
        _check(self.temperature > 0, at, "temperature", "must be > 0")
        _check(0 < self.top_p <= 1, at, "top_p", "must be in (0, 1]")
        _check(self.mismatch_cap > 0, at, "mismatch_cap", "must be > 0")
        if self.engine == "vllm":
            from klgrad.rollout.vllm_engine import vllm_unavailable_reason

            reason = vllm_unavailable_reason()
            _check(reason is None, at, "engine", f"'vllm' cannot run here: {reason}")


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

    def validate(self, at: str) -> None:
        _check(len(self.functions) >= 1, at, "functions", "needs at least one reward function")
        _check(self.timeout_s > 0, at, "timeout_s", "must be > 0")
        _check(
            self.max_failure_fraction is None or 0 <= self.max_failure_fraction < 1,
            at,
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

    def validate(self, at: str) -> None:
        _check(self.beta >= 0, at, "beta", "must be >= 0")
        _check(self.clip_eps is None or 0 < self.clip_eps < 1, at, "clip_eps", "must be in (0, 1) or null")
        _check(self.target_kl is None or self.target_kl > 0, at, "target_kl", "must be > 0 or null")
        _check(self.reset_ref_every is None or self.reset_ref_every >= 1, at, "reset_ref_every", "must be >= 1")
        _check(
            not (self.form == "combined" and self.level == "token"),
            at,
            "level",
            "'token' is not a return: the combined form needs 'sequence' or 'token_to_go'",
        )


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

    def validate(self, at: str) -> None:
        _check(self.std_min is None or self.std_min > 0, at, "std_min", "must be > 0 or null")
        _check(self.std_max is None or self.std_max > 0, at, "std_max", "must be > 0 or null")
        _check(0 < self.clip_eps_low < 1, at, "clip_eps_low", "must be in (0, 1)")
        _check(self.clip_eps_high > 0, at, "clip_eps_high", "must be > 0")
        _check(self.dual_clip is None or self.dual_clip > 1, at, "dual_clip", "must be > 1 or null")
        _check(self.entropy_coef >= 0, at, "entropy_coef", "must be >= 0")
        _check(self.ppo_epochs >= 1, at, "ppo_epochs", "must be >= 1")
        _check(self.mini_batches >= 1, at, "mini_batches", "must be >= 1")
        _check(self.micro_batch_size >= 1, at, "micro_batch_size", "must be >= 1")


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

    def validate(self, at: str) -> None:
        _check(self.lr > 0, at, "lr", "must be > 0")
        _check(self.weight_decay >= 0, at, "weight_decay", "must be >= 0")
        _check(all(0 <= b < 1 for b in self.betas), at, "betas", "must be in [0, 1)")
        _check(self.grad_clip is None or self.grad_clip > 0, at, "grad_clip", "must be > 0 or null")
        _check(self.warmup_steps >= 0, at, "warmup_steps", "must be >= 0")


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
    out_dir: str = "runs/train"
    """Run directory (metrics, curves, checkpoints, resolved config)."""
    tensorboard: bool = True
    """Also write TensorBoard events."""
    wandb: bool = False
    """Also log to Weights & Biases (when installed)."""
    threads: int | None = None
    """torch CPU threads; None = torch default."""
    max_skipped_steps: int = 3
    """Stop (with a checkpoint) after this many consecutive steps whose update had a non-finite loss/gradient."""
    eval_objective_prompts: int | None = None
    """Held-out prompts (the first ones) on which every evaluation computes the exact objective J_β = E[R] −
    β·KL(π‖π_ref) at β = ``kl.beta``, its optimum J* and KL(π‖π*) by enumerating all responses (``eval/J``,
    ``eval/J_star``, ``eval/kl_to_optimum``, ``eval/exact_kl``); 0 = off; null = 20 for short answers
    (``rollout.max_new_tokens`` ≤ 10) with ``kl.beta`` > 0 and ``rollout.top_p`` = 1, else off."""

    def validate(self, at: str) -> None:
        _check(self.steps >= 1, at, "steps", "must be >= 1")
        _check(self.eval_every >= 0, at, "eval_every", "must be >= 0")
        _check(self.save_every >= 1, at, "save_every", "must be >= 1")
        _check(self.eval_samples >= 1, at, "eval_samples", "must be >= 1")
        _check(self.max_skipped_steps >= 1, at, "max_skipped_steps", "must be >= 1")
        _check(self.threads is None or self.threads >= 1, at, "threads", "must be >= 1 or null")
        _check(
            self.eval_objective_prompts is None or self.eval_objective_prompts >= 0,
            at,
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

    def validate(self, at: str = "") -> None:
        b = self.rollout.prompts_per_step * self.rollout.group_size
        _check(
            not self.data.task.startswith("chat_") or bool(self.model.path),
            "model.",
            "path",
            f"is required with data.task = {self.data.task!r} (a chat task has no embedded reference: e.g. "
            "smollm2-135m-instruct)",
        )
        _check(
            self.rollout.group_size >= 2 or not needs_groups(self.algo.shaping),
            "rollout.",
            "group_size",
            f"must be >= 2 for group shaping {self.algo.shaping!r}",
        )
        # every log-prob klgrad takes (policy, reference, behaviour, exact KL) is of the full distribution at the
        # temperature; a top-p sampler draws from the truncated one, so KL heads and importance ratios would be of
        # a distribution that was not sampled
        off_policy = self.algo.ppo_epochs > 1 or self.algo.mini_batches > 1
        _check(
            self.rollout.top_p == 1.0 or (self.kl.head == "none" and not off_policy),
            "rollout.",
            "top_p",
            f"must be 1.0 with a KL head (kl.head = {self.kl.head!r}) or an off-policy update (algo.ppo_epochs > 1 "
            "or algo.mini_batches > 1), got "
            f"{self.rollout.top_p}: klgrad's log-probs are of the full distribution, and its KL heads and "
            "importance ratios are exact only for the distribution sampled",
        )
        _check(
            not self.train.eval_objective_prompts or (self.kl.beta > 0 and self.rollout.top_p == 1.0),
            "train.",
            "eval_objective_prompts",
            f"needs kl.beta > 0 (J_β is defined for β > 0; got {self.kl.beta}) and rollout.top_p = 1 (the "
            f"objective is of the full distribution; got {self.rollout.top_p}): set it to 0 or null",
        )
        # LoRA: the reference is the base weights under the adapter, and vLLM syncs plain weights
        lora = self.model.lora_rank > 0
        _check(
            not (lora and self.kl.reset_ref_every is not None),
            "kl.",
            "reset_ref_every",
            f"must be null with model.lora_rank = {self.model.lora_rank}: a LoRA run's reference is the frozen base "
            "weights with the adapter off, so it cannot be reset to the policy (docs/lora.md)",
        )
        _check(
            not (lora and self.rollout.engine == "vllm"),
            "rollout.",
            "engine",
            f"'vllm' cannot run with model.lora_rank = {self.model.lora_rank}: its weight sync loads plain weights, "
            "not a LoRA adapter; use 'klgrad' or 'hf'",
        )
        _check(
            b % self.algo.mini_batches == 0,
            "algo.",
            "mini_batches",
            f"must divide the rollout batch prompts_per_step*group_size = {b}",
        )
        _check(
            (b // self.algo.mini_batches) % self.rollout.group_size == 0,
            "algo.",
            "mini_batches",
            "must split the batch into whole groups",
        )


# ----------------------------------------------------------------------------------------------------------
# machinery: dict -> dataclass with dotted errors, YAML, overrides, reference


def _check(ok: bool, at: str, name: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{at}{name} {msg}")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        base, *meta = args
        if not any(isinstance(m, OrImportPath) for m in meta):
            return _coerce(value, base, where)
        if isinstance(value, str) and re.fullmatch(IMPORT_PATH, value):
            return value
        try:
            return _coerce(value, base, where)
        except ConfigError:
            raise ConfigError(
                f"{where} must be one of {list(get_args(base))} or 'package.module:name', got {value!r}"
            ) from None
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where} must not be null")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where} must be one of {list(args)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where + ".")
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where} must be a list, got {type(value).__name__} {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{where} must have {len(args)} items, got {len(value)}")
            return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))
        return [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:
            raise ConfigError(f"{where} must be a finite number, got an integer of {len(str(value))} digits") from None
        if number != number or number in (float("inf"), float("-inf")):
            raise ConfigError(f"{where} must be finite, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, str):
            scalar = isinstance(value, int | float)  # bool included
            hint = " (YAML read it as a number or boolean: quote it to keep it text)" if scalar else ""
            raise ConfigError(f"{where} must be a string, got {value!r}{hint}")
        return value
    raise ConfigError(f"{where}: unsupported type {tp}")


def from_dict(cls: type, data: Any, at: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping; unknown keys and bad values raise ConfigError (dotted)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{at.rstrip('.') or 'config'} must be a mapping, got {type(data).__name__}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            raise ConfigError(f"{at}{key} is not a config field; allowed here: {names}")
    kwargs = {k: _coerce(v, hints[k], f"{at}{k}") for k, v in data.items()}
    obj = cls(**kwargs)
    if hasattr(obj, "validate"):
        obj.validate(at)
    return obj


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
    """Set dotted keys (``kl.beta``) in a nested dict; unknown sections fail later in :func:`from_dict`."""
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
    cfg = from_dict(Config, apply_overrides(data, overrides or {}))
    cfg.validate()
    return cfg


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
        hints = _hints(cls)
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
            tname = (tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")) + suffix
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


def write_reference(path: str | Path = "docs/configuration.md") -> None:
    """Regenerate the configuration reference (``python -m klgrad.config``)."""
    Path(path).write_text(
        "# Configuration reference\n\nGenerated from `src/klgrad/config.py` by `python -m klgrad.config`; "
        "a test fails when it drifts. Set fields in YAML sections or with dotted flags "
        "(`klgrad train --kl.beta 0.1`).\n\n" + config_reference() + "\n",
        encoding="utf-8",
    )


if __name__ == "__main__":
    write_reference()
