"""klgrad.trainer.draws: each step's prompts and sampling uniforms are functions of (seed, step) only, the same
however the step is split over processes; responses are padded to the step's width."""

from __future__ import annotations

import torch

from klgrad.rollout.batch import Rollout
from klgrad.trainer import draw_prompts, pad_responses, prompt_indices, prompt_seed, rollout_uniforms, step_generator


def test_uniforms_of_a_prompt_do_not_depend_on_the_split():
    whole = rollout_uniforms(0, 5, slice(0, 8), 4, 6)  # (32, 6)
    halves = torch.cat([rollout_uniforms(0, 5, slice(0, 4), 4, 6), rollout_uniforms(0, 5, slice(4, 8), 4, 6)])
    assert torch.equal(whole, halves)
    assert not torch.equal(whole, rollout_uniforms(0, 6, slice(0, 8), 4, 6))  # another step, other draws
    assert not torch.equal(whole[:4], whole[4:8])  # prompts draw independently


def test_prompts_are_a_function_of_seed_and_step():
    assert prompt_indices(3, 7, 200, 32) == draw_prompts(step_generator(3, 7), 200, 32)
    assert prompt_indices(3, 7, 200, 32) != prompt_indices(3, 8, 200, 32)
    assert all(0 <= i < 200 for i in prompt_indices(3, 7, 200, 32))
    assert prompt_seed(0, 5, 2) == prompt_seed(0, 5, 2) != prompt_seed(0, 5, 3)
    assert 0 <= prompt_seed(0, 5, 2) < 2**63


def test_padding_responses_to_the_step_width_adds_masked_pad_tokens_with_log_prob_zero():
    ids = torch.tensor([[5, 6], [7, 2]])
    rollout = Rollout(
        prompt_ids=torch.tensor([[1, 4], [1, 4]]),
        prompt_mask=torch.ones(2, 2, dtype=torch.bool),
        response_ids=ids,
        response_mask=torch.tensor([[True, True], [True, True]]),
        logp=torch.tensor([[-0.5, -0.25], [-1.0, -2.0]]),
        truncated=torch.tensor([True, False]),
    )
    wide = pad_responses(rollout, 4, pad_id=0)
    assert wide.response_ids.tolist() == [[5, 6, 0, 0], [7, 2, 0, 0]]
    assert wide.response_mask.tolist() == [[True, True, False, False]] * 2
    assert wide.logp.tolist() == [[-0.5, -0.25, 0.0, 0.0], [-1.0, -2.0, 0.0, 0.0]]
    assert pad_responses(rollout, 2, pad_id=0) is rollout
    assert wide.input_ids[:, 2:].tolist() == wide.response_ids.tolist()  # the prompt + response view follows
