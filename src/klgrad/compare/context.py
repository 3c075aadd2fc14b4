"""What a final measurement of one finished run can use (:class:`FinalContext`), each piece loaded once on first
use and shared by every measurement of the run (:mod:`klgrad.compare.measurements`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

SHORT_ANSWER = 10
"""``rollout.max_new_tokens`` up to which every response is enumerated (the response tree is small)."""


class FinalContext:
    """What a measurement of one finished run can use, each loaded once on first use: the run's config as it
    trained (``cfg``) and at the grid's nominal β (``objective_cfg``, the β of J_β), its folder, the final policy
    and the reference it was regularised towards at its end (:meth:`models`), the first ``prompts`` held-out
    examples, encoded on the measuring device, ``samples`` policy samples per prompt.

    The device: ``device`` when given, else the CPU for short answers (enumerated) and the run's ``model.device``
    for longer ones."""

    def __init__(
        self,
        cfg,
        run_dir: Path,
        prompts: int,
        samples: int,
        *,
        objective_cfg=None,
        device: str | None = None,
        pinned: str | None = None,
    ) -> None:
        self.cfg, self.run_dir, self.prompts, self.samples = cfg, Path(run_dir), prompts, samples
        self.objective_cfg = objective_cfg or cfg
        self.short = cfg.rollout.max_new_tokens <= SHORT_ANSWER
        self.device_setting = device
        self.pinned = pinned
        """The commit of a pinned grid measured afterwards by another revision (None: a run measured where it
        trained, or an unpinned grid)."""
        self._cache: dict[str, Any] = {}

    def klgrad_source(self) -> Path | None:
        """The ``src`` folder a measurement that runs a klgrad command should run it from: the pinned grid's
        worktree (:func:`klgrad.compare.provenance.pin_worktree`, made on first use), or None for this process's."""
        if self.pinned is None:
            return None

        def pin() -> Path:
            from klgrad.compare import provenance as pv

            return pv.pin_worktree(self.pinned, pv.package_source(), pv.pin_root())[1] / "src"

        return self._once("klgrad_source", pin)

    def _once(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    @property
    def device(self):
        import torch

        from klgrad.trainer.setup import resolve_device

        if self.device_setting is not None:
            return resolve_device(self.device_setting, 1)
        return torch.device("cpu") if self.short else resolve_device(self.cfg.model.device, 1)

    def models(self) -> tuple[Any, Any, Any]:
        """(policy, reference, tokenizer) in eval mode: the checkpoint's ``ref.safetensors`` when the run resets its
        reference (``kl.reset_ref_every``), else the starting model (a LoRA run: its base with the final adapter
        merged, against the base itself)."""
        return self._once("models", self._load)

    def _load(self):
        from klgrad.models import load_model_and_tokenizer
        from klgrad.trainer import reference_path
        from klgrad.trainer.checkpoints import latest_checkpoint, load_lora_policy, load_weights

        model_dir, device = reference_path(self.cfg), self.device
        if self.cfg.model.lora_rank:
            policy, tok = load_lora_policy(self.run_dir, self.cfg, device=device)
            ref, _ = load_model_and_tokenizer(model_dir, device=device)
        else:
            policy, tok = load_model_and_tokenizer(model_dir, device=device)
            ref, _ = load_model_and_tokenizer(model_dir, device=device)
            load_weights(latest_checkpoint(self.run_dir), policy, ref)  # the reference the run ended with
        return policy.eval(), ref.eval(), tok

    def heldout(self) -> list:
        """The first ``prompts`` held-out examples, in order."""
        from klgrad.trainer import load_data

        return self._once("heldout", lambda: load_data(self.cfg)[1][: self.prompts])

    def encoded(self) -> tuple[Any, Any]:
        """(ids, mask) of the held-out prompts on the device, ``(P, T)`` each."""
        from klgrad.rollout.encoding import encode_prompts, uses_chat

        def encode():
            tok = self.models()[2]
            chat = uses_chat(self.cfg.data.prompt_format, tok)
            ids, mask = encode_prompts(tok, [e.prompt for e in self.heldout()], chat=chat)
            return ids.to(self.device), mask.to(self.device)

        return self._once("encoded", encode)

    def policy_samples(self) -> tuple[Any, Any]:
        """(``samples`` policy samples per prompt, groups contiguous, with a fixed seed; their sequence log-ratios
        to the reference ``(P·samples,)`` on the CPU), the full distribution at the sampling temperature."""

        def draw():
            import torch

            from klgrad.rollout.samplers import KlgradSampler
            from klgrad.trainer.evaluation import reference_log_ratios

            policy, ref, tok = self.models()
            ids, mask = self.encoded()
            tau = self.cfg.rollout.temperature
            sampled = KlgradSampler(tok.eos_token_id, tok.pad_token_id).generate(
                policy,
                ids,
                mask,
                group_size=self.samples,
                max_new_tokens=self.cfg.rollout.max_new_tokens,
                temperature=tau,
                generator=torch.Generator().manual_seed(12345),
            )
            return sampled, reference_log_ratios(sampled, ref, ids.shape[1], tau).cpu()

        return self._once("samples", draw)

    def enumeration(self) -> dict:
        """Every response of the held-out prompts enumerated (short answers): with β > 0 the exact objective J_β,
        J*, KL(π‖π*) and both KLs (:func:`klgrad.trainer.evaluation.objective_on`), else the tree KL alone."""

        def enumerate_all():
            from klgrad.exact.kl import tree_kl
            from klgrad.exact.objective import PRUNE
            from klgrad.trainer import reward_specs
            from klgrad.trainer.evaluation import objective_on

            policy, ref, tok = self.models()
            cfg = self.objective_cfg
            if cfg.kl.beta > 0:
                return objective_on(policy, ref, tok, self.heldout(), reward_specs(cfg), cfg)
            ids, mask = self.encoded()
            rows = [ids[i][mask[i]].tolist() for i in range(ids.shape[0])]
            return tree_kl(
                policy,
                ref,
                rows,
                eos_id=tok.eos_token_id,
                pad_id=tok.pad_token_id,
                max_new_tokens=cfg.rollout.max_new_tokens,
                temperature=cfg.rollout.temperature,
                prune=PRUNE,
            )

        return self._once("enumeration", enumerate_all)
