"""What this machine can run, asked without importing anything heavy: the checks a configuration makes before a
run starts (vLLM and a CUDA GPU for ``rollout.engine: vllm``). A leaf module: it imports no klgrad module, and
torch only inside a call."""

from __future__ import annotations

import importlib.util

VLLM_INSTALL_HINT = "pip install 'klgrad[vllm]'"


def vllm_requirements_error(has_vllm: bool, has_cuda: bool) -> str | None:
    """The message for a machine that cannot run the vLLM engine, or None when it can."""
    if not has_vllm:
        return f"rollout.engine 'vllm' needs the vllm package: {VLLM_INSTALL_HINT} (on a machine with a CUDA GPU)"
    if not has_cuda:
        return "rollout.engine 'vllm' needs a CUDA GPU (torch.cuda.is_available() is False here); use 'klgrad'"
    return None


def vllm_unavailable_reason() -> str | None:
    """Why vLLM cannot run here (not installed, or no CUDA GPU), or None."""
    import torch

    return vllm_requirements_error(importlib.util.find_spec("vllm") is not None, torch.cuda.is_available())
