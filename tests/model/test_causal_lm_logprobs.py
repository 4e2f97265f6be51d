"""tether.model.causal_lm: the one left padding, shared by the trainer's tensors and the rollout engine."""

from __future__ import annotations

import torch

from tether.model.causal_lm import left_pad, positions, to_tokens
from tether.rollout import RolloutBatch


def test_left_pad_puts_every_prompt_against_column_p_and_counts_positions_from_its_first_token():
    ids, mask, pos = left_pad([[5, 6, 7], [8], []], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0], [0, 0, 0]]
    assert torch.equal(pos, positions(mask))


def test_to_tokens_lays_out_a_rollout_with_the_same_padding():
    completion = torch.tensor([[9, 2, 0], [9, 9, 2]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]]).bool()
    rollout = RolloutBatch(
        prompt_ids=[[5, 6, 7], [8]],
        completion_ids=completion,
        mask=mask,
        sampler_logprobs=torch.zeros(2, 3),
        prompt_index=[0, 1],
        completions=["", ""],
        finish_reasons=["stop", "stop"],
    )
    tok = to_tokens(rollout, pad_id=0, device=torch.device("cpu"))
    ids, pmask, _ = left_pad(rollout.prompt_ids, 0)
    assert tok.prompt_len == 3
    assert torch.equal(tok.input_ids, torch.cat([ids, completion], 1))
    assert torch.equal(tok.attention_mask, torch.cat([pmask, mask.long()], 1))
    # the completion's positions continue from the prompt's last real token
    assert tok.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert tok.loss_mask.dtype == torch.float32 and torch.equal(tok.loss_mask, mask.float())
