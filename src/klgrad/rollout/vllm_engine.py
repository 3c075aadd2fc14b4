r"""vLLM as klgrad's rollout engine (GPU machines), and the sampler-vs-trainer log-prob mismatch correction.

NOT YET VERIFIED ON A GPU: this module has never run against a real vLLM engine (none was available where it
was written). The mismatch correction lives in :mod:`klgrad.rollout.mismatch` (tested on CPU); see docs/vllm.md.

:class:`VLLMSampler` implements :class:`klgrad.rollout.batch.Sampler` with vLLM's offline ``LLM`` API, in
the trainer's own process and on the trainer's GPU ("colocate", as TRL does): the engine is built lazily on the
first :meth:`~VLLMSampler.generate` from the policy's model directory, and :meth:`~VLLMSampler.sync_weights`
pushes the trainer's weights into it after every optimizer step. vLLM is imported only inside the class.

Mismatch. vLLM's kernels (and its bf16 / fp8 arithmetic) give log-probs ``s`` that differ from the trainer's
log-probs ``l̄`` of the very same tokens under the very same weights, so the rollout is slightly off-policy
even with one update per batch. Truncated importance sampling (TIS, as used by verl and OpenRLHF) reweights
the policy-gradient terms by min(π_trainer / π_sampler, cap); see :func:`klgrad.rollout.mismatch.mismatch_weights`.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from klgrad.machine import vllm_unavailable_reason
from klgrad.rollout.batch import Rollout


class VLLMSampler:
    """vLLM's offline ``LLM`` behind klgrad's :class:`~klgrad.rollout.batch.Sampler` interface (GPU only).

    The engine is created on the first :meth:`generate` from ``model_path`` (default: the policy's
    ``name_or_path``, the local HF directory it was loaded from), with ``logprobs_mode="processed_logprobs"`` so
    that the returned log-probs are at the sampling temperature, then immediately given the policy's current
    weights. Call :meth:`sync_weights` after every optimizer step (and after loading a checkpoint); as a guard,
    :meth:`generate` also syncs by itself when any parameter was modified in place since the last sync (torch's
    per-tensor version counters, which every optimizer step and ``load_state_dict`` bump), so it never samples
    from stale weights.

    Args:
        eos_id, pad_id: token ids (as for the other samplers).
        model_path: local HF model directory; None = ``model.name_or_path`` at the first ``generate``.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (the trainer shares the GPU).
        dtype: vLLM's weight dtype (``auto`` = the checkpoint's).
        max_model_len: prompt + response length cap; None = the model's.
        seed: engine seed (per-request seeds come from the ``generator`` passed to ``generate``).
        enforce_eager: skip CUDA-graph capture (faster start, slower decode; weights may change every step).
        **llm_kwargs: passed to ``vllm.LLM`` unchanged.

    Raises:
        RuntimeError: vLLM is not installed (names ``pip install 'klgrad[vllm]'``), or there is no CUDA GPU.
    """

    def __init__(
        self,
        eos_id: int,
        pad_id: int,
        *,
        model_path: str | None = None,
        gpu_memory_utilization: float = 0.3,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        enforce_eager: bool = False,
        **llm_kwargs,
    ) -> None:
        reason = vllm_unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        self.eos_id, self.pad_id = eos_id, pad_id
        self.model_path = model_path
        self.llm_options = dict(
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            enforce_eager=enforce_eager,
            **llm_kwargs,
        )
        self.llm = None
        self._synced: tuple[int, ...] | None = None  # parameter version counters at the last sync

    # -- engine -------------------------------------------------------------------------------------------

    def _engine(self, model: torch.nn.Module):
        if self.llm is not None:
            return self.llm
        from vllm import LLM

        path = self.model_path or getattr(model, "name_or_path", None)
        if not path or not os.path.isdir(path):
            raise ValueError(
                f"VLLMSampler needs the policy's local model directory (model_path, or model.name_or_path); "
                f"got {path!r}"
            )
        # One process, one GPU, the trainer's own: vLLM's "external launcher" keeps the engine (and so its
        # model) in this process, where sync_weights can reach it (TRL's colocate mode does the same).
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "localhost")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        self.llm = LLM(
            model=str(path),
            tokenizer=str(path),
            distributed_executor_backend="external_launcher",
            logprobs_mode="processed_logprobs",  # log-probs after temperature: what the trainer compares with
            **{k: v for k, v in self.llm_options.items() if v is not None},
        )
        self.sync_weights(model)
        return self.llm

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push the trainer's current weights into the engine (call after every optimizer step).

        Uses the in-process model's ``load_weights`` (vLLM maps HF parameter names onto its fused layers),
        then drops vLLM's prefix cache, whose KV entries were computed with the old weights. A no-op before
        the engine exists (it is built with the current weights).
        """
        if self.llm is None:
            return
        vllm_model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        vllm_model.load_weights((name, p.detach()) for name, p in model.state_dict().items())
        self.llm.reset_prefix_cache()
        self._synced = _param_versions(model)

    # -- sampling -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        model: torch.nn.Module,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        *,
        group_size: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
        generator: torch.Generator | None = None,
    ) -> Rollout:
        """P left-padded prompts -> P·G responses, groups contiguous; log-probs at ``temperature``.

        One vLLM request per prompt with ``n = group_size``, ``logprobs = 0`` (the sampled token's log-prob
        only) and a seed drawn from ``generator``. With ``top_p < 1`` vLLM's processed log-probs are those of
        the truncated distribution (the true behaviour policy), unlike klgrad's own samplers (see the
        samplers.py module docstring). ``greedy``: temperature 0 in vLLM; the log-probs are then vLLM's greedy ones.
        """
        from vllm import SamplingParams

        llm = self._engine(model)
        if _param_versions(model) != self._synced:  # updated in place since the last sync: never sample stale
            self.sync_weights(model)
        prompt_mask = prompt_mask.bool()
        base_seed = 0 if generator is None else int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        requests, params = [], []
        for i in range(prompt_ids.shape[0]):
            requests.append({"prompt_token_ids": prompt_ids[i][prompt_mask[i]].tolist()})
            params.append(
                SamplingParams(
                    n=group_size,
                    temperature=0.0 if greedy else temperature,
                    top_p=1.0 if greedy else top_p,
                    max_tokens=max_new_tokens,
                    stop_token_ids=[self.eos_id],
                    logprobs=0,
                    seed=(base_seed + i) % (2**31 - 1),
                )
            )
        outputs = llm.generate(requests, sampling_params=params, use_tqdm=False)
        samples = [completion for out in outputs for completion in out.outputs]  # P·G, groups contiguous
        return self._to_rollout(samples, prompt_ids, prompt_mask, group_size, max_new_tokens)

    def _to_rollout(
        self, samples: list, prompt_ids: Tensor, prompt_mask: Tensor, group_size: int, max_new_tokens: int
    ) -> Rollout:
        n = len(samples)
        width = max(1, max(len(s.token_ids) for s in samples))
        resp = torch.full((n, width), self.pad_id, dtype=torch.long)  # (N, T)
        logp = torch.zeros((n, width), dtype=torch.float32)  # (N, T)
        mask = torch.zeros((n, width), dtype=torch.bool)  # (N, T)
        truncated = torch.zeros(n, dtype=torch.bool)  # (N,)
        for row, s in enumerate(samples):
            ids = list(s.token_ids)[:max_new_tokens]
            if self.eos_id in ids:  # keep up to and including the first EOS
                ids = ids[: ids.index(self.eos_id) + 1]
            k = len(ids)
            resp[row, :k] = torch.tensor(ids, dtype=torch.long)
            mask[row, :k] = True
            # s.logprobs: one {token_id: Logprob} per generated token; the sampled token is always present
            logp[row, :k] = torch.tensor([float(s.logprobs[j][ids[j]].logprob) for j in range(k)])
            truncated[row] = k == max_new_tokens and ids[-1] != self.eos_id
        rep_ids = prompt_ids.repeat_interleave(group_size, dim=0)
        rep_mask = prompt_mask.repeat_interleave(group_size, dim=0)
        return Rollout(rep_ids, rep_mask, resp, mask, logp, truncated)


def _param_versions(model: torch.nn.Module) -> tuple[int, ...]:
    """torch's in-place version counter of every parameter: changes whenever a weight is written."""
    return tuple(p._version for p in model.parameters())


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
