"""Tests for klgrad.models: the character tokenizer, the tiny Llama factory, loading and saving by path.

Everything runs offline on CPU with tiny models (hidden 32, 2 layers) except the parameter-count test,
which builds the default 1.06M-parameter model once.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from klgrad.models import (
    CHARS,
    SPECIAL_TOKENS,
    build_char_tokenizer,
    build_tiny_model,
    count_parameters,
    default_attention,
    disable_dropout,
    load_model_and_tokenizer,
    save_model_and_tokenizer,
    tiny_llama_config,
)

pytestmark = pytest.mark.numerics

TINY = {"hidden": 32, "layers": 2, "heads": 2, "intermediate": 64, "max_position": 64}
TEXT = st.text(alphabet=CHARS, max_size=60)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def reloaded_tokenizer(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    tokenizer.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


# ----------------------------------------------------------------------------------------------------------
# tokenizer


def test_vocabulary_and_special_ids(tokenizer):
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    ids = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id)
    assert ids == (0, 1, 2, 3)
    assert SPECIAL_TOKENS == ("<pad>", "<bos>", "<eos>", "<unk>")
    assert len(tokenizer) == 4 + len(CHARS) == 90
    assert len(set(CHARS)) == len(CHARS)
    vocab = tokenizer.get_vocab()
    assert all(vocab[c] == 4 + i for i, c in enumerate(CHARS))
    for needed in " \n\\{}_^#|=+-*0123456789aZ":
        assert needed in vocab


def test_no_special_tokens_added_and_one_id_per_character(tokenizer):
    # "1" is CHARS[1] -> id 5; "+" -> 14; " " -> CHARS.index(" ") + 4.
    assert tokenizer("1+1")["input_ids"] == [5, 14, 5]
    assert tokenizer(" ")["input_ids"] == [4 + CHARS.index(" ")]
    assert tokenizer("")["input_ids"] == []
    # Text is only characters: the spelling of a special token is not the special token.
    assert tokenizer("<bos>")["input_ids"] == [4 + CHARS.index(c) for c in "<bos>"]
    assert tokenizer.convert_tokens_to_ids(["<pad>", "<bos>", "<eos>", "<unk>"]) == [0, 1, 2, 3]
    assert tokenizer("é~")["input_ids"] == [3, 3]  # outside the alphabet -> <unk>


@settings(max_examples=200, deadline=None)
@given(text=TEXT)
@example(text="<pad>")  # found by hypothesis before split_special_tokens=True: encoded to [0]
@example(text="<bos>1+1=2<eos>\n  ")
def test_round_trip(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)
    assert ids == [4 + CHARS.index(c) for c in text]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # With BOS/EOS and padding around it, skipping special tokens gives the text back exactly.
    framed = [0, 0, 1, *ids, 2, 0]
    assert tokenizer.decode(framed, skip_special_tokens=True) == text
    assert tokenizer.decode(framed) == "<pad><pad><bos>" + text + "<eos><pad>"


def test_decode_keeps_spaces_before_punctuation(tokenizer):
    text = "a . b , c ? d ! e\n \n  f  "
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_left_padding(tokenizer):
    batch = tokenizer(["1+2=", "12+34="], padding=True)
    one, two = tokenizer("1+2=")["input_ids"], tokenizer("12+34=")["input_ids"]
    assert batch["input_ids"] == [[0, 0, *one], two]
    assert batch["attention_mask"] == [[0, 0, 1, 1, 1, 1], [1] * 6]
    # The trainer adds BOS by id and pads id lists with tokenizer.pad: also on the left.
    pt = tokenizer.pad({"input_ids": [[1, 11], [1, 11, 11, 2]]}, return_tensors="pt")
    assert pt["input_ids"].tolist() == [[0, 0, 1, 11], [1, 11, 11, 2]]
    assert pt["attention_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


@settings(max_examples=100, deadline=None)
@given(texts=st.lists(TEXT, min_size=1, max_size=4))
def test_reloaded_tokenizer_encodes_identically(tokenizer, reloaded_tokenizer, texts):
    assert reloaded_tokenizer(texts, padding=True) == tokenizer(texts, padding=True)
    for text in texts:
        ids = reloaded_tokenizer(text)["input_ids"]
        assert reloaded_tokenizer.decode(ids, skip_special_tokens=True) == text


def test_reloaded_tokenizer_settings(tokenizer, reloaded_tokenizer):
    assert isinstance(reloaded_tokenizer, PreTrainedTokenizerFast)
    assert reloaded_tokenizer.padding_side == "left"
    assert reloaded_tokenizer.get_vocab() == tokenizer.get_vocab()
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id"):
        assert getattr(reloaded_tokenizer, attr) == getattr(tokenizer, attr)
    # " " = CHARS[20] -> 24, "\n" = CHARS[78] -> 82; special-token spellings stay characters after loading.
    assert reloaded_tokenizer("1 2\n")["input_ids"] == [5, 24, 6, 82]
    assert reloaded_tokenizer("<eos>")["input_ids"] == tokenizer("<eos>")["input_ids"] == [20, 34, 44, 48, 21]
    assert reloaded_tokenizer.decode([1, 5, 2, 0]) == "<bos>1<eos><pad>"


# ----------------------------------------------------------------------------------------------------------
# model factory


def test_default_config_parameter_count(tokenizer):
    cfg = tiny_llama_config(len(tokenizer))
    assert cfg.tie_word_embeddings
    assert cfg._attn_implementation == "eager"
    model = build_tiny_model(tokenizer, seed=0)
    # Per layer: 4·128² attention + 3·128·512 MLP + 2·128 norms = 262,400; 4 layers + 90·128 tied
    # embedding + 128 final norm = 1,061,248.
    assert count_parameters(model) == 4 * (4 * 128**2 + 3 * 128 * 512 + 2 * 128) + 90 * 128 + 128
    assert 1.0e6 < count_parameters(model) < 1.1e6
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_build_uses_tokenizer_ids_float32_and_eager(tokenizer):
    model = build_tiny_model(tokenizer, seed=0, **TINY)
    cfg = model.config
    assert (cfg.vocab_size, cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (90, 0, 1, 2)
    assert model.generation_config.pad_token_id == 0
    assert model.generation_config.eos_token_id == 2
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (32, 2)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert cfg._attn_implementation == "eager"
    assert default_attention("cpu") == "eager"
    assert default_attention("cuda") == "sdpa"


def test_build_is_deterministic_and_leaves_global_rng_alone(tokenizer):
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = build_tiny_model(tokenizer, seed=7, **TINY).state_dict()
    assert torch.equal(torch.rand(3), expected_next)  # the caller's RNG stream is untouched
    b = build_tiny_model(tokenizer, seed=7, **TINY).state_dict()
    c = build_tiny_model(tokenizer, seed=8, **TINY).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(a[q], c[q])


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_save_load_round_trip(tokenizer, tmp_path):
    model = build_tiny_model(tokenizer, seed=1, **TINY)
    path = tmp_path / "policy"
    assert save_model_and_tokenizer(model, tokenizer, path) == path.resolve()
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in path.iterdir()
    }
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]  # no temporary sibling left behind

    loaded, tok = load_model_and_tokenizer(path)
    assert loaded.config._attn_implementation == "eager"
    assert not loaded.training
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    ids = torch.tensor([[1, *tokenizer("12+34=46")["input_ids"], 2]])
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))
    assert tok(["1+2=", "12+34="], padding=True) == tokenizer(["1+2=", "12+34="], padding=True)
    assert tok.padding_side == "left"


def test_save_replaces_existing_directory(tokenizer, tmp_path):
    path = tmp_path / "policy"
    save_model_and_tokenizer(build_tiny_model(tokenizer, seed=1, **TINY), tokenizer, path)
    (path / "stale.txt").write_text("from the old save")
    newer = build_tiny_model(tokenizer, seed=2, **TINY)
    save_model_and_tokenizer(newer, tokenizer, path)
    assert not (path / "stale.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]
    loaded, _ = load_model_and_tokenizer(path)
    ids = torch.tensor([[1, 5, 14, 6, 17]])
    assert torch.equal(_logits(loaded, ids), _logits(newer, ids))


def test_load_options(tokenizer, tmp_path):
    path = save_model_and_tokenizer(build_tiny_model(tokenizer, seed=1, **TINY), tokenizer, tmp_path / "m")
    bf16, _ = load_model_and_tokenizer(path, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    sdpa, _ = load_model_and_tokenizer(str(path), dtype=torch.float64, attn_implementation="sdpa")
    assert sdpa.config._attn_implementation == "sdpa"
    assert all(p.dtype == torch.float64 for p in sdpa.parameters())
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        load_model_and_tokenizer(path, dtype="float8")


def test_load_any_causal_lm_and_pad_fallback(tmp_path):
    # Not only our Llama: a GPT-2 directory, with a tokenizer that has no pad token (pad falls back to EOS).
    tokenizer = build_char_tokenizer()
    tokenizer.pad_token = None
    sizes = {"n_positions": 32, "n_embd": 16, "n_layer": 1, "n_head": 2}
    cfg = GPT2Config(vocab_size=90, bos_token_id=1, eos_token_id=2, attn_implementation="eager", **sizes)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        gpt2 = GPT2LMHeadModel(cfg).eval()  # GPT-2 has dropout 0.1
    path = save_model_and_tokenizer(gpt2, tokenizer, tmp_path / "gpt2")
    loaded, tok = load_model_and_tokenizer(path)
    assert isinstance(loaded, GPT2LMHeadModel)
    assert loaded.config._attn_implementation == "eager"
    assert (tok.pad_token, tok.pad_token_id, tok.padding_side) == ("<eos>", 2, "left")
    ids = torch.tensor([[1, 5, 14, 6]])
    assert torch.equal(_logits(loaded, ids), _logits(gpt2, ids))


def test_load_missing_directory(tmp_path):
    missing = tmp_path / "does-not-exist"
    with pytest.raises(FileNotFoundError, match=f"{re.escape(str(missing))}.*does not exist"):
        load_model_and_tokenizer(missing)


def test_load_directory_without_config(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"{re.escape(str(tmp_path))}.*no config.json"):
        load_model_and_tokenizer(tmp_path)


def test_load_directory_without_tokenizer(tokenizer, tmp_path):
    build_tiny_model(tokenizer, seed=0, **TINY).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == 90
    with pytest.raises(FileNotFoundError, match=f"{re.escape(str(tmp_path))}.*no tokenizer"):
        load_model_and_tokenizer(tmp_path)


def test_disable_dropout_llama_attention_and_gpt2_modules(tokenizer):
    """Llama has no nn.Dropout: its attention reads ``self.attention_dropout`` (copied from the config) in train
    mode. GPT-2 has nn.Dropout modules and *_pdrop config values. After disable_dropout, two train-mode forwards
    give identical logits, equal to the eval-mode ones."""
    llama = build_tiny_model(tokenizer, seed=0, **TINY, attention_dropout=0.5).train()
    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=20, n_positions=16, n_embd=16, n_layer=2, n_head=2, attn_implementation="eager")
    ).train()
    for model, vocab in ((llama, len(tokenizer)), (gpt2, 20)):
        ids = torch.randint(vocab, (3, 10), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert not torch.equal(model(ids).logits, model(ids).logits)  # dropout is on
            assert disable_dropout(model) > 0
            a, b = model(ids).logits, model(ids).logits
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            torch.testing.assert_close(model.eval()(ids).logits, a, rtol=0, atol=0)
        assert disable_dropout(model) == 0  # nothing left to change
    assert llama.config.attention_dropout == 0.0
    assert all(m.self_attn.attention_dropout == 0.0 for m in llama.model.layers)
    assert (gpt2.config.resid_pdrop, gpt2.config.embd_pdrop, gpt2.config.attn_pdrop) == (0.0, 0.0, 0.0)
    assert all(m.p == 0.0 for m in gpt2.modules() if isinstance(m, torch.nn.Dropout))
