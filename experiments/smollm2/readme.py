"""The numbers this study's README quotes, recomputed from the runs' committed ``metrics.jsonl`` and ``config.yaml``.

    python experiments/smollm2/readme.py    # exit 1 naming each quote that is not the files'

No script writes the README; this one reads it: the table's rows as ``real_model_report.py`` renders them from the
four run folders here, and the other quoted fields, must occur once in the README (whitespace runs compared as one
space).
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = ("smollm2_sharpen", "smollm2_sharpen_lora", "smollm2_discover", "smollm2_discover_lora")
_spec = importlib.util.spec_from_file_location("real_model_report", HERE / "real_model_report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def flat(text: str) -> str:
    return " ".join(text.split())


def values(d: Path = HERE) -> dict[str, str]:
    runs = [report.read_run(d / name) for name in RUNS]
    v = {f"row{i}": line for i, line in enumerate(report.table(runs).splitlines()[2:])}
    kls = [r["last"]["eval/kl_k1"] for r in runs]
    v["kl_range"] = f"{min(kls):.2f} to {max(kls):.2f}"
    first = runs[0]["train"]
    v["len_first"] = f"{first[0]['response/length']:.1f}"
    v["len_last"] = f"{statistics.mean(r['response/length'] for r in first[-10:]):.1f}"
    v["all_raise"] = str(all(r["last"]["eval/greedy_accuracy"] > r["first"]["eval/greedy_accuracy"] for r in runs))
    v["discover_half"] = str(all(r["last"]["eval/greedy_accuracy"] > 0.5 for r in runs[2:]))
    v["lora_further"] = str(kls[1] > kls[0] and kls[3] > kls[2])
    return v


QUOTES = [
    "{row0}",
    "{row1}",
    "{row2}",
    "{row3}",
    "({kl_range} nats;",
    "shortened from {len_first} to {len_last} tokens",
]
ASSUMED = (("all_raise", "True"), ("discover_half", "True"), ("lora_further", "True"))


def check(readme: Path = HERE / "README.md", v: dict[str, str] | None = None) -> list[str]:
    v = values() if v is None else v
    text = flat(readme.read_text())
    problems = [
        f"{readme.name}: not once:\n{t.format_map(v)}" for t in QUOTES if text.count(flat(t.format_map(v))) != 1
    ]
    return problems + [f"{k} = {v[k]} (the README says {want})" for k, want in ASSUMED if v[k] != want]


if __name__ == "__main__":
    problems = check()
    print("\n".join(problems) or "every quoted number is the committed files'")
    sys.exit(1 if problems else 0)
