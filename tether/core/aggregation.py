"""Reduce per-token losses l (N, T) with mask m to a scalar.

    token-mean                sum(l m) / sum(m)
    seq-mean-token-mean       mean over sequences of sum_t(l m) / sum_t(m)
    seq-mean-token-sum        mean over sequences of sum_t(l m)
    seq-mean-token-sum-norm   sum(l m) / (N * T_max)            (Dr. GRPO's constant normaliser)

Gradient accumulation: a mini-batch split into micro-batches must give the full mini-batch's
gradient when the micro-batch losses are summed. Every mode is "a sum over tokens or
sequences divided by a mini-batch total", so the total (`normalizer`) is computed once over
the whole mini-batch and passed to `aggregate` for each micro-batch; without it, each
micro-batch normalises by its own total (correct only when it is the whole mini-batch).

Sequences count in "seq-mean" modes when they have at least one counted token, so padding
rows change nothing (verl's convention: its seq-mean modes count the rows whose mask is not all 0).
`empty_rows="count"` counts every row instead, as TRL's `grpo` (`.mean()` over the rows) and
`dr_grpo` (`per_token_loss.size(0) * max_completion_length`) do: a row with no counted token
(`mask_truncated_completions=True` on a truncated completion, a completion that is all tool
output) then adds 0 to the numerator and 1 to the normaliser; the TRL adapter uses it. T_max is
the generation budget (`max_len`) when given, else the padded width of the batch.
"""

from __future__ import annotations

from typing import Callable, Literal, NamedTuple, Optional, Union

import torch

from .registry import Registry

Norm = Union[float, torch.Tensor]
EmptyRows = Literal["skip", "count"]
"""Whether a seq-mean normaliser counts the rows without a counted token: skip (verl's, tether's trainer) or
count (TRL's grpo and dr_grpo, the TRL adapter)."""


class AggregationMode(NamedTuple):
    normalizer: Callable[[torch.Tensor, Optional[int], bool], torch.Tensor]  # (mask, max_len, count_empty_rows)
    numerator: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


AGGREGATIONS: Registry[AggregationMode] = Registry("aggregation mode")


def _token_sum(loss: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m.bool(), loss, torch.zeros_like(loss)).sum()


def _seq_token_mean_sum(loss: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    per_seq = torch.where(m.bool(), loss, torch.zeros_like(loss)).sum(-1)
    return (per_seq / m.sum(-1).clamp(min=1).to(loss.dtype)).sum()


def _n_tokens(m: torch.Tensor, max_len: Optional[int], count_empty: bool) -> torch.Tensor:
    return m.sum()


def _n_seqs(m: torch.Tensor, max_len: Optional[int], count_empty: bool) -> torch.Tensor:
    return torch.tensor(m.shape[0], device=m.device) if count_empty else (m.sum(-1) > 0).sum()


def _n_seqs_times_len(m: torch.Tensor, max_len: Optional[int], count_empty: bool) -> torch.Tensor:
    t_max = m.shape[-1] if max_len is None else max_len
    return _n_seqs(m, max_len, count_empty) * t_max


AGGREGATIONS.register("token-mean")(AggregationMode(_n_tokens, _token_sum))
AGGREGATIONS.register("seq-mean-token-mean")(AggregationMode(_n_seqs, _seq_token_mean_sum))
AGGREGATIONS.register("seq-mean-token-sum")(AggregationMode(_n_seqs, _token_sum))
AGGREGATIONS.register("seq-mean-token-sum-norm")(AggregationMode(_n_seqs_times_len, _token_sum))


def normalizer(
    mode: str, mask: torch.Tensor, max_len: Optional[int] = None, empty_rows: EmptyRows = "skip"
) -> torch.Tensor:
    """The mini-batch total that `aggregate` divides by; compute it over the whole mini-batch."""
    if empty_rows not in ("skip", "count"):
        raise ValueError(f"empty_rows must be 'skip' or 'count'; got {empty_rows!r}")
    return AGGREGATIONS.get(mode).normalizer(mask, max_len, empty_rows == "count")


def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, mode: str, norm: Optional[Norm] = None, max_len: Optional[int] = None
) -> torch.Tensor:
    """Scalar loss; `norm` is the mini-batch normaliser (default: this batch's own)."""
    spec = AGGREGATIONS.get(mode)
    if norm is None:
        norm = spec.normalizer(mask, max_len, False)
    norm_t = torch.as_tensor(norm, dtype=loss.dtype, device=loss.device).clamp(min=1)
    return spec.numerator(loss, mask) / norm_t
