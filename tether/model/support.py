"""What an objective with a sparse support (TROLL: `ObjectiveConfig.sparse_support()`) reads, computed from the
model for tether's trainer and for the TRL and verl adapters alike (docs/algorithms/troll.md, "What the trainer
feeds"):

    old pass   pi_old's log-probs (N, T) and, from the same forwards, its set of most probable tokens at every
               position: ids (N, T, K) int32, log-probs (N, T, K) float32, keep (N, T, K) bool (`old_with_set`)
    update     per micro-batch, from one forward: pi_theta's own set (no gradient), the support = pi_old's set
               U pi_theta's set U the sampled token (width S = 2K + 1), pi_theta's log-probs on it with gradient
               and pi_old's there from its stored set (`on_support`)

Memory: pi_old's set is 9 K bytes per token for the whole batch (576 bytes at K = 64), never (N, T, V): the fused
head computes each top-K in (R, C) tiles (`tether.model.ops.top_logprobs`), a head that cannot be fused one
forward's logits at a time. Compute: the old pass adds a running top-K to its head; the update's forward adds a
gradient-free pass of its head for pi_theta's own top-K, and its log-probs are gathered at S ids per position
instead of one. With one update per batch (`TrainerConfig.ratio_is_one`, no staleness) the old pass is skipped
and pi_old's log-probs on the support are pi_theta's, detached: nothing is projected.

Shapes: N rows, T completion tokens, K tokens per set, S support entries (`jaxtyping` annotations).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..core import troll as _troll
from ..core.troll import SparseSet
from .causal_lm import LogProbSettings, Tokens, batched_logprobs_and_top, completion_head
from .head import CompletionHead

SupportSize = Any
"""`tether.objectives.SupportSize` (`top_k`, `mass`): how large a set is; the model layer reads its two fields."""


class SupportLogprobs(NamedTuple):
    """One micro-batch's sparse supports, as `TokenBatch`'s four support_* fields read them."""

    logprobs: Float[Tensor, "M T S"]  # log pi_theta at the support, with gradient
    old_logprobs: Optional[Float[Tensor, "M T S"]]  # log pi_old there; None: on-policy (pi_theta's, detached)
    mask: Bool[Tensor, "M T S"]  # which entries count
    token_index: Int[Tensor, "M T"]  # the sampled token's entry
    index: Int[Tensor, "M T S"]  # the entries' vocabulary ids (ascending; 0 where `mask` is False)

    def batch_fields(self) -> dict[str, Tensor]:
        """`TokenBatch`'s four support_* fields (on-policy, pi_old's log-probs on the support are pi_theta's,
        detached): what tether's update and the TRL adapter both pass the objective."""
        old = self.logprobs.detach() if self.old_logprobs is None else self.old_logprobs
        return dict(
            support_logprobs=self.logprobs,
            old_support_logprobs=old,
            support_mask=self.mask,
            support_token_index=self.token_index,
        )


@torch.no_grad()
def old_with_set(model, tokens: Tokens, settings: LogProbSettings, size: SupportSize) -> tuple[Tensor, SparseSet]:
    """pi_old's log-probs (N, T) and its set of most probable tokens per position (`SparseSet`, (N, T, K)): at most
    `size.top_k`, while the mass before a token is below `size.mass`, only at positions `tokens.loss_mask` counts. The
    caller sets eval mode and the precision, as for `batched_logprobs`."""
    lp, ids, logp = batched_logprobs_and_top(model, tokens, size.top_k, settings)
    keep = _troll.mass_cut(logp, size.mass) & tokens.loss_mask.bool()[..., None]
    return lp, SparseSet(ids, logp, keep)


def rows_of(old: Optional[SparseSet], idx: Int[Tensor, " M"]) -> Optional[SparseSet]:
    """Rows `idx` (a micro-batch) of a stored set."""
    return None if old is None else SparseSet(*(x[idx] for x in old))


def on_support(
    model,
    tokens: Tokens,
    settings: LogProbSettings,
    size: SupportSize,
    old: Optional[SparseSet],
    old_lp: Optional[Float[Tensor, "M T"]],
) -> tuple[Float[Tensor, "M T"], Float[Tensor, "M T"], SupportLogprobs]:
    """One micro-batch's forward for a sparse-support objective: the sampled tokens' log-probs (M, T) and the
    entropy (M, T), both with gradient, and the supports (`SupportLogprobs`). `old` is pi_old's stored set of these
    rows and `old_lp` its log-probs of the sampled tokens (both None on-policy). 0s outside `tokens.loss_mask`."""
    return support_of(completion_head(model, tokens, settings), tokens.completion_ids, size, old, old_lp)


@torch.no_grad()
def set_of(head: CompletionHead, size: SupportSize) -> SparseSet:
    """The head's set of most probable tokens at each position it scores (`SparseSet`, (M, T, K)): at most
    `size.top_k`, while the mass before a token is below `size.mass`; what `old_with_set` keeps of pi_old."""
    ids, logp = head.top(size.top_k)
    return SparseSet(ids, logp, _troll.mass_cut(logp, size.mass) & head.loss_mask[..., None])


def support_of(
    head: CompletionHead,
    completion_ids: Int[Tensor, "M T"],
    size: SupportSize,
    old: Optional[SparseSet],
    old_lp: Optional[Float[Tensor, "M T"]],
    with_entropy: bool = True,
) -> tuple[Float[Tensor, "M T"], Optional[Float[Tensor, "M T"]], SupportLogprobs]:
    """`on_support` from a head already run (`CompletionHead`: the model's hidden states, or its logits, as verl's
    engine has them): pi_theta's own set (without gradient), the support = pi_old's set U pi_theta's U the sampled
    token, and pi_theta's log-probs there and its entropy (unless `with_entropy` is False), with gradient."""
    own = set_of(head, size)
    ids, keep = own.ids, own.keep
    if old is not None:
        ids, keep = torch.cat([old.ids.long(), ids], -1), torch.cat([old.keep, keep], -1)
    support = _troll.union_support(ids, keep, completion_ids, head.vocab)
    lp_support, entropy = head.logprobs(support.index, with_entropy=with_entropy)  # (M, T, S)
    lp = lp_support.gather(-1, support.token_index[..., None])[..., 0]
    old_support = None
    if old is not None:
        known = old.ids.long()
        old_support = _troll.old_on_support(support, known, old.logp, old.keep, head.vocab, old_lp)
    return lp, entropy, SupportLogprobs(lp_support, old_support, support.mask, support.token_index, support.index)
