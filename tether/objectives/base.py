"""What every objective shares: the keys of `ObjectiveConfig` (aggregation, KL-to-reference penalty,
entropy bonus, advantage estimator, rollout correction, off-policy mask) with the capabilities a
trainer asks of a config, the clip range `ClipRange` that most surrogates add, the validation
helpers, and the `OBJECTIVES` registry that pairs each config class with its loss function."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, NamedTuple, Optional

import torch

from ..core import advantages as _adv
from ..core import multi_reward as _mr
from ..core import aggregation as _agg
from ..core import correction as _corr
from ..core import divergences as _div
from ..core import kl as _kl
from ..core import surrogates as _sur
from ..core.etr import GroupStats
from ..core.kl import k3_of_log
from ..core.masked import masked_fraction, masked_mean
from ..core.registry import Registry, unknown_name_message
from ..schema import ConfigError, from_dict
from .batch import Extra, TokenBatch
from .distill import DistillConfig

# ---------------------------------------------------------------- validation


def check(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: got {value!r}, expected {expected}")


def check_name(registry: Registry, name: str, key: str) -> None:
    if name not in registry:
        raise ConfigError(f"{key}: {unknown_name_message(registry.kind, name, registry.names())}")


def check_at_least_zero(cfg: Any, *names: str) -> None:
    for n in names:
        check(getattr(cfg, n) >= 0, n, getattr(cfg, n), "a number >= 0")


def check_positive(cfg: Any, *names: str) -> None:
    for n in names:
        check(getattr(cfg, n) > 0, n, getattr(cfg, n), "a number > 0")


def check_dual(c: Optional[float]) -> None:
    check(c is None or c > 1, "dual_clip_c", c, "a number > 1, or null to disable the dual clip")


def check_measure(measure: Any, extra: tuple[str, ...] = ()) -> None:
    """A divergence measure: a registered name (or one of `extra`), or a callable D(w)."""
    if isinstance(measure, str):
        if measure not in extra and measure not in _div.MEASURES:
            valid = list(extra) + _div.MEASURES.names()
            raise ConfigError(f"measure: {unknown_name_message('divergence measure', measure, valid)}")
    elif not callable(measure):
        valid = ", ".join(list(extra) + _div.MEASURES.names())
        raise ConfigError(f"measure: got {measure!r}, expected one of {valid} or a callable D(w)")


# ---------------------------------------------------------------- the axes every objective has


class SupportSize(NamedTuple):
    """Each policy's set of most probable tokens per position, for an objective that reads a sparse support."""

    top_k: int  # at most this many tokens per policy (TROLL: 64)
    mass: float  # ... while the mass before a token is below this (TROLL: 1 - delta, delta = 1e-5)


@dataclass
class KLPenaltyConfig:
    estimator: str = "k3"
    """Per-token estimator: k1, k2, k3 (GRPO, uncorrected), k3_iw (importance-weighted, corrected), abs
    (|lp - lp_ref|, verl's and SkyRL's), k3_clamped (k3 clamped at 10, verl's low_var_kl)."""
    coef: float = 0.0
    """Penalty coefficient beta; 0 turns the penalty off (and no reference model is needed)."""

    def __post_init__(self):
        check_name(_kl.KL_ESTIMATORS, self.estimator, "kl_penalty.estimator")
        check(self.coef >= 0, "kl_penalty.coef", self.coef, "a number >= 0")


@dataclass
class RolloutCorrectionConfig:
    """Train-inference mismatch correction (tether.core.correction): weights from pi_old / pi_sampler."""

    level: Literal["token", "sequence", "sequence_geometric"] = "token"
    """token: r_t = pi_old / pi_sampler per token; sequence: the product of the sequence's token ratios
    (verl's and TRL's sequence level); sequence_geometric: their geometric mean."""
    mode: Literal["truncate", "mask"] = "truncate"
    """truncate (TIS): c = clamp(r, low, high); mask (MIS, IcePop): c = r inside [low, high], 0 outside;
    mask with `measure`: c = 1 if the divergence is <= delta, else 0 (rejection)."""
    low: float = 0.0
    """Lower bound of r (0: none for truncate); unused with `measure`."""
    high: float = 2.0
    """Upper bound of r; unused with `measure`."""
    measure: Optional[str] = None
    """A tether divergence measure (kl3, kl2, chi2, ...), mode mask only: reject a token whose D(r_t) > delta
    (token level), a sequence whose mean of D(r_t) over its tokens > delta (sequence level: verl's seq_mean_k3
    with kl3), or whose D(geometric-mean r) > delta (sequence_geometric). Kept tokens get weight 1. Or a binary
    measure of the two log-probs (binary_tv, binary_kl, binary_kl_max: AReaL's KPop, the larger of the two
    Bernoulli KLs), token or sequence level."""
    delta: Optional[float] = None
    """The divergence threshold with `measure` (kl3 with delta: verl's token_k3 / seq_mean_k3 rejection)."""

    def __post_init__(self):
        if self.measure is not None:
            if self.measure not in _div.MEASURES and self.measure not in _div.BINARY_MEASURES:
                valid = _div.MEASURES.names() + _div.BINARY_MEASURES.names()
                raise ConfigError(
                    f"rollout_correction.measure: {unknown_name_message('divergence measure', self.measure, valid)}"
                )
            check(
                self.measure not in _div.BINARY_MEASURES or self.level != "sequence_geometric",
                "rollout_correction.level",
                self.level,
                f"token or sequence with the binary measure "
                f"{self.measure!r} (it compares two log-probs; there is no ratio to average geometrically)",
            )
            check(
                self.delta is not None and self.delta > 0,
                "rollout_correction.delta",
                self.delta,
                "a number > 0 (with measure)",
            )
            check(
                self.mode == "mask",
                "rollout_correction.mode",
                self.mode,
                "'mask' with measure and delta (a divergence rejects tokens, it does not truncate r); "
                "for truncation give low and high instead of measure",
            )
        else:
            check(self.delta is None, "rollout_correction.delta", self.delta, "null without measure (or give measure)")
        check(
            0 <= self.low < 1 < self.high, "rollout_correction.low/high", (self.low, self.high), "0 <= low < 1 < high"
        )


def rollout_correction(rc: RolloutCorrectionConfig, old: torch.Tensor, sampler: torch.Tensor, m: torch.Tensor):
    """The rollout-correction weights (`tether.core.correction.Correction`) and their metrics (docs/metrics.md)."""
    c = _corr.rollout_correction(old, sampler, m, rc.level, rc.mode, rc.low, rc.high, rc.measure, rc.delta)
    log_r = c.log_ratio  # log pi_old - log pi_sampler
    metrics = {
        "rollout_correction/mismatch_k1": masked_mean(-log_r, m),  # KL(sampler || old), k1 from sampler samples
        "rollout_correction/mismatch_k3": masked_mean(k3_of_log(log_r), m),  # the same KL, k3 (>= 0)
        "rollout_correction/weight_mean": masked_mean(c.weights, m),
        "rollout_correction/truncated_frac": masked_fraction(c.truncated, m),
        "rollout_correction/masked_frac": masked_fraction(c.masked, m),
    }
    return c, metrics


@dataclass
class ObjectiveConfig:
    """Keys common to every objective."""

    aggregation: str = "token-mean"
    """Loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm."""
    kl_penalty: Optional[KLPenaltyConfig] = None
    """KL-to-reference penalty {estimator, coef}; None or coef 0 for none."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss gets -entropy_coef * mean entropy (needs `entropy` in the batch). Under tether's
    adaptive entropy control (`trainer.entropy_target`) the coefficient's starting value c_0, moved each step."""
    advantage: str = "grpo"
    """Advantage estimator the trainer uses with this objective: grpo, dr_grpo, rloo, reinforce_pp,
    reinforce_pp_no_baseline, grpo_batch_std, maxrl (`tether list`; docs/algorithms/advantages_aggregation.md)."""
    reward_aggregation: str = "sum"
    """How a weighted reward's parts become the reward the estimator reads: sum (sum_k w_k r_k) or
    normalize_then_sum (GDPO: each part normalised within its group, then weighted and summed)."""
    max_len: Optional[int] = None
    """T_max of seq-mean-token-sum-norm (the generation budget); None: the batch's padded width."""
    rollout_correction: Optional[RolloutCorrectionConfig] = None
    """Train-inference mismatch correction {level, mode, low, high | measure, delta}: each token's loss
    times SG(c), c from pi_old / pi_sampler truncated or masked, or a 0/1 rejection by a divergence; a masked
    token leaves the loss (needs TokenBatch.sampler_logprobs); null: none."""
    off_policy_mask: Optional[float] = None
    """Off-policy sequence mask delta (DeepSeek-V3.2; TRL's off_policy_mask_threshold): a sequence with A < 0 whose
    mean token log(pi_sampler / pi_theta) exceeds delta leaves the loss (pi_old when sampler_logprobs is None);
    null: off. TRL suggests 0.5."""
    sampler_kl_coef: float = 0.0
    """tau of the squared log-ratio to the sampler (Kimi K2.5; prime-rl's kl_tau, default 1e-3 there): the loss gets
    + tau * agg((log pi_theta - log pi_sampler)^2) over every counted token (needs TokenBatch.sampler_logprobs);
    0: off."""
    top_entropy_frac: Optional[float] = None
    """rho of "Beyond the 80/20 Rule" (arXiv 2506.01939; TRL's top_entropy_quantile): only the ceil(rho n)
    highest-entropy of the n counted tokens of the batch the loss sees keep their policy loss (the paper: 0.2);
    the others leave it as a rejected token does (the normaliser, KL penalty and entropy bonus still count them).
    Needs TokenBatch.entropy; logs policy/top_entropy_kept_frac. null: every token."""
    distill: Optional[DistillConfig] = None
    """On-policy distillation to the run's teacher (`teacher.name_or_path`) {signal, coef, task_coef, estimator,
    discount, clamp, topk, log_prob_min, tail}: the teacher's per-token divergence as an advantage (reverse_kl) or a
    loss term (kl_loss, forward_kl_topk), mixed with the task's advantage (docs/algorithms/distillation.md). null:
    none."""

    def __post_init__(self):
        check_name(_agg.AGGREGATIONS, self.aggregation, "aggregation")
        check(
            self.off_policy_mask is None or self.off_policy_mask >= 0,
            "off_policy_mask",
            self.off_policy_mask,
            "a number >= 0 (the mean log-ratio in nats per token), or null for no mask",
        )
        check_name(_adv.ADVANTAGES, self.advantage, "advantage")
        check_name(_mr.REWARD_AGGREGATIONS, self.reward_aggregation, "reward_aggregation")
        if isinstance(self.kl_penalty, dict):
            self.kl_penalty = from_dict(KLPenaltyConfig, self.kl_penalty, "kl_penalty")
        if isinstance(self.rollout_correction, dict):
            self.rollout_correction = from_dict(RolloutCorrectionConfig, self.rollout_correction, "rollout_correction")
        if isinstance(self.distill, dict):
            self.distill = from_dict(DistillConfig, self.distill, "distill")
        check(self.max_len is None or self.max_len > 0, "max_len", self.max_len, "a positive integer or null")
        check(
            self.sampler_kl_coef >= 0,
            "sampler_kl_coef",
            self.sampler_kl_coef,
            "a number >= 0 (prime-rl's kl_tau: 1e-3), or 0 for none",
        )
        check(
            self.top_entropy_frac is None or 0 < self.top_entropy_frac <= 1,
            "top_entropy_frac",
            self.top_entropy_frac,
            "a share in (0, 1] (the paper's 0.2), or null to train every token",
        )

    # ---- capabilities: what the trainers ask of a config instead of probing its keys

    def needs(self) -> dict[str, str]:
        """The TokenBatch fields the loss reads beyond logprobs, old_logprobs, advantages and loss_mask, each with
        why (`ref_logprobs`: a reference model; `sampler_logprobs`: the sampler's log-probs; `entropy`)."""
        need = {}
        if self.kl_penalty is not None and self.kl_penalty.coef > 0:
            need["ref_logprobs"] = "kl_penalty.coef > 0 compares against the reference policy"
        if self.entropy_coef != 0:
            need["entropy"] = "entropy_coef != 0 adds an entropy bonus"
        if self.top_entropy_frac is not None:
            need.setdefault("entropy", "top_entropy_frac keeps the policy loss of the highest-entropy tokens only")
        if self.rollout_correction is not None:
            need["sampler_logprobs"] = (
                "rollout_correction weighs each token by pi_old / pi_sampler; pass the sampler's log-probs (tether's "
                "engine: RolloutBatch.sampler_logprobs; TRL: vLLM's sampling_per_token_logps) or drop "
                "rollout_correction"
            )
        if self.sampler_kl_coef > 0:
            need.setdefault(
                "sampler_logprobs",
                (
                    "sampler_kl_coef > 0 penalises (log pi_theta - log pi_sampler)^2; pass the sampler's log-probs "
                    "(tether's engine: RolloutBatch.sampler_logprobs; TRL: vLLM's sampling_per_token_logps) or set "
                    "sampler_kl_coef=0"
                ),
            )
        if self.distill is not None:
            need.update(self.distill.needs())
        return need

    def sparse_support(self) -> Optional[SupportSize]:
        """THE test of whether the loss reads each position's distribution on a sparse support (TROLL) rather than
        the sampled token's log-prob alone: the size of each policy's set of most probable tokens, or None (every
        other loss). A trainer then keeps pi_old's set in its old log-prob pass and gives the loss pi_theta's
        log-probs on the union support (tether.model.support); one that cannot refuses the objective."""
        return None

    def vanishes_when_old_is_sampler(self) -> dict[str, str]:
        """The keys of this config whose constraint is identically inactive when pi_old IS pi_sampler (tether's
        trainer.old_logprobs=sampler, verl's bypass mode), each with why and the fix; a trainer with that
        anchoring refuses the config (docs/algorithms/rollout_correction.md, "Anchoring")."""
        if self.rollout_correction is None:
            return {}
        return {
            "rollout_correction": (
                "weighs each token by pi_old / pi_sampler, which is 1 when pi_old is pi_sampler: every weight is 1 and "
                "nothing is truncated or rejected (verl's bypass mode instead measures pi_theta / pi_rollout "
                "inside the "
                "loss, which tether does not do); set trainer.old_logprobs: recompute, or drop rollout_correction"
            )
        }

    def uses_reference(self) -> bool:
        """Whether a reference model's log-probs are needed (the trainer loads it only then)."""
        return "ref_logprobs" in self.needs()

    def uses_teacher(self) -> bool:
        """Whether a teacher model's log-probs are needed (`distill`: the trainer loads `teacher.name_or_path`)."""
        return "teacher_logprobs" in self.needs()

    def uses_teacher_topk(self) -> bool:
        """Whether the teacher's top-k log-probs at each position, and the student's on those tokens, are needed."""
        return "teacher_topk_logprobs" in self.needs()

    def reference_kl_coef(self) -> float:
        """The coefficient of the loss's KL to the reference policy (0: none); a trainer that switches its
        reference model on by a KL coefficient (TRL's beta) reads it."""
        return self.kl_penalty.coef if self.kl_penalty is not None else 0.0

    def folds_rollout_correction(self) -> bool:
        """Whether the loss takes the rollout-correction weights into its own weight (VESPO folds them into its
        sequence ratio) instead of having each token's loss multiplied by them and the masked tokens removed; the
        runtime then passes them as `TokenBatch.rollout_weights`."""
        return False

    @property
    def trains_entropy(self) -> bool:
        """THE test of whether the loss differentiates the entropy (an entropy bonus, `entropy_coef` != 0): the
        trainer keeps the entropy's gradient only then (`trainer.update`), and the objective reads it only then."""
        return self.entropy_coef != 0

    def has_trust_region(self) -> bool:
        """Whether the loss limits how far an update may move from the sampling policy (a clip, mask, truncation,
        soft gate or |log w| penalty); every such limit acts only on off-policy updates (w != 1)."""
        return True

    def needs_group_stats(self) -> bool:
        """Whether the loss reads statistics of each sample's group over the whole rollout batch
        (`group_stats`); the trainers compute them once per rollout batch and slice them per micro-batch."""
        return False

    def group_stats(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> Optional[GroupStats]:
        """Per-sequence group statistics over a whole rollout batch (rewards, group_ids (N,)); None if unused."""
        return None

    def group_stats_needed(self) -> tuple[str, ...]:
        """The fields of `group_stats` the loss reads (an adapter that can supply only some checks this)."""
        return ()

    def group_stats_options(self) -> dict[str, Any]:
        """Settings of `group_stats` beyond the rewards and groups (ETR's reward_range when set), which an
        adapter computing the statistics without this config (verl's estimators) cannot honour."""
        return {}


@dataclass
class ClipRange(ObjectiveConfig):
    """The clip range [1 - eps_low, 1 + eps_high] of the ratio w = pi_theta / pi_old that most surrogates
    take (each family says what it clips: the token ratio, a sequence ratio, the weight, log w)."""

    eps_low: float = 0.2
    """Lower clip: the ratio may fall to 1 - eps_low for negative advantages."""
    eps_high: float = 0.2
    """Upper clip: the ratio may rise to 1 + eps_high for positive advantages (DAPO: 0.28)."""

    def __post_init__(self):
        super().__post_init__()
        check_at_least_zero(self, "eps_low", "eps_high")


# ---------------------------------------------------------------- the registry

LossFn = Callable[[Any, TokenBatch, torch.Tensor, torch.Tensor], "tuple[_sur.TokenLoss, Extra]"]
"""(config, batch, logprobs, old_logprobs) -> (per-token loss, the objective's own metrics); the
log-probs are the batch's with the padding zeroed, `old_logprobs` detached."""


@dataclass(frozen=True)
class ObjectiveEntry:
    """A registered objective: its config class and its loss function."""

    config: type
    loss: LossFn


OBJECTIVES: Registry[ObjectiveEntry] = Registry("objective")


def objective(name: str, config: type):
    """Register `fn` as the loss of objective `name`, configured by `config`."""

    def decorator(fn: LossFn) -> LossFn:
        OBJECTIVES.register(name)(ObjectiveEntry(config, fn))
        return fn

    return decorator
