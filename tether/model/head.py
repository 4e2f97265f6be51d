"""`CompletionHead`: a causal LM's head at a batch's completion positions, not yet applied, asked for the log-probs
of given token ids (with gradient) or for the most probable ids (without).

`tether.model.causal_lm.completion_head` builds it from a model and a batch: the decoder's final hidden states and
the head's weight when the head can be fused (every question then runs in `tether.model.ops`' (R, C) tiles, and
the (N, T, V) logits never exist), else the model's own logits divided by the temperature. The trainer asks it for
the sampled tokens' log-probs (one id per position) and, for TROLL, for each position's top-k and the log-probs of
a support of ids per position (tether.model.support).

Departures: none; the fused and unfused answers agree to float rounding (tests/model/test_fused_head.py,
tests/objectives/test_troll_objective.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .ops import IGNORE_INDEX, token_logprobs_and_entropy, top_logprobs


@dataclass(frozen=True)
class CompletionHead:
    """The LM head at a batch's completion positions, not yet applied: the decoder's final hidden states and the
    head's weight (fused: every question asked of it runs in tiles, the (N, T, V) logits never exist), or the
    model's own logits / tau (N, T, V) for a head that cannot be fused. `logprobs` gives the log-probs of given
    ids with gradient, `top` the most probable ids without; positions outside `loss_mask` give 0s."""

    loss_mask: torch.Tensor  # (N, T) bool: the positions scored (`Tokens.loss_mask` != 0)
    temperature: float  # tau > 0
    chunk_size: Optional[int]  # tokens per tile of the fused head (None: `tile_shape`'s)
    hidden: Optional[torch.Tensor] = None  # (N, T, H) with gradient: fused
    weight: Optional[torch.Tensor] = None  # (V, H): fused
    logits: Optional[torch.Tensor] = None  # (N, T, V) float32 (float64 for such a model), divided by tau: not fused

    @property
    def fused(self) -> bool:
        return self.hidden is not None

    @property
    def vocab(self) -> int:
        return self.weight.shape[0] if self.fused else self.logits.shape[-1]

    def logprobs(self, ids: torch.Tensor, with_entropy: bool = False):
        """log pi(ids) at each position, ids (N, T) or (N, T, S) -> the same shape, and the entropy (N, T) or
        None; with gradient, 0 outside `loss_mask`."""
        if self.fused:
            skip = ~self.loss_mask if ids.dim() == 2 else ~self.loss_mask[..., None]
            return token_logprobs_and_entropy(
                self.hidden,
                self.weight,
                ids.masked_fill(skip, IGNORE_INDEX),
                temperature=self.temperature,
                chunk_size=self.chunk_size,
                with_entropy=with_entropy,
            )
        logp = torch.log_softmax(self.logits, -1)
        lp = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1) if ids.dim() == 2 else logp.gather(-1, ids)
        ent = -(logp.exp() * logp).sum(-1) if with_entropy else None
        skip = ~self.loss_mask
        lp = lp.masked_fill(skip if ids.dim() == 2 else skip[..., None], 0.0)
        return lp, None if ent is None else ent.masked_fill(skip, 0.0)

    @torch.no_grad()
    def top(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most probable ids at each position (at most V), most probable first, and their log-probs
        (N, T, k) long and float32, without gradient; ids 0 and log-probs 0 outside `loss_mask`."""
        if not self.fused:
            values, ids = torch.log_softmax(self.logits.detach(), -1).topk(min(k, self.vocab), dim=-1)
            skip = ~self.loss_mask[..., None]
            return ids.masked_fill(skip, 0), values.masked_fill(skip, 0.0)
        N, T, H = self.hidden.shape
        rows = self.loss_mask.reshape(-1).nonzero().squeeze(1)
        ids, values = top_logprobs(
            self.hidden.detach().reshape(N * T, H).index_select(0, rows),
            self.weight.detach(),
            k,
            temperature=self.temperature,
            chunk_size=self.chunk_size,
        )
        k = ids.shape[1]
        out_ids = ids.new_zeros(N * T, k).index_copy(0, rows, ids)
        return out_ids.view(N, T, k), values.new_zeros(N * T, k).index_copy(0, rows, values).view(N, T, k)
