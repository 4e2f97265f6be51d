"""Policy objectives: one config class per surrogate, composed with the orthogonal axes.

An objective = surrogate (ppo_clip, divergence_clip, gspo, cispo, reinforce, rpg, etr, dppo, sapo,
gmpo, clip_cov, kl_cov, m2po)
+ aggregation mode + optional KL-to-reference penalty + optional entropy bonus
+ the advantage estimator the trainer should use. "GRPO", "DAPO", "ATR-GRPO", "RPG-URKL"...
are presets (YAML files in `tether/presets/`) choosing one value per axis.

    from tether import objectives
    obj = objectives.build("atr_grpo")                       # a preset
    obj = objectives.build({"preset": "dapo", "eps_high": 0.3})   # a preset, overridden
    obj = objectives.build({"name": "divergence_clip", "measure": "kl3", "delta": 0.0231})
    out = obj(objectives.TokenBatch(logprobs=lp, old_logprobs=lp_old, advantages=adv, mask=m))
    out.loss.backward(); out.metrics   # dict[str, Tensor], detached, no host sync

The math lives in `tether.core`; this module validates configs and assembles metrics.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Callable, ClassVar, Literal, NamedTuple, Optional, Union

import torch
import yaml

from .core import advantages as _adv
from .core import aggregation as _agg
from .core import correction as _corr
from .core import covariance as _cov
from .core import divergences as _div
from .core import dppo as _dppo
from .core import etr as _etr
from .core import gmpo as _gmpo
from .core import kl as _kl
from .core import m2po as _m2po
from .core import rpg as _rpg
from .core import sapo as _sapo
from .core import surrogates as _sur
from .core.kl import k3_of_log
from .core.masked import masked_fraction, masked_max, masked_mean, masked_min
from .core.registry import Registry, unknown_name_message
from .schema import ConfigError, from_dict, to_dict

# ---------------------------------------------------------------- batch and output


@dataclass(frozen=True)
class TokenBatch:
    """One (micro-)batch of N sequences with T response tokens. Tensors are never modified."""

    logprobs: torch.Tensor
    """(N, T) log pi_theta of each response token, with gradient."""
    old_logprobs: torch.Tensor
    """(N, T) log-probs under the policy that sampled the batch (recomputed before the updates)."""
    advantages: torch.Tensor
    """(N,) per sequence, or (N, T) per token."""
    mask: torch.Tensor
    """(N, T) 1/True for response tokens that count (the stop token included), 0 for padding."""
    ref_logprobs: Optional[torch.Tensor] = None
    """(N, T) log-probs under the reference/anchor policy; needed by `kl_penalty` and rpg anchor=ref."""
    group_ids: Optional[torch.Tensor] = None
    """(N,) integer prompt-group label of each sequence; ETR's group statistics come from it when `group_stats` is None."""
    rewards: Optional[torch.Tensor] = None
    """(N,) scalar reward of each sequence; ETR's group statistics come from it when `group_stats` is None."""
    entropy: Optional[torch.Tensor] = None
    """(N, T) per-token entropy of pi_theta; needed when entropy_coef != 0, logged when given."""
    loss_norm: Optional[Union[float, torch.Tensor]] = None
    """The mini-batch normaliser (`Objective.normalizer(mini_batch_mask)`) when this is one
    micro-batch of several; None means this batch is the whole mini-batch."""
    sampler_logprobs: Optional[torch.Tensor] = None
    """(N, T) log-probs of the sampled tokens under the sampler (the rollout engine, vLLM); read by
    `rollout_correction` (train-inference mismatch), which needs them."""
    group_stats: Optional[Any] = None
    """Per-sequence statistics of each sample's group over the WHOLE rollout batch
    (`Objective.group_stats(rewards, group_ids)`, rows selected like this batch's; ETR's nu_g - nu_bar).
    None: an objective that needs them computes them from `rewards` and `group_ids`, taking this batch
    as the whole rollout batch; refused when `loss_norm` is set (a micro-batch of several)."""


class Mean(NamedTuple):
    """A metric that is a mean, with the count behind it, so micro-batches merge exactly."""

    value: torch.Tensor
    count: torch.Tensor


MergeRule = Union[torch.Tensor, Literal["min", "max", "share"]]


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor
    """Scalar, differentiable w.r.t. `logprobs` (and `entropy` when entropy_coef != 0)."""
    metrics: dict[str, torch.Tensor]
    """Detached scalar tensors, namespaced (`loss/`, `policy/`, `kl/`, `etr/`, `rpg/`)."""
    merge: dict[str, MergeRule] = field(default_factory=dict)
    """How each metric merges over micro-batches (`MetricMerger`): a tensor is the count behind a mean
    (tokens or sequences); "min"/"max"; "share" for `loss/*` values that are shares of the mini-batch
    loss (summed within a mini-batch)."""


@dataclass
class TokenTerms:
    """An objective's per-token terms on one batch (`Objective.terms`), 0 at padding, before any
    aggregation: loss = agg(tokens.loss) + kl_penalty.coef * agg(kl_penalty) - entropy_coef * agg(entropy)."""

    tokens: Any
    """`tether.core.surrogates.TokenLoss`: the per-token policy loss (N, T) and its clip flags."""
    kl_penalty: Optional[torch.Tensor]
    """(N, T) the KL-penalty estimator per token (with gradient), None when the penalty is off."""
    entropy: Optional[torch.Tensor]
    """(N, T) the entropy per token (with gradient) when entropy_coef != 0, else None."""
    metrics: dict[str, torch.Tensor]
    """Detached scalar metrics (policy/*, kl/ref, the objective's own), without the loss/* values."""
    merge: dict[str, MergeRule]
    """How each metric merges over micro-batches (see `ObjectiveOutput.merge`)."""


class MetricMerger:
    """The metrics of many micro-batches (and mini-batches) merged exactly as if computed at once:
    means weighted by their counts, minima and maxima, and `loss/*` shares summed per mini-batch
    then averaged over mini-batches. The result does not depend on the micro-batch size."""

    def __init__(self):
        self._num: dict[str, torch.Tensor] = {}
        self._den: dict[str, torch.Tensor] = {}
        self._ext: dict[str, tuple[str, torch.Tensor]] = {}
        self._share: dict[str, torch.Tensor] = {}
        self._shares: dict[str, list[torch.Tensor]] = {}

    def add(self, out: ObjectiveOutput) -> None:
        for k, v in out.metrics.items():
            rule = out.merge[k]
            v = v.detach().double()
            if isinstance(rule, torch.Tensor):
                w = rule.detach().double()
                self._num[k] = self._num.get(k, 0.0) + v * w
                self._den[k] = self._den.get(k, 0.0) + w
            elif rule == "share":
                self._share[k] = self._share.get(k, 0.0) + v
            else:
                pick = torch.minimum if rule == "min" else torch.maximum
                self._ext[k] = (rule, v if k not in self._ext else pick(self._ext[k][1], v))

    def end_mini_batch(self) -> None:
        for k, v in self._share.items():
            self._shares.setdefault(k, []).append(v)
        self._share = {}

    def result(self) -> dict[str, torch.Tensor]:
        out = {k: self._num[k] / torch.clamp(self._den[k], min=1e-300) for k in self._num}
        out.update({k: v for k, (_, v) in self._ext.items()})
        out.update({k: torch.stack(v).mean() for k, v in self._shares.items()})
        return out


# ---------------------------------------------------------------- configs


@dataclass
class KLPenaltyConfig:
    estimator: str = "k3"
    """Per-token estimator: k1, k2, k3 (GRPO, uncorrected), k3_iw (importance-weighted, corrected)."""
    coef: float = 0.0
    """Penalty coefficient beta; 0 turns the penalty off (and no reference model is needed)."""

    def __post_init__(self):
        _check_name(_kl.KL_ESTIMATORS, self.estimator, "kl_penalty.estimator")
        _check(self.coef >= 0, "kl_penalty.coef", self.coef, "a number >= 0")


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
    with kl3), or whose D(geometric-mean r) > delta (sequence_geometric). Kept tokens get weight 1."""
    delta: Optional[float] = None
    """The divergence threshold with `measure` (kl3 with delta: verl's token_k3 / seq_mean_k3 rejection)."""

    def __post_init__(self):
        if self.measure is not None:
            _check_name(_div.MEASURES, self.measure, "rollout_correction.measure")
            _check(self.delta is not None and self.delta > 0, "rollout_correction.delta", self.delta,
                   "a number > 0 (with measure)")
            _check(self.mode == "mask", "rollout_correction.mode", self.mode,
                   "'mask' with measure and delta (a divergence rejects tokens, it does not truncate r); "
                   "for truncation give low and high instead of measure")
        else:
            _check(self.delta is None, "rollout_correction.delta", self.delta, "null without measure (or give measure)")
        _check(0 <= self.low < 1 < self.high, "rollout_correction.low/high", (self.low, self.high),
               "0 <= low < 1 < high")


@dataclass
class ObjectiveConfig:
    """Keys common to every objective."""

    aggregation: str = "token-mean"
    """Loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm."""
    kl_penalty: Optional[KLPenaltyConfig] = None
    """KL-to-reference penalty {estimator, coef}; None or coef 0 for none."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss gets -entropy_coef * mean entropy (needs `entropy` in the batch)."""
    advantage: str = "grpo"
    """Advantage estimator the trainer uses with this objective: grpo, dr_grpo, rloo, reinforce_pp."""
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

    def __post_init__(self):
        _check_name(_agg.AGGREGATIONS, self.aggregation, "aggregation")
        _check(self.off_policy_mask is None or self.off_policy_mask >= 0, "off_policy_mask", self.off_policy_mask,
               "a number >= 0 (the mean log-ratio in nats per token), or null for no mask")
        _check_name(_adv.ADVANTAGES, self.advantage, "advantage")
        if isinstance(self.kl_penalty, dict):
            self.kl_penalty = from_dict(KLPenaltyConfig, self.kl_penalty, "kl_penalty")
        if isinstance(self.rollout_correction, dict):
            self.rollout_correction = from_dict(RolloutCorrectionConfig, self.rollout_correction, "rollout_correction")
        _check(self.max_len is None or self.max_len > 0, "max_len", self.max_len, "a positive integer or null")

    def required_fields(self) -> list[str]:
        """TokenBatch fields this objective needs beyond logprobs, old_logprobs, advantages, mask."""
        need = []
        if self.uses_reference():
            need.append("ref_logprobs")
        if self.entropy_coef != 0:
            need.append("entropy")
        if self.rollout_correction is not None:
            need.append("sampler_logprobs")
        return need

    def uses_reference(self) -> bool:
        """Whether a reference model's log-probs are needed (the trainer loads it only then)."""
        return self.kl_penalty is not None and self.kl_penalty.coef > 0

    def has_trust_region(self) -> bool:
        """Whether the loss limits how far an update may move from the sampling policy (a clip, mask, truncation,
        soft gate or |log w| penalty); every such limit acts only on off-policy updates (w != 1)."""
        return True

    GROUP_STATS: ClassVar[Optional[type]] = None
    """The NamedTuple type of `group_stats` (fields: (N,) tensors or None), for adapters that carry
    it as separate batch columns; None when the objective reads no group statistics."""

    def needs_group_stats(self) -> bool:
        """Whether the loss reads statistics of each sample's group over the whole rollout batch
        (`group_stats`); the trainers compute them once per rollout batch and slice them per micro-batch."""
        return False

    def group_stats(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> Any:
        """Per-sequence group statistics over a whole rollout batch (rewards, group_ids (N,)); None if unused."""
        return None

    def group_stats_needed(self) -> tuple[str, ...]:
        """The fields of `group_stats` the loss reads (an adapter that can supply only some checks this)."""
        return ()


def _check(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: got {value!r}, expected {expected}")


def _check_name(registry: Registry, name: str, key: str) -> None:
    if name not in registry:
        raise ConfigError(f"{key}: {unknown_name_message(registry.kind, name, registry.names())}")


def _check_eps(cfg, *names: str) -> None:
    for n in names:
        _check(getattr(cfg, n) >= 0, n, getattr(cfg, n), "a number >= 0")


def _check_dual(c: Optional[float]) -> None:
    _check(c is None or c > 1, "dual_clip_c", c, "a number > 1, or null to disable the dual clip")


@dataclass
class PPOClipConfig(ObjectiveConfig):
    """PPO/GRPO/DAPO ratio clipping with bounds [1 - eps_low, 1 + eps_high]."""

    eps_low: float = 0.2
    """Lower clip: the ratio may fall to 1 - eps_low for negative advantages."""
    eps_high: float = 0.2
    """Upper clip: the ratio may rise to 1 + eps_high for positive advantages (DAPO: 0.28)."""
    dual_clip_c: Optional[float] = None
    """Dual clip: for A < 0 the loss is capped at -c A (c > 1); null disables it."""

    def __post_init__(self):
        super().__post_init__()
        _check_eps(self, "eps_low", "eps_high")
        _check_dual(self.dual_clip_c)


@dataclass
class DivergenceClipConfig(ObjectiveConfig):
    """Clip by a policy divergence: keep tokens with D(w) <= delta (ATR-GRPO with kl3)."""

    measure: Any = "kl3"
    """Divergence measure: ratio, log_ratio, kl2, kl3, kl3_reverse, chi2, hellinger, or a callable D(w)."""
    delta: float = 0.0231
    """Trust-region size; kl3 with 0.0231 gives [0.800, 1.231] (PPO's lower bound, wider upper)."""
    dual_clip_c: Optional[float] = None
    """Dual clip bound c > 1 for negative advantages; null disables it."""

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.measure, str):
            _check_name(_div.MEASURES, self.measure, "measure")
        elif not callable(self.measure):
            raise ConfigError(f"measure: got {self.measure!r}, expected one of {', '.join(_div.MEASURES.names())} or a callable")
        _check(self.delta > 0, "delta", self.delta, "a number > 0")
        _check_dual(self.dual_clip_c)
        self.bounds = _div.interval(self.measure, self.delta)


@dataclass
class GSPOConfig(ObjectiveConfig):
    """GSPO: sequence-level ratio (geometric mean of token ratios), clipped per sequence."""

    aggregation: str = "seq-mean-token-mean"
    """GSPO's default; with it the gradient equals that of GSPO's sequence-level objective."""
    eps_low: float = 3e-4
    """Lower clip of the sequence ratio."""
    eps_high: float = 4e-4
    """Upper clip of the sequence ratio."""

    def __post_init__(self):
        super().__post_init__()
        _check_eps(self, "eps_low", "eps_high")


@dataclass
class CISPOConfig(ObjectiveConfig):
    """CISPO: clip the importance weight (stop-gradient), keep every token's gradient."""

    eps_low: float = 1.0
    """Lower truncation of the weight at 1 - eps_low (1.0: no lower bound, as in MiniMax-M1)."""
    eps_high: float = 0.28
    """Upper truncation of the weight at 1 + eps_high."""

    def __post_init__(self):
        super().__post_init__()
        _check_eps(self, "eps_low", "eps_high")


@dataclass
class ReinforceConfig(ObjectiveConfig):
    """Plain REINFORCE: l = -A lp."""

    importance_weight: bool = False
    """Multiply by SG(w) (unbiased off-policy; unbounded variance)."""

    def has_trust_region(self) -> bool:
        return False


@dataclass
class RPGConfig(ObjectiveConfig):
    """Regularized Policy Gradient [RPG, arXiv 2505.17508]."""

    kl: Literal["fkl", "ufkl", "rkl", "urkl"] = "urkl"
    """KL regulariser: fkl/ufkl (forward, normalised/unnormalised), rkl/urkl (reverse)."""
    form: Literal["differentiable", "reinforce"] = "reinforce"
    """differentiable: -w A + beta term (Table 1); reinforce: -SG(w A + C_KL) lp (Table 2)."""
    beta: float = 5e-5
    """KL coefficient, relative to the reward scale: 5e-5 for 0/1 rewards is the paper's 1e-4 for its +1/-1
    rewards (docs/algorithms/rpg.md, "Reward scale and beta"); in general 1e-4 * (R_max - R_min) / 2."""
    anchor: Literal["old", "ref"] = "old"
    """The policy the KL is taken to: old (pi_old, the paper's choice) or ref (needs ref_logprobs)."""
    clip: Literal["none", "rpg"] = "rpg"
    """rpg: RPG-Style Clip (reinforce form, Algorithm 2) or dual-clip + clamped KL (differentiable form)."""
    eps_low: float = 0.2
    """Lower clip."""
    eps_high: float = 0.28
    """Upper clip."""
    dual_clip_c: Optional[float] = 10.0
    """Dual-clip bound for negative advantages; null disables it."""
    branch_on: Literal["regularized_advantage", "advantage"] = "regularized_advantage"
    """RPG-Style Clip's positive branch: A' = A + C_KL / w >= 0 (SPEC), or A > 0 (the authors' code; A = 0 then
    takes the negative branch)."""
    advantage: str = "dr_grpo"
    """RPG uses A = R - group mean, no std division ([RPG] Algorithm 2, lines 6 and 12)."""

    def __post_init__(self):
        super().__post_init__()
        _check_eps(self, "eps_low", "eps_high")
        _check(self.beta >= 0, "beta", self.beta, "a number >= 0")
        _check_dual(self.dual_clip_c)

    def required_fields(self) -> list[str]:
        need = super().required_fields()
        if self.anchor == "ref" and "ref_logprobs" not in need:
            need.append("ref_logprobs")
        return need

    def uses_reference(self) -> bool:
        return super().uses_reference() or self.anchor == "ref"

    def has_trust_region(self) -> bool:
        return self.clip != "none"


@dataclass
class ETRConfig(ObjectiveConfig):
    """Elastic Trust Regions (reconstruction; see tether.core.etr)."""

    eps_low: float = 0.2
    """Base lower clip before scaling."""
    eps_high: float = 0.28
    """Base upper clip before scaling."""
    alpha: float = 0.5
    """Micro factor 1 + alpha tanh(|A|); 0 turns it off."""
    eta: float = 0.5
    """Macro factor 1 + eta (nu_g - mean nu); 0 turns it off."""
    eps_min: float = 0.05
    """Floor of the per-sample eps."""
    eps_max: float = 0.5
    """Ceiling of the per-sample eps."""
    macro: Literal["explicit", "implicit", "off"] = "explicit"
    """explicit: group-variance factor; implicit: un-normalised |R - mean| in micro, eta = 0; off: micro only."""
    reward_range: Optional[tuple[float, float]] = None
    """(R_min, R_max) for var_max; null: the batch's observed range."""
    dual_clip_c: Optional[float] = None
    """Dual clip bound c > 1; null disables it."""

    def __post_init__(self):
        super().__post_init__()
        _check_eps(self, "eps_low", "eps_high", "alpha", "eta", "eps_min")
        _check(self.eps_max >= self.eps_min, "eps_max", self.eps_max, f"a number >= eps_min ({self.eps_min})")
        _check_dual(self.dual_clip_c)
        if self.reward_range is not None:
            _check(len(self.reward_range) == 2 and self.reward_range[1] > self.reward_range[0],
                   "reward_range", self.reward_range, "[R_min, R_max] with R_max > R_min")

    GROUP_STATS: ClassVar[Optional[type]] = _etr.ETRGroupStats

    def needs_group_stats(self) -> bool:
        return self.macro != "off"

    def group_stats_needed(self) -> tuple[str, ...]:
        return {"explicit": ("nu_shift",), "implicit": ("spread",), "off": ()}[self.macro]

    def group_stats(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> Optional[_etr.ETRGroupStats]:
        return _etr.etr_group_stats(rewards, group_ids, self.reward_range) if self.needs_group_stats() else None


def _check_measure(measure: Any, extra: tuple[str, ...] = ()) -> None:
    if isinstance(measure, str):
        if measure not in extra and measure not in _div.MEASURES:
            valid = list(extra) + _div.MEASURES.names()
            raise ConfigError(f"measure: {unknown_name_message('divergence measure', measure, valid)}")
    elif not callable(measure):
        valid = ", ".join(list(extra) + _div.MEASURES.names())
        raise ConfigError(f"measure: got {measure!r}, expected one of {valid} or a callable D(w)")


@dataclass
class DPPOConfig(ObjectiveConfig):
    """DPPO [arXiv 2602.04879]: mask the tokens whose update left a divergence trust region (tether.core.dppo)."""

    measure: Any = "binary_tv"
    """binary_tv or binary_kl (divergence of the sampled token's Bernoulli, the paper's), or a ratio measure
    (ratio, log_ratio, kl2, kl3, kl3_reverse, chi2, hellinger, or a callable D(w)): then the mask keeps
    D(w) <= delta on the side the advantage pushes, ATR-GRPO's region."""
    delta_low: float = 0.15
    """Threshold for tokens with A <= 0 (verl's clip_ratio_low); the paper: 0.15 for binary_tv, 0.05 for binary_kl."""
    delta_high: float = 0.15
    """Threshold for tokens with A > 0 (verl's clip_ratio_high)."""
    truncation_c: Optional[float] = None
    """Cap c of the importance weight SG(min(w, c)) (truncated IS); null (default): no cap, as in the authors'
    runs (their verl script sets clip_ratio_c 10000). verl's dppo_tv/dppo_kl read actor.clip_ratio_c, which
    defaults to 3.0 (its code falls back to 20 only when the key is missing): set 3.0 to match verl's default."""

    def __post_init__(self):
        super().__post_init__()
        _check_measure(self.measure, tuple(_dppo.BINARY_MEASURES.names()))
        _check(self.delta_low > 0, "delta_low", self.delta_low, "a number > 0")
        _check(self.delta_high > 0, "delta_high", self.delta_high, "a number > 0")
        _check(self.truncation_c is None or self.truncation_c > 0, "truncation_c", self.truncation_c,
               "a number > 0, or null for no truncation")
        self.bounds: Optional[tuple[float, float]] = None
        if not (isinstance(self.measure, str) and self.measure in _dppo.BINARY_MEASURES):
            self.bounds = (_div.interval(self.measure, self.delta_low)[0], _div.interval(self.measure, self.delta_high)[1])


@dataclass
class SAPOConfig(ObjectiveConfig):
    """SAPO [arXiv 2511.20347]: soft sigmoid gate (4 / tau) sigmoid(tau (w - 1)) instead of a hard clip."""

    aggregation: str = "seq-mean-token-mean"
    """The paper's (and verl's sapo's) aggregation."""
    tau_pos: float = 1.0
    """Gate temperature for A > 0 (larger: the gradient decays faster as w leaves 1)."""
    tau_neg: float = 1.05
    """Gate temperature for A <= 0; the paper takes tau_neg > tau_pos."""

    def __post_init__(self):
        super().__post_init__()
        _check(self.tau_pos > 0, "tau_pos", self.tau_pos, "a number > 0")
        _check(self.tau_neg > 0, "tau_neg", self.tau_neg, "a number > 0")


@dataclass
class GMPOConfig(ObjectiveConfig):
    """GMPO [arXiv 2507.20673]: geometric mean of the token ratios, each clipped in log space first."""

    aggregation: str = "seq-mean-token-mean"
    """With it the loss is the paper's mean over sequences of -A_i * (geometric-mean ratio)."""
    eps_low: float = 0.4
    """Log-space lower clip: log w >= -eps_low for A < 0 (ratio e^-0.4 = 0.670, the paper's)."""
    eps_high: float = 0.4
    """Log-space upper clip: log w <= eps_high for A > 0 (ratio e^0.4 = 1.492, the paper's)."""

    def __post_init__(self):
        super().__post_init__()
        _check_eps(self, "eps_low", "eps_high")


@dataclass
class ClipCovConfig(ObjectiveConfig):
    """Clip-Cov [arXiv 2505.22617]: PPO clip, plus no gradient for a random few high-covariance tokens."""

    eps_low: float = 0.2
    """PPO lower clip."""
    eps_high: float = 0.2
    """PPO upper clip."""
    select_frac: float = 2e-4
    """Share r of the batch's tokens to detach: k = max(floor(r N_tok), 1) (the paper's 2e-4)."""
    cov_lb: float = 1.0
    """Candidates have cov_lb < (A - mean A)(lp - mean lp) < cov_ub (the paper's 1)."""
    cov_ub: float = 5.0
    """Upper covariance bound of the candidates (the paper's 5)."""

    def __post_init__(self):
        super().__post_init__()
        _check_eps(self, "eps_low", "eps_high")
        _check(0 < self.select_frac <= 1, "select_frac", self.select_frac, "a share in (0, 1]")
        _check(self.cov_ub > self.cov_lb, "cov_ub", self.cov_ub, f"a number > cov_lb ({self.cov_lb})")


@dataclass
class KLCovConfig(ObjectiveConfig):
    """KL-Cov [arXiv 2505.22617]: no clip; a |log w| penalty on the top-covariance tokens."""

    select_frac: float = 2e-3
    """Share r of the batch's tokens penalised: the top k = max(floor(r N_tok), 1) by covariance
    (the paper: 2e-3 for 7B models, 2e-4 for 32B)."""
    kl_coef: float = 1.0
    """Coefficient of |log w| on the selected tokens (the paper's beta = 1; verl's ppo_kl_coef, 0.1 there by default)."""

    def __post_init__(self):
        super().__post_init__()
        _check(0 < self.select_frac <= 1, "select_frac", self.select_frac, "a share in (0, 1]")
        _check(self.kl_coef >= 0, "kl_coef", self.kl_coef, "a number >= 0")


@dataclass
class M2POConfig(ObjectiveConfig):
    """M2PO [arXiv 2510.01161]: drop the tokens with the largest (log r)^2 until the batch's mean is below tau."""

    tau: float = 0.04
    """tau_M2: the kept tokens' mean of (log r)^2 must be below it (the paper's 0.04 in every run; AReaL's m2_threshold)."""
    against: Literal["old", "sampler"] = "old"
    """Which log-ratio the second moment measures: old, log(pi_theta / pi_old) at every update (the paper, with pi_old
    the behaviour policy: trainer.old_logprobs=sampler); sampler, log(pi_old / pi_sampler), fixed per rollout batch
    (AReaL: behaviour against the recomputed proximal policy; needs sampler_logprobs)."""

    def __post_init__(self):
        super().__post_init__()
        _check(self.tau > 0, "tau", self.tau, "a number > 0")

    def required_fields(self) -> list[str]:
        need = super().required_fields()
        if self.against == "sampler" and "sampler_logprobs" not in need:
            need.append("sampler_logprobs")
        return need


# ---------------------------------------------------------------- surrogate functions

Extra = dict[str, Union[torch.Tensor, "Mean"]]  # a plain tensor is a mean over the batch's counted tokens
LossFn = Callable[[Any, TokenBatch, torch.Tensor, torch.Tensor], "tuple[_sur.TokenLoss, Extra]"]


@dataclass(frozen=True)
class ObjectiveSpec:
    config: type
    loss: LossFn


OBJECTIVES: Registry[ObjectiveSpec] = Registry("objective")


def objective(name: str, config: type):
    def decorator(fn: LossFn) -> LossFn:
        OBJECTIVES.register(name)(ObjectiveSpec(config, fn))
        return fn

    return decorator


@objective("ppo_clip", PPOClipConfig)
def _ppo_clip(cfg: PPOClipConfig, b: TokenBatch, lp, old):
    return _sur.ppo_clip(lp, old, b.advantages, cfg.eps_low, cfg.eps_high, cfg.dual_clip_c), {}


@objective("divergence_clip", DivergenceClipConfig)
def _divergence_clip(cfg: DivergenceClipConfig, b: TokenBatch, lp, old):
    low, high = cfg.bounds
    out = _sur.divergence_clip(lp, old, b.advantages, low, high, cfg.dual_clip_c)
    ref = torch.ones((), dtype=lp.dtype, device=lp.device)
    return out, {"policy/clip_bound_low": ref * low, "policy/clip_bound_high": ref * high}


@objective("gspo", GSPOConfig)
def _gspo(cfg: GSPOConfig, b: TokenBatch, lp, old):
    return _sur.gspo(lp, old, b.advantages, b.mask, cfg.eps_low, cfg.eps_high), {}


@objective("cispo", CISPOConfig)
def _cispo(cfg: CISPOConfig, b: TokenBatch, lp, old):
    return _sur.cispo(lp, old, b.advantages, cfg.eps_low, cfg.eps_high), {}


@objective("reinforce", ReinforceConfig)
def _reinforce(cfg: ReinforceConfig, b: TokenBatch, lp, old):
    return _sur.reinforce(lp, old, b.advantages, cfg.importance_weight), {}


@objective("rpg", RPGConfig)
def _rpg_loss(cfg: RPGConfig, b: TokenBatch, lp, old):
    log_q = _rpg.anchor_log_q(old, _masked_fill(b.ref_logprobs, b.mask) if cfg.anchor == "ref" else None)
    args = (cfg.kl, lp, old, b.advantages, cfg.beta, log_q)
    if cfg.form == "reinforce":
        out = (
            _rpg.rpg_style_clip(*args, cfg.eps_low, cfg.eps_high, cfg.dual_clip_c, cfg.branch_on)
            if cfg.clip == "rpg"
            else _rpg.rpg_reinforce(*args)
        )
    else:
        out = (
            _rpg.rpg_clipped_differentiable(*args, cfg.eps_low, cfg.eps_high, cfg.dual_clip_c)
            if cfg.clip == "rpg"
            else _rpg.rpg_differentiable(*args)
        )
    log_w = _sur.log_ratio(lp, old).detach()
    m = b.mask
    extra = {
        "rpg/c_kl_mean": masked_mean(_rpg.c_kl(cfg.kl, cfg.beta, log_w, log_q), m),
        # k3 estimate of the divergence between the policy and its anchor (drives SPEC 2.5's refresh).
        "rpg/kl_anchor": masked_mean(k3_of_log(log_q - log_w), m),
    }
    return out, extra


_PASS_BUCKETS = ((0.0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 1.0001))


@objective("etr", ETRConfig)
def _etr_loss(cfg: ETRConfig, b: TokenBatch, lp, old):
    stats = b.group_stats  # set by Objective.__call__ when the config needs it
    bounds = _etr.etr_bounds(b.advantages, stats, cfg.eps_low, cfg.eps_high, cfg.alpha, cfg.eta,
                             cfg.eps_min, cfg.eps_max, cfg.macro)
    eps_low, eps_high = (e[:, None] if e.dim() == 1 else e for e in (bounds.eps_low, bounds.eps_high))
    out = _sur.ppo_clip(lp, old, b.advantages, eps_low, eps_high, cfg.dual_clip_c)
    m = b.mask
    extra: Extra = {
        "etr/eps_low_mean": masked_mean(eps_low.expand_as(lp), m),
        "etr/eps_high_mean": masked_mean(eps_high.expand_as(lp), m),
    }
    n_seq = torch.tensor(float(lp.shape[0]), dtype=lp.dtype, device=lp.device)
    if stats is not None and stats.nu is not None:
        extra["etr/nu_mean"] = Mean(stats.nu.to(lp.dtype).mean(), n_seq)
    if stats is not None and stats.pass_rate is not None:
        # Effective upper eps per pass-rate bucket: where the update budget goes.
        seq_eps_high = eps_high.expand_as(lp)
        seq_eps_high = (seq_eps_high * m).sum(-1) / m.sum(-1).clamp(min=1)  # (N,)
        for lo, hi in _PASS_BUCKETS:
            inb = ((stats.pass_rate >= lo) & (stats.pass_rate < hi)).to(lp.dtype)
            name = f"etr/eps_high_pass_{int(lo * 100)}-{min(int(hi * 100), 100)}"
            extra[name] = Mean((seq_eps_high * inb).sum() / inb.sum().clamp(min=1), inb.sum())
    return out, extra


@objective("dppo", DPPOConfig)
def _dppo_loss(cfg: DPPOConfig, b: TokenBatch, lp, old):
    if cfg.bounds is None:
        valid = _dppo.binary_valid(cfg.measure, lp, old, b.advantages, cfg.delta_low, cfg.delta_high)
    else:
        valid = _dppo.interval_valid(lp, old, b.advantages, *cfg.bounds)
    out, truncated = _dppo.dppo(lp, old, b.advantages, valid, cfg.truncation_c)
    return out, {"dppo/truncfrac": masked_fraction(truncated, b.mask)}


@objective("sapo", SAPOConfig)
def _sapo_loss(cfg: SAPOConfig, b: TokenBatch, lp, old):
    out, slope = _sapo.sapo(lp, old, b.advantages, cfg.tau_pos, cfg.tau_neg)
    return out, {"sapo/gate_slope_mean": masked_mean(slope, b.mask)}


@objective("gmpo", GMPOConfig)
def _gmpo_loss(cfg: GMPOConfig, b: TokenBatch, lp, old):
    out, seq_ratio = _gmpo.gmpo(lp, old, b.advantages, b.mask, cfg.eps_low, cfg.eps_high)
    has_tokens = (b.mask.sum(-1) > 0).to(lp.dtype)  # (N,)
    n_seq = has_tokens.sum()
    mean_ratio = (seq_ratio * has_tokens).sum() / n_seq.clamp(min=1.0)
    return out, {"gmpo/seq_ratio_mean": Mean(mean_ratio, n_seq)}


def _cov_metrics(out: "_cov.CovLoss", m: torch.Tensor) -> Extra:
    return {"cov/selected_frac": masked_fraction(out.selected, m), "cov/candidate_frac": masked_fraction(out.candidates, m)}


@objective("clip_cov", ClipCovConfig)
def _clip_cov_loss(cfg: ClipCovConfig, b: TokenBatch, lp, old):
    out = _cov.clip_cov(lp, old, b.advantages, b.mask, cfg.eps_low, cfg.eps_high, cfg.select_frac, cfg.cov_lb,
                        cfg.cov_ub)
    return out.tokens, _cov_metrics(out, b.mask)


@objective("kl_cov", KLCovConfig)
def _kl_cov_loss(cfg: KLCovConfig, b: TokenBatch, lp, old):
    out = _cov.kl_cov(lp, old, b.advantages, b.mask, cfg.select_frac, cfg.kl_coef)
    extra = _cov_metrics(out, b.mask)
    extra["cov/kl_abs_mean"] = masked_mean(_sur.log_ratio(lp, old).detach().abs(), b.mask)
    return out.tokens, extra


@objective("m2po", M2POConfig)
def _m2po_loss(cfg: M2POConfig, b: TokenBatch, lp, old):
    if cfg.against == "old":
        d = _sur.log_ratio(lp, old).detach()
    else:  # log(pi_old / pi_sampler); the padding and a missing (NaN) sampler log-prob count as 0
        d = torch.nan_to_num(old - _masked_fill(b.sampler_logprobs, b.mask).detach(), nan=0.0)
    keep = _m2po.m2_keep(d, b.mask, cfg.tau)
    ones = torch.ones((), dtype=lp.dtype, device=lp.device)
    return _m2po.m2po(lp, old, b.advantages, keep), {
        "m2po/m2": _m2po.second_moment(d, b.mask),
        "m2po/m2_kept": _m2po.second_moment(d, keep),
        "m2po/masked_frac": masked_fraction(b.mask.bool() & ~keep, b.mask),
        "m2po/tau": ones * cfg.tau,
    }


# ---------------------------------------------------------------- the objective


def _correction(rc: RolloutCorrectionConfig, old: torch.Tensor, sampler: torch.Tensor, m: torch.Tensor):
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


def _masked_fill(x: Optional[torch.Tensor], mask: torch.Tensor) -> Optional[torch.Tensor]:
    """Zero the padding of a log-prob tensor so no inf/NaN there can reach a gradient."""
    if x is None:
        return None
    return torch.where(mask.bool(), x, torch.zeros_like(x))


POLICY_METRIC_EXTREMES: dict[str, MergeRule] = {"policy/ratio_min": "min", "policy/ratio_max": "max"}
"""The `policy_metrics` that merge over micro-batches as extremes; the others are token means."""


def policy_metrics(tokens: _sur.TokenLoss, log_w: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The `policy/*` metrics of one batch (docs/metrics.md): clip fractions, the ratio's range and
    how far the updates moved from the sampling policy; `log_w` = log(pi_theta / pi_old), detached."""
    w = torch.exp(log_w)
    return {
        "policy/clipfrac_low": masked_fraction(tokens.clip_low, mask),
        "policy/clipfrac_high": masked_fraction(tokens.clip_high, mask),
        "policy/clipfrac_dual": masked_fraction(tokens.clip_dual, mask),
        "policy/ratio_mean": masked_mean(w, mask),
        "policy/ratio_min": masked_min(w, mask, empty=1.0),
        "policy/ratio_max": masked_max(w, mask, empty=1.0),
        # E_old[k3(pi_theta / pi_old)] = UKL(pi_old || pi_theta): how far the updates moved.
        "policy/kl_old": masked_mean(k3_of_log(log_w), mask),
    }


class Objective:
    """A built objective: `obj(batch) -> ObjectiveOutput`. See the module docstring."""

    def __init__(self, name: str, config: ObjectiveConfig):
        self.name = name
        self.config = config
        self._loss = OBJECTIVES.get(name).loss

    def __repr__(self) -> str:
        return f"Objective({self.name!r}, {self.config})"

    def uses_reference(self) -> bool:
        return self.config.uses_reference()

    def has_trust_region(self) -> bool:
        """Whether the loss limits the update by the ratio to the old policy (all but plain REINFORCE and
        unclipped RPG; the config's capability); such a limit can act only on off-policy updates."""
        return self.config.has_trust_region()

    def normalizer(self, mask: torch.Tensor) -> torch.Tensor:
        """The aggregation normaliser of a whole mini-batch; pass it as `TokenBatch.loss_norm`."""
        return _agg.normalizer(self.config.aggregation, mask, self.config.max_len)

    def advantages(self, rewards: torch.Tensor, group_ids: torch.Tensor,
                   lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Advantages (N,); `lengths` (N,), each sequence's counted tokens, weigh the batch statistics of
        the estimators that whiten over tokens (reinforce_pp, as verl does); the others ignore them."""
        return _adv.compute_advantages(self.config.advantage, rewards, group_ids, lengths)

    def needs_group_stats(self) -> bool:
        return self.config.needs_group_stats()

    def group_stats(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> Any:
        """Statistics of each sample's group over a whole rollout batch, for `TokenBatch.group_stats`
        (select rows with `.select(idx)`); None when the objective reads none."""
        return self.config.group_stats(rewards, group_ids)

    def terms(self, batch: TokenBatch) -> "TokenTerms":
        """The per-token terms on `batch`, before aggregation: the one implementation of each
        objective's masking, group statistics, KL penalty, entropy and metrics, which tether's
        trainer and the TRL adapter aggregate with `__call__` and the verl plugin with verl's own
        `agg_loss` (tether.integrations.verl)."""
        self._validate(batch)
        cfg, m = self.config, batch.mask
        if cfg.needs_group_stats() and batch.group_stats is None:  # this batch is the whole rollout batch
            batch = dataclasses.replace(batch, group_stats=cfg.group_stats(batch.rewards, batch.group_ids))
        lp = _masked_fill(batch.logprobs, m)
        old = _masked_fill(batch.old_logprobs, m).detach()
        n_tokens = m.detach().sum().to(torch.float64)
        metrics: dict[str, torch.Tensor] = {}
        merge: dict[str, MergeRule] = {}
        kept, correction = m, None
        if cfg.rollout_correction is not None:
            correction, correction_metrics = _correction(cfg.rollout_correction, old, batch.sampler_logprobs, m)
            metrics.update(correction_metrics)
            # A masked token leaves the loss: the objective sees it as padding, so it enters no sequence
            # statistic (GMPO's geometric mean, GSPO's sequence ratio) and its loss is 0 (c = 0).
            kept = torch.where(correction.masked, torch.zeros_like(m), m)
        off_policy = None
        if cfg.off_policy_mask is not None:  # DeepSeek-V3.2's sequence mask: its tokens leave the loss, like masked ones
            behaviour = old if batch.sampler_logprobs is None else _masked_fill(batch.sampler_logprobs, m).detach()
            off_policy = _corr.off_policy_sequence_mask(lp, behaviour, batch.advantages, m, cfg.off_policy_mask)
            metrics["policy/off_policy_masked_frac"] = masked_fraction(off_policy, m)
            kept = torch.where(off_policy, torch.zeros_like(m), kept)
        n_kept = n_tokens if kept is m else kept.detach().sum().to(torch.float64)  # the tokens left in the loss
        tokens, extra = self._loss(cfg, batch if kept is m else dataclasses.replace(batch, mask=kept), lp, old)
        if correction is not None:
            tokens = tokens._replace(loss=tokens.loss * correction.weights.to(tokens.loss.dtype))
        if off_policy is not None:
            tokens = tokens._replace(loss=torch.where(off_policy, torch.zeros_like(tokens.loss), tokens.loss))
        penalty = None
        if batch.ref_logprobs is not None:
            ref = _masked_fill(batch.ref_logprobs, m).detach()
            metrics["kl/ref"] = masked_mean(k3_of_log(ref - lp.detach()), m)
            if cfg.kl_penalty is not None and cfg.kl_penalty.coef > 0:
                penalty = _kl.kl_penalty(cfg.kl_penalty.estimator, lp, ref, old)
        entropy = None
        if batch.entropy is not None:
            entropy = _masked_fill(batch.entropy, m)
            metrics["policy/entropy"] = masked_mean(entropy.detach(), m)
        merge.update({k: n_tokens for k in metrics})
        # The policy metrics describe the tokens in the loss (all counted ones unless a correction masks some).
        policy = policy_metrics(tokens, log_w=_sur.log_ratio(lp, old).detach(), mask=kept)
        metrics.update(policy)
        merge.update({k: n_kept for k in policy})
        merge.update(POLICY_METRIC_EXTREMES)
        for k, v in extra.items():
            metrics[k], merge[k] = (v.value.detach(), v.count.detach()) if isinstance(v, Mean) else (v.detach(), n_kept)
        return TokenTerms(tokens, penalty, entropy if cfg.entropy_coef != 0 else None, metrics, merge)

    def __call__(self, batch: TokenBatch) -> ObjectiveOutput:
        """The loss on `batch`: its terms aggregated by `config.aggregation` (with `loss_norm`, as one
        micro-batch's share of the mini-batch loss), plus the `loss/*` metrics."""
        cfg, t = self.config, self.terms(batch)

        def reduce(x: torch.Tensor) -> torch.Tensor:
            return _agg.aggregate(x, batch.mask, cfg.aggregation, batch.loss_norm, cfg.max_len)

        total = policy = reduce(t.tokens.loss)
        losses = {"loss/policy": policy}
        if t.kl_penalty is not None:
            losses["loss/kl_penalty"] = pen = reduce(t.kl_penalty)
            total = total + cfg.kl_penalty.coef * pen
        if t.entropy is not None:
            losses["loss/entropy"] = ent = reduce(t.entropy)
            total = total - cfg.entropy_coef * ent
        losses["loss/total"] = total
        metrics = {**{k: v.detach() for k, v in losses.items()}, **t.metrics}
        return ObjectiveOutput(total, metrics, {**{k: "share" for k in losses}, **t.merge})

    def _validate(self, batch: TokenBatch) -> None:
        if self.config.needs_group_stats() and batch.group_stats is None:
            if batch.loss_norm is not None:  # a micro-batch: its own rewards would give per-micro-batch statistics
                raise ValueError(
                    f"objective {self.name!r} reads group statistics over the whole rollout batch, but this batch has "
                    "loss_norm set (it is one micro-batch of several) and no group_stats: computing them from its own "
                    "rewards and group_ids would make them depend on the micro-batch split. Compute "
                    "stats = obj.group_stats(rewards, group_ids) once over the whole rollout batch and pass each "
                    "micro-batch its rows, TokenBatch(group_stats=stats.select(idx))"
                )
            for name in ("rewards", "group_ids"):
                if getattr(batch, name) is None:
                    raise ValueError(
                        f"objective {self.name!r} needs TokenBatch.group_stats (Objective.group_stats over the whole "
                        f"rollout batch) or, for a batch that is the whole rollout batch, TokenBatch.{name}, which is "
                        f"None ({_WHY_NEEDED[name]}); pass it or change the config"
                    )
        for name in self.config.required_fields():
            if getattr(batch, name) is None:
                raise ValueError(
                    f"objective {self.name!r} needs TokenBatch.{name}, which is None "
                    f"({_WHY_NEEDED.get(name, '')}); pass it or change the config"
                )
        shape = batch.logprobs.shape
        if batch.logprobs.dim() != 2:
            raise ValueError(f"logprobs must be (N, T); got shape {tuple(shape)}")
        for name in ("old_logprobs", "mask", "ref_logprobs", "entropy"):
            t = getattr(batch, name)
            if t is not None and t.shape != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logprobs")
        adv = batch.advantages
        if adv.shape not in (shape, shape[:1]):
            raise ValueError(f"advantages must be (N,) or (N, T) = {tuple(shape)}; got {tuple(adv.shape)}")
        for name in ("rewards", "group_ids"):
            t = getattr(batch, name)
            if t is not None and t.shape != shape[:1]:
                raise ValueError(f"{name} must be (N,) = ({shape[0]},); got {tuple(t.shape)}")


_WHY_NEEDED = {
    "ref_logprobs": "the KL penalty or anchor='ref' compares against the reference policy",
    "entropy": "entropy_coef != 0 adds an entropy bonus",
    "rewards": "ETR's macro factor uses each group's reward variance; or set macro='off'",
    "sampler_logprobs": "rollout_correction weighs each token by pi_old / pi_sampler; pass the sampler's log-probs "
                        "(tether's engine: RolloutBatch.sampler_logprobs; TRL: vLLM's sampling_per_token_logps) or drop "
                        "rollout_correction",
    "group_ids": "ETR's macro factor needs to know which samples share a prompt; or set macro='off'",
}


# ---------------------------------------------------------------- presets and build


def preset_names() -> list[str]:
    files = resources.files("tether").joinpath("presets").iterdir()
    return sorted(f.name[: -len(".yaml")] for f in files if f.name.endswith(".yaml"))


def load_preset(name: str) -> dict:
    """The preset's YAML as a dict (`name` is the objective it selects)."""
    if name not in preset_names():
        raise KeyError(unknown_name_message("preset", name, preset_names()))
    text = resources.files("tether").joinpath("presets", f"{name}.yaml").read_text()
    return yaml.safe_load(text)


def names() -> list[str]:
    """Registered objective names (the surrogates; presets are listed by `preset_names`)."""
    return OBJECTIVES.names()


def label_of(spec: Union[str, dict]) -> str:
    """The name a spec was chosen by, which reports show: its recorded `label`, else the preset's
    name, else the objective's (`objective=grpo` is labelled grpo, though it builds ppo_clip)."""
    if isinstance(spec, str):
        return spec
    label = spec.get("label") or spec.get("preset") or spec.get("name")
    if not isinstance(label, str):
        raise ConfigError(f"objective.label: expected a string (the name reports show), got {label!r}")
    return label


def resolve(spec: Union[str, dict]) -> dict:
    """A preset name, objective name, or dict -> the full dict {name, **params} it stands for
    (without its `label`, which names it in reports and is no parameter)."""
    if isinstance(spec, str):
        spec = {"preset": spec} if spec in preset_names() else {"name": spec}
    if not isinstance(spec, dict):
        raise ConfigError(f"an objective is a preset name, an objective name or a mapping; got {spec!r}")
    spec = {k: v for k, v in spec.items() if k != "label"}
    if "preset" in spec:
        base = load_preset(spec.pop("preset"))
        if "name" in spec and spec["name"] != base["name"]:
            raise ConfigError(f"preset selects objective {base['name']!r} but 'name' says {spec['name']!r}; drop one")
        if isinstance(spec.get("kl_penalty"), dict) and isinstance(base.get("kl_penalty"), dict):
            spec["kl_penalty"] = {**base["kl_penalty"], **spec["kl_penalty"]}
        spec = {**base, **spec}
    if "name" not in spec:
        raise ConfigError(
            f"an objective mapping needs 'name' ({', '.join(names())}) or 'preset' ({', '.join(preset_names())})"
        )
    return spec


def build(spec: Union[str, dict]) -> Objective:
    """Build an objective from a preset name, an objective name, or a config mapping."""
    spec = resolve(spec)
    name = spec.pop("name")
    if name not in OBJECTIVES:
        raise ConfigError(unknown_name_message("objective or preset", name, names() + preset_names()))
    config = from_dict(OBJECTIVES.get(name).config, spec, "objective")
    return Objective(name, config)


def resolved(spec: Union[str, dict], max_len: Optional[int] = None) -> dict:
    """THE place a preset or objective spec is interpreted: the full mapping {label, name, every
    parameter} it stands for, with `max_len` filled in when the spec leaves it null. A config records
    this, so a run never depends on what a preset says later; `build(resolved(spec))` is the same
    objective. `label` is the name the user chose (`label_of`): reports show it, with `name` and the
    parameters beside it, so a run of the atr_grpo preset reads as atr_grpo, not divergence_clip."""
    label = label_of(spec)
    obj = build(spec)
    if max_len is not None and obj.config.max_len is None:
        obj.config.max_len = max_len
    return {"label": label, **describe(obj)}


def display(spec: dict, width: Optional[int] = None, skip: tuple[str, ...] = ()) -> tuple[str, str]:
    """A resolved objective for a reader, as (head, parameters): ('atr_grpo (divergence_clip)',
    'measure=kl3, delta=0.0231, ...'), the head just the name when the label is the objective's own.
    The objective's own parameters come first, then the axes every objective has; nulls and `skip`
    are left out, and the parameters are cut at `width` characters."""
    name, label = str(spec.get("name") or ""), str(spec.get("label") or spec.get("preset") or spec.get("name") or "")
    head = label if label == name or not name else f"{label} ({name})"
    shared = ("advantage", "aggregation", "kl_penalty", "entropy_coef", "rollout_correction", "max_len")
    keys = [k for k in spec if k not in shared] + [k for k in shared if k in spec]
    params = ", ".join(f"{k}={_compact(spec[k])}" for k in keys
                       if k not in ("label", "name", "preset", *skip) and spec[k] is not None)
    if width is not None and len(params) > width:
        params = params[: width - 3] + "..."
    return head, params


def _compact(v) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_compact(x)}" for k, x in v.items() if x is not None) + "}"
    return format(v, "g") if isinstance(v, float) else str(v)


def describe(obj: Objective) -> dict:
    """The objective's full resolved config as plain data (for run directories and reports)."""
    d = {"name": obj.name, **to_dict(obj.config)}
    if callable(d.get("measure")):
        d["measure"] = getattr(d["measure"], "__name__", "callable")
    return d
