"""The option records: one frozen pydantic dataclass per concept, checked when made; ``Field`` constraints are the
rules, the string under a field its doc, a validator (:func:`require`) a rule across fields. Used unchanged."""

from __future__ import annotations

import importlib.util
from dataclasses import field
from typing import Annotated, Literal

from pydantic import AfterValidator, ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass

from klgrad import choices as c
from klgrad.stopping import check_stop_rule

# strict types (no "5" -> 5, no 1 -> true), no unknown keys, finite numbers, field docs from the source
RULES = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, use_attribute_docstrings=True)
record = dataclass(frozen=True, config=RULES)
Positive, NonNegative = Annotated[float, Field(gt=0)], Annotated[float, Field(ge=0)]
Fraction, Beta = Annotated[float, Field(gt=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]
AtLeastOne, AtLeastZero = Annotated[int, Field(ge=1)], Annotated[int, Field(ge=0)]


def require(rules: list[tuple[bool, str, str]]) -> None:
    """A ``ValueError`` with a ``field message`` line for each ``(holds, field, message)`` that does not hold."""
    if broken := [f"{name} {msg}" for ok, name, msg in rules if not ok]:
        raise ValueError("\n".join(broken))


@record
class ModelConfig:
    path: str | None = None
    """A local HF folder, smollm2-135m-instruct, a .gguf, an HF id; null = data.task's embedded model (docs/models)."""
    dtype: c.ModelDtype = "float32"
    """Parameter dtype (CPU: float32)."""
    attn_implementation: c.AttnImplementation = "auto"
    """Attention kernel; auto = eager on CPU (never slower there in our measurement), sdpa on GPU."""
    fast_forward: bool = True
    """Llama/Qwen2/Mistral: klgrad's functional forward for rollout and shared-prompt log-probs (false: HF's)."""
    device: Annotated[str, Field(pattern=r"^(auto|cpu|cuda|cuda:[0-9]+)$")] = "auto"
    """Where klgrad train runs the policy and reference: auto (cuda when available, else cpu), cpu, cuda, cuda:N."""
    lora_rank: AtLeastZero = 0
    """LoRA rank r (pip install 'klgrad[lora]'; 0 = full fine-tuning): only the adapter trains (docs/lora.md)."""
    lora_alpha: Positive = 16.0
    """LoRA α: each targeted weight W becomes W + (α/r)·B·A, i.e. the adapter's scale is α/r (> 0)."""
    lora_targets: Annotated[list[c.LoraTarget], Field(min_length=1)] = field(default_factory=lambda: [*c.LORA_TARGETS])
    """Projections with an adapter in every decoder layer (Llama/Qwen2/Mistral names; default all seven)."""

    @model_validator(mode="after")
    def _rules(self) -> ModelConfig:
        has_peft = self.lora_rank == 0 or importlib.util.find_spec("peft") is not None
        require([
            (len(set(self.lora_targets)) == len(self.lora_targets), "lora_targets", "lists a projection twice"),
            (has_peft, "lora_rank", f"{self.lora_rank} needs peft (not installed): pip install 'klgrad[lora]'"),
        ])  # fmt: skip
        if self.device.startswith("cuda"):
            import torch

            require([(torch.cuda.is_available(), "device", f"{self.device!r}: no CUDA GPU is visible to torch here")])
        return self


@record
class DataConfig:
    task: c.Task = "addition"
    """Synthetic task (chat_*: for a pretrained chat model, model.path required), or 'file' (data.path's rows)."""
    digits: Annotated[int, Field(ge=1, le=9)] = 2
    """Operand digits of the synthetic task."""
    n_train: AtLeastOne = 4000
    """Synthetic training prompts."""
    n_eval: AtLeastOne = 200
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
    prompt_format: c.PromptFormat = "auto"
    """Prompt tokens: chat = one user message in the chat template; raw = BOS + text; auto = chat if there is one."""
    response_format: c.ResponseFormat = "boxed"
    """task = file: the response format the 'format' reward checks (\\boxed{...} or <think>..<answer>)."""

    @model_validator(mode="after")
    def _rules(self) -> DataConfig:
        require([(self.task != "file" or bool(self.path), "path", "is required when data.task = file")])
        return self


@record
class RolloutConfig:
    engine: c.Engine = "klgrad"
    """Sampler: klgrad's KV-cache sampler, transformers generate, or vLLM (CUDA GPU + klgrad[vllm]; docs/vllm.md)."""
    prompts_per_step: AtLeastOne = 32
    """Prompts drawn per step, in all (under accelerate launch each process answers an equal share)."""
    group_size: AtLeastOne = 8
    """Responses per prompt (G)."""
    max_new_tokens: AtLeastOne = 8
    """Response length cap (tokens); longer responses are truncated and flagged."""
    temperature: Positive = 1.0
    """Sampling temperature; log-probs for training are taken at the same temperature."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Nucleus sampling mass (1.0 = off); < 1 only with kl.head none and on-policy (log-probs are untruncated)."""
    mismatch_correction: Literal["none", c.MismatchLevel] = "none"
    """IS for sampler-vs-trainer mismatch, r = π_trainer/π_sampler per token / response: token, sequence (truncated,
    min(r, C)); token_mask, sequence_mask (masked, r where 1/C ≤ r ≤ C, else 0)."""
    mismatch_cap: Positive = 2.0
    """Cap C of the mismatch weights (> 0): truncation at C, or masking outside [1/C, C] (needs C > 1)."""
    sampler_dtype: c.ModelDtype | None = None
    """klgrad engine: sample from a copy of the policy in this dtype, synced after every update (bfloat16: an
    inference engine's arithmetic, docs/vllm.md); null = the policy itself (model.dtype)."""
    staleness: AtLeastZero = 0
    """Stale rollouts (async RL): step t samples with the policy of k updates back, whose log-probs the ratios use."""

    @model_validator(mode="after")
    def _rules(self) -> RolloutConfig:
        if self.engine == "vllm":
            from klgrad.machine import vllm_unavailable_reason

            reason = vllm_unavailable_reason()
            require([(reason is None, "engine", f"'vllm' cannot run here: {reason}")])
        stale_ok = self.engine != "vllm" or self.staleness == 0
        why = "its weight sync loads the current policy only; use 'klgrad' or 'hf'"
        require([(stale_ok, "staleness", f"must be 0 with engine 'vllm' (got {self.staleness}): {why}")])
        copy_ok = self.sampler_dtype is None or self.staleness == 0
        why = "the sampler's copy follows the current policy, not the one k updates back"
        require([(copy_ok, "staleness", f"must be 0 with a sampler_dtype (got {self.staleness}): {why}")])
        return self


@record
class RewardFnConfig:
    name: str = "accuracy"
    """Built-in reward name (accuracy, format) or 'module:function' (TRL signature)."""
    weight: float = 1.0
    """Weight in the summed reward."""


@record
class RewardConfig:
    functions: Annotated[list[RewardFnConfig], Field(min_length=1)] = field(
        default_factory=lambda: [RewardFnConfig("accuracy", 1.0), RewardFnConfig("format", 0.1)]
    )
    """Reward functions and weights, summed."""
    failure_value: float = 0.0
    """Reward given to a sample whose reward function raised, timed out or returned NaN."""
    timeout_s: Positive = 5.0
    """Time limit of one reward-function call (seconds)."""
    max_failure_fraction: Annotated[float, Field(ge=0, lt=1)] | None = None
    """Stop the run when more than this fraction of a step's samples had a failed reward (null = never)."""


@record
class KLHeadOptions:
    """The KL term: head, level, form, off-policy correction. The ``kl`` section's base and the TRL plug-in's."""

    head: Annotated[str, c.OrImportPath(c.HeadName)] = "k2_as_loss"
    """KL head: a built-in (klgrad.KL_HEADS), a registered one, 'package.module:name' (a penalty, a KLHead), or a
    framework preset id of `klgrad audit --framework` (trl/grpo-k3: that framework's KL term; docs/frameworks.md)."""
    level: c.Level = "sequence"
    """Where the head acts: sequence | token_to_go | token (token: decoupled only)."""
    form: c.Form = "decoupled"
    """combined: coefficient in the reward before shaping; decoupled: separate KL loss."""
    clip_eps: Fraction | None = 0.2
    """Off-policy symmetric clip ε of the decoupled KL head, in (0, 1) (null: importance sampling only)."""
    ratio_level: c.RatioLevel = "sequence"
    """Off-policy importance ratio of the KL head (no gspo: exactness needs the true sequence IS weight)."""
    is_correction: bool = True
    """False reproduces the common bug (no IS on an as-loss KL off-policy); comparisons only."""

    @model_validator(mode="after")
    def _rules(self) -> KLHeadOptions:
        no_return = "'token' is not a return: the combined form needs 'sequence' or 'token_to_go'"
        require([(not (self.form == "combined" and self.level == "token"), "level", no_return)])
        return self


@record
class KLConfig(KLHeadOptions):
    """The ``kl`` section: the KL term (:class:`KLHeadOptions`), its weight β and how β and the reference change."""

    beta: NonNegative = 0.5
    """KL weight β (initial value when adaptive)."""
    target_kl: Positive | None = None
    """Adaptive β: target sequence KL (nats); None = fixed β."""
    adapt_rate: float = 0.1
    """Adaptive β: proportional gain per step (β *= 1 + rate·clip(KL/target - 1, ±0.2)/0.2)."""
    reset_ref_every: AtLeastOne | None = None
    """Copy the policy into the reference every N steps (ProRL); None = never."""
    aggregation: c.Aggregation | None = None
    """Aggregation of the decoupled KL term; null = algo.aggregation. A framework preset head sets its own."""


@record
class AlgoConfig:
    shaping: c.ShapingMethod = "grpo"
    """Reward shaping operator or preset (grpo, dr_grpo, rloo, reinforce_pp, ...)."""
    std_min: Positive | None = None
    """Lower clip of normalising stds (paper: ~0.1 for [0,1] rewards)."""
    std_max: Positive | None = None
    """Upper clip of normalising stds."""
    clip_eps_low: Fraction = 0.2
    """Reward head PPO clip ε_low, in (0, 1)."""
    clip_eps_high: Positive = 0.2
    """Reward head PPO clip ε_high; > ε_low is 'clip-higher'."""
    dual_clip: Annotated[float, Field(gt=1)] | None = None
    """Dual-clip constant (> 1) for negative advantages; None = off."""
    ratio_level: c.RewardRatioLevel = "token"
    """Reward head ratio, Δ_t = log π_t - log π_old,t: token exp(Δ_t); sequence exp(Σ_t Δ_t); gspo exp(mean_t Δ_t)."""
    aggregation: c.Aggregation = "seq_mean_token_sum"
    """Loss aggregation."""
    entropy_coef: NonNegative = 0.0
    """Entropy bonus weight (paper: 0)."""
    ppo_epochs: AtLeastOne = 1
    """Update passes over each rollout batch (1 = fully on-policy)."""
    mini_batches: AtLeastOne = 1
    """Optimizer steps per epoch M; mini-batch k holds the step's groups k, k+M, k+2M, ..."""
    micro_batch_size: AtLeastOne = 64
    """Sequences per forward/backward (gradient accumulation); does not change the result."""


@record
class OptimConfig:
    lr: Positive = 1e-4
    """AdamW learning rate."""
    weight_decay: NonNegative = 0.0
    """AdamW weight decay."""
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    """AdamW betas, each in [0, 1)."""
    grad_clip: Positive | None = 1.0
    """Global grad-norm clip; None = off."""
    warmup_steps: AtLeastZero = 0
    """Linear warm-up steps."""
    schedule: c.Schedule = "constant"
    """LR schedule after warm-up."""


@record
class TrainConfig:
    steps: AtLeastOne = 150
    """RL steps (one rollout batch each); a resumed run may raise it (its learning-rate schedule follows)."""
    seed: int = 0
    """Training seed (sampling, init of anything random)."""
    eval_every: AtLeastZero = 25
    """Held-out evaluation period (steps); 0 = only at the end."""
    eval_samples: AtLeastOne = 1
    """Samples per held-out prompt behind eval/sampled_* and the KL estimates (more: finer on a small held-out set)."""
    save_every: AtLeastOne = 50
    """Checkpoint period (steps); the last step is always saved."""
    keep_checkpoints: AtLeastOne | None = None
    """Keep only the newest N checkpoints (older ones go once a newer one is complete); null = keep all."""
    stop_when: Annotated[str, AfterValidator(check_stop_rule)] | None = None
    """Stop at 'METRIC OP VALUE [for K]' (e.g. 'kl/k1 > 5 for 3'; saved, in summary.json 'stopped'); null = never."""
    out_dir: str = "runs/train"
    """Run directory (metrics, curves, checkpoints, resolved config)."""
    tensorboard: bool = True
    """Also write TensorBoard events."""
    wandb: bool = False
    """Also log to Weights & Biases (when installed)."""
    threads: AtLeastOne | Literal["auto"] | None = "auto"
    """torch threads: 'auto' = this process's share of the free cores, re-decided each step; N = N; null = torch's."""
    max_skipped_steps: AtLeastOne = 3
    """Stop (with a checkpoint) after this many consecutive steps whose update had a non-finite loss/gradient."""
    packing: bool = True
    """Log-prob passes compute real response positions only (docs/performance.md); false = the padded forward."""
    eval_objective_prompts: AtLeastZero | None = None
    """Held-out prompts on which each evaluation enumerates J_β, J*, KL(π‖π*) at kl.beta; 0 = off; null = auto."""
    log_stepwise_kl: bool = False
    """Also log kl/stepwise: the batch's sequence KL as Σ_t of each prefix's exact next-token KL (2 no-grad passes)."""


@record
class Config:
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

    @model_validator(mode="after")
    def _rules(self) -> Config:
        """The rules across sections (run once every section is valid on its own)."""
        rollout, kl, algo, lora, task = self.rollout, self.kl, self.algo, self.model.lora_rank, self.data.task
        b = rollout.prompts_per_step * rollout.group_size
        off_policy = algo.ppo_epochs > 1 or algo.mini_batches > 1 or rollout.staleness > 0
        require([
            (not task.startswith("chat_") or bool(self.model.path), "model.path", f"is required with data.task = "
             f"{task!r} (a chat task has no embedded reference: e.g. smollm2-135m-instruct)"),
            (rollout.group_size >= 2 or not c.needs_groups(algo.shaping), "rollout.group_size",
             f"must be >= 2 for group shaping {algo.shaping!r}"),
            (rollout.top_p == 1.0 or (kl.head == "none" and not off_policy), "rollout.top_p", f"must be 1.0 with a "
             f"KL head (kl.head = {kl.head!r}) or an off-policy update (algo.ppo_epochs or mini_batches > 1, "
             f"rollout.staleness > 0), got "
             f"{rollout.top_p}: klgrad's log-probs, KL heads and ratios are of the full distribution, not top-p's"),
            (not self.train.eval_objective_prompts or (kl.beta > 0 and rollout.top_p == 1.0),
             "train.eval_objective_prompts", f"needs kl.beta > 0 (J_β is defined for β > 0; got {kl.beta}) and "
             f"rollout.top_p = 1 (the objective is of the full distribution; got {rollout.top_p}): set 0 or null"),
            (not (lora and kl.reset_ref_every is not None), "kl.reset_ref_every", f"must be null with model.lora_rank "
             f"= {lora}: a LoRA run's reference is the frozen base weights with the adapter off (docs/lora.md)"),
            (not (lora and rollout.engine == "vllm"), "rollout.engine", f"'vllm' cannot run with model.lora_rank = "
             f"{lora}: its weight sync loads plain weights, not a LoRA adapter; use 'klgrad' or 'hf'"),
            (rollout.sampler_dtype is None or rollout.engine == "klgrad", "rollout.sampler_dtype", f"needs rollout."
             f"engine = 'klgrad' (klgrad's sampler draws from its cast copy of the policy), got {rollout.engine!r}; "
             f"set it to null"),
            (rollout.sampler_dtype is None or not lora, "rollout.sampler_dtype", f"must be null with model.lora_rank = "
             f"{lora}: the sampler's cast copy syncs plain weights, not a LoRA adapter"),
            (not rollout.mismatch_correction.endswith("_mask") or rollout.mismatch_cap > 1, "rollout.mismatch_cap",
             f"must be > 1 with rollout.mismatch_correction = {rollout.mismatch_correction!r} (it keeps ratios in "
             f"[1/C, C]), got {rollout.mismatch_cap}"),
            (b % algo.mini_batches == 0, "algo.mini_batches", f"must divide prompts_per_step*group_size = {b}"),
            (b // algo.mini_batches % rollout.group_size == 0, "algo.mini_batches", "must split it into whole groups"),
        ])  # fmt: skip
        return self
