r"""LoRA through peft: the adapter, its reference, its checkpoint file, and the weights the fast forward reads.

A LoRA adapter of rank r on a linear projection y = x·Wᵀ + b (W of shape (O, D)) adds a trainable low-rank
update: A of shape (r, D) and B of shape (O, r), scale s = α / r,

    y = x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ        (effective weight W + s·B·A)

with W and b frozen. peft initialises A (Kaiming-uniform) and B = 0, so the adapted model starts equal to the
base. klgrad applies it to the projections named in ``model.lora_targets`` of every decoder layer.

The reference needs no weights of its own: π_ref is the base model, i.e. the policy with the adapter switched
off. :func:`base_view` builds it as a second module tree that holds the very same parameter tensors, with each
adapted projection replaced by its frozen base layer, so every consumer of a reference (the transformers
forward, the fast forward, the exact enumeration) sees an ordinary causal LM; its forward is peft's
adapter-disabled forward (``self.base_layer(x)``) step for step.

peft is imported only by the functions that build an adapter (:func:`apply_lora`, :func:`load_lora_policy`);
everything that reads one (:func:`lora_parts`, :func:`is_lora_layer`, the state-dict helpers) works on any
model, so the fast forward imports this module without peft installed.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from klgrad.choices import LORA_TARGETS

if TYPE_CHECKING:
    pass


ADAPTER_FILE = "adapter.safetensors"
"""The adapter's file in a checkpoint folder (in place of ``policy.safetensors``)."""

ADAPTER_KEYS = (".lora_A.", ".lora_B.")
"""What names an adapter parameter in a peft-adapted model's ``named_parameters`` (e.g.
``model.layers.0.self_attn.q_proj.lora_A.default.weight``)."""


def is_lora_layer(module: torch.nn.Module) -> bool:
    """True for a peft LoRA layer (a ``base_layer`` with ``lora_A`` / ``lora_B`` beside it)."""
    return all(hasattr(module, name) for name in ("base_layer", "lora_A", "lora_B", "scaling"))


def apply_lora(model: torch.nn.Module, rank: int, alpha: float, targets: list[str] | tuple[str, ...], *, seed: int = 0):
    """Wrap ``model`` (a transformers causal LM) in a peft LoRA adapter; returns the ``PeftModel``.

    Every projection named in ``targets`` gets A (rank, D) and B (O, rank) with scale ``alpha / rank``; no
    dropout (every log-prob klgrad compares must be of one deterministic policy), no bias. Only A and B require
    gradients afterwards. The modules are replaced in place: ``peft_model.get_base_model()`` is ``model``
    itself, now holding the adapted layers. A's random initialisation draws from a forked RNG seeded with
    ``seed``, so the same seed gives the same adapter and the caller's RNG state is left untouched.
    """
    from peft import LoraConfig, get_peft_model

    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown or not targets:
        raise ValueError(f"LoRA targets must be a non-empty subset of {list(LORA_TARGETS)}, got {list(targets)}")
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none")
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The adapter's parameters (every A and B) by their names in ``model``; empty for a model without one."""
    return {name: p for name, p in model.named_parameters() if any(key in name for key in ADAPTER_KEYS)}


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer updates: every parameter that requires a gradient (all of them in full fine-tuning,
    the adapter's A and B under LoRA), in ``model.parameters()`` order."""
    return [p for p in model.parameters() if p.requires_grad]


def adapter_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """Detached, contiguous copies of the adapter's tensors by name (what :func:`save_adapter` writes)."""
    state = {name: p.detach().contiguous().clone() for name, p in adapter_parameters(model).items()}
    if not state:
        raise ValueError("the model has no LoRA adapter (no parameter named *.lora_A.* or *.lora_B.*)")
    return state


@torch.no_grad()
def load_adapter_state_dict(model: torch.nn.Module, state: dict[str, Tensor]) -> None:
    """Copy ``state`` into the adapter of ``model`` in place; its names and shapes must match exactly (a file
    of another rank, other targets or another model is refused, naming the first difference)."""
    params = adapter_parameters(model)
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"adapter does not match the model: {len(missing)} missing (e.g. {missing[:1]}), "
            f"{len(unexpected)} unexpected (e.g. {unexpected[:1]})"
        )
    for name, p in params.items():
        if state[name].shape != p.shape:
            raise ValueError(f"adapter tensor {name}: shape {tuple(state[name].shape)}, model {tuple(p.shape)}")
    for name, p in params.items():
        p.copy_(state[name])


def save_adapter(model: torch.nn.Module, path: str | Path) -> None:
    """Write the adapter's tensors to a safetensors file (names as in ``model.named_parameters()``)."""
    save_file(adapter_state_dict(model), str(path))


def load_adapter(model: torch.nn.Module, path: str | Path) -> None:
    """Load a file written by :func:`save_adapter` into the adapter of ``model`` (:func:`load_adapter_state_dict`)."""
    load_adapter_state_dict(model, load_file(str(path)))


def _shallow_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object of the same class and attributes, whose containers (parameters, buffers, submodules,
    hooks) are new dicts / sets holding the same entries: changing one tree's structure or mode leaves the other
    alone, while every tensor is shared."""
    new = copy.copy(module)
    for name, value in vars(new).items():
        if isinstance(value, dict | set):
            new.__dict__[name] = copy.copy(value)
    return new


def base_view(model: torch.nn.Module) -> torch.nn.Module:
    """The base model under a LoRA-adapted ``model``: the reference of a LoRA run, with no weights of its own.

    A module tree of the same classes whose every parameter and buffer *is* the adapted model's tensor, with
    each LoRA layer replaced by (a copy of the module object of) its frozen ``base_layer``. Its forward is the
    adapted model's forward with the adapter disabled (what peft's ``disable_adapter()`` runs: ``base_layer(x)``
    in every adapted projection), so it can be passed wherever a model is expected. Its mode
    (``train``/``eval``) is its own; it costs no parameter memory.
    """

    def view(module: torch.nn.Module) -> torch.nn.Module:
        source = module.base_layer if is_lora_layer(module) else module
        new = _shallow_copy(source)
        children = {name: None if child is None else view(child) for name, child in source._modules.items()}
        new.__dict__["_modules"] = children
        return new

    return view(model)


@dataclass(frozen=True)
class LowRank:
    """One adapter of a projection: the term s·(x·Aᵀ)·Bᵀ, A (r, D), B (O, r), s = α / r."""

    a: Tensor
    b: Tensor
    scale: float

    def delta_weight(self, dtype: torch.dtype) -> Tensor:
        """s·B·A (O, D), computed in the adapter's dtype (float32 with peft's default casting) and returned in
        ``dtype`` (the base weight's), as peft's merge adds it."""
        return (self.b @ self.a * self.scale).to(dtype)

    def apply(self, x: Tensor) -> Tensor:
        """s·(x·Aᵀ)·Bᵀ (..., O) in the adapter's dtype, x cast to it first (peft's forward, step for step)."""
        x = x.to(self.a.dtype)
        return torch.nn.functional.linear(torch.nn.functional.linear(x, self.a), self.b) * self.scale


def lora_parts(linear: torch.nn.Module) -> tuple[Tensor, Tensor | None, list[LowRank]]:
    """(W, b, adapters) of a linear projection as its forward uses them now: a plain ``nn.Linear`` gives its own
    weight and bias and no adapter; a LoRA layer its base layer's weight and bias and one :class:`LowRank` per
    active adapter, none while its adapters are disabled. Tensors are the live parameters (differentiable)."""
    if not is_lora_layer(linear):
        return linear.weight, linear.bias, []
    base = linear.base_layer
    if linear.disable_adapters:
        return base.weight, base.bias, []
    adapters = [
        LowRank(linear.lora_A[name].weight, linear.lora_B[name].weight, float(linear.scaling[name]))
        for name in linear.active_adapters
        if name in linear.lora_A
    ]
    return base.weight, base.bias, adapters


def lora_unsupported_reason(linear: torch.nn.Module) -> str | None:
    """None when :func:`lora_parts` describes ``linear``'s forward exactly, else why not: merged adapters, a
    variant (DoRA, ...), an adapter bias, active dropout, fan-in-fan-out weights, or a base layer that is not
    a plain ``nn.Linear`` (quantised)."""
    if not is_lora_layer(linear):
        return None
    if type(linear.base_layer) is not torch.nn.Linear:
        return f"LoRA over a {type(linear.base_layer).__name__} base layer"
    if linear.merged:
        return "merged LoRA adapters"
    if getattr(linear, "fan_in_fan_out", False):
        return "fan_in_fan_out LoRA weights"
    for name in linear.active_adapters:
        if name in getattr(linear, "lora_variant", {}):
            return f"LoRA variant {type(linear.lora_variant[name]).__name__}"
        if name in linear.lora_A and linear.lora_B[name].bias is not None:
            return "LoRA with a bias"
        dropout = linear.lora_dropout[name] if name in linear.lora_dropout else None
        if dropout is not None and getattr(dropout, "p", 0.0) > 0 and dropout.training:
            return "LoRA dropout"
    return None
