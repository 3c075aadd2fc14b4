"""klgrad on a CUDA GPU (marker ``gpu``; tools/gpu_check.sh runs ``pytest -m gpu tests/test_gpu.py``). Every
test here is skipped when torch sees no CUDA GPU.

- ``klgrad train`` with ``model.device: auto`` puts the policy, the reference and every rollout tensor on cuda,
  in float32 and (where the GPU supports it) bfloat16;
- klgrad's fast forward equals the transformers forward on CUDA, and the log-probs klgrad's sampler returns for
  the tokens it drew equal a teacher-forced transformers forward of the same tokens: in float32 within the
  rounding bound the CPU tests use (tests/models/test_fast_forward.py), in bfloat16 within the bound of bf16 storage
  with float32 accumulation (tolerances.stored_network_tol).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from klgrad.data.tasks import make_splits
from klgrad.models import load_model_and_tokenizer
from klgrad.models.fast_forward import FastForward
from klgrad.rollout.encoding import encode_prompts
from klgrad.rollout.samplers import KlgradSampler
from klgrad.trainer import EMBEDDED_DIR, loop
from klgrad.trainer.record import read_jsonl
from tests.helpers.tiny_llama import BOS, PAD, full_forward_logits, llama, qwen2
from tests.helpers.tiny_runs import small
from tests.helpers.tolerances import max_abs_logit, model_tol, model_tol_stored

CUDA = "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to torch"),
]
needs_bf16 = pytest.mark.skipif(
    torch.cuda.is_available() and not torch.cuda.is_bf16_supported(), reason="this GPU has no bfloat16"
)
DTYPES = [
    pytest.param(torch.float32, "eager", id="float32"),
    pytest.param(torch.bfloat16, "sdpa", id="bfloat16", marks=needs_bf16),
]
"""float32 against transformers' eager attention (plain float32 matmuls and softmax); bfloat16 against sdpa, what
klgrad loads on a GPU (``model.attn_implementation: auto``)."""


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    """TF32 off (torch's default for matmuls, set here in case the environment changed it): the float32 bound
    assumes float32 products (TF32 rounds their inputs to 10 mantissa bits)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def logit_tol(model, scale: float, dtype: torch.dtype) -> float:
    """Two evaluations of ``model``'s logits at magnitude ``scale``: float32 rounding (model_tol), or bf16 storage
    with float32 accumulation (model_tol_stored)."""
    return model_tol(model.config, scale) if dtype == torch.float32 else model_tol_stored(model.config, scale, dtype)


# ----------------------------------------------------------------------------------------------------------
# klgrad train on cuda


def small_run(tmp_path, **over):
    """The small run of tests/helpers/tiny_runs.py: 2 steps, evaluated at the start and the end only, an entropy
    bonus so that every update has a gradient whatever the rewards, on the device ``model.device: auto`` picks."""
    base = {"model.device": "auto", "train.steps": 2, "train.eval_every": 0, "train.eval_objective_prompts": 0}
    return small(tmp_path, **{**base, "algo.entropy_coef": 0.01, **over})


def devices_of(obj) -> set[str]:
    """Device types of every tensor field of a dataclass (a Rollout, a Batch)."""
    return {v.device.type for f in dataclasses.fields(obj) if isinstance(v := getattr(obj, f.name), torch.Tensor)}


def spy_on_train(monkeypatch) -> dict:
    """Record, during ``train``, where the policy, the reference, the rollout and the update's batch live."""
    seen: dict = {"rollout": set(), "batch": set()}
    real_setup, real_sample, real_ref = loop.setup_run, loop.sample_responses, loop.with_reference_logprobs

    def setup_run(*args, **kwargs):
        run = real_setup(*args, **kwargs)
        seen["device"] = run.device
        for name in ("policy", "ref"):
            model = getattr(run, name)
            seen[name] = {p.device.type for p in model.parameters()} | {b.device.type for b in model.buffers()}
            seen[name + "_dtype"] = {p.dtype for p in model.parameters()}
        return run

    def sample_responses(*args, **kwargs):
        rollout, prompt_len, examples = real_sample(*args, **kwargs)
        seen["rollout"] |= devices_of(rollout)
        return rollout, prompt_len, examples

    def with_reference_logprobs(*args, **kwargs):
        batch = real_ref(*args, **kwargs)
        seen["batch"] |= devices_of(batch)
        return batch

    monkeypatch.setattr(loop, "setup_run", setup_run)
    monkeypatch.setattr(loop, "sample_responses", sample_responses)
    monkeypatch.setattr(loop, "with_reference_logprobs", with_reference_logprobs)
    return seen


def finite_steps(run_dir) -> list[dict]:
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]
    for r in steps:
        for k in ("reward/mean", "kl/k1", "entropy", "grad_norm", "loss/policy"):
            assert r[k] is not None, (r["step"], k)
            assert math.isfinite(r[k]), (r["step"], k, r[k])
        assert r["skipped_updates"] == 0
    return steps


@pytest.mark.parametrize("dtype", [pytest.param("float32"), pytest.param("bfloat16", marks=needs_bf16)])
def test_train_with_device_auto_runs_everything_on_cuda(tmp_path, monkeypatch, dtype):
    """model.device auto on a GPU machine: the policy, the reference (parameters and buffers), every rollout
    tensor and the update's batch on cuda, in the configured dtype; two steps with finite metrics."""
    seen = spy_on_train(monkeypatch)
    cfg = small_run(tmp_path, **{"model.dtype": dtype})
    loop.train(cfg, progress=False)
    assert seen["device"].type == CUDA
    assert seen["policy"] == seen["ref"] == {CUDA}
    assert seen["rollout"] == seen["batch"] == {CUDA}
    assert seen["policy_dtype"] == seen["ref_dtype"] == {getattr(torch, dtype)}
    steps = finite_steps(tmp_path / "run")
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["grad_norm"] > 0 for r in steps)
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "policy.safetensors").is_file()


# ----------------------------------------------------------------------------------------------------------
# the fast forward and the sampler's log-probs against transformers, on cuda


def on_cuda(model, dtype, attn):
    model.set_attn_implementation(attn)
    return model.to(device=CUDA, dtype=dtype).eval()


@pytest.mark.parametrize("make", [llama, qwen2])
@pytest.mark.parametrize(("dtype", "attn"), DTYPES)
def test_fast_forward_equals_transformers_on_cuda(make, dtype, attn):
    """Prefill and six decode steps of left-padded prompts (Llama with grouped-query attention; Qwen2 with q/k/v
    biases), as tests/models/test_fast_forward.py does on CPU, on the GPU's kernels."""
    model = on_cuda(make(), dtype, attn)
    prompts = torch.tensor([[PAD, PAD, BOS, 5, 6], [BOS, 7, 8, 9, 4], [PAD, BOS, 3, 3, 11]], device=CUDA)
    mask = prompts != PAD
    g, steps = 2, 6
    dec = FastForward(model)
    logits = [dec.prefill(prompts, mask, g, steps)]
    gen = torch.Generator().manual_seed(0)
    toks = []
    for _ in range(steps - 1):
        t = torch.randint(3, 23, (prompts.shape[0] * g,), generator=gen).to(CUDA)
        toks.append(t)
        logits.append(dec.step(t))
    ids = torch.cat([prompts.repeat_interleave(g, 0), torch.stack(toks, 1)], 1)
    full_mask = torch.cat([mask.repeat_interleave(g, 0), torch.ones_like(ids[:, steps - 1 :], dtype=torch.bool)], 1)
    ref = full_forward_logits(model, ids, full_mask)[:, prompts.shape[1] - 1 :]  # (N, steps, V)
    got = torch.stack(logits, 1)
    assert got.device.type == CUDA
    assert got.dtype == dtype
    # float32: model_tol, the rounding of each chained reduction (as on CPU); bfloat16: model_tol_stored, every
    # stored bf16 rounding with float32 accumulation (loose; the float32 case is the sharp one)
    tol = logit_tol(model, float(ref.float().abs().max()), dtype)
    torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=tol)


def embedded(dtype, attn):
    model, tok = load_model_and_tokenizer(EMBEDDED_DIR / "tiny_addition", dtype=dtype, attn_implementation=attn)
    return model.to(CUDA).eval(), tok.eos_token_id, tok.pad_token_id, tok


def teacher_forced_logprobs(model, rollout, temperature: float) -> torch.Tensor:
    """(N, T) log-probs at ``temperature`` of the rollout's response tokens under a transformers forward."""
    length = rollout.prompt_ids.shape[1]
    logits = full_forward_logits(model, rollout.input_ids, rollout.attention_mask)  # (N, L + T, V)
    at = logits[:, length - 1 : -1].float() / temperature  # the distribution of each response token
    logp = torch.log_softmax(at, -1).gather(-1, rollout.response_ids[..., None]).squeeze(-1)
    return logp.masked_fill(~rollout.response_mask, 0.0)


@pytest.mark.parametrize("which", ["embedded_llama", "random_qwen2"])
@pytest.mark.parametrize(("dtype", "attn"), DTYPES)
def test_sampler_logprobs_equal_a_transformers_forward_on_cuda(which, dtype, attn):
    """klgrad's sampler (fast forward, finished rows dropped mid-rollout) on cuda: the log-prob it returns for each
    token it drew equals the transformers forward's log-prob of that token, at temperature 0.7."""
    temperature, g, new = 0.7, 8, 8
    if which == "embedded_llama":
        model, eos, pad, tok = embedded(dtype, attn)
        train, _ = make_splits("addition", 16, 1, 0, 2)
        ids, mask = (x.to(CUDA) for x in encode_prompts(tok, [e.prompt for e in train]))
    else:
        model, eos, pad = on_cuda(qwen2(), dtype, attn), 2, PAD
        ids = torch.tensor([[PAD, PAD, BOS, 5, 6], [BOS, 7, 8, 9, 4], [PAD, BOS, 3, 3, 11]], device=CUDA)
        mask = ids != PAD
    sampler = KlgradSampler(eos, pad)
    assert sampler.uses_fast_path(model)
    u = torch.rand(ids.shape[0] * g, new, generator=torch.Generator().manual_seed(5))
    rollout = sampler.generate(model, ids, mask, group_size=g, max_new_tokens=new, temperature=temperature, uniforms=u)
    assert devices_of(rollout) == {CUDA}
    assert int(rollout.response_mask.sum()) > 0
    ref = teacher_forced_logprobs(model, rollout, temperature)
    # a log-prob moves by at most twice the largest move of the logits (log-softmax is 2-Lipschitz in the max
    # norm); the logits' bound as in the test above, at the batch's largest |logit| / temperature
    scale = max_abs_logit(model, rollout.input_ids, rollout.attention_mask) / temperature
    tol = 2 * logit_tol(model, scale, dtype)
    torch.testing.assert_close(rollout.logp, ref, rtol=0, atol=tol)


# ----------------------------------------------------------------------------------------------------------
# klgrad compare's final numbers on cuda


def test_compare_final_numbers_of_a_gpu_run_are_measured_on_cuda(tmp_path, monkeypatch):
    """A run whose answers are too long to enumerate (12 tokens) gets its final stepwise KLs on the GPU it trained
    on: the models its final measurements load are on cuda, and with the reference reset to the policy after the
    last step (kl.reset_ref_every = 2) every KL is exactly 0 in both directions, as on the CPU
    (tests/compare/test_grid.py)."""
    from klgrad.compare.measurements import measure_run
    from klgrad.config import load_config

    over = {
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "data.n_eval": 8,
        "train.steps": 2,
        "train.eval_every": 0,
        "train.out_dir": str(tmp_path / "run"),
        "train.tensorboard": False,
        "optim.lr": 1e-3,
        "kl.reset_ref_every": 2,
        "rollout.max_new_tokens": 12,
        "model.device": "auto",
    }
    cfg = load_config("configs/tiny_add.yaml", over)
    loop.train(cfg, progress=False)
    import klgrad.models

    loaded = []
    real = klgrad.models.load_model_and_tokenizer

    def spy(*args, **kwargs):
        loaded.append(kwargs.get("device", "cpu"))
        return real(*args, **kwargs)

    monkeypatch.setattr(klgrad.models, "load_model_and_tokenizer", spy)  # the context imports it at call time
    out = measure_run(cfg, tmp_path / "run", 2, 4)
    assert loaded
    assert all(torch.device(d).type == CUDA for d in loaded)
    assert (out["stepwise_kl"], out["stepwise_kl_se"], out["forward_kl"], out["forward_kl_se"]) == (0.0, 0.0, 0.0, 0.0)
    assert out["stepwise_kl_per_prompt"] == [0.0, 0.0]
