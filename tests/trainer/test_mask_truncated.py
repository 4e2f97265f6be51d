"""`trainer.mask_truncated` (overlong filtering): a completion that ran out of its token budget leaves the loss,
its reward still in its group's baseline; off by default."""

from types import SimpleNamespace

import torch

from tether.model.causal_lm import Tokens
from tether.config.sections import TrainerConfig
from tether.trainer.step import truncated_out
from tether import objectives


def _tokens(mask):
    n, t = mask.shape
    ids = torch.zeros(n, t, dtype=torch.long)
    return Tokens(ids, torch.ones(n, t), torch.zeros(n, t, dtype=torch.long), ids, mask.float(), 0)


def test_truncated_completions_leave_the_loss_mask_and_are_counted():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    rollout = SimpleNamespace(truncated=torch.tensor([True, False, True, False]))  # finish reasons length, stop, ...
    out, n_cut = truncated_out(rollout, _tokens(mask))
    assert n_cut == 2.0
    assert out.loss_mask.tolist() == [[0, 0, 0], [1, 1, 0], [0, 0, 0], [1, 0, 0]]
    assert out.attention_mask.sum() == 12  # the model still reads every token: only the loss mask changes


def test_nothing_changes_without_a_truncated_completion():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    tokens = _tokens(mask)
    out, n_cut = truncated_out(SimpleNamespace(truncated=torch.tensor([False, False])), tokens)
    assert n_cut == 0.0 and out is tokens


def test_a_truncated_row_keeps_its_advantage_but_gives_no_gradient():
    # Group of 4, rewards 1, 0, 0, 1: GRPO advantages +-0.866 (std of [1, 0, 0, 1] is 0.5774). Row 3 (A = +0.866)
    # was truncated: its tokens leave the loss, rows 0-2 keep the advantages of the whole group.
    obj = objectives.build("dapo")
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long)
    adv = obj.advantages(rewards, groups)
    tokens, _ = truncated_out(
        SimpleNamespace(truncated=torch.tensor([False, False, False, True])),
        _tokens(torch.ones(4, 2, dtype=torch.long)),
    )
    lp = torch.full((4, 2), -1.0, requires_grad=True)
    out = obj(objectives.TokenBatch(logprobs=lp, old_logprobs=lp.detach(), advantages=adv, loss_mask=tokens.loss_mask))
    out.loss.backward()
    assert adv[3].item() > 0.8 and lp.grad[3].abs().sum() == 0
    # on-policy token-mean over the 6 kept tokens: d loss / d lp = -A / 6 per token
    torch.testing.assert_close(lp.grad[:3], (-adv[:3, None] / 6).expand(3, 2))


def test_off_by_default():
    assert TrainerConfig().mask_truncated is False
