"""The choices a configuration names: every closed set of option values (``Literal`` types and their tuples) in one
leaf module that imports nothing from klgrad and no torch, so ``klgrad.config`` validates a YAML file without
loading a model library. The modules that implement each choice import its type from here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, get_args

# KL heads and where they act (klgrad.kl)
HeadName = Literal[
    "none",
    "k1_in_reward",
    "k2_as_loss",
    "k3_as_loss",
    "k3_in_reward",
    "k1_as_loss",
    "mse_in_reward",
    "fkl_as_loss",
    "js_in_reward",
    "js_as_loss",
]
"""The built-in heads' names, in registry (and docs table) order."""
AnalyticHeadName = Literal["analytic_kl"]
"""Heads that read whole next-token distributions (klgrad.kl.analytic), registered apart from the elementwise ones."""
ANALYTIC_HEADS: tuple[str, ...] = get_args(AnalyticHeadName)
IMPORT_PATH = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
"""``package.module:name`` (``name`` may be a dotted attribute path): a user's head, as rewards take theirs."""
PRESET_ID = r"[a-z0-9][a-z0-9.-]*/[a-z0-9][a-z0-9.-]*"
"""``framework/name``: a preset id of ``klgrad audit --framework`` (``trl/grpo-k3``), a framework's KL term that
``kl.head`` trains (klgrad.audit.framework_head); the framework must be one of :data:`FRAMEWORKS`, the name is
checked against the presets when the trainer resolves it (the presets need torch, this module does not)."""


class ResolvedHead:
    """Base of what config load turns a ``kl.head`` name into (:data:`HEAD_RESOLVERS`): the object the name denotes,
    say a framework preset's KL term (``klgrad.objective.KLTermHead``). The config holds the object and records its
    ``name`` (config.yaml, ``to_dict``); ``note`` says what resolving it set, for the run to print."""

    name: str
    note: str


HEAD_RESOLVERS: list[Callable[[Any], Any]] = []
"""``resolve(cfg) -> cfg``: functions that :func:`klgrad.config.load_config` applies in turn to every config it makes;
one turns a ``kl.head`` name it knows into a :class:`ResolvedHead` (setting the fields the name implies) and returns
any other config unchanged. The package registers the framework presets' at import (``klgrad/__init__.py``); a
user's package registers its own the same way."""


def is_preset_id(value: Any) -> bool:
    """Whether ``value`` has a preset id's form, ``framework/name`` with ``framework`` in :data:`FRAMEWORKS`."""
    import re

    return (
        isinstance(value, str) and re.fullmatch(PRESET_ID, value) is not None and value.split("/", 1)[0] in FRAMEWORKS
    )


class OrImportPath:
    """``Annotated[str, OrImportPath(SomeLiteral)]``: a choice that also takes a head registered in this process,
    a ``package.module:name`` of the user's or a framework preset id ``framework/name`` (``kl.head``); the config
    checks the form, the implementing module imports (or looks up) it. The field's type stays ``str``, so
    argparse-based parsers (TRL's ``TrlParser``) take any name.

    For pydantic (which validates the records) it is one value check with one message, and in the JSON schema an
    ``anyOf`` of the choices, the import-path pattern and the preset-id pattern, so an editor completes them."""

    def __init__(self, choices: Any) -> None:
        self.choices: tuple[str, ...] = get_args(choices)

    def __repr__(self) -> str:
        return f"OrImportPath({list(self.choices)})"

    def accepts(self, value: Any) -> bool:
        """A choice, a head registered in this process (``klgrad.register_kl_head``), ``package.module:name``, a
        preset id's form (:func:`is_preset_id`) or what config load resolved one into (:class:`ResolvedHead`)."""
        import re
        import sys

        registered = getattr(sys.modules.get("klgrad.kl.heads"), "_REGISTERED", {})  # loaded only by a registrant
        if isinstance(value, ResolvedHead):
            return True
        return isinstance(value, str) and (
            value in self.choices
            or value in ANALYTIC_HEADS
            or value in registered
            or re.fullmatch(IMPORT_PATH, value) is not None
            or is_preset_id(value)
        )

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import PydanticCustomError, core_schema

        def check(value: Any) -> str:
            if self.accepts(value):
                return value
            raise PydanticCustomError(
                "choice_or_import_path",
                "Input should be one of {expected}, 'package.module:name' or a framework preset id "
                "'framework/name' (klgrad audit --framework; framework one of {frameworks})",
                {"expected": [*self.choices, *ANALYTIC_HEADS], "frameworks": list(FRAMEWORKS)},
            )

        name = core_schema.plain_serializer_function_ser_schema(lambda v: v.name if isinstance(v, ResolvedHead) else v)
        return core_schema.no_info_plain_validator_function(check, serialization=name)  # a resolved head: its name

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> dict[str, Any]:
        return {
            "anyOf": [
                {"enum": [*self.choices, *ANALYTIC_HEADS]},
                {"type": "string", "pattern": IMPORT_PATH},
                {"type": "string", "pattern": PRESET_ID},
            ]
        }


Level = Literal["sequence", "token_to_go", "token"]
LEVELS: tuple[str, ...] = get_args(Level)
RatioLevel = Literal["token", "sequence", "per_decision"]
"""The KL head's importance ratio: per token, per response, or per decision (each term by its own prefix's ratio)."""
RewardRatioLevel = Literal["token", "sequence", "gspo"]
RATIO_LEVELS: tuple[str, ...] = get_args(RatioLevel)
REWARD_RATIO_LEVELS: tuple[str, ...] = get_args(RewardRatioLevel)
"""The reward head's ratio levels: the token and sequence ratios plus ``gspo`` (klgrad.kl.offpolicy.gspo_ratio)."""

# the objective (klgrad.objective)
Form = Literal["combined", "decoupled"]
Aggregation = Literal["seq_mean_token_sum", "token_mean", "seq_mean_token_mean"]
FORMS: tuple[str, ...] = get_args(Form)
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)

# reward shaping (klgrad.advantages)
ShapingMethod = Literal[
    "none",
    "group_baseline",
    "batch_baseline",
    "batch_norm",
    "group_norm",
    "rloo",
    "grpo",
    "dr_grpo",
    "reinforce",
    "reinforce_pp",
    "reinforce_pp_baseline",
]
SHAPING_METHODS: tuple[str, ...] = get_args(ShapingMethod)
SHAPING_PRESETS: dict[str, tuple[str, ...]] = {
    "reinforce": ("batch_norm",),
    "reinforce_pp": ("batch_norm",),
    "grpo": ("group_norm",),
    "dr_grpo": ("group_baseline",),
    "reinforce_pp_baseline": ("group_baseline", "batch_norm"),
}
"""Shaping preset name -> operators applied left to right."""
GROUP_OPS = frozenset({"group_baseline", "group_norm", "rloo"})


def needs_groups(method: str) -> bool:
    """True when ``method`` takes a statistic over each prompt's group (group baseline, group norm, RLOO), so it
    needs ``group_size`` ≥ 2: with one response per prompt its advantages would all be 0 (or undefined)."""
    return bool(GROUP_OPS.intersection(SHAPING_PRESETS.get(method, (method,))))


# rewards (klgrad.rewards)
ACCURACY_REWARDS: tuple[str, ...] = ("accuracy", "final_number")
"""Built-in rewards that score correctness (0 or 1; ``klgrad eval --reward``): evaluation reports the first one a run
uses as its accuracy (``eval/greedy_accuracy``, ``eval/sampled_accuracy``) and the curves plot it."""

# rollout (klgrad.rollout)
Engine = Literal["klgrad", "hf", "vllm"]
"""``rollout.engine``: klgrad's own KV-cache decoder (KlgradSampler), transformers ``generate``, vLLM."""
ENGINES: tuple[str, ...] = get_args(Engine)
Task = Literal["addition", "addition_discovery", "scratchpad", "chat_addition", "chat_multiplication", "file"]
"""``data.task``: a synthetic task (klgrad.data.tasks) or ``file`` (prompts and answers from ``data.path``)."""
ResponseFormat = Literal["boxed", "think_answer"]
"""``data.response_format``: what the ``format`` reward checks in a file task's responses."""
PromptFormat = Literal["auto", "chat", "raw"]
"""How a prompt becomes tokens: ``chat`` = one user message through the tokenizer's chat template with the
generation prompt appended; ``raw`` = BOS + the prompt text; ``auto`` = chat when the tokenizer has a template."""
MismatchLevel = Literal["token", "sequence", "token_mask", "sequence_mask"]
"""``rollout.mismatch_correction`` (besides none): truncated IS per token / response, or masked IS (the ratio where
it lies in [1/C, C], 0 outside: verl's rollout rejection) per token / response."""
MISMATCH_LEVELS: tuple[str, ...] = get_args(MismatchLevel)

# optimisation and models
ModelDtype = Literal["float32", "bfloat16", "float16"]
AttnImplementation = Literal["auto", "eager", "sdpa", "flash_attention_2"]
"""``model.attn_implementation``: transformers' attention kernels, or auto (eager on CPU, sdpa on GPU)."""
"""``model.dtype`` and ``klgrad export --dtype``: torch's names of the parameter dtypes klgrad trains and exports."""
MODEL_DTYPES: tuple[str, ...] = get_args(ModelDtype)
Schedule = Literal["constant", "cosine", "linear"]
LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_TARGETS: tuple[str, ...] = get_args(LoraTarget)
"""Every linear projection of a Llama / Qwen2 / Mistral decoder layer: the default and the allowed targets."""

AuditDtype = Literal["float64", "float32", "bfloat16", "float16"]
"""``klgrad audit --dtype``: the dtype in which the audit computes log-probs and the KL term (its precision axis)."""
AUDIT_DTYPES: tuple[str, ...] = get_args(AuditDtype)

# the frameworks ``klgrad audit --framework`` covers (klgrad.audit.presets), in table order
FRAMEWORKS: tuple[str, ...] = (
    "trl",
    "verl",
    "openrlhf",
    "slime",
    "nemo-rl",
    "deepseek-v3.2",
    "rpg",
    "roll",
    "areal",
    "open-instruct",
    "torchtune",
    "prime-rl",
    "skyrl",
    "ms-swift",
    "tinker",
)
