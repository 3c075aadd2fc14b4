"""Prompts for chat models: the chat template switch (data.prompt_format), the chat arithmetic tasks and the
``final_number`` reward that scores them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from klgrad.config import load_config
from klgrad.data.example import repeat_columns
from klgrad.data.tasks import CHAT_TASKS, extract_answer, final_number, is_heldout, make_splits, sft_target
from klgrad.models import load_model_and_tokenizer
from klgrad.models.sources import EMBEDDED_DIR
from klgrad.rewards import accuracy_reward_name, final_number_reward, load_reward_fn
from klgrad.rollout.encoding import encode_prompts, uses_chat

TEMPLATE = "<bos>{% for m in messages %}Q:{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"


@pytest.fixture
def tok():
    _, tokenizer = load_model_and_tokenizer(EMBEDDED_DIR / "tiny_addition")
    return tokenizer


def test_prompt_format_decides_the_encoding(tok):
    raw, raw_mask = encode_prompts(tok, ["1+2=", "10+20="])
    assert tok.decode(raw[1][raw_mask[1]]) == "<bos>10+20="
    assert not uses_chat("auto", tok)  # no template: raw, as before
    with pytest.raises(ValueError, match=r"data\.prompt_format is 'chat'"):
        uses_chat("chat", tok)
    tok.chat_template = TEMPLATE
    assert uses_chat("auto", tok)
    assert uses_chat("chat", tok)
    assert not uses_chat("raw", tok)
    ids, mask = encode_prompts(tok, ["1+2=", "10+20="], chat=True)
    assert tok.decode(ids[0][mask[0]]) == "<bos>Q:1+2=A:"  # one BOS: the template's own
    assert tok.decode(ids[1][mask[1]]) == "<bos>Q:10+20=A:"
    assert not mask[0][: ids.shape[1] - mask[0].sum()].any()  # left padding
    assert torch.equal(encode_prompts(tok, ["1+2=", "10+20="], chat=False)[0], raw)


def test_prompt_format_is_validated():
    with pytest.raises(ValueError, match=r"data\.prompt_format must be 'auto', 'chat' or 'raw'"):
        load_config(overrides={"data.prompt_format": "template"})


@pytest.mark.parametrize(
    ("completion", "number"),
    [
        ("13 * 9 = 117.", "117"),
        ("To calculate 502 + 703, we need to add", "703"),
        ("The answer is 1,205.", "1205"),
        ("It is -4, I think", "-4"),
        ("2.5 and then 3", "3"),
        ("pi is 3.14", "3.14"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_final_number_reads_the_last_number(completion: str, number: str | None):
    assert final_number(completion) == number


def test_final_number_reward_refuses_an_echoed_question():
    """Math-Verify alone scores a response that restates the sum as correct; final_number does not."""
    echo = "To calculate 502 + 703, we need to add"
    answers = {"answer": ["1205", "1205", "1205", "117"]}
    completions = [echo, "502 + 703 = 1205", "The result is 1,205.", "13 * 9 = 129"]
    assert load_reward_fn("accuracy")(None, [echo], answer=["1205"]) == [1.0]  # the hole this reward closes
    assert final_number_reward(None, completions, **answers) == [0.0, 1.0, 1.0, 0.0]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=-(10**9), max_value=10**9),
    m=st.integers(min_value=0, max_value=10**9),
    text=st.text(alphabet="abcdefghij ,.!?:=+*", max_size=30),
)
def test_final_number_reward_scores_the_last_number_only(n: int, m: int, text: str):
    """Any text without digits around two numbers: the last one decides, whatever the first is."""
    completion = f"{m}{text} {n}{text.replace(',', '').replace('.', '')}"
    assert final_number_reward(None, [completion], answer=[str(n)]) == [1.0]
    assert final_number_reward(None, [completion], answer=[str(n + 1)]) == [0.0]


def test_accuracy_reward_name_prefers_accuracy():
    assert accuracy_reward_name(["format", "final_number"]) == "final_number"
    assert accuracy_reward_name(["accuracy", "final_number"]) == "accuracy"
    assert accuracy_reward_name(["format"]) is None


@pytest.mark.parametrize("task", CHAT_TASKS)
def test_chat_tasks_are_instructions_with_disjoint_splits(task: str):
    train, heldout = make_splits(task, 300, 60, seed=3, digits=2)
    op = "+" if task == "chat_addition" else "*"
    for e in train + heldout:
        a, b = (int(x) for x in e.prompt.removeprefix("Calculate ").removesuffix(". Give just the result.").split(op))
        assert e.prompt == f"Calculate {a} {op} {b}. Give just the result."
        assert e.answer == str(a + b if op == "+" else a * b)
        assert is_heldout(a, b) == (e in heldout)
    assert not {e.prompt for e in train} & {e.prompt for e in heldout}
    assert extract_answer(task, "So 12 * 3 = 36.") == "36"
    with pytest.raises(ValueError, match="no supervised target"):
        sft_target(task, train[0])


def test_one_digit_pool_is_complete():
    """digits = 1: every ordered pair of 0..9 is in exactly one split (78 training, 22 held out)."""
    train, heldout = make_splits("chat_addition", 78, 22, seed=0, digits=1)
    assert len({e.prompt for e in train + heldout}) == 100


def test_repeat_columns_keeps_groups_contiguous():
    assert repeat_columns({"answer": ["1", "2"], "id": ["a", "b"]}, 3) == {
        "answer": ["1", "1", "1", "2", "2", "2"],
        "id": ["a", "a", "a", "b", "b", "b"],
    }
