"""Shared by the tests of klgrad.integrations.trl (tests/integrations/test_trl*.py): the embedded tiny model as TRL
loads it offline, a scored batch, trainers built the same way and the gradients of their losses.

Imports TRL: a test module calls ``pytest.importorskip("trl", ...)`` before importing this, then binds the fixtures
(``offline, model_dir, dataset, setup``) to names of its own, where pytest looks for them. Works on every TRL the
integration supports (1.10–1.16): the log-probs whose gradients are compared are caught where every release
returns them, GRPOTrainer's ``_get_per_token_logps_and_entropies``.
"""

from __future__ import annotations

import shutil
from importlib.resources import files
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from torch import Tensor
from transformers import TrainingArguments
from trl import GRPOConfig, GRPOTrainer

from klgrad.data.tasks import make_splits
from klgrad.integrations.trl import KLGradTRLConfig
from klgrad.models import load_model_and_tokenizer
from tests.helpers.tolerances import gamma, llama_depth, network_tol, sum_tol

CHECKPOINTING_OFF = {
    "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing": False
}  # fmt: skip
"""No activation checkpointing, by the name the installed transformers takes (5.23 renamed it and warns on the
old one)."""
BETA = 0.5
GROUP = 4
TERM = 3.0
"""Bound on a per-token loss term |A·ρ| + β·|k| in these batches (group-normalised |A| ≤ (G−1)/√G = 1.5)."""
LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "luspo")
LEVEL_NAMES = ("sequence", "token_to_go", "token")


def partial_credit(prompts: list[str], completions: list[str], answer: list[str], **_: object) -> list[float]:
    """1 for the exact answer, else half the share of answer characters in place: rewards vary within a group."""
    return [
        1.0 if c == a else 0.5 * sum(x == y for x, y in zip(c, a, strict=False)) / len(a)
        for c, a in zip(completions, answer, strict=True)
    ]


class Recorder:
    """A reward function that remembers what it returned (the raw R of the last batch)."""

    def __init__(self) -> None:
        self.last: list[float] = []
        self.__name__ = "recorded_partial_credit"

    def __call__(self, prompts: list[str], completions: list[str], **columns: object) -> list[float]:
        self.last = partial_credit(prompts, completions, **columns)
        return self.last


# ----------------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def offline() -> object:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, offline: object) -> Path:
    path = tmp_path_factory.mktemp("trl") / "tiny_addition"
    shutil.copytree(Path(str(files("klgrad") / "assets" / "tiny_addition")), path)
    return path


@pytest.fixture(scope="module")
def dataset() -> Dataset:
    train, _ = make_splits("addition", 16, 0, seed=0)
    # the tiny model was fine-tuned on "<bos>" + prompt; TRL tokenizes the text as given
    return Dataset.from_list([{"prompt": "<bos>" + e.prompt, "answer": e.answer} for e in train])


def make_trainer(
    cls: type[GRPOTrainer],
    model: torch.nn.Module,
    tokenizer: object,
    dataset: Dataset,
    out: Path,
    *,
    reward: object = partial_credit,
    klgrad_config: KLGradTRLConfig | None = None,
    **args: object,
) -> GRPOTrainer:
    base = {
        "output_dir": str(out),
        "per_device_train_batch_size": 2 * GROUP,
        "num_generations": GROUP,
        "max_completion_length": 6,
        "beta": BETA,
        "bf16": False,
        "use_cpu": True,
        "use_vllm": False,
        "report_to": "none",
        "save_strategy": "no",
        **CHECKPOINTING_OFF,
        "logging_steps": 1,
        "seed": 0,
    }
    config = GRPOConfig(**{**base, **args})
    extra = {} if klgrad_config is None else {"klgrad_config": klgrad_config}
    return cls(
        model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer, **extra
    )


@pytest.fixture(scope="module")
def setup(model_dir: Path, dataset: Dataset, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A policy moved away from the reference (so the KL and its gradient are not 0), one scored batch and a
    behaviour policy o = l + 0.2·noise (importance ratios around 1, some beyond the 0.2 clip).

    TRL's forward returns float32 log-probs whatever the model's dtype, so the model stays float32; gradients are
    compared w.r.t. those log-probs (absolute) and w.r.t. the parameters (relative to their largest entry).
    """
    model, tokenizer = load_model_and_tokenizer(model_dir, attn_implementation="eager")
    out = tmp_path_factory.mktemp("trl_out")
    trl_trainer = make_trainer(GRPOTrainer, model, tokenizer, dataset, out)  # builds the reference from disk
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    rows = [dataset[0]] * GROUP + [dataset[1]] * GROUP
    torch.manual_seed(1)
    inputs = trl_trainer._generate_and_score_completions(rows)
    with torch.no_grad():
        logp = policy_logps(trl_trainer, model, inputs)
    old = logp + 0.2 * torch.randn_like(logp)
    return {"model": model, "tokenizer": tokenizer, "out": out, "rows": rows, "inputs": inputs, "old": old}


def params(model: torch.nn.Module) -> list[Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


class Grads:
    """Gradients of one loss w.r.t. the completions' per-token log-probs TRL's forward produced (B, T) and the
    parameters."""

    def __init__(self, logp: Tensor, params: Tensor) -> None:
        self.logp, self.params = logp, params

    def diff(self, other: Grads) -> tuple[float, float]:
        """(max |Δ| of the log-prob gradients, max |Δ| of the parameter gradients relative to their max)."""
        rel = (self.params - other.params).abs().max() / self.params.abs().max()
        return max_abs(self.logp, other.logp), float(rel)


def grads_of(loss_fn: object, model: torch.nn.Module) -> tuple[float, Grads]:
    """Run ``loss_fn()`` (one policy forward through GRPOTrainer's ``_get_per_token_logps_and_entropies``); its
    value and gradients. The completions' log-probs (B, T) are caught as that method returns them: the real method
    runs, wrapped for the call to record its output (1.16 computes them inside the model's forward, 1.10–1.14 from
    its logits, so a hook on the model would not see them everywhere)."""
    seen: list[Tensor] = []
    method = GRPOTrainer._get_per_token_logps_and_entropies

    def recorded(self: GRPOTrainer, *args: object, **kwargs: object) -> tuple:
        out = method(self, *args, **kwargs)
        seen.append(out[0])
        return out

    GRPOTrainer._get_per_token_logps_and_entropies = recorded
    try:
        loss = loss_fn()
    finally:
        GRPOTrainer._get_per_token_logps_and_entropies = method
    assert len(seen) == 1
    g_logp, *g_params = torch.autograd.grad(loss, [seen[0], *params(model)])
    return float(loss.detach()), Grads(g_logp, torch.cat([g.reshape(-1) for g in g_params]))


def loss_and_grad(trainer: GRPOTrainer, model: torch.nn.Module, inputs: dict) -> tuple[float, Grads]:
    """The trainer's loss on ``inputs`` and its gradients."""
    return grads_of(lambda: trainer.compute_loss(model, inputs), model)


def check(label: str, *, d_logp: float, d_param: float, **exact: float) -> None:
    """Print the measured differences (quoted in docs/trl.md) and assert the tolerances derived below.

    Both sides differentiate the same forward's log-probs, so only the loss arithmetic differs: per token ≤ 10
    roundings of terms |A·ρ| + β·|k| ≤ TERM = 3, and a mean over ≤ 48 tokens. Loss (and advantages) of two such
    computations differ by ≤ 2·γ_58·TERM ≈ 2.1e-5; ∂loss/∂logp per token by ≤ 2·γ_10·TERM ≈ 3.6e-6; parameter
    gradients, the backward of those through the 4-layer model, by its rounding bound relative to their largest
    entry (2·network_tol(2·(8·4 + 2), 512, 1) ≈ 2.2e-3).
    """
    parts = [f"max |Δ{name}| {value:.1e}" for name, value in exact.items()]
    parts += [f"max |Δ∂loss/∂logp| {d_logp:.1e}", f"parameter gradients max |Δ|/max|g| {d_param:.1e}"]
    print(f"\n{label}: " + ", ".join(parts))
    for name, value in exact.items():
        assert value <= 2 * sum_tol(58, TERM), name
    assert d_logp <= 2 * gamma(10) * TERM
    assert d_param <= 2 * network_tol(2 * llama_depth(4), 512, 1.0)


def max_abs(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max())


def policy_logps(trainer: GRPOTrainer, model: torch.nn.Module, inputs: dict) -> Tensor:
    """TRL's forward: per-token log-probs of the completions, (B, T), with gradient."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logp, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, attention, inputs["completion_ids"].size(1))
    return logp


def set_mode(trainers: list[GRPOTrainer], model: torch.nn.Module, train: bool) -> None:
    """Eval, or training mode inside an accumulation window of 2 (what Trainer's loop sets)."""
    model.train(train)
    for t in trainers:
        t.current_gradient_accumulation_steps = 2
