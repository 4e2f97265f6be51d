"""Policy objectives: one config class per surrogate, composed with the orthogonal axes.

An objective = surrogate (ppo_clip, divergence_clip, gspo, luspo, gmpo, vespo, reinforce, cispo, dro, rpg,
etr, dppo, m2po, sapo, clip_cov, kl_cov, bapo, gppo, ce_gppo, aspo, pspo, cfpo, trm, dgpo, abc_grpo,
troll) + aggregation
mode + optional KL-to-reference penalty + optional entropy
bonus + the advantage estimator the trainer should use. "GRPO", "DAPO", "ATR-GRPO", "RPG-URKL"... are
presets (YAML files in `tether/presets/`) choosing one value per axis.

    from tether import objectives
    obj = objectives.build("atr_grpo")                       # a preset
    obj = objectives.build({"preset": "dapo", "eps_high": 0.3})   # a preset, overridden
    obj = objectives.build({"name": "divergence_clip", "measure": "kl3", "delta": 0.0231})
    out = obj(objectives.TokenBatch(logprobs=lp, old_logprobs=lp_old, advantages=adv, loss_mask=m))
    out.loss.backward(); out.metrics   # dict[str, Tensor], detached, no host sync

The math lives in `tether.core`; this package validates configs and assembles metrics:

    batch.py     what an objective reads and returns (TokenBatch, TokenTerms, ObjectiveOutput)
    metrics.py   the policy/* metrics and MetricMerger (exact merging over micro-batches)
    base.py      the keys every objective has (ObjectiveConfig and its capabilities), the shared
                 clip range (ClipRange), validation, and the OBJECTIVES registry
    runtime.py   Objective: terms(batch) per token, __call__ aggregated
    spec.py      presets and THE spec function: `build(spec, max_len=, default=)` -> Objective and
                 `resolve(...)`, the same as the plain mapping a run records
    one file per family, each config class directly above the loss function that uses it:
    clip.py (ppo_clip, divergence_clip), sequence.py (gspo, luspo, gmpo, vespo), reinforce.py (reinforce, cispo, dro),
    rpg.py, etr.py, masks.py (dppo, m2po), sapo.py, covariance.py (clip_cov, kl_cov), bapo.py, gppo.py (gppo,
    ce_gppo), aspo.py, pspo.py, cfpo.py, trm.py, dgpo.py, abc_grpo.py, troll.py (TROLL: reads a sparse support)
"""

from .base import (
    OBJECTIVES,
    ClipRange,
    KLPenaltyConfig,
    LossFn,
    ObjectiveConfig,
    ObjectiveEntry,
    RolloutCorrectionConfig,
    SupportSize,
    objective,
)
from ..core.etr import GroupStats
from .batch import Mean, MergeRule, ObjectiveOutput, TokenBatch, TokenTerms
from .metrics import POLICY_METRIC_EXTREMES, MetricMerger, policy_metrics
from .runtime import Objective
from .spec import Spec, build, describe, display, label_of, load_preset, names, preset_names, resolve, spec_mapping

# The families register their objectives on import; the order is the order `names()` lists them in.
from .clip import DivergenceClipConfig, PPOClipConfig  # noqa: E402  isort: skip
from .sequence import GMPOConfig, GSPOConfig, LUSPOConfig, VESPOConfig  # noqa: E402  isort: skip
from .reinforce import CISPOConfig, DROConfig, ReinforceConfig  # noqa: E402  isort: skip
from .rpg import RPGConfig  # noqa: E402  isort: skip
from .etr import ETRConfig  # noqa: E402  isort: skip
from .masks import DPPOConfig, M2POConfig  # noqa: E402  isort: skip
from .sapo import SAPOConfig  # noqa: E402  isort: skip
from .covariance import ClipCovConfig, KLCovConfig  # noqa: E402  isort: skip
from .bapo import BAPOConfig  # noqa: E402  isort: skip
from .gppo import CEGPPOConfig, GPPOConfig  # noqa: E402  isort: skip
from .aspo import ASPOConfig  # noqa: E402  isort: skip
from .pspo import PSPOConfig  # noqa: E402  isort: skip
from .cfpo import CFPOConfig  # noqa: E402  isort: skip
from .trm import TRMConfig  # noqa: E402  isort: skip
from .dgpo import DGPOConfig  # noqa: E402  isort: skip
from .abc_grpo import ABCGRPOConfig  # noqa: E402  isort: skip
from .troll import TROLLConfig  # noqa: E402  isort: skip

__all__ = [
    "OBJECTIVES",
    "ABCGRPOConfig",
    "ASPOConfig",
    "DGPOConfig",
    "TRMConfig",
    "BAPOConfig",
    "CEGPPOConfig",
    "CFPOConfig",
    "GPPOConfig",
    "PSPOConfig",
    "POLICY_METRIC_EXTREMES",
    "CISPOConfig",
    "GroupStats",
    "ClipCovConfig",
    "ClipRange",
    "DPPOConfig",
    "DROConfig",
    "DivergenceClipConfig",
    "ETRConfig",
    "GMPOConfig",
    "GSPOConfig",
    "KLCovConfig",
    "KLPenaltyConfig",
    "LUSPOConfig",
    "LossFn",
    "M2POConfig",
    "VESPOConfig",
    "Mean",
    "MergeRule",
    "MetricMerger",
    "Objective",
    "ObjectiveConfig",
    "ObjectiveEntry",
    "ObjectiveOutput",
    "PPOClipConfig",
    "RPGConfig",
    "ReinforceConfig",
    "RolloutCorrectionConfig",
    "SAPOConfig",
    "SupportSize",
    "TROLLConfig",
    "TokenBatch",
    "TokenTerms",
    "build",
    "describe",
    "display",
    "label_of",
    "load_preset",
    "names",
    "objective",
    "policy_metrics",
    "preset_names",
    "resolve",
    "Spec",
    "spec_mapping",
]
