"""Rollout at reasoning lengths: ≤ 128 and ≤ 512 new tokens at batch 256, klgrad's sampler vs transformers
``generate``; and the decode cost per token against its position.

The embedded scratchpad model's answers end after ~20 tokens, so these workloads run with EOS suppressed: every
sampler stops only on ``<unk>`` (which the model does not produce), so every response decodes to the full length
and every contender does the same work. Batch 256 = 32 prompts × 8 samples, temperature 1, CPU fp32.

Decode cost per position: one prefill, then the per-step wall time of klgrad's fast decoder (static cache, the
filled prefix only) and of its transformers-forward path (DynamicCache) at every position up to 512, batch 256.
Attention per step grows with the prefix (≈ 2·N·layers·S·D multiply-adds at prefix S) while the rest of the step
is constant, so the cost is flat until the prefix's share dominates.
"""

from __future__ import annotations

import time

import torch

from bench.common import RESULTS, median, print_table, write_json
from bench.rollout import measure, ratio_rows
from klgrad.data.tasks import make_splits
from klgrad.models import load_model_and_tokenizer
from klgrad.rollout.encoding import encode_prompts
from klgrad.trainer import EMBEDDED_DIR

LENGTHS = (128, 512)


def _setup(prompts: int = 32):
    model, tok = load_model_and_tokenizer(EMBEDDED_DIR / "tiny_scratchpad")
    model.eval()
    train, _ = make_splits("scratchpad", prompts, 1, 0, 2)
    ids, mask = encode_prompts(tok, [e.prompt for e in train])
    return model, tok, ids, mask


@torch.no_grad()
def step_costs(max_new: int = 512, group: int = 8) -> dict[str, list[float]]:
    """Seconds of each decode step at positions 1..max_new, batch 32·group, for both of klgrad's decoders."""
    from klgrad.models.fast_forward import FastForward
    from klgrad.rollout.samplers import _hf_decoder

    model, _tok, ids, mask = _setup()
    n = ids.shape[0] * group
    tokens = torch.randint(4, model.config.vocab_size, (max_new, n), generator=torch.Generator().manual_seed(0))
    out = {}
    for name in ("fast decode", "HF forward"):
        if name == "fast decode":
            dec = FastForward(model)
            dec.prefill(ids, mask.bool(), group, max_new)
            advance = dec.step
        else:
            _, advance = _hf_decoder(model, ids, mask.bool(), group)
        costs = []
        for t in range(max_new - 1):
            t0 = time.perf_counter()
            advance(tokens[t])
            costs.append(time.perf_counter() - t0)
        out[name] = costs
    return out


def plot(costs: dict[str, list[float]], path) -> None:
    from klgrad.plotting import pyplot, save

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for name, color in (("fast decode", "#1f5f8b"), ("HF forward", "#c0392b")):
        ms = [1000 * c for c in costs[name]]
        window = 8  # running median over 8 steps: the trend, not the scheduler's noise
        smooth = [median(ms[max(0, i - window + 1) : i + 1]) for i in range(len(ms))]
        ax.plot(range(1, len(ms) + 1), ms, color=color, alpha=0.25, lw=0.8)
        ax.plot(range(1, len(ms) + 1), smooth, color=color, lw=1.8, label=f"klgrad {name}")
    ax.set_xlabel("decode step (tokens already generated)")
    ax.set_ylabel("ms per step, batch 256")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("Decode cost per token position (tiny scratchpad model, CPU fp32, 2 threads)", fontsize=10)
    fig.tight_layout()
    save(fig, path, dpi=110)


def main(repeats: int = 3) -> dict:
    results = {
        f"long decode (≤{n} new, EOS suppressed)": measure(
            "scratchpad", n, repeats=repeats, warmup=1, suppress_eos=True
        )
        for n in LENGTHS
    }
    rows = ratio_rows(results)
    print_table(
        "rollout at reasoning lengths, batch 256 (32 prompts × 8), temperature 1, CPU fp32",
        ["workload", "sampler", "median s", "response tok/s", "× generate"],
        rows,
    )
    costs = step_costs()
    summary = {
        name: {f"ms_at_{p}": 1000 * median(c[p - 8 : p]) for p in (16, 64, 128, 256, 511)} for name, c in costs.items()
    }
    print_table(
        "decode step cost by position (median of 8 steps), batch 256",
        ["decoder", *[f"pos {p}" for p in (16, 64, 128, 256, 511)]],
        [[name, *s.values()] for name, s in summary.items()],
    )
    plot(costs, RESULTS / "decode_cost.png")
    write_json("long_decode", {"results": results, "step_cost_ms": summary})
    return {"results": results, "step_cost_ms": summary}


if __name__ == "__main__":
    main()
