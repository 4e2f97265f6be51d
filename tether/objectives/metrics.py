"""Metrics of an objective: the `policy/*` metrics every objective logs, and `MetricMerger`, which
merges the metrics of many micro-batches exactly as if they had been computed at once."""

from __future__ import annotations

import torch

from ..core import surrogates as _sur
from ..core.kl import k3_of_log
from ..core.masked import masked_fraction, masked_max, masked_mean, masked_min
from .batch import MergeRule, ObjectiveOutput

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
