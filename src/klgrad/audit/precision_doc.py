"""docs/frameworks.md, “Precision”: which framework's KL gradient survives float32, bfloat16 and float16, from
:mod:`klgrad.audit.precision` (the rows of ``klgrad audit --framework all --dtype D``), with its findings read
from the numbers and checked by tests/audit/test_precision.py."""

from __future__ import annotations

import torch

from klgrad.audit.framework_kl import FrameworkKL
from klgrad.audit.frameworks import frozen_range
from klgrad.audit.precision import (
    U_LIMIT,
    WRONG,
    PrecisionReport,
    fmt_precision,
    fmt_relative_error,
    head_precision,
    preset_gradient,
    preset_precision,
)
from klgrad.audit.presets import PRESETS
from klgrad.kl import KL_HEADS

LOW_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
"""The columns of the precision table."""

RHO_K3 = ("trl/grpo-k3-bias-correction", "deepseek-v3.2/unbiased-kl")
"""ρ·k3 with neither clamp nor detach: the presets whose gradient is u mathematically and cancels numerically."""

RHO_K3_CLAMPED = ("slime/kl-loss-low-var-kl-unbiased", "nemo-rl/k3-loss")
"""ρ·k3 (slime's ratio, NeMo-RL's exp(l − sg l)) clamped to ±10 after the product."""

K3_LOSS = "trl/grpo-k3"
"""Plain k3 as a loss, unclamped (TRL before 1.10; the same arithmetic as every framework's k3)."""

K1_REWARD = "openrlhf/k1-reward"
"""k1 in the reward (what most frameworks' exact remedy is)."""

K3_REWARD = "trl/ppo-k3-reward"
"""k3 in the reward, computed directly."""


def gradient_at(preset_id: str, u: float, dtype: str) -> float:
    """A preset's per-token gradient coefficient at l = u, r = 0 with both stored in ``dtype``
    (:func:`klgrad.audit.precision.preset_gradient`)."""
    preset = next(p for p in PRESETS if p.id == preset_id)
    low = getattr(torch, dtype)
    l = torch.tensor([u], dtype=low)
    return float(preset_gradient(preset)(l, torch.zeros_like(l))[0])


def precision_reports() -> dict[str, dict[str, PrecisionReport]]:
    """{dtype: {key: report}} for every dtype of :data:`LOW_DTYPES`: each preset by id and each klgrad head as
    ``klgrad/<name>`` (``none`` left out)."""
    heads = {f"klgrad/{name}": head for name, head in KL_HEADS.items() if name != "none"}
    return {d: {**preset_precision(PRESETS, d), **head_precision(heads, d)} for d in LOW_DTYPES}


def edge_ranges(text: str | None) -> str | None:
    """The parts of a :func:`~klgrad.audit.precision.u_ranges` text that reach an end of the range
    (``u ≤ a``, ``u ≥ b``, ``everywhere``), or None."""
    if not text:
        return None
    parts = [p for p in text.split(", ") if p.startswith(("u ≤", "u ≥", "everywhere"))]
    return ", ".join(parts) or None


def _short(text: str | None, width: int = 40) -> str | None:
    """``text`` when at most ``width`` characters, else its parts reaching an end of the range and "…"."""
    if not text or len(text) <= width:
        return text
    edges = edge_ranges(text)
    return f"{edges}, …" if edges else "…"


def short_cell(row: dict) -> str:
    """The main tables' **∇ in bf16** cell from a row's precision fields: the largest relative error and, short,
    where the gradient is 0, wrong or not finite."""
    parts = [fmt_relative_error(row["dtype_grad_err"])]
    zero, wrong = _short(row["dtype_zero"]), _short(row["dtype_wrong"])
    if zero:
        parts.append(f"0 at {zero}")
    if wrong and row["dtype_wrong"] != row["dtype_zero"]:
        parts.append(f"wrong at {wrong}")
    if row["dtype_nonfinite"]:
        parts.append("inf/nan")
    return "; ".join(parts)


INTRO = """
## Precision: which KL survives bfloat16

The tables above are exact float64 arithmetic. Here each KL term's per-token gradient coefficient g (what
multiplies ∇ log π on a token, on-policy: ∂(term)/∂l by autograd for a loss; the per-token penalty, the weight the
policy loss puts on ∇l, for a reward) is computed with the log-probs stored in a lower precision and the
framework's code run in the dtype of its inputs, as `klgrad audit --framework all --dtype D` does (the rows'
`dtype`, `dtype_grad_err` and ranges), and compared with float64 on the same rounded log-probs: the error is the
term's arithmetic, not the rounding of the log-probs. The log-ratios u = l − r cover [−{limit:g}, {limit:g}] in steps
of 0.01 and ±10^k (k ∈ [−6, −2]), with l, r ≤ 0 around the log-probs 0, log ½ and log 1/10.

Each cell: the largest relative error where the float64 value fits the dtype; then where g is exactly 0 though it
should not be, off by more than {wrong:.0%}, inf or nan, or overflows the dtype (float16's largest number 65504 is
e^11.09). Gradients below float16's smallest normal number 6.1e-5 (k1's at |u| < 6e-5) only lose relative accuracy;
the JSON lists them (`dtype_underflow`). A reward's g is a per-token value: near u = 0 k3's is u²/2, and a large
relative error there is an absolute error of about the dtype's unit roundoff (float32 6e-8, bfloat16 3.9e-3,
float16 4.9e-4) per token. klgrad's own heads (`klgrad/…`) promote half-precision log-probs to float32 before the
log-ratio, compute in float32 and round the gradient once to the dtype. The **∇ in bf16** column of the tables
above is the bfloat16 cell, shortened.

This page is computed with every float32, bfloat16 and float16 operation correctly rounded (evaluated in float64
and rounded to its dtype: `klgrad.audit.rounding`), so it is the same on every CPU. A machine's own kernels (AVX2,
AVX-512, the C library's) compute exp and log within about an ulp of that, not alike: where a float32 gradient
rounds to exactly 0 can move by a point or two of the grid between machines. `klgrad audit --framework all
--dtype D` reports what your own kernels compute.

| preset | KL as configured | float32 | bfloat16 | float16 |
|---|---|---|---|---|
"""

FINDINGS = """
### What the precision numbers say

- **k3 times a differentiable ratio, unclamped** (TRL's `use_bias_correction_kl`, the default since 1.10;
  DeepSeek-V3.2's unbiased KL). Its gradient is exactly u mathematically, but autograd computes it as
  ρ·k3 + ρ·(1 − e^{{−u}}) = (e^{{−u}} − 1 + u) + (1 − e^{{−u}}), whose e^{{−u}} terms cancel. In bfloat16 it is 0 at
  {bf16_zero} (u = −8 gives {bf16_m8:g}) and off by more than {wrong:.0%} at {bf16_wrong}; in float32 it is off at
  {f32_wrong} (u = −17 gives {f32_m17:g}, u = −20 gives {f32_m20:g}) and 0 at {f32_zero}; in float16 inf or nan at
  {f16_nonfinite}; float64 gives {f64_m41:g} at u = −41. The tokens the policy has pushed far below the reference
  lose their KL gradient exactly where it matters.
- **k3 times a ratio, clamped** (slime's `--use-unbiased-kl`, NeMo-RL's loss since 0.7): both clamp the product
  to ±10, which zeroes the gradient at {clamp_zero} in every dtype, float64 included (the **clamp** column above),
  before the cancellation begins; the rest is k3's arithmetic (largest bfloat16 error {nemo_bf16} for NeMo-RL).
  In float16 NeMo-RL's e^x of x clamped to ±20 overflows: inf or nan at {nemo_f16}.
- **k3 as a loss** (TRL before 1.10, verl `low_var_kl`, OpenRLHF, ROLL, torchtune, SkyRL, ms-swift, Open-Instruct,
  NeMo-RL before 0.7): the gradient 1 − e^{{−u}} is computed as −e^{{−u}} + 1, which cancels near u = 0: in bfloat16
  it is 0 at {k3_bf16_zero}, where a policy close to its reference has most of its tokens; elsewhere one rounding.
  In float16 e^{{−u}} overflows for u < −11.1 (verl's ±20 input clamp does not prevent it: inf/nan at
  {lowvar_f16}).
- **k3 in the reward** (TRL's PPO `k3`, NeMo-RL's and SkyRL's k3 rewards): the penalty e^{{−u}} − 1 + u is computed
  directly and loses the u²/2 near u = 0: relative error {k3r_bf16} in bfloat16 (0 at {k3r_bf16_zero}).
- **k1 and k2**, in the reward or as a loss (every framework's exact remedy below): the gradient is u, one
  rounding: {k1_bf16} in bfloat16, {k1_f16} in float16. They survive every dtype.
- **klgrad's heads**: every coefficient and gradient is written in a form that does not cancel (k3's
  1 − e^{{−u}} as −expm1(−u), each penalty's derivative in closed form), computed in float32: largest relative error
  {klgrad_f32} in float32, {klgrad_bf16} in bfloat16, {klgrad_f16} in float16 (one rounding to the dtype); only
  float16's range bounds them (e^{{−u}} overflows 65504 for u < −11.1: k3's and the forward KL's coefficients are
  ±inf there, with their sign).

### Surviving bfloat16, in each framework's flags

The exact reverse-KL settings of the table above are k1 in the reward or k2 as a loss, and they survive every
dtype (below). Where a framework's default does not (TRL ≥ 1.10: ρ·k3), `use_bias_correction_kl=False` returns to
k3 (in bfloat16 0 only at {k3_bf16_zero}, but the forward-KL gradient) and `RLOOTrainer` with `beta > 0` gives k1
in the reward; computing the log-probs and the KL term in float32 is not enough for ρ·k3 (off at {f32_wrong}).
slime's default `--kl-loss-type k1` survives but has zero expected gradient (above): leave `--use-kl-loss` off and
use its reward flags below.

| framework | set | audited | float32 | bfloat16 | float16 |
|---|---|---|---|---|---|
{remedies}
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _variant(key: str) -> str:
    if key.startswith("klgrad/"):
        return f"klgrad head `{key.removeprefix('klgrad/')}`"
    return next(p.variant for p in PRESETS if p.id == key)


def precision_table(reports: dict[str, dict[str, PrecisionReport]]) -> list[str]:
    """One markdown row per preset and klgrad head: its cell in each dtype of :data:`LOW_DTYPES`."""
    keys = list(reports[LOW_DTYPES[0]])
    return [
        f"| `{key}` | {_cell(_variant(key))} | "
        + " | ".join(_cell(fmt_precision(reports[d][key])) for d in LOW_DTYPES)
        + " |"
        for key in keys
    ]


def _preset(pid: str) -> FrameworkKL:
    return next(p for p in PRESETS if p.id == pid)


def precision_findings(reports: dict[str, dict[str, PrecisionReport]], remedies: list[tuple[str, str, str]]) -> str:
    """The findings, their numbers read from ``reports``; ``remedies`` = (framework, flags, preset id) per line
    (a line whose preset is ρ·k3, the DeepSeek report's, is the first finding and left out of the table)."""
    remedies = [r for r in remedies if r[2] not in RHO_K3]
    f32, bf16, f16 = (reports[d] for d in LOW_DTYPES)
    trl = RHO_K3[0]
    klgrad = [k for k in bf16 if k.startswith("klgrad/")]
    lines = [
        f"| {fw} | {_cell(flags)} | `{pid}` | "
        + " | ".join(_cell(fmt_precision(reports[d][pid])) for d in LOW_DTYPES)
        + " |"
        for fw, flags, pid in remedies
    ]
    return FINDINGS.format(
        wrong=WRONG,
        bf16_zero=edge_ranges(bf16[trl].zero),
        bf16_m8=gradient_at(trl, -8.0, "bfloat16"),
        bf16_wrong=edge_ranges(bf16[trl].wrong),
        f32_wrong=f32[trl].wrong,
        f32_m17=gradient_at(trl, -17.0, "float32"),
        f32_m20=gradient_at(trl, -20.0, "float32"),
        f32_zero=f32[trl].zero,
        f16_nonfinite=f16[trl].nonfinite,
        f64_m41=gradient_at(trl, -41.0, "float64"),
        clamp_zero=" and ".join(sorted({str(frozen_range(_preset(p), "gradient")) for p in RHO_K3_CLAMPED})),
        nemo_bf16=fmt_relative_error(bf16["nemo-rl/k3-loss"].grad_err),
        nemo_f16=f16["nemo-rl/k3-loss"].nonfinite,
        k3_bf16_zero=bf16[K3_LOSS].zero,
        lowvar_f16=f16["verl/kl-loss-low-var-kl"].nonfinite,
        k3r_bf16=fmt_relative_error(bf16[K3_REWARD].grad_err),
        k3r_bf16_zero=bf16[K3_REWARD].zero,
        k1_bf16=fmt_relative_error(bf16[K1_REWARD].grad_err),
        k1_f16=fmt_relative_error(f16[K1_REWARD].grad_err),
        klgrad_f32=fmt_relative_error(max(f32[k].grad_err for k in klgrad)),
        klgrad_bf16=fmt_relative_error(max(bf16[k].grad_err for k in klgrad)),
        klgrad_f16=fmt_relative_error(max(f16[k].grad_err for k in klgrad)),
        remedies="\n".join(lines),
    )


def precision_markdown(remedies: list[tuple[str, str, str]]) -> str:
    """The section: intro, the table, findings and the flags per framework (``remedies``)."""
    reports = precision_reports()
    return (
        INTRO.format(limit=U_LIMIT, wrong=WRONG)
        + "\n".join(precision_table(reports))
        + "\n"
        + precision_findings(reports, remedies)
    )
