"""Masked reductions over (N, T) token tensors.

Every reduction treats `mask` as the set of tokens that count; an all-masked input gives a
finite value (0, or the neutral element for min/max) rather than NaN, because an empty
micro-batch must not poison a running average.
"""

from __future__ import annotations

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(x * m) over all elements; mask (N, T) of 0/1 or bool."""
    return torch.where(mask.bool(), x, torch.zeros_like(x)).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(x m) / max(sum(m), 1): 0 for an all-masked input."""
    m = mask.to(x.dtype)
    return masked_sum(x, mask) / m.sum().clamp(min=1.0)


def masked_min(x: torch.Tensor, mask: torch.Tensor, empty: float = 0.0) -> torch.Tensor:
    big = torch.full_like(x, float("inf"))
    v = torch.where(mask.bool(), x, big).min()
    return torch.where(torch.isfinite(v), v, torch.full_like(v, empty))


def masked_max(x: torch.Tensor, mask: torch.Tensor, empty: float = 0.0) -> torch.Tensor:
    small = torch.full_like(x, float("-inf"))
    v = torch.where(mask.bool(), x, small).max()
    return torch.where(torch.isfinite(v), v, torch.full_like(v, empty))


def masked_fraction(cond: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Share of masked tokens where `cond` holds (0 for an all-masked input)."""
    m = mask.bool()
    return (cond & m).sum().to(torch.float64) / m.sum().clamp(min=1).to(torch.float64)  # exact k / n


def seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence masked mean: (N, T) -> (N,); 0 for a sequence with no counted token."""
    m = mask.to(x.dtype)
    return (x * m).sum(-1) / m.sum(-1).clamp(min=1.0)


def group_summary(values: torch.Tensor, group_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-sample summary (mean, variance, count, range) of the sample's own group, without a host sync.

    Not to be confused with an objective's group statistics (`tether.core.etr.GroupStats`), which
    are built from it.

    values (N,), group_ids (N,) of any integer labels. Returns a dict of (N,) tensors:
    `mean`, `var` (population variance), `count`, `min`, `max`. Uses an (N, N) equality
    matrix rather than `torch.unique` (which syncs with the host on CUDA); N is a batch of
    sequences, so N^2 is small. `min == max` is the exact test for a zero-variance group
    (a computed variance can be 1e-17 instead of 0).
    """
    same = group_ids[:, None] == group_ids[None, :]  # (N, N)
    w = same.to(values.dtype)
    count = w.sum(-1)
    mean = w @ values / count
    dev = torch.where(same, values[None, :] - mean[:, None], torch.zeros_like(w))  # (N, N)
    var = (dev**2).sum(-1) / count
    vmin = torch.where(same, values[None, :], torch.full_like(w, float("inf"))).min(-1).values
    vmax = torch.where(same, values[None, :], torch.full_like(w, float("-inf"))).max(-1).values
    return {"mean": mean, "var": var, "count": count, "min": vmin, "max": vmax}
