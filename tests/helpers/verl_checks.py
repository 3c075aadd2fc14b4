"""Checks of klgrad.integrations.verl against the installed verl; runs in the verl environment, prints JSON.

Run by tests/integrations/test_verl.py with the venv's python (tools/verl_env.sh builds it); by hand:
    VERL_USE_EXTERNAL_MODULES=klgrad.integrations.verl .venvs/verl/bin/python tests/helpers/verl_checks.py

Output: one JSON object with
- ``external_module``: was klgrad.integrations.verl imported by ``import verl`` (VERL_USE_EXTERNAL_MODULES) and
  does verl's ``get_policy_loss_fn("klgrad")`` return klgrad's loss;
- ``parity``: per verl ``kl_penalty`` option, the klgrad quantity it should equal and the max abs differences of
  values and of gradients w.r.t. log_prob, on moderate log-ratios and on all log-ratios incl. extreme ones
  (float64; verl's k3 clamps, so "all" differs there by design and the region where they agree is reported);
- ``loss``: the registered loss inside verl's own actor loss (``ppo_loss``) with a real ``ActorConfig`` built by
  verl's ``omega_conf_to_dataclass``, against klgrad core's ``policy_objective`` on the same tensors.
"""

from __future__ import annotations

import json
import os
import sys
from functools import partial

os.environ.setdefault("VERL_USE_EXTERNAL_MODULES", "klgrad.integrations.verl")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import verl  # loads klgrad.integrations.verl through verl's external-module setting)

LOADED_BY_VERL = "klgrad.integrations.verl" in sys.modules

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass  # noqa: E402

import klgrad  # noqa: E402
from klgrad.integrations import verl as kv  # noqa: E402

torch.manual_seed(0)
DT = torch.float64


def _grad(fn, l: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(value, d sum(value) / d l) of an elementwise fn(l, r)."""
    l = l.clone().requires_grad_(True)
    v = fn(l, r)
    (g,) = torch.autograd.grad(v.sum(), l)
    return v.detach(), g


def _log_ratios() -> tuple[torch.Tensor, torch.Tensor]:
    """Moderate (|u| ≤ 2.5) and all log-ratios (adds extreme ones up to ±100), as (l, r) pairs in float64."""
    moderate = torch.cat([torch.randn(4000, dtype=DT), torch.linspace(-2.5, 2.5, 501, dtype=DT)]).clamp(-2.5, 2.5)
    extreme = torch.tensor(
        [-100, -50, -25, -20.5, -19.9, -15, -11, -5, -3, 3, 5, 11, 15, 19.9, 20.5, 25, 50, 100], dtype=DT
    )
    u_all = torch.cat([moderate, 8 * torch.randn(4000, dtype=DT), extreme])
    out = []
    for u in (moderate, u_all):
        r = -torch.rand(u.shape, dtype=DT) * 5  # reference log-probs in (-5, 0]
        out.append((r + u, r))
    return out[0], out[1]


def parity() -> dict:
    """verl kl_penalty(option) vs klgrad: value vs kl_estimate, gradient vs the matching head."""
    heads = {name: klgrad.get_kl_head(name) for name in ("k2_as_loss", "k3_as_loss")}
    # klgrad counterparts: (value fn, gradient fn) with gradient = d/dl of the klgrad quantity
    klgrad_k1_as_loss = klgrad.KL_HEADS["k1_as_loss"]
    cases = {
        # option: (klgrad value kind, klgrad head whose penalty gradient verl's gradient should equal, description)
        "k1": ("k1", klgrad_k1_as_loss, "k1 value; gradient of k1_as_loss (c = 1)"),
        "kl": ("k1", klgrad_k1_as_loss, "alias of k1"),
        "k2": ("k2", heads["k2_as_loss"], "k2 value; gradient of k2_as_loss (c = u)"),
        "mse": ("k2", heads["k2_as_loss"], "alias of k2"),
        "k3": ("k3", heads["k3_as_loss"], "k3 value; gradient of k3_as_loss (c = 1 - e^-u)"),
        "low_var_kl": ("k3", heads["k3_as_loss"], "alias of k3"),
        "k1+": ("k1", heads["k2_as_loss"], "k1 value, straight-through gradient of k2 (c = u, k1_in_reward's)"),
        "k3+": ("k3", heads["k2_as_loss"], "k3 value, straight-through gradient of k2 (c = u, k1_in_reward's)"),
        "k2+": ("k2", heads["k2_as_loss"], "same as k2"),
        "mse+": ("k2", heads["k2_as_loss"], "same as k2"),
    }
    (lm, rm), (la, ra) = _log_ratios()
    out = {}
    for option, (kind, head, what) in cases.items():
        row = {"klgrad": what}
        for tag, (l, r) in (("moderate", (lm, rm)), ("all", (la, ra))):
            v_verl, g_verl = _grad(partial(core_algos.kl_penalty, kl_penalty=option), l, r)
            v_kg = klgrad.kl_estimate(l, r, kind)
            _, g_kg = _grad(lambda l_, r_, h=head: h.penalty(l_, r_), l, r)
            # the straight-through options' gradient is k1_in_reward's coefficient; check it against that too
            c = klgrad.get_kl_head("k1_in_reward").coefficient(l, r) if option in ("k1+", "k3+") else g_kg
            dv, dg = (v_verl - v_kg).abs(), (g_verl - g_kg).abs()
            row[f"value_max_abs_diff_{tag}"] = float(dv.max())
            row[f"grad_max_abs_diff_{tag}"] = float(dg.max())
            row[f"grad_vs_coefficient_max_abs_diff_{tag}"] = float((g_verl - c).abs().max())
            if tag == "all":
                u = l - r
                bad = (dv > 1e-9) | (dg > 1e-9)
                row["differs_at_u"] = (
                    None
                    if not bool(bad.any())
                    else {
                        "n": int(bad.sum()),
                        "u_min": float(u[bad].min()),
                        "u_max": float(u[bad].max()),
                        "agrees_on_u_in": _agree_interval(u, bad),
                    }
                )
                row["verl_grad_zeroed_at_n"] = int(((g_verl == 0) & (g_kg != 0)).sum())
                row["klgrad_finite"] = bool(torch.isfinite(v_kg).all() and torch.isfinite(g_kg).all())
        out[option] = row
    return out


def _agree_interval(u: torch.Tensor, bad: torch.Tensor) -> list[float]:
    """Largest interval around 0 of the sampled log-ratios on which verl and klgrad agree."""
    neg_bad, pos_bad = u[bad & (u < 0)], u[bad & (u > 0)]
    lo = float(neg_bad.max()) if neg_bad.numel() else float(u.min())
    hi = float(pos_bad.min()) if pos_bad.numel() else float(u.max())
    return [lo, hi]


# ----------------------------------------------------------------------------------------------------------
# the registered loss inside verl


def actor_config(loss_agg_mode: str, **policy_loss):
    """A real verl ActorConfig, built the way verl's workers build it (omega_conf_to_dataclass + _target_)."""
    cfg = OmegaConf.create(
        {
            "_target_": "verl.workers.config.ActorConfig",
            "strategy": "fsdp",
            "rollout_n": 4,
            "ppo_mini_batch_size": 8,
            "ppo_micro_batch_size_per_gpu": 8,
            "clip_ratio": 0.2,
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.28,
            "clip_ratio_c": 3.0,
            "loss_agg_mode": loss_agg_mode,
            "entropy_coeff": 0.0,
            "use_kl_loss": True,
            "kl_loss_coef": 0.0,
            "kl_loss_type": "low_var_kl",
            "policy_loss": {"_target_": "klgrad.integrations.verl.KlgradPolicyLossConfig", **policy_loss},
        }
    )
    return omega_conf_to_dataclass(cfg)


def batch(b: int = 8, p: int = 3, t: int = 6):
    """Random response log-probs (B, T) with ragged response lengths, an off-policy behaviour and a reference."""
    resp_len = torch.randint(1, t + 1, (b,))
    resp_len[0] = t
    mask = torch.arange(t)[None, :] < resp_len[:, None]  # (B, T)
    logp = (-torch.rand(b, t) * 3).float()  # (B, T)
    old = (logp + 0.4 * torch.randn(b, t)).clamp(max=0)  # off-policy behaviour
    ref = (logp + 0.8 * torch.randn(b, t)).clamp(max=0)
    adv = torch.randn(b, 1).expand(b, t) * mask  # sequence advantages on every response token
    return dict(mask=mask, logp=logp, old=old, ref=ref, adv=adv, resp_len=resp_len, p=p, t=t)


def verl_micro_batch(d: dict, logp_leaf: torch.Tensor) -> tuple[dict, TensorDict]:
    """verl's padded micro-batch and model output: flat per-token log-probs, shifted as verl's models emit them."""
    b, p, t = d["mask"].shape[0], d["p"], d["t"]
    flat = []
    for i in range(b):
        n = int(d["resp_len"][i])
        # position j of the flat output holds log p(token j+1): the response starts at p - 1
        flat += [torch.zeros(p - 1), logp_leaf[i, :n], torch.zeros(1)]
    attn = torch.cat([torch.ones(b, p, dtype=torch.long), d["mask"].long()], dim=1)  # (B, P + T)
    data = TensorDict(
        {
            "prompts": torch.ones(b, p, dtype=torch.long),
            "responses": torch.ones(b, t, dtype=torch.long),
            "attention_mask": attn,
            "response_mask": d["mask"].long(),
            "old_log_probs": d["old"],
            "advantages": d["adv"],
            "ref_log_prob": d["ref"],
        },
        batch_size=[b],
    )
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    return {"log_probs": torch.cat(flat)}, data


def loss_checks() -> dict:
    out: dict = {}
    fn = core_algos.get_policy_loss_fn(kv.LOSS_MODE)
    out["registered_is_klgrad"] = fn is kv.compute_policy_loss_klgrad
    cases = [
        ("token-mean", dict(kl_head="k2_as_loss", kl_beta=0.5, kl_level="sequence")),
        ("seq-mean-token-sum", dict(kl_head="k3_as_loss", kl_beta=0.3, kl_level="token", kl_ratio_level="token")),
        ("seq-mean-token-mean", dict(kl_head="k1_in_reward", kl_beta=0.2, kl_level="token_to_go", kl_clip_eps=None)),
        ("token-mean", dict(kl_head="none", kl_beta=0.0)),
    ]
    d = batch()
    results = []
    for mode, pl in cases:
        config = actor_config(mode, **pl)
        row = {
            "loss_agg_mode": mode,
            **{k: v for k, v in pl.items()},
            "config_type": type(config).__name__,
            "policy_loss_type": type(config.policy_loss).__name__,
        }
        spec = kv.spec_from_verl(config, mode)

        # 1) inside verl's actor loss call (verl.workers.utils.losses.ppo_loss via klgrad_ppo_loss)
        leaf = d["logp"].clone().requires_grad_(True)
        model_output, data = verl_micro_batch(d, leaf)
        loss, metrics = kv.klgrad_ppo_loss(config, model_output, data)
        (g_verl,) = torch.autograd.grad(loss, leaf)

        # 2) klgrad core on the same tensors
        leaf2 = d["logp"].clone().requires_grad_(True)
        terms = klgrad.policy_objective(leaf2, d["ref"], d["mask"], d["adv"], spec, old_logp=d["old"])
        (g_core,) = torch.autograd.grad(terms.loss, leaf2)

        # 3) the registered fn called directly with verl's keyword signature (+ ref_log_prob)
        leaf3 = d["logp"].clone().requires_grad_(True)
        loss3, _ = fn(
            old_log_prob=d["old"],
            log_prob=leaf3,
            advantages=d["adv"],
            response_mask=d["mask"],
            loss_agg_mode=mode,
            config=config,
            rollout_is_weights=None,
            ref_log_prob=d["ref"],
        )
        (g3,) = torch.autograd.grad(loss3, leaf3)

        m = d["mask"]
        row.update(
            loss_in_verl=float(loss.detach()),
            loss_core=float(terms.loss.detach()),
            loss_abs_diff=abs(float(loss.detach()) - float(terms.loss.detach())),
            grad_max_abs_diff=float((g_verl - g_core)[m].abs().max()),
            direct_call_loss_abs_diff=abs(float(loss3.detach()) - float(terms.loss.detach())),
            direct_call_grad_max_abs_diff=float((g3 - g_core)[m].abs().max()),
            finite=bool(torch.isfinite(loss) and torch.isfinite(g_verl).all()),
            grad_nonzero=bool((g_verl[m] != 0).any()),
            metric_keys=sorted(k for k in metrics if "klgrad" in k or "pg_" in k),
            verl_kl_loss_logged="kl_loss" in metrics,
        )
        results.append(row)
    out["cases"] = results

    # KL head on but no reference log-probs: a clear error, not a silent zero
    config = actor_config("token-mean", kl_head="k2_as_loss", kl_beta=0.5)
    try:
        fn(
            old_log_prob=d["old"],
            log_prob=d["logp"],
            advantages=d["adv"],
            response_mask=d["mask"],
            loss_agg_mode="token-mean",
            config=config,
        )
        out["missing_ref_error"] = None
    except ValueError as e:
        out["missing_ref_error"] = str(e)

    # KL head off: runs in stock verl's ppo_loss without the klgrad wrapper
    from verl.workers.utils.losses import ppo_loss

    config = actor_config("token-mean", kl_head="none", kl_beta=0.0)
    leaf = d["logp"].clone().requires_grad_(True)
    model_output, data = verl_micro_batch(d, leaf)
    loss, _ = ppo_loss(config, model_output, data)
    (g,) = torch.autograd.grad(loss, leaf)
    out["stock_ppo_loss_kl_off_finite"] = bool(torch.isfinite(loss) and torch.isfinite(g).all())

    out["vs_verl"] = vs_verl(d)

    # verl's own PolicyLossConfig (no klgrad fields): klgrad's defaults, KL head off (β = 0)
    plain = omega_conf_to_dataclass(
        OmegaConf.create(
            {
                "_target_": "verl.workers.config.ActorConfig",
                "strategy": "fsdp",
                "rollout_n": 4,
                "ppo_micro_batch_size_per_gpu": 8,
                "policy_loss": {"_target_": "verl.workers.config.PolicyLossConfig", "loss_mode": "klgrad"},
            }
        )
    )
    spec = kv.spec_from_verl(plain, "token-mean")
    out["plain_policy_loss_config"] = {
        "type": type(plain.policy_loss).__name__,
        "kl_head": spec.kl.head,
        "beta": spec.kl.beta,
        "kl_clip_eps": spec.kl.clip_eps,
    }

    # bad setting names the field
    try:
        kv.spec_from_verl(actor_config("token-mean", kl_head="k9"), "token-mean")
        out["bad_head_error"] = None
    except ValueError as e:
        out["bad_head_error"] = str(e)
    return out


def vs_verl(d: dict) -> dict:
    """klgrad against verl's own losses on the same micro-batch, through verl's ppo_loss.

    - KL off: klgrad's reward head vs verl's ``vanilla`` (equal; verl's ±20 log-ratio clamp is not reached here).
    - KL on, k2 at token level, token-mean: klgrad's decoupled head vs verl's ``use_kl_loss`` with ``kl_loss_type``
      k2 and ``kl_loss_coef`` β. On-policy (old = current) they coincide; off-policy verl's gradient is β·u·∇l
      without importance sampling or clipping, klgrad's is β·max(ρu, clip(ρ)u)' (docs/math.md,
      “Off-policy: importance sampling and the clip side”): they differ.
    """
    from verl.workers.utils.losses import ppo_loss

    beta = 0.5

    def run(config, old, wrapper):
        leaf = d["logp"].clone().requires_grad_(True)
        model_output, data = verl_micro_batch({**d, "old": old}, leaf)
        loss, _ = wrapper(config, model_output, data)
        (g,) = torch.autograd.grad(loss, leaf)
        return float(loss.detach()), g

    def verl_config(use_kl: bool):
        raw = OmegaConf.create(
            {
                "_target_": "verl.workers.config.ActorConfig",
                "strategy": "fsdp",
                "rollout_n": 4,
                "ppo_micro_batch_size_per_gpu": 8,
                "clip_ratio_low": 0.2,
                "clip_ratio_high": 0.28,
                "loss_agg_mode": "token-mean",
                "use_kl_loss": use_kl,
                "kl_loss_coef": beta,
                "kl_loss_type": "k2",
                "policy_loss": {"loss_mode": "vanilla"},
            }
        )
        return omega_conf_to_dataclass(raw)

    out = {}
    m = d["mask"]
    for tag, old in (("on_policy", d["logp"].clone()), ("off_policy", d["old"])):
        lv, gv = run(verl_config(False), old, ppo_loss)
        lk, gk = run(actor_config("token-mean", kl_head="none", kl_beta=0.0), old, kv.klgrad_ppo_loss)
        out[f"vanilla_{tag}"] = {"loss_abs_diff": abs(lv - lk), "grad_max_abs_diff": float((gv - gk)[m].abs().max())}
        lv, gv = run(verl_config(True), old, ppo_loss)
        cfg = actor_config("token-mean", kl_head="k2_as_loss", kl_beta=beta, kl_level="token", kl_ratio_level="token")
        lk, gk = run(cfg, old, kv.klgrad_ppo_loss)
        out[f"k2_token_kl_{tag}"] = {
            "loss_abs_diff": abs(lv - lk),
            "grad_max_abs_diff": float((gv - gk)[m].abs().max()),
        }
    return out


VERL_OPTIONS = {  # klgrad.audit.presets' verl preset id -> verl's kl_penalty option it reproduces
    "verl/kl-loss-k1": "kl",
    "verl/kl-loss-abs": "abs",
    "verl/kl-loss-mse": "mse",
    "verl/kl-loss-low-var-kl": "low_var_kl",
    "verl/kl-loss-low-var-kl-plus": "low_var_kl+",
    "verl/kl-reward-grpo": "kl",
    "verl/kl-reward-gae": "kl",
}


def audit_presets() -> dict:
    """``klgrad audit --framework verl``'s presets against verl's own ``kl_penalty`` on the same float64 tensors,
    every log-ratio including the extreme ones: loss presets in value and ∂/∂log_prob; reward presets in the
    penalty value (verl's apply_kl_penalty computes it from the behaviour log-probs, without gradient)."""
    from klgrad.audit.frameworks import select

    _, (l, r) = _log_ratios()
    out = {}
    for preset in select("verl", verl.__version__):
        option = VERL_OPTIONS[preset.id]
        v_verl, g_verl = _grad(partial(core_algos.kl_penalty, kl_penalty=option), l, r)
        mask = torch.ones_like(l, dtype=torch.bool)
        v_kg, g_kg = _grad(lambda l_, r_, p=preset, m=mask: p.token_kl(l_, r_, l_.detach(), m), l, r)
        out[preset.id] = {
            "option": option,
            "style": preset.style,
            "value_max_abs_diff": float((v_verl - v_kg).abs().max()),
            "grad_max_abs_diff": float((g_verl - g_kg).abs().max()) if preset.style == "loss" else None,
            "n": int(l.numel()),
        }
    return out


def main() -> None:
    result = {
        "versions": {"verl": verl.__version__, "torch": torch.__version__, "klgrad": klgrad.__version__},
        "external_module": {
            "env": os.environ.get("VERL_USE_EXTERNAL_MODULES"),
            "loaded_by_import_verl": LOADED_BY_VERL,
            "get_policy_loss_fn_is_klgrad": core_algos.get_policy_loss_fn("klgrad") is kv.compute_policy_loss_klgrad,
        },
        "parity": parity(),
        "loss": loss_checks(),
        "audit_presets": audit_presets(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
