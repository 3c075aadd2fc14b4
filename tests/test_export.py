"""``klgrad export``: a run's policy as a plain Hugging Face folder. Two real two-step runs on the embedded default
(full fine-tuning and LoRA) are exported and loaded with plain transformers: the full fine-tune's weights and
logits are the checkpoint's exactly, the merged LoRA's logits the adapted policy's within the merge's rounding;
``klgrad eval`` on the folder reproduces the run's own held-out greedy accuracy; the folder's files are the base
model's (config, tokenizer with its chat template, generation ids) with nothing of klgrad's; bad sources and an
occupied ``--out`` are refused before anything is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from klgrad.config import load_config, to_dict
from klgrad.data import make_splits
from klgrad.export import export_model
from klgrad.models.lora import adapter_parameters
from klgrad.rollout.encoding import encode_prompts
from klgrad.trainer import EMBEDDED_DIR, read_jsonl, train
from klgrad.trainer.checkpoints import load_policy_weights, load_weights, save_checkpoint
from klgrad.trainer.setup import load_policy_and_reference, make_optimizer
from tests.helpers.extras import needs_extras, reason
from tests.helpers.tolerances import llama_depth, network_tol

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_add.yaml"
BASE = EMBEDDED_DIR / "tiny_addition"
N_EVAL = 40
"""Held-out problems of the runs below: the run's step-0 evaluation of the reference scores 25 of them (0.625), so
an accuracy check on them means something (neither all right nor all wrong)."""
EXPORTED_FILES = {
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


def merge_tol(config, scale: float) -> float:
    """Largest expected |logit difference| between the merged export and the adapted policy it came from, both in
    float32, at logit magnitude ``scale``.

    Both compute the same real function, per adapted projection x·(W + s·B·A)ᵀ, with their roundings in
    different places. Merged: the r-term sums of B·A, one rounding adding s·B·A to W, then the one D-term dot
    product with x that every evaluation of the base network has. Low-rank (peft's forward as trained): x·Wᵀ, and
    beside it x·Aᵀ (D terms) then ·Bᵀ (r terms), and one addition. So beyond the base network's chain of
    reductions (:func:`tolerances.llama_depth`, paid by both), each of a layer's 4 projection stages (q/k/v, o,
    gate/up, down) adds at most two reductions of length ≤ width = max(hidden, intermediate) ≥ r: 8 per layer.
    Each reduction adds a relative error of at most λ·√width·u (:func:`tolerances.sum_tol_probabilistic`, u = 2⁻²⁴,
    λ = 6) and the RMSNorms keep the layers' errors additive relative to the output's size
    (:func:`tolerances.network_tol`, which doubles the sum for two evaluations). The same model covers the
    attention kernels reducing in another order (plain ``from_pretrained`` picks sdpa, the run's policy eager).
    Here (4 layers, width 512): 2·66·6·√512·u ≈ 1.1e-3 relative to the largest logit.
    """
    layers = config.num_hidden_layers
    return network_tol(llama_depth(layers) + 8 * layers, max(config.hidden_size, config.intermediate_size), scale)


# ---------------------------------------------------------------------------------------------------------------
# two real runs and their exports (module fixtures: each run trains once)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One CPU thread for the whole module, as the runs train and evaluate with (train.threads 1); restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _train(out: Path, lora_rank: int):
    """Two steps of ``klgrad train`` on the embedded default (4 prompts × 4 responses, N_EVAL held out; the last
    step is evaluated and checkpointed); returns the config."""
    over = {
        "model.lora_rank": lora_rank,
        "optim.lr": 1e-3 if lora_rank else 1e-4,
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "data.n_eval": N_EVAL,
        "train.steps": 2,
        "train.eval_every": 0,
        "train.save_every": 2,
        "train.eval_objective_prompts": 0,
        "train.tensorboard": False,
        "train.threads": 1,  # on a shared 2-core machine a second OpenMP thread waits on its descheduled peer
        "train.out_dir": str(out),
    }
    cfg = load_config(CONFIG, over)
    train(cfg, progress=False)
    return cfg


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """(run directory, config, exported folder) of a full fine-tuning run."""
    root = tmp_path_factory.mktemp("full")
    cfg = _train(root / "run", 0)
    return root / "run", cfg, export_model(root / "run", root / "export").path


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """(run directory, config, exported folder) of a rank-4 LoRA run; its tests skip without peft."""
    pytest.importorskip("peft", reason=reason("peft"))
    root = tmp_path_factory.mktemp("lora")
    cfg = _train(root / "run", 4)
    return root / "run", cfg, export_model(root / "run", root / "export").path


CKPT = Path("checkpoints") / "step_000002"


def _batch(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Eight held-out prompts with their answers, left-padded as klgrad encodes them (BOS + text)."""
    _, heldout = make_splits("addition", 0, 8, seed=1)
    return encode_prompts(tokenizer, [e.prompt + e.answer for e in heldout])


@torch.no_grad()
def _logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logits at the real (unpadded) positions."""
    return model(input_ids=ids, attention_mask=mask.long()).logits[mask]


def _plain(folder: Path):
    """(model, tokenizer) as any transformers user loads a folder: no klgrad, no options."""
    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


# ---------------------------------------------------------------------------------------------------------------
# (1) plain transformers loads it, and it is the checkpoint's policy


def test_full_fine_tune_exports_the_checkpoint_weights_bit_for_bit(full):
    run, _, out = full
    model, tok = _plain(out)
    assert not any("lora" in n for n, _ in model.named_parameters())
    saved = load_file(str(run / CKPT / "policy.safetensors"))
    state = model.state_dict()
    assert set(saved) <= set(state)
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    # the policy as the checkpoint holds it: the base model with policy.safetensors loaded over it, same attention
    # kernel as the export got. The weights are the same bits and every op runs on the same inputs in the same
    # order, so the logits are the same floats: exact equality, no tolerance.
    policy = AutoModelForCausalLM.from_pretrained(BASE, attn_implementation=model.config._attn_implementation).eval()
    base_logits = _logits(policy, *_batch(tok))
    load_policy_weights(run / CKPT, policy)
    want = _logits(policy, *_batch(tok))
    got = _logits(model, *_batch(tok))
    assert torch.equal(got, want)
    assert not torch.equal(got, base_logits)  # the two steps moved the policy: exporting the base would fail above
    # the exported tokenizer encodes as the run's (the base's) does
    base_tok = AutoTokenizer.from_pretrained(BASE)
    assert torch.equal(_batch(tok)[0], _batch(base_tok)[0])
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)


def test_lora_export_is_the_adapter_merged_within_the_merge_rounding(lora):
    run, cfg, out = lora
    model, tok = _plain(out)
    assert not any("lora" in n for n, _ in model.named_parameters())  # a plain Llama: peft not needed
    assert not any("lora" in k for k in load_file(str(out / "model.safetensors")))
    # the policy as it trained: the base with a peft adapter (low-rank path), the checkpoint's A and B loaded
    policy, ref, _ = load_policy_and_reference(cfg, BASE, torch.device("cpu"))
    load_weights(run / CKPT, policy, ref)
    assert any(float(p.detach().abs().max()) > 0 for n, p in adapter_parameters(policy).items() if ".lora_B." in n)
    policy.eval()
    ids, mask = _batch(tok)
    want, got, base = _logits(policy, ids, mask), _logits(model, ids, mask), _logits(ref.eval(), ids, mask)
    tol = merge_tol(model.config, float(want.abs().max()))
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    assert float((want - base).abs().max()) > 10 * tol  # the adapter matters far beyond the tolerance


# ---------------------------------------------------------------------------------------------------------------
# (2) klgrad eval on the exported folder reproduces the run's own held-out evaluation


@pytest.mark.parametrize("which", ["full", "lora"])
def test_eval_of_the_export_reproduces_the_runs_heldout_greedy_accuracy(which, request, tmp_path):
    """The run evaluated its last step (step 2, the checkpoint exported) on its N_EVAL held-out prompts in one
    greedy batch with klgrad's sampler; ``klgrad eval`` samples the exported folder the same way (one batch of
    N_EVAL, the same sampler, the same CPU thread count).

    Full fine-tuning: the same weights bit for bit and the same computation, so the same tokens: equal. LoRA: the
    run sampled through the adapter's low-rank term, the export has it merged into W; their logits differ by
    rounding (``merge_tol``), which can flip a greedy near-tie: equal up to one problem (tests/models/test_lora.py
    allows the same for ``klgrad eval`` of a LoRA run directory)."""
    from klgrad.cli import main

    run, cfg, out = request.getfixturevalue(which)
    recorded = next(r for r in read_jsonl(run / "metrics.jsonl") if r["step"] == 2)["eval/greedy_accuracy"]
    _, heldout = make_splits(cfg.data.task, cfg.data.n_train, cfg.data.n_eval, cfg.data.seed, cfg.data.digits)
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n" for e in heldout))
    argv = ["eval", "--model", str(out), "--data", str(data), "--samples", "1", "--device", "cpu"]
    argv += ["--max-new-tokens", str(cfg.rollout.max_new_tokens), "--batch-size", str(N_EVAL)]
    assert torch.get_num_threads() == cfg.train.threads  # the run's thread count (module fixture)
    assert main([*argv, "--out", str(tmp_path / "ev")]) == 0
    report = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert report["model"]["checkpoint"] is None  # a plain model folder, not resolved back to the run
    scored = report["benchmarks"]["heldout"]
    assert scored["n"] == N_EVAL
    assert 0 < recorded < 1
    if which == "full":
        assert scored["greedy_accuracy"] == recorded
    else:
        assert abs(scored["greedy_accuracy"] - recorded) <= 1 / N_EVAL, (scored["greedy_accuracy"], recorded)


# ---------------------------------------------------------------------------------------------------------------
# (4) what the folder holds


def test_folder_holds_the_base_config_tokenizer_and_generation_ids(full, lora):
    base_config = json.loads((BASE / "config.json").read_text())
    for _, _, out in (full, lora):
        assert {p.name for p in out.iterdir()} == EXPORTED_FILES
        config = json.loads((out / "config.json").read_text())
        # the base's config exactly (only the writer's version differs): no klgrad, peft or training-only keys
        assert {k: v for k, v in config.items() if k != "transformers_version"} == {
            k: v for k, v in base_config.items() if k != "transformers_version"
        }
        generation = json.loads((out / "generation_config.json").read_text())
        assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, 2, 0)
        tok_config = json.loads((out / "tokenizer_config.json").read_text())
        assert not {"is_local", "local_files_only"} & set(tok_config)  # how we loaded it is not a setting


TEMPLATE = "{% for m in messages %}<bos>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
"""A chat template for the templated base below (any template: the test checks that it is carried over)."""


def _templated_lora_run(root: Path) -> tuple[Path, Path]:
    """(base, run): a copy of the embedded model with a chat template, attention dropout 0.1 and a generation
    config whose stop id is another token and that has no pad id; and a LoRA "run" on it whose one checkpoint
    holds a random adapter (written by the trainer's save_checkpoint, no training: the files are what matters)."""
    base = root / "base"
    shutil.copytree(BASE, base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    tok = AutoTokenizer.from_pretrained(base)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(base)
    generation = json.loads((base / "generation_config.json").read_text())
    del generation["pad_token_id"]
    (base / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": 5}))
    cfg = load_config(CONFIG, {"model.path": str(base), "model.lora_rank": 4, "train.out_dir": str(root / "run")})
    policy, ref, _ = load_policy_and_reference(cfg, base, torch.device("cpu"))
    assert policy.config.attention_dropout == 0.0  # training turned dropout off in the config: export undoes it
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in adapter_parameters(policy).values():
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    optimizer, scheduler = make_optimizer(cfg, policy)
    run = root / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    save_checkpoint(run, 1, policy, ref, optimizer, scheduler, 0.5, cfg, save_ref=False)
    return base, run


@needs_extras("peft")  # a LoRA run
def test_base_settings_come_through_and_dtype_is_kept_or_cast(tmp_path):
    base, run = _templated_lora_run(tmp_path)
    ckpt = run / "checkpoints" / "step_000001"
    f32 = export_model(ckpt, tmp_path / "f32")  # a checkpoint folder as the source
    bf16 = export_model(run, tmp_path / "bf16", dtype="bfloat16")
    assert (f32.dtype, bf16.dtype, f32.lora, f32.checkpoint, bf16.checkpoint) == (
        "float32",
        "bfloat16",
        True,
        ckpt,
        ckpt,
    )
    base_config = json.loads((base / "config.json").read_text())
    for done in (f32, bf16):
        assert {p.name for p in done.path.iterdir()} == EXPORTED_FILES | {"chat_template.jinja"}
        tok = AutoTokenizer.from_pretrained(done.path)
        assert tok.chat_template == TEMPLATE
        config = json.loads((done.path / "config.json").read_text())
        assert config["attention_dropout"] == 0.1  # the base's, not training's 0.0
        drop = {"transformers_version", "dtype"}
        assert {k: v for k, v in config.items() if k not in drop} == {
            k: v for k, v in base_config.items() if k not in drop
        }
        assert config["dtype"] == done.dtype
        generation = json.loads((done.path / "generation_config.json").read_text())
        # the base's stop id kept, the tokenizer's EOS (what klgrad's sampler stops at) added, pad filled in
        assert (generation["eos_token_id"], generation["pad_token_id"]) == ([5, 2], 0)
    # --dtype bfloat16 casts the float32 merge: each tensor is that cast, one rounding of the same numbers
    a, b = load_file(str(f32.path / "model.safetensors")), load_file(str(bf16.path / "model.safetensors"))
    assert set(a) == set(b)
    assert all(b[k].dtype == torch.bfloat16 and torch.equal(b[k], a[k].to(torch.bfloat16)) for k in a)
    model = AutoModelForCausalLM.from_pretrained(bf16.path)
    assert model.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------------------------
# (3) refusals, before anything is written


def _export(argv: list[str], capsys) -> tuple[int, str]:
    from klgrad.cli import main

    code = main(["export", *argv])
    return code, capsys.readouterr().err


def test_missing_or_wrong_sources_are_refused_naming_them(tmp_path, capsys):
    out = tmp_path / "out"
    code, err = _export([str(tmp_path / "nope"), "--out", str(out)], capsys)
    assert code == 2
    assert f"klgrad export: {tmp_path / 'nope'}: no such run directory or checkpoint folder" in err
    code, err = _export([str(BASE), "--out", str(out)], capsys)
    assert code == 2
    assert "neither a klgrad run directory" in err
    empty_run = tmp_path / "empty_run"
    empty_run.mkdir()
    (empty_run / "config.yaml").write_text(yaml.safe_dump(to_dict(load_config(CONFIG))))
    code, err = _export([str(empty_run), "--out", str(out)], capsys)
    assert code == 2
    assert "without a valid checkpoint" in err
    assert not out.exists()


def test_an_occupied_out_is_refused_unless_forced(full, tmp_path, capsys):
    run, _, _ = full
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = _export([str(run), "--out", str(out)], capsys)
    assert code == 2
    assert "exists and is not empty; pass --force to replace it" in err
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left beside it
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    # the run directory itself is never replaced, even with --force
    code, err = _export([str(run / CKPT), "--out", str(run), "--force"], capsys)
    assert code == 2
    assert "is or contains the run directory" in err
    assert (run / CKPT / "checksums.json").is_file()
    # --force replaces the folder whole; an empty folder needs no --force
    code, _ = _export([str(run), "--out", str(out), "--force"], capsys)
    assert code == 0
    assert {p.name for p in out.iterdir()} == EXPORTED_FILES
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    (tmp_path / "empty").mkdir()
    assert _export([str(run), "--out", str(tmp_path / "empty")], capsys)[0] == 0
    assert {p.name for p in (tmp_path / "empty").iterdir()} == EXPORTED_FILES
