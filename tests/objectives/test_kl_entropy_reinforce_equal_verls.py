"""The KL-penalty estimators, the entropy bonus and plain REINFORCE equal verl 0.9.1's own (float64), called in the
test: `core_algos.kl_penalty` for k1 / k2 / k3 / abs / k3_clamped (verl's "kl", "mse", "low_var_kl" inside its
clamp, "abs", "low_var_kl" everywhere), `agg_loss` of the entropy, and
the "gpg" policy loss (-A lp, Group Policy Gradient, arXiv 2504.02546) for tether's `reinforce`.

verl clamps k3's log-ratio to [-20, 20] and its value to [-10, 10]; tether does not clamp k3 (docs/algorithms/rpg.md,
"The GRPO KL term"): the estimators agree wherever |k3| <= 10, and the test pins where they part.
"""

import pytest
import torch

verl = pytest.importorskip("verl")

from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402

from tether import objectives  # noqa: E402
from tether.core.kl import kl_penalty  # noqa: E402

D = torch.float64
VERL_NAMES = {
    "k1": ["kl", "k1"],
    "k2": ["mse", "k2"],
    "k3": ["low_var_kl", "k3"],
    "abs": ["abs"],
    "k3_clamped": ["low_var_kl", "k3"],
}


def _logprobs(seed=0, n=5, t=6, spread=2.0):
    g = torch.Generator().manual_seed(seed)
    ref = -torch.rand(n, t, generator=g, dtype=D) * 3 - 0.05
    lp = (ref + (torch.rand(n, t, generator=g, dtype=D) * 2 - 1) * spread).requires_grad_()
    return lp, ref


@pytest.mark.parametrize("ours", ["k1", "k2", "k3", "abs", "k3_clamped"])
def test_kl_estimators_equal_verls_kl_penalty(ours):
    lp, ref = _logprobs()  # |log r| <= 2: k3 <= e^2 - 3 = 4.39, inside verl's clamp
    mine = kl_penalty(ours, lp, ref, lp.detach())
    g_mine = torch.autograd.grad(mine.sum(), lp)[0]
    for name in VERL_NAMES[ours]:
        theirs = core_algos.kl_penalty(lp, ref, name)
        g_theirs = torch.autograd.grad(theirs.sum(), lp)[0]
        torch.testing.assert_close(mine, theirs, rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(g_mine, g_theirs, rtol=1e-13, atol=1e-15)


def test_k3_clamped_is_verls_low_var_kl_beyond_the_clamp_too():
    # log r = 3 and -12: k3 = 16.09 and 10.99 + e^-12 - 1 = 11.0000061, both clamped to 10 with no gradient; log r = 25
    # is first clamped to 20 (then k3 = e^20 - 21, clamped to 10).
    lp = torch.tensor([[-4.0, 11.0, -26.0, -1.5]], dtype=D, requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0, -1.0, -1.0]], dtype=D)
    mine, theirs = kl_penalty("k3_clamped", lp, ref, lp.detach()), core_algos.kl_penalty(lp, ref, "low_var_kl")
    torch.testing.assert_close(mine, theirs, rtol=1e-13, atol=0)
    assert mine[0, :3].tolist() == [10.0, 10.0, 10.0]
    g_mine, g_theirs = (torch.autograd.grad(x.sum(), lp)[0] for x in (mine, theirs))
    torch.testing.assert_close(g_mine, g_theirs, rtol=1e-13, atol=0)
    assert g_mine[0, :3].tolist() == [0.0, 0.0, 0.0] and g_mine[0, 3] != 0


def test_k3_departs_from_verl_only_where_verl_clamps_it():
    # log r = ref - lp = 3: k3 = e^3 - 1 - 3 = 16.0855 > 10, which verl clamps to 10 (and gives no gradient).
    lp = torch.tensor([[-4.0, -1.5]], dtype=D, requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0]], dtype=D)
    mine, theirs = kl_penalty("k3", lp, ref, lp.detach()), core_algos.kl_penalty(lp, ref, "low_var_kl")
    assert mine[0, 0].item() == pytest.approx(16.085536923187668, rel=1e-13) and theirs[0, 0].item() == 10.0
    torch.testing.assert_close(mine[0, 1], theirs[0, 1], rtol=1e-13, atol=0)  # log r = 0.5: no clamp


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_entropy_bonus_is_verls_aggregated_entropy_times_its_coefficient(agg):
    # verl's actor: loss = policy_loss - entropy_coeff * agg_loss(entropy, mask, loss_agg_mode).
    lp, old = _logprobs(seed=1, spread=0.3)
    mask = torch.ones(5, 6, dtype=D)
    mask[2, 3:] = 0
    entropy = (torch.rand(5, 6, generator=torch.Generator().manual_seed(2), dtype=D) * 3).requires_grad_()
    adv = torch.tensor([1.0, -0.5, 0.25, 0.0, -1.0], dtype=D)
    batch = objectives.TokenBatch(
        logprobs=lp, old_logprobs=old.detach(), advantages=adv, loss_mask=mask, entropy=entropy
    )
    plain = objectives.build({"name": "ppo_clip", "aggregation": agg})(batch).loss
    bonus = objectives.build({"name": "ppo_clip", "aggregation": agg, "entropy_coef": 0.01})(batch).loss
    verl_entropy = core_algos.agg_loss(entropy, mask, agg)
    # verl's seq-mean-token-mean divides each sequence by (count + 1e-8): a relative 1e-9 apart at these counts.
    tol = dict(rtol=1e-7, atol=1e-9) if agg == "seq-mean-token-mean" else dict(rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(bonus, plain - 0.01 * verl_entropy, **tol)
    g_ours = torch.autograd.grad(bonus, entropy)[0]
    g_verl = torch.autograd.grad(-0.01 * core_algos.agg_loss(entropy, mask, agg), entropy)[0]
    torch.testing.assert_close(g_ours, g_verl, **tol)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_reinforce_equals_verls_gpg_loss(agg):
    lp, old = _logprobs(seed=3, spread=0.5)
    mask = torch.ones(5, 6, dtype=D)
    mask[0, 2:] = 0
    mask[4, 5:] = 0
    adv = torch.tensor([1.0, -0.5, 0.25, 0.0, -1.0], dtype=D)
    ours = objectives.build({"name": "reinforce", "aggregation": agg})(
        objectives.TokenBatch(logprobs=lp, old_logprobs=old.detach(), advantages=adv, loss_mask=mask)
    ).loss
    config = FSDPActorConfig(strategy="fsdp", rollout_n=5, ppo_micro_batch_size_per_gpu=2, loss_agg_mode=agg)
    theirs, _ = core_algos.get_policy_loss_fn("gpg")(old, lp, adv[:, None].expand(5, 6), mask, agg, config)
    tol = dict(rtol=1e-7, atol=1e-9) if agg == "seq-mean-token-mean" else dict(rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(ours, theirs, **tol)
    torch.testing.assert_close(torch.autograd.grad(ours, lp)[0], torch.autograd.grad(theirs, lp)[0], **tol)
