"""On-policy distillation: the student samples, a frozen teacher scores the student's tokens, and the per-token
divergence to the teacher is the learning signal. With s_t = log pi_student(y_t), q_t = log pi_teacher(y_t) of
the sampled token y_t, and m the loss mask (the student's own tokens):

    reverse_kl       an advantage: c_t = D(s_t, q_t) (k1: s_t - q_t, the one-sample reverse KL), and
                         A_t = task_coef A + coef G_gamma(-c m)_t,     G_gamma(x)_t = sum_{k >= 0} gamma^k x_{t+k}
                     (gamma = 0: per token), detached, fed to any surrogate (clip, staleness, rollout correction)
                     [Thinking Machines, "On-Policy Distillation" (2025); Agarwal et al., GKD, arXiv 2306.13649]
    kl_loss          a loss term with gradient: + coef agg(D(s_t, q_t)), D a KL estimator of `tether.core.kl`
                     (verl's k3: the clamped k3 of `k3_clamped`); on samples of pi_student the gradient of k3 is
                     that of the FORWARD KL(teacher || student) (tether.core.kl)
    forward_kl_topk  a loss term with gradient over the teacher's top-k tokens S_t at each position:
                         l_t = sum_{v in S_t} p_T(v) (log p_T(v) - log p_S(v)),   clamped to [0, clamp]
                     (verl's `forward_kl_topk`); with `tail`, one more bucket holds the mass outside S_t for both
                     (TRL's `add_tail`), so l_t is a proper KL over K + 1 outcomes, 0 exactly when they agree on it

Sources: Thinking Machines' tinker-cookbook `distillation/train_on_policy.py` (the advantage -coef (s - q), its
discounted future sum); slime `--use-opd` (`apply_opd_kl_to_advantages`: A_t - opd_kl_coef (s - q) on top of any
estimator); prime-rl's `opd` algorithm (`ref_kl_loss_fn`); verl's `trainer/distillation` (estimator losses with or
without a policy gradient, `forward_kl_topk`, `use_task_rewards`); TRL's `DistillationTrainer`, GKD and IW-OPD.

Where this departs from them, and why:
1. The student's log-prob in the advantage is pi_old's, the policy that sampled (tinker-cookbook: the sampler's;
   slime: the recomputed old policy's), fixed for the batch like any advantage. verl's and prime-rl's advantage
   reads the live policy's log-prob (detached) at each update: the same value at the first update of an
   on-policy batch, moving with the policy over several updates, which a clipped surrogate's fixed advantage
   does not.
2. The mix is one coefficient on the task advantage (task_coef; 0: pure distillation, as tinker-cookbook and
   prime-rl). verl scales its distillation loss instead (distillation_loss_coef with use_task_rewards); for a
   surrogate positively homogeneous in A (all of tether's) the two differ only by the overall scale.
3. The discount runs over positions, as tinker-cookbook's `discounted_future_sum_vectorized`: an environment's
   tokens inside a multi-turn completion (mask 0) add nothing but are counted in gamma's exponent.
4. forward_kl_topk's optional `tail` bucket computes log(1 - sum_S p) with the log-sum capped at -1e-7, as TRL's
   `_add_tail_bucket` (a top-k set holding all the mass would otherwise give log 0).

Shapes: N rows, T completion tokens, K top-k entries. Plain functions on tensors; nothing syncs with the host.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .registry import Registry

TAIL_LOG_SUM_MAX = -1e-7
"""The cap of log(sum_S p) before the tail bucket's log(1 - sum_S p) (departure 4; TRL's value)."""


class Signal(NamedTuple):
    """A distillation signal: how the teacher's scores enter the objective."""

    kind: str  # "advantage": added to the advantage before the surrogate; "loss": a term added to the loss
    topk: bool  # whether it reads the teacher's top-k distribution at each position (not only the sampled token)
    summary: str  # one line, for `tether list`


DISTILL_SIGNALS: Registry[Signal] = Registry("distillation signal")
DISTILL_SIGNALS.register("reverse_kl")(
    Signal("advantage", False, "A_t += -coef D(lp_old, lp_teacher), optionally discounted to go")
)
DISTILL_SIGNALS.register("kl_loss")(Signal("loss", False, "+ coef agg(D(lp, lp_teacher)), with gradient"))
DISTILL_SIGNALS.register("forward_kl_topk")(
    Signal("loss", True, "+ coef agg(sum_{teacher's top-k} p_T (log p_T - log p_S)), with gradient")
)


def discounted_to_go(x: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_gamma(x)_t = sum_{k >= 0} gamma^k x_{t+k} along the last dimension (N, T) -> (N, T); gamma = 0: x."""
    if gamma == 0:
        return x
    out, running = torch.empty_like(x), torch.zeros_like(x[..., 0])
    for t in range(x.shape[-1] - 1, -1, -1):
        running = x[..., t] + gamma * running
        out[..., t] = running
    return out


def reverse_kl_advantage(
    cost: torch.Tensor, mask: torch.Tensor, coef: float, discount: float = 0.0, clamp: Optional[float] = None
) -> torch.Tensor:
    """The distillation part of the advantage (N, T), detached, 0 at mask 0: coef G_gamma(-c m), with the per-token
    cost c (N, T) (the estimator's D(lp_old, lp_teacher); k1: lp_old - lp_teacher) clamped to [-clamp, clamp]
    first when `clamp` is given (verl's loss_max_clamp)."""
    c = cost.detach()
    if clamp is not None:
        c = c.clamp(-clamp, clamp)
    m = mask.to(c.dtype)
    return discounted_to_go(-coef * c * m, discount) * m


def mixed_advantage(task: torch.Tensor, distill: torch.Tensor, task_coef: float) -> torch.Tensor:
    """A_t = task_coef A + distill_t (N, T): the task advantage (N,) or (N, T), detached, mixed in (departure 2)."""
    a = task.detach().to(distill.dtype)
    return task_coef * (a[:, None] if a.dim() == 1 else a) + distill


class TopK(NamedTuple):
    """The per-token top-k forward KL (N, T) with gradient, and the mass each policy puts on the top-k set."""

    loss: torch.Tensor
    student_mass: torch.Tensor  # (N, T) sum_S p_S, detached
    teacher_mass: torch.Tensor  # (N, T) sum_S p_T


def with_tail(topk_logprobs: torch.Tensor) -> torch.Tensor:
    """(..., K) log-probs of a top-k set -> (..., K + 1): the last is log(1 - sum_S p), the mass outside the set
    (departure 4)."""
    log_sum = torch.logsumexp(topk_logprobs, -1, keepdim=True).clamp(max=TAIL_LOG_SUM_MAX)
    return torch.cat([topk_logprobs, torch.log(-torch.expm1(log_sum))], -1)


def topk_forward_kl(
    student: torch.Tensor,
    teacher: torch.Tensor,
    log_prob_min: Optional[float] = None,
    clamp: Optional[float] = None,
    tail: bool = False,
) -> TopK:
    """sum_{v in S} p_T(v) (log p_T(v) - log p_S(v)) per position, S the teacher's top-k: student, teacher (N, T, K)
    the log-probs (full softmax) of the same K tokens, the student's with gradient. Without `tail`, each log-prob
    is first clamped below at `log_prob_min` (verl's log_prob_min_clamp) and the value clamped to [0, clamp] (verl:
    the truncated sums can make it negative; clamp None: no upper bound); with `tail`, the (K + 1)-outcome KL."""
    t = teacher.detach()
    masses = (student.detach().exp().sum(-1), t.exp().sum(-1))
    if tail:
        s, t = with_tail(student), with_tail(t)
    elif log_prob_min is not None:
        s, t = student.clamp(min=log_prob_min), t.clamp(min=log_prob_min)
    else:
        s = student
    kl = (t.exp() * (t - s)).sum(-1)
    if not tail:
        kl = kl.clamp(min=0.0)
    if clamp is not None:
        kl = kl.clamp(max=clamp)
    return TopK(kl, *masses)
