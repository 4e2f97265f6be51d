"""What an objective reads and what it returns: `TokenBatch` in; `TokenTerms` (per token, before
aggregation) and `ObjectiveOutput` (the loss and its metrics) out. Plain containers, no math."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Optional, Union

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

from ..core.etr import GroupStats


@dataclass(frozen=True)
class TokenBatch:
    """One (micro-)batch of N sequences with T response tokens (S support entries, K top-k tokens per position;
    `jaxtyping` shapes, checked in a training run by `tests/trainer/test_step_shapes.py`). Tensors are never
    modified."""

    logprobs: Float[Tensor, "N T"]
    """(N, T) log pi_theta of each response token, with gradient."""
    old_logprobs: Float[Tensor, "N T"]
    """(N, T) log-probs under the policy that sampled the batch (recomputed before the updates)."""
    advantages: Union[Float[Tensor, " N"], Float[Tensor, "N T"]]
    """(N,) per sequence, or (N, T) per token."""
    loss_mask: Shaped[Tensor, "N T"]
    """(N, T) 1/True for the response tokens that count (the stop token included), 0 for padding, an environment's
    tokens and any the trainer excluded (`tether.trainer.step.tokens_for_update` names why)."""
    ref_logprobs: Optional[Float[Tensor, "N T"]] = None
    """(N, T) log-probs under the reference/anchor policy; needed by `kl_penalty` and rpg anchor=ref."""
    group_ids: Optional[Int[Tensor, " N"]] = None
    """(N,) integer prompt-group label of each sequence; ETR's group statistics come from it when `group_stats` is
    None."""
    rewards: Optional[Float[Tensor, " N"]] = None
    """(N,) scalar reward of each sequence; ETR's group statistics come from it when `group_stats` is None."""
    entropy: Optional[Float[Tensor, "N T"]] = None
    """(N, T) per-token entropy of pi_theta; needed when entropy_coef != 0 (with gradient) or with
    top_entropy_frac (which selects by it, detached), logged when given."""
    loss_norm: Optional[Union[float, Float[Tensor, ""]]] = None
    """The mini-batch normaliser (`Objective.normalizer(mini_batch_mask)`) when this is one
    micro-batch of several; None means this batch is the whole mini-batch."""
    sampler_logprobs: Optional[Float[Tensor, "N T"]] = None
    """(N, T) log-probs of the sampled tokens under the sampler (the rollout engine, vLLM); read by
    `rollout_correction` (train-inference mismatch), which needs them."""
    group_stats: Optional[GroupStats] = None
    """Per-sequence statistics of each sample's group over the WHOLE rollout batch
    (`Objective.group_stats(rewards, group_ids)`, rows selected like this batch's; ETR's nu_g - nu_bar).
    None: an objective that needs them computes them from `rewards` and `group_ids`, taking this batch
    as the whole rollout batch; refused when `loss_norm` is set (a micro-batch of several)."""
    support_logprobs: Optional[Float[Tensor, "N T S"]] = None
    """(N, T, S) log pi_theta of each position's support tokens (full-softmax log-probs, with gradient); read by an
    objective with a sparse support (`ObjectiveConfig.sparse_support`: TROLL), with the three fields below."""
    old_support_logprobs: Optional[Float[Tensor, "N T S"]] = None
    """(N, T, S) log pi_old at the same support (`tether.core.troll.old_on_support` from pi_old's stored set)."""
    support_mask: Optional[Bool[Tensor, "N T S"]] = None
    """(N, T, S) bool: which support entries count (a support is padded to a common width S)."""
    support_token_index: Optional[Int[Tensor, "N T"]] = None
    """(N, T) long: the sampled token's entry in each position's support."""
    rollout_weights: Optional[Float[Tensor, "N T"]] = None
    """(N, T) rollout-correction weights pi_old / pi_sampler computed outside the objective (verl's
    rollout_is_weights), for an objective that folds them into its own weight (`folds_rollout_correction`:
    VESPO); `Objective.terms` sets it from the config's `rollout_correction`. Other objectives refuse it: their
    callers multiply such weights into the per-token loss."""
    teacher_logprobs: Optional[Float[Tensor, "N T"]] = None
    """(N, T) log-probs of the sampled tokens under the distillation teacher (`distill`), at the sampling
    temperature, like `ref_logprobs`."""
    teacher_topk_logprobs: Optional[Float[Tensor, "N T K"]] = None
    """(N, T, K) the teacher's K largest log-probs at each position (full softmax), for `distill.signal`
    forward_kl_topk."""
    student_topk_logprobs: Optional[Float[Tensor, "N T K"]] = None
    """(N, T, K) log pi_theta of the same K tokens at each position (full softmax), with gradient: forward_kl_topk."""


class Mean(NamedTuple):
    """A metric that is a mean, with the count behind it, so micro-batches merge exactly."""

    value: torch.Tensor
    count: torch.Tensor


MergeRule = Union[torch.Tensor, Literal["min", "max", "share"]]
Extra = dict[str, Union[torch.Tensor, Mean]]
"""A loss function's own metrics: a plain tensor is a mean over the batch's counted tokens."""


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
    aggregation: loss = agg(tokens.loss) + kl_penalty.coef * agg(kl_penalty) - entropy_coef * agg(entropy)
    + sampler_kl_coef * agg(sampler_kl) + distill.coef * agg(distill)."""

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
    sampler_kl: Optional[torch.Tensor] = None
    """(N, T) the squared log-ratio to the sampler per token (with gradient) when sampler_kl_coef > 0, else None."""
    distill: Optional[torch.Tensor] = None
    """(N, T) the distillation loss per token (with gradient) for a loss signal of `distill`, else None."""


def masked_fill(x: Optional[torch.Tensor], mask: torch.Tensor) -> Optional[torch.Tensor]:
    """Zero the padding of a log-prob tensor so no inf/NaN there can reach a gradient."""
    if x is None:
        return None
    return torch.where(mask.bool(), x, torch.zeros_like(x))
