"""`top_entropy_frac` on every objective ("Beyond the 80/20 Rule", arXiv 2506.01939; TRL's top_entropy_quantile):
only the highest-entropy tokens of the batch the loss sees keep their policy loss; the normaliser, the KL penalty
and the entropy bonus still count every token. Hand-computed, then invariants over every preset."""

import dataclasses

import pytest
import torch
from conftest import with_support

from tether import objectives
from tether.core.entropy import top_entropy_mask
from tether.schema import ConfigError

D = torch.float64


def _hand_batch(**kw):
    # Five counted tokens; A = (1, -2). The padding (row 1, last) has the highest entropy and never counts.
    fields = dict(
        logprobs=torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, 0.0]], dtype=D, requires_grad=True),
        old_logprobs=torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, 0.0]], dtype=D),
        advantages=torch.tensor([1.0, -2.0], dtype=D),
        loss_mask=torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=D),
        entropy=torch.tensor([[0.1, 0.5, 0.3], [0.9, 0.2, 7.0]], dtype=D),
    )
    return objectives.TokenBatch(**{**fields, **kw})


def test_reinforce_on_the_two_highest_entropy_tokens_by_hand():
    # rho = 0.4: k = ceil(0.4 x 5) = 2 tokens, the entropies 0.9 (row 1, token 0) and 0.5 (row 0, token 1).
    # REINFORCE l_t = -A lp_t: l(0,1) = -1 x -2.0 = 2.0; l(1,0) = 2 x -1.5 = -3.0; the rest leave the loss.
    # token-mean over all 5 counted tokens (the normaliser is unchanged): (2.0 - 3.0) / 5 = -0.2.
    b = _hand_batch()
    out = objectives.build({"name": "reinforce", "top_entropy_frac": 0.4})(b)
    assert out.loss.item() == pytest.approx(-0.2, abs=1e-15)
    assert out.metrics["policy/top_entropy_kept_frac"].item() == pytest.approx(2 / 5, abs=1e-15)
    # d loss / d lp_t = -A_i / 5 on the kept tokens, 0 elsewhere.
    (grad,) = torch.autograd.grad(out.loss, b.logprobs)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.2, 0.0], [0.4, 0.0, 0.0]], dtype=D), rtol=0, atol=1e-15)
    # Every token: (-(1)(-1 - 2 - 0.5) + 2 (-1.5 - 0.2)) / 5 = (3.5 - 3.4) / 5 = 0.02.
    every = objectives.build("reinforce")(_hand_batch())
    assert every.loss.item() == pytest.approx(0.02, abs=1e-15)
    assert "policy/top_entropy_kept_frac" not in every.metrics


def test_the_entropy_bonus_and_the_kl_penalty_still_count_every_token():
    # loss/entropy = mean over the 5 counted tokens = (0.1 + 0.5 + 0.3 + 0.9 + 0.2) / 5 = 0.4 (the padding's 7.0 out).
    # loss/kl_penalty, k1 = lp - lp_ref with lp_ref = lp - 0.1: 0.1 on each of the 5 tokens, mean 0.1.
    b = _hand_batch()
    spec = {"name": "reinforce", "top_entropy_frac": 0.4, "entropy_coef": 0.01, "kl_penalty": {"estimator": "k1"}}
    spec["kl_penalty"]["coef"] = 0.5
    out = objectives.build(spec)(dataclasses.replace(b, ref_logprobs=b.old_logprobs - 0.1))
    assert out.metrics["loss/entropy"].item() == pytest.approx(0.4, abs=1e-15)
    assert out.metrics["loss/kl_penalty"].item() == pytest.approx(0.1, abs=1e-15)
    # total = -0.2 + 0.5 x 0.1 - 0.01 x 0.4 = -0.154
    assert out.loss.item() == pytest.approx(-0.154, abs=1e-15)


def test_the_mask_takes_no_gradient_through_the_entropy():
    ent = _hand_batch().entropy.clone().requires_grad_()
    out = objectives.build({"name": "reinforce", "top_entropy_frac": 0.4})(_hand_batch(entropy=ent))
    assert torch.autograd.grad(out.loss, ent, allow_unused=True)[0] is None


def test_the_selection_is_within_the_batch_the_loss_sees():
    # Row by row, each row keeps its own ceil(0.4 n) tokens: row 0 (n = 3) keeps 2, 0.5 and 0.3; row 1 (n = 2) keeps
    # 1, 0.9. On the whole batch only 0.5 and 0.9 train: a batch-selecting key, like Clip-Cov's (the micro-batch
    # split changes the loss; tests/objectives/test_objective_api_and_invariants.py, BATCH_SELECTING).
    obj = objectives.build({"name": "reinforce", "top_entropy_frac": 0.4})
    b = _hand_batch()
    kept = []
    for row in (0, 1):
        sub = objectives.TokenBatch(
            b.logprobs[row : row + 1],
            b.old_logprobs[row : row + 1],
            b.advantages[row : row + 1],
            b.loss_mask[row : row + 1],
        )
        out = obj(dataclasses.replace(sub, entropy=b.entropy[row : row + 1]))
        kept.append(out.metrics["policy/top_entropy_kept_frac"].item() * b.loss_mask[row].sum().item())
    assert kept == pytest.approx([2, 1], abs=1e-12)


def _random_batch(seed=0, N=8, T=6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, T, generator=g, dtype=D) - 0.1
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (N,), generator=g)[:, None]).to(D)
    return objectives.TokenBatch(
        logprobs=(old + 0.3 * torch.randn(N, T, generator=g, dtype=D)).requires_grad_(),
        old_logprobs=old,
        advantages=torch.randn(N, generator=g, dtype=D),
        loss_mask=mask,
        ref_logprobs=old - 0.2 * torch.rand(N, T, generator=g, dtype=D),
        group_ids=torch.arange(N) // 4,
        rewards=torch.randint(0, 2, (N,), generator=g).to(D),
        entropy=torch.rand(N, T, generator=g, dtype=D),
        sampler_logprobs=old,
        teacher_logprobs=old - 0.3 * torch.rand(N, T, generator=g, dtype=D),  # the opd preset's teacher
    )


@pytest.mark.parametrize("preset", objectives.preset_names())
def test_keeping_every_token_changes_nothing_and_a_share_trains_only_those_tokens(preset):
    b = _random_batch()
    results = []
    for frac in (None, 1.0, 0.3):
        torch.manual_seed(0)  # Clip-Cov's random choice
        obj = objectives.build({"preset": preset, "top_entropy_frac": frac})
        out = obj(with_support(obj, b))
        results.append((out.loss.detach(), torch.autograd.grad(out.loss, b.logprobs)[0], out.metrics))
    (loss, grad, metrics), (loss_1, grad_1, metrics_1), (_, grad_03, metrics_03) = results
    assert torch.equal(loss, loss_1) and torch.equal(grad, grad_1)
    assert {k: v for k, v in metrics_1.items() if k != "policy/top_entropy_kept_frac"}.keys() == metrics.keys()
    assert metrics_1["policy/top_entropy_kept_frac"].item() == 1.0
    # rho = 0.3 of the batch's counted tokens (ceil(0.3 n)): no gradient reaches the others through the policy loss
    # (a KL penalty, which some presets carry, still acts on every token).
    top = top_entropy_mask(b.entropy, b.loss_mask, 0.3)
    n = int(b.loss_mask.sum())
    assert metrics_03["policy/top_entropy_kept_frac"].item() == pytest.approx(top.sum().item() / n, abs=1e-15)
    if objectives.build(preset).config.reference_kl_coef() == 0:
        assert not grad_03[b.loss_mask.bool() & ~top].any()


def test_it_needs_the_entropy_and_a_share():
    obj = objectives.build({"preset": "dapo", "top_entropy_frac": 0.2})
    assert "entropy" in obj.config.needs() and not obj.config.trains_entropy
    with pytest.raises(ValueError, match="TokenBatch.entropy.*top_entropy_frac"):
        obj(_hand_batch(entropy=None))
    for bad in (0, 0.0, -0.1, 1.5):
        with pytest.raises(ConfigError, match=r"top_entropy_frac: got .*expected a share in \(0, 1\]"):
            objectives.build({"preset": "dapo", "top_entropy_frac": bad})
    assert objectives.ObjectiveConfig().top_entropy_frac is None  # off unless asked for
