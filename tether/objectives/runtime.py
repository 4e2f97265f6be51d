"""`Objective`: a built objective (a registered name and its validated config), the one runtime
every trainer uses. `terms(batch)` gives the per-token loss, KL penalty, entropy and metrics before
aggregation (the verl plugin aggregates them with verl's `agg_loss`); `__call__` aggregates them
with the config's aggregation mode (tether's trainer, the TRL adapter)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..core import aggregation as _agg
from ..core import advantages as _adv
from ..core import correction as _corr
from ..core import entropy as _ent
from ..core import multi_reward as _mr
from ..core.multi_reward import RewardParts
from ..core import kl as _kl
from ..core import surrogates as _sur
from ..core.etr import GroupStats
from ..core.kl import k3_of_log
from ..core.masked import masked_fraction, masked_mean
from .base import OBJECTIVES, ObjectiveConfig, rollout_correction
from . import distill as _distill
from .batch import Mean, MergeRule, ObjectiveOutput, TokenBatch, TokenTerms, masked_fill
from .metrics import POLICY_METRIC_EXTREMES, policy_metrics


class Objective:
    """A built objective (`objectives.build`): `obj(batch) -> ObjectiveOutput`. See the package docstring."""

    def __init__(self, name: str, config: ObjectiveConfig, label: Optional[str] = None):
        self.name = name
        self.config = config
        self.label = label or name  # the name it was chosen by (atr_grpo for divergence_clip), which reports show
        self._loss = OBJECTIVES.get(name).loss

    def __repr__(self) -> str:
        return f"Objective({self.name!r}, {self.config})"

    def uses_reference(self) -> bool:
        return self.config.uses_reference()

    def uses_teacher(self) -> bool:
        """Whether the objective distills to a teacher (its `distill`): a teacher's log-probs are needed."""
        return self.config.uses_teacher()

    def with_entropy_coef(self, coef: float) -> "Objective":
        """This objective with its entropy bonus coefficient set to `coef` (the trainer's adaptive entropy
        control, `trainer.entropy_target`, sets each step's); the same objective otherwise."""
        return Objective(self.name, dataclasses.replace(self.config, entropy_coef=coef), self.label)

    def has_trust_region(self) -> bool:
        """Whether the loss limits the update by the ratio to the old policy (all but plain REINFORCE and
        unclipped RPG; the config's capability); such a limit can act only on off-policy updates."""
        return self.config.has_trust_region()

    def normalizer(self, mask: torch.Tensor, empty_rows: _agg.EmptyRows = "skip") -> torch.Tensor:
        """The aggregation normaliser of a whole mini-batch; pass it as `TokenBatch.loss_norm`. `empty_rows`:
        whether a seq-mean mode counts rows with no counted token (tether.core.aggregation)."""
        return _agg.normalizer(self.config.aggregation, mask, self.config.max_len, empty_rows)

    def advantages(
        self,
        rewards: torch.Tensor,
        group_ids: torch.Tensor,
        lengths: Optional[torch.Tensor] = None,
        parts: Optional[RewardParts] = None,
    ) -> torch.Tensor:
        """Advantages (N,); `lengths` (N,), each sequence's counted tokens, weigh the batch statistics of
        the estimators that whiten over tokens (reinforce_pp and reinforce_pp_no_baseline, as verl does); the others
        ignore them.
        `parts` (scores (N, K), weights (K,)), the reward's weighted parts, replace `rewards` by the config's
        `reward_aggregation` of them; with `sum` (the default) `rewards`, their weighted sum, is used."""
        if self.needs_reward_parts():
            if parts is None:
                raise ValueError(
                    f"reward_aggregation {self.config.reward_aggregation!r} needs the reward's parts "
                    "(pass parts=RewardParts(scores (N, K), weights (K,)))"
                )
            rewards = _mr.aggregate_rewards(self.config.reward_aggregation, parts, group_ids).to(rewards.dtype)
        return _adv.compute_advantages(self.config.advantage, rewards, group_ids, lengths)

    def needs_reward_parts(self) -> bool:
        """Whether `advantages` reads the reward's parts rather than their weighted sum."""
        return self.config.reward_aggregation != "sum"

    def needs_group_stats(self) -> bool:
        return self.config.needs_group_stats()

    def group_stats(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> Optional[GroupStats]:
        """Statistics of each sample's group over a whole rollout batch, for `TokenBatch.group_stats`
        (select rows with `.select(idx)`); None when the objective reads none."""
        return self.config.group_stats(rewards, group_ids)

    def terms(self, batch: TokenBatch) -> TokenTerms:
        """The per-token terms on `batch`, before aggregation: the one implementation of each
        objective's masking, group statistics, KL penalty, entropy and metrics, which tether's
        trainer and the TRL adapter aggregate with `__call__` and the verl plugin with verl's own
        `agg_loss` (tether.integrations.verl)."""
        _validate(self.name, self.config, batch)
        cfg, m = self.config, batch.loss_mask
        if cfg.needs_group_stats() and batch.group_stats is None:  # this batch is the whole rollout batch
            batch = dataclasses.replace(batch, group_stats=cfg.group_stats(batch.rewards, batch.group_ids))
        lp = masked_fill(batch.logprobs, m)
        old = masked_fill(batch.old_logprobs, m).detach()
        n_tokens = m.detach().sum().to(torch.float64)
        metrics: dict[str, torch.Tensor] = {}
        if cfg.distill is not None:  # the teacher's advantage, mixed in before any mask or surrogate reads A
            batch = _distill.distilled(cfg.distill, batch, old, metrics)
        loss_mask, correction, dropped = _loss_mask(cfg, batch, lp, old, metrics)
        n_kept = (
            n_tokens if loss_mask is m else loss_mask.detach().sum().to(torch.float64)
        )  # the tokens left in the loss
        loss_batch = batch if loss_mask is m else dataclasses.replace(batch, loss_mask=loss_mask)
        folded = correction is not None and cfg.folds_rollout_correction()
        if folded:  # the objective takes the weights into its own weight (VESPO), nothing multiplies its loss
            loss_batch = dataclasses.replace(loss_batch, rollout_weights=correction.weights.detach())
        tokens, extra = self._loss(cfg, loss_batch, lp, old)
        if correction is not None and not folded:
            tokens = tokens._replace(loss=tokens.loss * correction.weights.to(tokens.loss.dtype))
        for out in dropped:  # the off-policy and low-entropy tokens: their loss is 0, whatever the objective's
            tokens = tokens._replace(loss=torch.where(out, torch.zeros_like(tokens.loss), tokens.loss))
        penalty = _reference_terms(cfg, batch, lp, old, metrics)
        entropy = None
        if batch.entropy is not None:
            entropy = masked_fill(batch.entropy, m)
            metrics["policy/entropy"] = masked_mean(entropy.detach(), m)
        sampler_kl = _sampler_terms(cfg, batch, lp) if cfg.sampler_kl_coef > 0 else None
        distill = _distill.distill_terms(cfg.distill, batch, lp, metrics) if cfg.distill is not None else None
        merge: dict[str, MergeRule] = {k: n_tokens for k in metrics}
        # The policy metrics describe the tokens in the loss (all counted ones unless a correction masks some).
        policy = policy_metrics(tokens, log_w=_sur.log_ratio(lp, old).detach(), mask=loss_mask)
        metrics.update(policy)
        merge.update({k: n_kept for k in policy})
        merge.update(POLICY_METRIC_EXTREMES)
        for k, v in extra.items():
            metrics[k], merge[k] = (v.value.detach(), v.count.detach()) if isinstance(v, Mean) else (v.detach(), n_kept)
        return TokenTerms(tokens, penalty, entropy if cfg.trains_entropy else None, metrics, merge, sampler_kl, distill)

    def __call__(self, batch: TokenBatch) -> ObjectiveOutput:
        """The loss on `batch`: its terms aggregated by `config.aggregation` (with `loss_norm`, as one
        micro-batch's share of the mini-batch loss), plus the `loss/*` metrics."""
        cfg, t = self.config, self.terms(batch)

        def reduce(x: torch.Tensor) -> torch.Tensor:
            return _agg.aggregate(x, batch.loss_mask, cfg.aggregation, batch.loss_norm, cfg.max_len)

        total = policy = reduce(t.tokens.loss)
        losses = {"loss/policy": policy}
        if t.kl_penalty is not None:
            losses["loss/kl_penalty"] = pen = reduce(t.kl_penalty)
            total = total + cfg.kl_penalty.coef * pen
        if t.entropy is not None:
            losses["loss/entropy"] = ent = reduce(t.entropy)
            total = total - cfg.entropy_coef * ent
        if t.sampler_kl is not None:
            losses["loss/sampler_kl"] = skl = reduce(t.sampler_kl)
            total = total + cfg.sampler_kl_coef * skl
        if t.distill is not None:
            losses["loss/distill"] = dis = reduce(t.distill)
            total = total + cfg.distill.coef * dis
        losses["loss/total"] = total
        metrics = {**{k: v.detach() for k, v in losses.items()}, **t.metrics}
        return ObjectiveOutput(total, metrics, {**{k: "share" for k in losses}, **t.merge})


def _loss_mask(cfg: ObjectiveConfig, batch: TokenBatch, lp: torch.Tensor, old: torch.Tensor, metrics: dict):
    """(loss_mask, correction, dropped): the tokens left in the loss after the rollout correction's mask, the off-policy
    sequence mask and the high-entropy selection (`batch.loss_mask` itself when none masks), the correction, and the
    (N, T) masks of the tokens the latter two took out; adds their metrics."""
    m = batch.loss_mask
    loss_mask, correction, dropped = m, None, []
    if cfg.rollout_correction is not None:
        correction, correction_metrics = rollout_correction(cfg.rollout_correction, old, batch.sampler_logprobs, m)
        metrics.update(correction_metrics)
        # A masked token leaves the loss: the objective sees it as padding, so it enters no sequence
        # statistic (GMPO's geometric mean, GSPO's sequence ratio) and its loss is 0 (c = 0). An objective
        # that folds the weights into its own (VESPO) keeps the token: its c = 0 is part of that weight.
        if not cfg.folds_rollout_correction():
            loss_mask = torch.where(correction.masked, torch.zeros_like(m), m)
    if cfg.off_policy_mask is not None:  # DeepSeek-V3.2's sequence mask: its tokens leave the loss, like masked ones
        behaviour = old if batch.sampler_logprobs is None else masked_fill(batch.sampler_logprobs, m).detach()
        off_policy = _corr.off_policy_sequence_mask(lp, behaviour, batch.advantages, m, cfg.off_policy_mask)
        metrics["policy/off_policy_masked_frac"] = masked_fraction(off_policy, m)
        loss_mask = torch.where(off_policy, torch.zeros_like(m), loss_mask)
        dropped.append(off_policy)
    if cfg.top_entropy_frac is not None:  # Beyond the 80/20 Rule: among all counted tokens, whatever else masks
        top = _ent.top_entropy_mask(batch.entropy.detach(), m, cfg.top_entropy_frac)
        metrics["policy/top_entropy_kept_frac"] = masked_fraction(top, m)
        loss_mask = torch.where(top, loss_mask, torch.zeros_like(m))
        dropped.append(m.bool() & ~top)
    return loss_mask, correction, dropped


def _sampler_terms(cfg: ObjectiveConfig, batch: TokenBatch, lp: torch.Tensor) -> torch.Tensor:
    """The squared log-ratio to the sampler per token (N, T), 0 at padding; a token whose sampler log-prob is
    missing (NaN, as vLLM may return) gets no penalty instead of a NaN loss."""
    sampler = masked_fill(batch.sampler_logprobs, batch.loss_mask).detach().to(lp.dtype)
    sampler = torch.where(torch.isfinite(sampler), sampler, lp.detach())  # difference 0, gradient 0 (not NaN)
    return torch.where(batch.loss_mask.bool(), _kl.squared_log_ratio(lp, sampler), torch.zeros_like(lp))


def _reference_terms(
    cfg: ObjectiveConfig, batch: TokenBatch, lp: torch.Tensor, old: torch.Tensor, metrics: dict
) -> Optional[torch.Tensor]:
    """The KL penalty per token (None when off); logs `kl/ref` whenever the reference log-probs are given."""
    if batch.ref_logprobs is None:
        return None
    m = batch.loss_mask
    ref = masked_fill(batch.ref_logprobs, m).detach()
    metrics["kl/ref"] = masked_mean(k3_of_log(ref - lp.detach()), m)
    if cfg.kl_penalty is not None and cfg.kl_penalty.coef > 0:
        return _kl.kl_penalty(cfg.kl_penalty.estimator, lp, ref, old)
    return None


def _validate(name: str, cfg: ObjectiveConfig, batch: TokenBatch) -> None:
    """Every field the objective reads is there, and every tensor has the shape of `logprobs`."""
    if cfg.needs_group_stats() and batch.group_stats is None:
        _validate_group_stats_source(name, batch)
    for field, why in cfg.needs().items():
        if getattr(batch, field) is None:
            raise ValueError(
                f"objective {name!r} needs TokenBatch.{field}, which is None ({why}); pass it or change the config"
            )
    if batch.rollout_weights is not None and not cfg.folds_rollout_correction():
        raise ValueError(
            f"objective {name!r} does not fold rollout-correction weights into its own weight; multiply "
            "them into its per-token loss (Objective.terms(...).tokens.loss) instead of passing "
            "TokenBatch.rollout_weights"
        )
    if batch.rollout_weights is not None and cfg.rollout_correction is not None:
        raise ValueError(
            f"objective {name!r} got TokenBatch.rollout_weights and computes its own from rollout_correction: drop one"
        )
    shape = batch.logprobs.shape
    if batch.logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (N, T); got shape {tuple(shape)}")
    for field in ("old_logprobs", "loss_mask", "ref_logprobs", "entropy", "sampler_logprobs", "rollout_weights"):
        t = getattr(batch, field)
        if t is not None and t.shape != shape:
            raise ValueError(f"{field} has shape {tuple(t.shape)}, expected {tuple(shape)} like logprobs")
    _validate_support(batch)
    _validate_teacher(batch, shape)
    adv = batch.advantages
    if adv.shape not in (shape, shape[:1]):
        raise ValueError(f"advantages must be (N,) or (N, T) = {tuple(shape)}; got {tuple(adv.shape)}")
    for field in ("rewards", "group_ids"):
        t = getattr(batch, field)
        if t is not None and t.shape != shape[:1]:
            raise ValueError(f"{field} must be (N,) = ({shape[0]},); got {tuple(t.shape)}")


def _validate_support(batch: TokenBatch) -> None:
    """The sparse support's fields, where given, are (N, T, S) of one S, and its token index (N, T)."""
    shape, width = tuple(batch.logprobs.shape), None
    for field in ("support_logprobs", "old_support_logprobs", "support_mask"):
        t = getattr(batch, field)
        if t is None:
            continue
        if t.dim() != 3 or tuple(t.shape[:2]) != shape or width not in (None, t.shape[2]):
            raise ValueError(f"{field} has shape {tuple(t.shape)}, expected (N, T, S) = {shape + (width or 'S',)}")
        width = t.shape[2]
    index = batch.support_token_index
    if index is not None and tuple(index.shape) != shape:
        raise ValueError(f"support_token_index has shape {tuple(index.shape)}, expected {shape} like logprobs")


def _validate_teacher(batch: TokenBatch, shape: torch.Size) -> None:
    """The teacher's tensors have the batch's shape: (N, T), and (N, T, K) with one K for the top-k pair."""
    if batch.teacher_logprobs is not None and batch.teacher_logprobs.shape != shape:
        raise ValueError(f"teacher_logprobs has shape {tuple(batch.teacher_logprobs.shape)}, expected {tuple(shape)}")
    pair = [t for t in (batch.teacher_topk_logprobs, batch.student_topk_logprobs) if t is not None]
    if any(t.dim() != 3 or t.shape[:2] != shape or t.shape != pair[0].shape for t in pair):
        got = [tuple(t.shape) for t in pair]
        raise ValueError(
            f"teacher_topk_logprobs and student_topk_logprobs must both be (N, T, K) = {tuple(shape)} + (K,); got {got}"
        )


def _validate_group_stats_source(name: str, batch: TokenBatch) -> None:
    """A batch without `group_stats` is the whole rollout batch, with its rewards and group ids."""
    if batch.loss_norm is not None:  # a micro-batch: its own rewards would give per-micro-batch statistics
        raise ValueError(
            f"objective {name!r} reads group statistics over the whole rollout batch, but this batch has "
            "loss_norm set (it is one micro-batch of several) and no group_stats: computing them from its own "
            "rewards and group_ids would make them depend on the micro-batch split. Compute "
            "stats = obj.group_stats(rewards, group_ids) once over the whole rollout batch and pass each "
            "micro-batch its rows, TokenBatch(group_stats=stats.select(idx))"
        )
    for field in ("rewards", "group_ids"):
        if getattr(batch, field) is None:
            raise ValueError(
                f"objective {name!r} needs TokenBatch.group_stats (Objective.group_stats over the whole "
                f"rollout batch) or, for a batch that is the whole rollout batch, TokenBatch.{field}, which is "
                f"None ({_WHY_NEEDED[field]}); pass it or change the config"
            )


_WHY_NEEDED = {  # the sources of group statistics computed in the loss (a batch that is the whole rollout batch)
    "rewards": "ETR's macro factor uses each group's reward variance; or set macro='off'",
    "group_ids": "ETR's macro factor needs to know which samples share a prompt; or set macro='off'",
}
