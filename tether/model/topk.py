"""The LM head at a few tokens per position, for distillation to a teacher's top-k distribution: the teacher's K
largest log-probs at each position, and the student's log-probs of those K tokens, with gradient. With hidden
states h_t (H,), head weight W (V, H) and temperature tau,

    log p_t(v) = z_t[v] - logsumexp_u z_t[u],     z_t = W h_t / tau.

Only the counted positions (`keep`) run, in chunks of R positions whose (R, V) logits are all that exists at once
(R from `TILE_BYTES` of `tether.model.ops`, or the trainer's `logprob_chunk_size`); the (N, T, V) logits never do.
`gathered_logprobs` runs each chunk under activation checkpointing: the backward recomputes the chunk's logits
rather than keeping them, one more head matmul for O(R V) instead of O(N T V) memory.

Departures: none from the math. The matmul runs in the inputs' dtype (bf16 under autocast); the softmax in float32
(float64 stays float64), as the fused head's does. Positions outside `keep` get log-prob 0 and id 0.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from .ops import TILE_BYTES


def chunk_rows(vocab: int, device: torch.device, chunk_size: Optional[int] = None) -> int:
    """Positions per chunk: `chunk_size`, else as many as keep one (R, V) float32 logits tile within TILE_BYTES."""
    kind = "cpu" if torch.device(device).type == "cpu" else "other"
    return chunk_size or max(1, TILE_BYTES[kind] // (4 * vocab))


def _scaled_logits(h: torch.Tensor, weight: torch.Tensor, tau: float) -> torch.Tensor:
    """z = h W^T / tau (R, V), in float32 or wider."""
    z = h @ weight.t()
    return z.to(torch.promote_types(z.dtype, torch.float32)) / tau


def _gathered(h: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, tau: float) -> torch.Tensor:
    z = _scaled_logits(h, weight, tau)
    return z.gather(-1, ids) - torch.logsumexp(z, -1, keepdim=True)


def topk_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, keep: torch.Tensor, k: int, temperature: float = 1.0, chunk_size=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids), each (N, T, K): the K largest log p_t(v) at each position of hidden (N, T, H) where keep (N, T)
    is set, in decreasing order, without gradient. K is at most V."""
    n, t, _ = hidden.shape
    k = min(k, weight.shape[0])
    values = torch.zeros(n, t, k, dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
    ids = torch.zeros(n, t, k, dtype=torch.long, device=hidden.device)
    h = hidden[keep.bool()]  # (P, H): the counted positions only
    rows = chunk_rows(weight.shape[0], hidden.device, chunk_size)
    with torch.no_grad():
        parts = []
        for s in range(0, h.shape[0], rows):
            z = _scaled_logits(h[s : s + rows], weight, temperature)
            top = torch.topk(z, k, dim=-1)
            parts.append((top.values - torch.logsumexp(z, -1, keepdim=True), top.indices))
    if parts:
        values[keep.bool()] = torch.cat([p[0] for p in parts]).to(values.dtype)
        ids[keep.bool()] = torch.cat([p[1] for p in parts])
    return values, ids


def gathered_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor, temperature=1.0, chunk_size=None
) -> torch.Tensor:
    """log p_t(ids[..., j]) (N, T, K) at the positions where keep (N, T) is set (0 elsewhere), with gradient through
    hidden (N, T, H) and weight (V, H); each chunk is checkpointed (module docstring)."""
    m = keep.bool()
    h, i = hidden[m], ids[m]  # (P, H), (P, K)
    rows = chunk_rows(weight.shape[0], hidden.device, chunk_size)
    parts = [
        checkpoint(_gathered, h[s : s + rows], weight, i[s : s + rows], temperature, use_reentrant=False)
        for s in range(0, h.shape[0], rows)
    ]
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    out = torch.zeros(*ids.shape, dtype=dtype, device=hidden.device)
    if not parts:  # no counted position
        return out
    return out.index_put(m.nonzero(as_tuple=True), torch.cat(parts).to(dtype))


def topk_of_logprobs(logp: torch.Tensor, keep: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) (N, T, K) of full log-softmax rows logp (N, T, V) (the model's own logits), 0 outside keep."""
    top = torch.topk(logp.detach(), min(k, logp.shape[-1]), dim=-1)
    m = keep.bool()[..., None]
    return torch.where(m, top.values, torch.zeros_like(top.values)), torch.where(m, top.indices, 0)
