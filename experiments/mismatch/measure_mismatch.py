"""Measure the sampler-vs-trainer mismatch of klgrad's bf16 sampler on a real model, once (issue 37, item 3).

Draws G responses to each of P training prompts of ``--config`` with :class:`klgrad.rollout.samplers.KlgradSampler`
at ``rollout.sampler_dtype = bfloat16`` (a bf16 copy of the float32 policy: weights and activations), recomputes
the log-probs of the same tokens in float32 as the trainer does, and writes the per-token |Δ log-prob| statistics,
the sampled sequence KL(π_sampler ‖ π_trainer) (k1, k3) and the exact per-position KL summed along the samples,
and how often the mismatch corrections at cap C would act. Also checks the sampler's log-probs against a bf16
teacher-forced forward of the same tokens (the KV-cache decode against one full forward).

    PYTHONPATH=src python experiments/mismatch/measure_mismatch.py --config configs/smollm2_sharpen.yaml \
        --out experiments/mismatch/smollm2_mismatch.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from klgrad.config import load_config, to_dict
from klgrad.logprobs import sequence_logprobs
from klgrad.models.sources import reference_path
from klgrad.rollout.encoding import encode_prompts, uses_chat
from klgrad.rollout.mismatch import mismatch_stats, position_kl
from klgrad.rollout.samplers import KlgradSampler
from klgrad.trainer.draws import rollout_uniforms
from klgrad.trainer.setup import load_data, load_policy_and_reference


def response_logits(model, input_ids, attention_mask, prompt_len: int) -> torch.Tensor:
    """(N, T, V) float32 logits predicting each response token (teacher forcing, the shift convention)."""
    pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask.long(), position_ids=pos).logits
    return logits[:, prompt_len - 1 : -1].float()


def quantiles(x: torch.Tensor) -> dict[str, float]:
    x = x.double()
    return {
        "mean": float(x.mean()),
        "median": float(x.quantile(0.5)),
        "p90": float(x.quantile(0.9)),
        "p99": float(x.quantile(0.99)),
        "max": float(x.max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/smollm2_sharpen.yaml")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--cap", type=float, default=2.0)
    ap.add_argument("--out", default="experiments/mismatch/smollm2_mismatch.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    t0 = time.perf_counter()
    cfg = load_config(args.config, {"rollout.sampler_dtype": "bfloat16", "train.threads": 2})
    train_set, _ = load_data(cfg)
    examples = train_set[: args.prompts]
    policy, _, tok = load_policy_and_reference(cfg, reference_path(cfg), torch.device("cpu"))
    policy.eval()
    chat = uses_chat(cfg.data.prompt_format, tok)
    ids, mask = encode_prompts(tok, [e.prompt for e in examples], chat=chat)
    g, tau, t_max = args.group_size, cfg.rollout.temperature, cfg.rollout.max_new_tokens
    sampler = KlgradSampler(tok.eos_token_id, tok.pad_token_id, dtype=torch.bfloat16)
    uniforms = rollout_uniforms(cfg.train.seed, 0, slice(0, len(examples)), g, t_max)
    r = sampler.generate(policy, ids, mask, group_size=g, max_new_tokens=t_max, temperature=tau, uniforms=uniforms)
    m, p = r.response_mask, ids.shape[1]
    trainer_lp, _ = sequence_logprobs(policy, r.input_ids, r.attention_mask, p, tau)  # float32, the trainer's
    bf16_model = sampler.engine_model(policy)
    tf_lp, _ = sequence_logprobs(bf16_model, r.input_ids, r.attention_mask, p, tau, fast_forward=False)
    zs = response_logits(bf16_model, r.input_ids, r.attention_mask, p)  # (N, T, V) the engine's
    zt = response_logits(policy, r.input_ids, r.attention_mask, p)  # (N, T, V) the trainer's
    d = (trainer_lp.double() - r.logp.double())[m]  # l̄ - s on response tokens
    seq_d = torch.where(m, trainer_lp.double() - r.logp.double(), 0.0).sum(-1)  # (N,) log of the sequence ratio
    c = args.cap
    kl_pos = position_kl(zs, zt, m, tau)  # (N,)
    stats = mismatch_stats(trainer_lp, r.logp, m)
    out = {
        "what": "klgrad sampler with rollout.sampler_dtype=bfloat16 (bf16 copy of the float32 policy) vs the "
        "trainer's float32 recomputation of the same tokens",
        "config": args.config,
        "model": cfg.model.path,
        "prompts": len(examples),
        "group_size": g,
        "responses": int(m.shape[0]),
        "response_tokens": int(m.sum()),
        "temperature": tau,
        "max_new_tokens": t_max,
        "abs_logp_diff_per_token": quantiles(d.abs()),
        "signed_logp_diff_per_token_mean": float(d.mean()),
        "sequence_log_ratio": {"mean_abs": float(seq_d.abs().mean()), "max_abs": float(seq_d.abs().max())},
        "sequence_kl_sampler_to_trainer": {
            "k1_sampled": stats["kl_k1"],
            "k3_per_token_summed": stats["kl_k3"],
            "exact_per_position_summed_mean": float(kl_pos.mean()),
            "exact_per_position_summed_max": float(kl_pos.max()),
        },
        "corrections_at_cap": {
            "cap": c,
            "token_ratio_outside_[1/C,C]_frac": float((d.abs() > torch.log(torch.tensor(c))).double().mean()),
            "sequence_ratio_outside_[1/C,C]_frac": float((seq_d.abs() > torch.log(torch.tensor(c))).double().mean()),
            "token_ratio_min": float(d.exp().min()),
            "token_ratio_max": float(d.exp().max()),
        },
        "sampler_vs_bf16_teacher_forced_abs_max": float((r.logp.double() - tf_lp.double())[m].abs().max()),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "seconds": round(time.perf_counter() - t0, 1),
        "rollout_config": to_dict(cfg)["rollout"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
