"""Memory at a real vocabulary: per-token log-probs and entropy for V = 151,936 (Qwen2.5), T = 1,024, B = 4.

The logits alone are B·T·V·4 bytes = 2.49 GB in float32. Each path runs in a fresh subprocess that first
allocates and touches the logits; its peak extra memory is the rise of the process's peak resident set
(``ru_maxrss``) above that point. Paths, each without and with backward:
- naive: ``log_softmax(logits / τ, -1).gather(-1, tokens)`` and entropy ``-(p·logp).sum(-1)``;
- klgrad: :func:`klgrad.logprobs.token_logprobs_and_entropy`, what the trainer calls (chunked forward and
  backward, one logits-sized gradient for both outputs).
Each subprocess saves its (B, T) outputs; the table gives both paths' differences, and each path's error
against float64 on 16 positions (entropy sums 151,936 terms, so float32 rounding alone reaches ~1e-5 there).
With backward, both paths must hold the logits' gradient (the same size as the logits); the peak includes it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench.common import print_table, write_json

B, T, V = 4, 1024, 151_936

CHILD = r"""
import json, resource, sys, time, torch
from klgrad.logprobs import token_logprobs_and_entropy
torch.set_num_threads(2)
path, backward, out = sys.argv[1], sys.argv[2] == "1", sys.argv[3]
B, T, V = 4, 1024, 151_936
g = torch.Generator().manual_seed(0)
logits = torch.randn(B, T, V, generator=g).mul_(3).requires_grad_(backward)  # in place: no temporary copy
tokens = torch.randint(V, (B, T), generator=g)
def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
base = rss()
t0 = time.perf_counter()
if path == "naive":
    lsm = torch.log_softmax(logits, -1)
    logp = lsm.gather(-1, tokens[..., None]).squeeze(-1)
    ent = -(lsm.exp() * lsm).sum(-1)
else:
    logp, ent = token_logprobs_and_entropy(logits, tokens)
if backward:
    (logp.sum() + 0.1 * ent.sum()).backward()
dt = time.perf_counter() - t0
with torch.no_grad():  # float64 truth on the first 16 positions, to say which path rounds more
    z = logits[0, :16].double()
    lsm64 = torch.log_softmax(z, -1)
    truth = {"logp": lsm64.gather(-1, tokens[0, :16, None]).squeeze(-1), "ent": -(lsm64.exp() * lsm64).sum(-1)}
err = {k: float((v.detach()[0, :16].double() - truth[k]).abs().max()) for k, v in (("logp", logp), ("ent", ent))}
torch.save({"logp": logp.detach(), "ent": ent.detach()}, out)
print(json.dumps({"peak_extra_bytes": rss() - base, "seconds": dt, "err_vs_float64": err}))
"""


def run(path: str, backward: bool, out: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, path, "1" if backward else "0", str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> dict:
    results, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for backward in (False, True):
            outs = {}
            for path in ("naive", "klgrad"):
                outs[path] = Path(tmp) / f"{path}_{backward}.pt"
                results[f"{path}{' +backward' if backward else ''}"] = run(path, backward, outs[path])
            a, b = torch.load(outs["naive"]), torch.load(outs["klgrad"])
            suffix = " +backward" if backward else ""
            for k in ("logp", "ent"):
                results[f"max_abs_diff_{k}{suffix}"] = float((a[k] - b[k]).abs().max())
    for backward in ("", " +backward"):
        naive, ours = results[f"naive{backward}"], results[f"klgrad{backward}"]
        for name, r in (("naive", naive), ("klgrad", ours)):
            rows.append(
                [
                    f"{name}{backward}",
                    r["peak_extra_bytes"] / 2**20,
                    r["seconds"],
                    r["peak_extra_bytes"] / max(naive["peak_extra_bytes"], 1),
                    f"{r['err_vs_float64']['logp']:.1e} / {r['err_vs_float64']['ent']:.1e}",
                ]
            )
        rows.append(
            [
                f"  max |naive - klgrad|{backward}",
                "",
                "",
                "",
                f"{results[f'max_abs_diff_logp{backward}']:.1e} / {results[f'max_abs_diff_ent{backward}']:.1e}",
            ]
        )
    print_table(
        f"log-probs + entropy at V = {V:,}, T = {T}, B = {B} (logits {B * T * V * 4 / 2**30:.2f} GiB fp32)",
        ["path", "peak extra MiB", "seconds", "× naive memory", "max err vs float64: logp / entropy"],
        rows,
    )
    write_json("memory", results)
    return results


if __name__ == "__main__":
    main()
