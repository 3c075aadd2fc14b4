r"""``klgrad compare run --beta-scale length``: every method at the same nominal KL strength.

A method's KL term is reduced by its own aggregation (``kl.aggregation``, a framework preset's or, for klgrad's
heads, ``algo.aggregation``), the task reward's policy-gradient term by the grid's shared ``algo.aggregation``.
Per response the aggregations divide by

    n(seq_mean_token_sum) = 1 (a token sum),  n(token_mean) = n(seq_mean_token_mean) = L̄,

L̄ the mean response length in tokens (a batch token mean divides the batch's summed KL by its token count,
B·L̄; a per-sequence mean of token means divides each response's KL by its own length, ≈ L̄). The loss
agg_pg(task) + β'·agg_kl(KL) then has the gradient of E[R] − β'·n_pg/n_kl·KL, so the method whose KL weight is

    β' = β · n_kl / n_pg

regularises J_β = E[R] − β·KL(π‖π_ref) at the grid's nominal β. With the shared token-sum policy gradient (the
default), a token-mean method gets β·L̄, a token-sum or sequence-level head β. A ``combined``-form method (KL in
the reward, shaped with the task reward) has its KL reduced with the task reward: β' = β.

L̄ is measured once per grid (:func:`mean_response_length`: the reference's samples on the first training
prompts, on the CPU, at the rollout's temperature and length limit, a fixed seed) and recorded in grid.json with
each method's β' (a continuation reuses the recorded L̄; ``length=L`` gives it). It is nominal: during training
the responses' length moves, and a token mean's actual weight with it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from klgrad.choices import Aggregation

if TYPE_CHECKING:
    from klgrad.config import Config

LENGTH_PROMPTS = 16
"""Training prompts L̄ is measured on (the first ones, in the data's order)."""
LENGTH_SAMPLES = 4
"""Reference samples per prompt of L̄."""
LENGTH_SEED = 2024
"""The sampling seed of L̄ (one L̄ for every machine that measures it on the CPU)."""
PER_TOKEN_MEANS: frozenset[str] = frozenset({"token_mean", "seq_mean_token_mean"})
"""Aggregations that divide a response's KL by (about) its length."""


@dataclass(frozen=True)
class BetaScale:
    """How a grid's β is scaled per method: ``mode`` ``"length"`` (β·n_kl/n_pg, module docstring), with
    ``mean_length`` L̄ when given (``length=L``) or measured, None before it is measured."""

    mode: str = "length"
    mean_length: float | None = None
    prompts: int = LENGTH_PROMPTS
    samples: int = LENGTH_SAMPLES
    seed: int = LENGTH_SEED
    measured: bool = True
    """False when L̄ was given on the command line (``length=L``)."""

    def as_dict(self) -> dict:
        return asdict(self)


def parse_beta_scale(text: str | None) -> BetaScale | None:
    """``None``/``"off"`` → None (β shared as given); ``"length"`` → L̄ to be measured; ``"length=12.5"`` → L̄
    given. Raises ValueError for anything else or L ≤ 0."""
    if text is None or text == "off":
        return None
    mode, sep, value = text.partition("=")
    if mode != "length":
        raise ValueError(f"--beta-scale {text!r}: expected off, length or length=L (L the mean response length)")
    if not sep:
        return BetaScale()
    try:
        length = float(value)
    except ValueError:
        length = -1.0
    if not length > 0:
        raise ValueError(f"--beta-scale {text!r}: L must be a positive number of tokens")
    return BetaScale(mean_length=length, measured=False)


def aggregation_normaliser(aggregation: Aggregation, mean_length: float) -> float:
    """n(agg), what ``aggregation`` divides one response's summed term by: 1 for ``seq_mean_token_sum`` (a token
    sum), L̄ = ``mean_length`` for ``token_mean`` (Σ_i Σ_t / Σ_i |y_i| = Σ_i Σ_t / (B·L̄)) and
    ``seq_mean_token_mean`` ((1/B) Σ_i Σ_t / |y_i| ≈ Σ_i Σ_t / (B·L̄))."""
    return mean_length if aggregation in PER_TOKEN_MEANS else 1.0


def beta_factor(form: str, kl_aggregation: Aggregation, pg_aggregation: Aggregation, mean_length: float) -> float:
    """β'/β = n_kl / n_pg (:func:`aggregation_normaliser`) for a decoupled KL term; 1 for the ``combined`` form,
    whose KL is in the reward and reduced with it."""
    if form == "combined":
        return 1.0
    return aggregation_normaliser(kl_aggregation, mean_length) / aggregation_normaliser(pg_aggregation, mean_length)


def kl_aggregation(cfg: Config) -> Aggregation:
    """The run's KL aggregation: ``kl.aggregation``, else ``algo.aggregation`` (as the objective reduces it)."""
    return cfg.kl.aggregation or cfg.algo.aggregation


def effective_beta(cfg: Config, mean_length: float) -> float:
    """β' = ``cfg.kl.beta`` · :func:`beta_factor` of the run's form and aggregations (``cfg`` at the nominal β)."""
    return cfg.kl.beta * beta_factor(cfg.kl.form, kl_aggregation(cfg), cfg.algo.aggregation, mean_length)


def beta_row(method: str, beta: float, cfg: Config, mean_length: float) -> dict:
    """grid.json's record of one (method, β): its KL aggregation, β'/β and β'."""
    factor = beta_factor(cfg.kl.form, kl_aggregation(cfg), cfg.algo.aggregation, mean_length)
    return {
        "method": method,
        "beta": beta,
        "form": cfg.kl.form,
        "kl_aggregation": kl_aggregation(cfg),
        "pg_aggregation": cfg.algo.aggregation,
        "factor": factor,
        "effective_beta": beta * factor,
    }


def mean_response_length(
    cfg: Config, prompts: int = LENGTH_PROMPTS, samples: int = LENGTH_SAMPLES, seed: int = LENGTH_SEED
) -> float:
    """L̄ = (1/(P·K)) Σ_i |y_i|: the reference's mean response length in tokens (the trainer's response mask,
    EOS included) over ``samples`` samples of each of the first ``prompts`` training prompts, at the rollout's
    temperature and ``max_new_tokens``, on the CPU with a fixed ``seed`` (``klgrad compare mean-length`` prints
    it, for ``--beta-scale length=L`` on seeds run apart)."""
    import torch

    from klgrad.models import load_model_and_tokenizer
    from klgrad.rollout.encoding import encode_prompts, uses_chat
    from klgrad.rollout.samplers import KlgradSampler
    from klgrad.trainer import load_data, reference_path

    device = torch.device("cpu")
    ref, tok = load_model_and_tokenizer(reference_path(cfg), device=device)
    ref.eval()
    train_examples, _ = load_data(cfg)
    texts = [e.prompt for e in train_examples[:prompts]]
    ids, mask = encode_prompts(tok, texts, chat=uses_chat(cfg.data.prompt_format, tok))
    with torch.no_grad():
        out = KlgradSampler(tok.eos_token_id, tok.pad_token_id).generate(
            ref,
            ids,
            mask,
            group_size=samples,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            generator=torch.Generator().manual_seed(seed),
        )
    return float(out.response_mask.sum(1).double().mean())


def settle_scale(scale: BetaScale | None, recorded: dict | None, cfg: Config) -> BetaScale | None:
    """The grid's β scale: None when off; the recorded one (grid.json's ``beta_scale``) when the grid has it and
    this invocation gives no other L̄; else ``scale`` with L̄ measured (:func:`mean_response_length`) unless given.
    A given L̄ that differs from the record is left to the design check (it refuses the continuation)."""
    if scale is None:
        return None
    if recorded is not None and (scale.mean_length is None or scale.mean_length == recorded.get("mean_length")):
        return BetaScale(**recorded)
    if scale.mean_length is not None:
        return scale
    return BetaScale(
        mean_length=mean_response_length(cfg, scale.prompts, scale.samples, scale.seed),
        prompts=scale.prompts,
        samples=scale.samples,
        seed=scale.seed,
    )


if __name__ == "__main__":  # the module's former command line: a pointer, not a silent no-op
    raise SystemExit("python -m klgrad.compare.beta_scale --config C is now: klgrad compare mean-length --config C")
