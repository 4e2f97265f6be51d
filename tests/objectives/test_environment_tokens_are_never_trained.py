"""Tokens an environment wrote are context, never trained: in a multi-turn episode the completion interleaves the
model's turns and the environment's (tether.envs), and the loss mask holds only the model's. For every consumer of
that mask (each objective's loss, the sequence-level ratios of GSPO, GMPO, LUSPO and VESPO included, the KL
penalty, the entropy bonus, rollout-correction weights and rejection, the off-policy sequence mask, M2PO's
selection, sampler-KL, distillation's advantage and loss term, and every metric), an environment token's log-prob
receives exactly zero gradient, and giving it any other value (log-probs, old, reference, sampler and teacher
log-probs, entropy) changes no loss and no metric.

The environment tokens sit inside the sequences (model turn, environment turn, model turn), not only at their
ends, since a consumer that summed a sequence up to its last counted token, or counted a sequence's length from
its first padding token, would take them in. (The trainer's own consumers, the length of each sequence for the
advantages, `trainer.mask_truncated` and the length metrics, are tested in tests/trainer/test_multi_turn.py.)
"""

from __future__ import annotations

import pytest
import torch
from conftest import with_support

from tether import objectives

N, T = 4, 12
ENV = torch.zeros(N, T, dtype=torch.bool)
ENV[:, 3:6] = True  # an environment's turn between the model's first turn and its second
ENV[1, 8:10] = True  # a second one in row 1
REAL = torch.ones(N, T, dtype=torch.bool)
REAL[2, 10:] = False  # row 2 ends early: padding after it
MASK = (REAL & ~ENV).double()  # the loss mask: the model's real tokens only

SETTINGS = {
    "kl penalty (k3)": {"preset": "grpo", "kl_penalty": {"estimator": "k3", "coef": 0.1}},
    "kl penalty (k3_iw)": {"preset": "dapo", "kl_penalty": {"estimator": "k3_iw", "coef": 0.1}},
    "entropy bonus": {"preset": "dapo", "entropy_coef": 0.01},
    "rollout correction, truncate": {"preset": "dapo", "rollout_correction": {"mode": "truncate", "high": 2.0}},
    "rollout correction, sequence mask": {
        "preset": "dapo",
        "rollout_correction": {"level": "sequence", "mode": "mask", "low": 0.5, "high": 2.0},
    },
    "rollout correction, k3 rejection": {
        "preset": "dapo",
        "rollout_correction": {"mode": "mask", "measure": "kl3", "delta": 0.5},
    },
    "off-policy sequence mask": {"preset": "dapo", "off_policy_mask": 0.1},
    "sampler kl": {"preset": "dapo", "sampler_kl_coef": 0.1},
    "distillation, discounted reverse-kl advantage": {"preset": "dapo", "distill": {"discount": 0.9}},
    "distillation, k3 loss term": {"preset": "dapo", "distill": {"signal": "kl_loss", "estimator": "k3"}},
}
CASES = {**{name: {"preset": name} for name in objectives.preset_names() if name != "gdpo"}, **SETTINGS}


def _batch(seed: int, env_noise: float) -> dict[str, torch.Tensor]:
    """The tensors of a batch; the environment's tokens get values shifted by `env_noise` (0: none)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, T, generator=g, dtype=torch.float64) - 0.1
    lp = old + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64)
    ref = old - 0.2 * torch.rand(N, T, generator=g, dtype=torch.float64)
    sampler = old + 0.2 * torch.randn(N, T, generator=g, dtype=torch.float64)
    entropy = torch.rand(N, T, generator=g, dtype=torch.float64) + 0.5
    teacher = old - 0.3 * torch.rand(N, T, generator=g, dtype=torch.float64)
    out = {"logprobs": lp, "old_logprobs": old, "ref_logprobs": ref, "sampler_logprobs": sampler, "entropy": entropy}
    out["teacher_logprobs"] = teacher  # the distillation teacher's (the opd preset, the distill settings)
    if env_noise:
        h = torch.Generator().manual_seed(1000 + seed)
        out = {
            k: torch.where(ENV, v + env_noise * torch.randn(N, T, generator=h, dtype=torch.float64), v)
            for k, v in out.items()
        }
    return out


def _run(spec: dict, seed: int, env_noise: float):
    obj = objectives.build(spec)
    t = _batch(seed, env_noise)
    lp = t["logprobs"].clone().requires_grad_()
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1])
    lengths = MASK.sum(1)
    adv = obj.advantages(rewards, groups, lengths)
    batch = objectives.TokenBatch(
        logprobs=lp,
        old_logprobs=t["old_logprobs"],
        advantages=adv,
        loss_mask=MASK,
        ref_logprobs=t["ref_logprobs"],
        group_ids=groups,
        rewards=rewards,
        entropy=t["entropy"],
        sampler_logprobs=t["sampler_logprobs"],
        teacher_logprobs=t["teacher_logprobs"],
    )
    out = obj(with_support(obj, batch))  # TROLL's supports: derived from the log-probs, environment tokens too
    out.loss.backward()
    metrics = {k: float(v) for k, v in out.metrics.items()}
    return float(out.loss.detach()), lp.grad, metrics


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_environment_token_gets_no_gradient_and_changes_no_loss_or_metric(case):
    spec = CASES[case]
    for seed in (0, 1):
        loss, grad, metrics = _run(spec, seed, 0.0)
        assert torch.equal(grad[ENV], torch.zeros_like(grad[ENV])), (case, grad[ENV])
        assert grad[~ENV & REAL].abs().sum() > 0 or loss == 0.0, case  # the model's tokens do train
        loss2, grad2, metrics2 = _run(spec, seed, 3.0)  # the environment's values moved far: nothing else may move
        assert loss2 == pytest.approx(loss, rel=1e-12, abs=1e-15), case
        torch.testing.assert_close(grad2, grad, rtol=1e-12, atol=1e-15)
        assert metrics2.keys() == metrics.keys()
        for k in metrics:
            assert metrics2[k] == pytest.approx(metrics[k], rel=1e-12, abs=1e-15, nan_ok=True), (case, k)
