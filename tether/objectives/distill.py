"""On-policy distillation, an axis every objective has (`objective.distill`): the per-token divergence to a frozen
teacher as an advantage (`reverse_kl`) or as a loss term (`kl_loss`, `forward_kl_topk`), mixed with the task's
advantage by `task_coef`. The math and its sources are `tether.core.distill`; the teacher itself is the run's
`teacher` section (`tether.trainer.teacher`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from ..core import distill as _distill
from ..core import kl as _kl
from ..core.masked import masked_mean
from ..core.registry import unknown_name_message
from ..schema import ConfigError
from .batch import TokenBatch, masked_fill

DEFAULT_ESTIMATOR = {"reverse_kl": "k1", "kl_loss": "k3"}
"""The KL estimator a signal uses when `estimator` is null: k1, the one-sample reverse KL (tinker-cookbook, slime,
prime-rl) for the advantage; k3 for the loss term (verl's default loss_mode, unclamped here: k3_clamped is verl's)."""


@dataclass
class DistillConfig:
    """On-policy distillation to the run's teacher (docs/algorithms/distillation.md)."""

    signal: str = "reverse_kl"
    """reverse_kl: A_t = task_coef A + coef G(-D(lp_old, lp_teacher)), an advantage any surrogate takes (Thinking
    Machines' on-policy distillation); kl_loss: + coef agg(D(lp, lp_teacher)) with gradient (verl's estimator
    losses); forward_kl_topk: + coef agg of the forward KL over the teacher's top-k tokens (verl's forward_kl_topk)."""
    coef: float = 1.0
    """Weight of the distillation signal (tinker-cookbook's kl_penalty_coef, slime's opd_kl_coef, verl's
    distillation_loss_coef)."""
    task_coef: float = 1.0
    """Weight of the task reward's advantage: 1 adds distillation to RL on the reward (slime, verl's
    use_task_rewards); 0 is pure distillation (tinker-cookbook, prime-rl's opd; the `opd` preset)."""
    estimator: Optional[str] = None
    """The per-token KL estimator D of reverse_kl and kl_loss (tether.core.kl: k1, k2, k3, k3_iw, abs, k3_clamped);
    null: k1 for reverse_kl, k3 for kl_loss. kl_loss refuses k1, whose gradient does not depend on the teacher."""
    discount: float = 0.0
    """gamma of reverse_kl's discounted sum to go, G(x)_t = sum_k gamma^k x_{t+k} (tinker-cookbook's
    kl_discount_factor); 0: each token's own divergence (their default), 1: the whole rest of the completion's."""
    clamp: Optional[float] = None
    """Clamp of the per-token divergence: to [-clamp, clamp] for reverse_kl and kl_loss, to [0, clamp] for
    forward_kl_topk (verl's loss_max_clamp, 10 there); null: none (tinker-cookbook)."""
    topk: int = 32
    """forward_kl_topk: the teacher's top-k tokens at each position (verl's topk, 128 there)."""
    log_prob_min: Optional[float] = None
    """forward_kl_topk: clamp every top-k log-prob below at this value (verl's log_prob_min_clamp, -10 there); null:
    none."""
    tail: bool = False
    """forward_kl_topk: add the mass outside the top-k as one more outcome of both distributions, making the value
    a proper KL over k + 1 outcomes (TRL's add_tail); false: verl's truncated sum, clamped at 0."""

    def __post_init__(self):
        if self.signal not in _distill.DISTILL_SIGNALS:
            names = _distill.DISTILL_SIGNALS.names()
            raise ConfigError(f"distill.signal: {unknown_name_message('distillation signal', self.signal, names)}")
        if self.estimator is None and self.signal in DEFAULT_ESTIMATOR:
            self.estimator = DEFAULT_ESTIMATOR[self.signal]
        self._check_values()

    def _check_values(self) -> None:
        bad = self._problem()
        if bad:
            raise ConfigError(f"distill.{bad}")

    def _problem(self) -> str:
        """What is wrong with these values, as `KEY: got ..., expected ...` (a fix included), or ""."""
        s = self.signal
        if not self.coef > 0 or not self.task_coef >= 0:
            return f"coef/task_coef: got {self.coef}, {self.task_coef}; expected coef > 0 and task_coef >= 0"
        if self.estimator is not None and (s == "forward_kl_topk" or self.estimator not in _kl.KL_ESTIMATORS):
            valid = "null with forward_kl_topk" if s == "forward_kl_topk" else ", ".join(_kl.KL_ESTIMATORS.names())
            return f"estimator: got {self.estimator!r}, expected {valid}"
        if s == "kl_loss" and self.estimator == "k1":
            return (
                "estimator: got 'k1' with signal kl_loss, whose gradient (the score function) does not depend on the "
                "teacher; use k3 (or k2, k3_clamped), or signal reverse_kl, which takes k1 as an advantage"
            )
        if not 0 <= self.discount <= 1 or (self.discount and s != "reverse_kl"):
            return f"discount: got {self.discount} with signal {s}; expected 0 <= discount <= 1, and 0 but reverse_kl"
        if self.clamp is not None and not self.clamp > 0:
            return f"clamp: got {self.clamp}, expected a number > 0 (verl's 10) or null"
        if s != "forward_kl_topk" and (self.tail or self.log_prob_min is not None):
            return f"tail/log_prob_min: set with signal {s}; they belong to forward_kl_topk, leave them at false/null"
        if self.topk < 1 or (self.tail and self.log_prob_min is not None):
            return (
                f"topk/tail/log_prob_min: got {self.topk}, {self.tail}, {self.log_prob_min}; expected topk >= 1, and "
                "log_prob_min null with tail (the tail bucket is a proper distribution; nothing to clamp)"
            )
        return ""

    @property
    def kind(self) -> str:
        """The signal's kind, "advantage" or "loss" (`tether.core.distill.Signal`)."""
        return _distill.DISTILL_SIGNALS.get(self.signal).kind

    @property
    def uses_topk(self) -> bool:
        """Whether the signal reads the teacher's top-k distribution and the student's log-probs on it."""
        return _distill.DISTILL_SIGNALS.get(self.signal).topk

    def needs(self) -> dict[str, str]:
        """The TokenBatch fields the signal reads, each with why."""
        need = {"teacher_logprobs": f"distill.signal={self.signal} compares with the teacher's log-probs"}
        if self.uses_topk:
            why = "forward_kl_topk reads the teacher's top-k log-probs and the student's on the same tokens"
            need.update(teacher_topk_logprobs=why, student_topk_logprobs=why)
        return need


def distilled(cfg: DistillConfig, batch: TokenBatch, old: torch.Tensor, metrics: dict) -> TokenBatch:
    """`batch` with its advantages mixed with the teacher's signal (reverse_kl: A_t = task_coef A + coef G(-c)), or
    only scaled by task_coef (the loss signals); logs `distill/advantage_mean` for reverse_kl. `old` (N, T): pi_old's
    log-probs, 0 at padding, detached (tether.core.distill, departure 1)."""
    if cfg.kind == "loss":
        return batch if cfg.task_coef == 1 else dataclasses.replace(batch, advantages=cfg.task_coef * batch.advantages)
    m = batch.loss_mask
    teacher = masked_fill(batch.teacher_logprobs, m).detach().to(old.dtype)
    cost = _kl.kl_penalty(cfg.estimator, old, teacher, old)
    part = _distill.reverse_kl_advantage(cost, m, cfg.coef, cfg.discount, cfg.clamp)
    metrics["distill/advantage_mean"] = masked_mean(part, m)
    return dataclasses.replace(batch, advantages=_distill.mixed_advantage(batch.advantages, part, cfg.task_coef))


def distill_terms(cfg: DistillConfig, batch: TokenBatch, lp: torch.Tensor, metrics: dict) -> Optional[torch.Tensor]:
    """The distillation loss per token (N, T) with gradient, 0 at padding (None for reverse_kl, an advantage); logs
    `distill/reverse_kl` and `distill/k3` (of the policy being updated) and, for forward_kl_topk, the top-k masses.
    `lp` (N, T): the batch's log-probs, 0 at padding."""
    m = batch.loss_mask
    teacher = masked_fill(batch.teacher_logprobs, m).detach().to(lp.dtype)
    log_r = teacher - lp.detach()
    metrics["distill/reverse_kl"] = masked_mean(-log_r, m)
    metrics["distill/k3"] = masked_mean(_kl.k3_of_log(log_r), m)
    if cfg.kind == "advantage":
        return None
    if cfg.signal == "kl_loss":
        per_token = _kl.kl_penalty(cfg.estimator, lp, teacher, masked_fill(batch.old_logprobs, m).detach())
        if cfg.clamp is not None:
            per_token = per_token.clamp(-cfg.clamp, cfg.clamp)
    else:
        keep = m.bool()[..., None]
        student = torch.where(keep, batch.student_topk_logprobs, torch.zeros_like(batch.student_topk_logprobs))
        teacher_k = torch.where(keep, batch.teacher_topk_logprobs, torch.zeros_like(batch.teacher_topk_logprobs))
        top = _distill.topk_forward_kl(student, teacher_k.to(student.dtype), cfg.log_prob_min, cfg.clamp, cfg.tail)
        per_token = top.loss
        metrics["distill/student_mass"] = masked_mean(top.student_mass, m)
        metrics["distill/teacher_mass"] = masked_mean(top.teacher_mass, m)
    return torch.where(m.bool(), per_token, torch.zeros_like(per_token))
