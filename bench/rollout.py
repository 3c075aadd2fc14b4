"""Rollout: klgrad's sampler (fast functional decode, and its transformers-forward fallback) vs
transformers ``generate``, same prompts, batch, lengths and sampling settings; response tokens per second.

Batch 256 = 32 prompts × 8 samples (``generate`` gets each prompt repeated 8 times, as TRL does). Two
workloads: the embedded addition model (≤ 8 new tokens, answers of ~3 tokens) and the scratchpad model
(≤ 32 new tokens, long answers). Timed calls alternate between the contenders after warm-up.
"""

from __future__ import annotations

import torch

from bench.common import alternate, median, print_table, write_json
from klgrad.data.tasks import make_splits
from klgrad.models import load_model_and_tokenizer
from klgrad.rollout.encoding import encode_prompts
from klgrad.rollout.samplers import HFGenerateSampler, KlgradSampler
from klgrad.trainer import EMBEDDED_DIR

WORKLOADS = {"addition (≤8 new)": ("addition", 8), "scratchpad (≤32 new)": ("scratchpad", 32)}


def measure(
    task: str,
    max_new: int,
    prompts: int = 32,
    group: int = 8,
    repeats: int = 5,
    warmup: int = 2,
    suppress_eos: bool = False,
) -> dict:
    """Median wall time and response tokens/s of each sampler on the embedded ``task`` model. ``suppress_eos``:
    every sampler stops only on ``<unk>`` (which the models do not produce), so responses run to ``max_new``."""
    model, tok = load_model_and_tokenizer(EMBEDDED_DIR / f"tiny_{task}")
    model.eval()
    train, _ = make_splits(task, prompts, 1, 0, 2)
    ids, mask = encode_prompts(tok, [e.prompt for e in train])
    stop = tok.unk_token_id if suppress_eos else tok.eos_token_id
    samplers = {
        "klgrad (fast decode)": KlgradSampler(stop, tok.pad_token_id),
        "klgrad (HF forward)": KlgradSampler(stop, tok.pad_token_id, fast_forward=False),
        "transformers generate": HFGenerateSampler(stop, tok.pad_token_id),
    }
    counts: dict[str, list[int]] = {k: [] for k in samplers}
    seeds = iter(range(10**6))

    def run(name):
        gen = torch.Generator().manual_seed(next(seeds))
        r = samplers[name].generate(model, ids, mask, group_size=group, max_new_tokens=max_new, generator=gen)
        counts[name].append(int(r.response_mask.sum()))

    times = alternate({k: (lambda k=k: run(k)) for k in samplers}, warmup=warmup, repeats=repeats)
    out = {}
    for k, ts in times.items():
        toks = counts[k][-len(ts) :]
        out[k] = {"median_s": median(ts), "tok_per_s": median([n / t for n, t in zip(toks, ts, strict=True)])}
    return out


def ratio_rows(results: dict[str, dict]) -> list[list]:
    """Table rows (workload, sampler, median s, tok/s, × generate) of :func:`measure` results by workload."""
    rows = []
    for wl, res in results.items():
        base = res["transformers generate"]["tok_per_s"]
        for k, v in res.items():
            rows.append([wl, k, v["median_s"], v["tok_per_s"], v["tok_per_s"] / base])
    return rows


def main(repeats: int = 5) -> dict:
    results = {name: measure(task, n, repeats=repeats) for name, (task, n) in WORKLOADS.items()}
    rows = ratio_rows(results)
    print_table(
        "rollout at batch 256 (32 prompts × 8), temperature 1, CPU fp32",
        ["workload", "sampler", "median s", "response tok/s", "× generate"],
        rows,
    )
    write_json("rollout", {"results": results})
    return results


if __name__ == "__main__":
    main()
