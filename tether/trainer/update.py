"""The policy and its optimiser steps: `ppo_epochs x mini_batches` updates on one scored batch.

    for epoch in 1..ppo_epochs:
        for mini-batch (whole prompt groups, in a seeded order):       one optimiser step each
            for micro-batch of at most trainer.micro_batch_size rows (or trainer.micro_batch_tokens real tokens):
                loss = objective(its rows) / the mini-batch's normaliser, backward    (gradients accumulate)
            clip the gradient norm; step AdamW and the schedule (a non-finite loss or gradient: skipped)

The normaliser is the objective's over the whole mini-batch (docs/algorithms/advantages_aggregation.md), so a
micro-batch's loss is its share of the mini-batch objective and the accumulated gradient is the objective's,
whatever `trainer.micro_batch_size` (or `trainer.micro_batch_tokens`) is, and whether the forwards are packed
(`trainer.packing`, tether.model.packing: the objective reads the same (N, T) tensors either way). Group
statistics (ETR's) are computed once over the whole batch and
sliced per micro-batch. Metrics merge exactly over micro-batches (`objectives.MetricMerger`) and come to the host
in one sync per step.

Shapes: N rows (completions) of the batch, T completion tokens per row (`jaxtyping` annotations; the tests run a
step with them checked, tests/trainer/test_step_shapes.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .. import faults, objectives
from ..config.sections import TrainerConfig
from ..core.etr import GroupStats
from ..core.troll import SparseSet
from ..model.causal_lm import LogProbSettings, Precision, Tokens, head_pass
from ..model.packing import token_batches
from ..model.support import SupportLogprobs, on_support, rows_of


@dataclass(frozen=True)
class Policy:
    """The model being trained and what updates it, and how its log-probs are computed."""

    model: Any  # the policy (under LoRA: the base model with the adapters injected)
    peft: Any  # the peft wrapper under model.lora (its `disable_adapter` gives the reference), else None
    optimizer: torch.optim.Optimizer
    scheduler: Any  # the learning-rate schedule, stepped with the optimiser
    device: torch.device
    precision: Precision  # bf16 autocast or not, for every forward pass
    logprob_settings: LogProbSettings  # how every log-prob pass runs (old policy, reference, update)


@dataclass(frozen=True)
class TeacherScores:
    """The distillation teacher's scores of a batch (`tether.trainer.teacher`), without gradient."""

    logprobs: Float[Tensor, "N T"]  # of the sampled tokens
    topk_logprobs: Optional[Float[Tensor, "N T K"]] = None  # its K largest at each position (forward_kl_topk)
    topk_ids: Optional[Int[Tensor, "N T K"]] = None  # their token ids: the student's log-probs are taken at these

    def select(self, idx: Int[Tensor, " M"]) -> "TeacherScores":
        def rows(x: Optional[Tensor]) -> Optional[Tensor]:
            return None if x is None else x[idx]

        return TeacherScores(self.logprobs[idx], rows(self.topk_logprobs), rows(self.topk_ids))


@dataclass(frozen=True)
class UpdateBatch:
    """A scored batch as the updates read it, on the training device: the data, now tokens with their
    advantages and the log-probs of the policies the objective compares."""

    tokens: Tokens  # input ids and the (N, T) loss mask: 1 for a counted completion token
    advantages: Union[Float[Tensor, " N"], Float[Tensor, "N T"]]
    rewards: Float[Tensor, " N"]
    group_ids: Int[Tensor, " N"]
    old_logprobs: Optional[Float[Tensor, "N T"]]  # None: one update per batch, on-policy (pi_old = pi_theta)
    ref_logprobs: Optional[Float[Tensor, "N T"]] = None  # when the objective uses a reference
    sampler_logprobs: Optional[Float[Tensor, "N T"]] = None  # the engine's, for rollout correction
    group_stats: Optional[GroupStats] = None  # over the whole batch (`Objective.group_stats`), set by `update`
    old_set: Optional[SparseSet] = None  # pi_old's most probable tokens (N, T, K), for a sparse-support objective
    teacher: Optional[TeacherScores] = None  # when the objective distills

    def select(
        self,
        idx: Int[Tensor, " M"],
        logprobs: Float[Tensor, "M T"],
        entropy: Float[Tensor, "M T"],
        loss_norm,
        support: Optional[SupportLogprobs] = None,
        student_topk: Optional[Float[Tensor, "M T K"]] = None,
    ) -> objectives.TokenBatch:
        """Rows `idx` (a micro-batch) as the objective reads them, around their log-probs and entropy under
        the policy being updated (and their sparse supports, `support`, or the policy's log-probs of the teacher's
        top-k tokens, `student_topk`); `loss_norm` is the mini-batch normaliser."""

        def rows(x: Optional[Tensor]) -> Optional[Tensor]:
            return None if x is None else x[idx]

        teacher = None if self.teacher is None else self.teacher.select(idx)
        return objectives.TokenBatch(
            logprobs=logprobs,
            old_logprobs=logprobs.detach() if self.old_logprobs is None else self.old_logprobs[idx],
            advantages=self.advantages[idx],
            loss_mask=self.tokens.loss_mask[idx],
            ref_logprobs=rows(self.ref_logprobs),
            group_ids=self.group_ids[idx],
            rewards=self.rewards[idx],
            sampler_logprobs=rows(self.sampler_logprobs),
            entropy=entropy,
            loss_norm=loss_norm,
            group_stats=None if self.group_stats is None else self.group_stats.select(idx),
            teacher_logprobs=None if teacher is None else teacher.logprobs,
            teacher_topk_logprobs=None if teacher is None else teacher.topk_logprobs,
            student_topk_logprobs=student_topk,
            **({} if support is None else support.batch_fields()),
        )


def update(
    policy: Policy, obj: objectives.Objective, batch: UpdateBatch, t: TrainerConfig, gen: torch.Generator
) -> tuple[dict[str, float], int]:
    """ppo_epochs x mini-batches optimiser steps (module docstring); returns the step's metrics, on the host,
    and the optimiser steps taken (a step skipped for a non-finite loss or gradient is not one)."""
    device = batch.tokens.input_ids.device
    flat = not obj.uses_teacher() and not bool(batch.advantages.ne(0).any())  # a teacher's signal is never flat
    if t.skip_flat_steps and flat:  # every group flat: nothing to learn from
        return _host_metrics({}, [], {"loss": 0, "gradient": 0}, device, flat=True), 0
    batch = dataclasses.replace(batch, group_stats=obj.group_stats(batch.rewards, batch.group_ids))  # None unless read
    merger = objectives.MetricMerger()
    skipped = {"loss": 0, "gradient": 0}
    grad_norms = []
    params = [p for p in policy.model.parameters() if p.requires_grad]
    lengths = batch.tokens.attention_mask.sum(1).cpu() if t.micro_batch_tokens > 0 else None  # for a token budget
    for _ in range(t.ppo_epochs):
        for mb_groups in mini_batches(batch.group_ids.cpu(), t.mini_batches, gen):
            norm = obj.normalizer(batch.tokens.loss_mask[torch.cat(mb_groups).to(device)])
            loss_bad = torch.zeros((), dtype=torch.bool, device=device)
            for idx in micro_batches(mb_groups, t.micro_batch_size, lengths, t.micro_batch_tokens):
                out = _micro_step(policy, obj, batch, idx.to(device), norm)
                loss_bad = loss_bad | ~torch.isfinite(out.loss.detach())
                merger.add(out)
            merger.end_mini_batch()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm if t.max_grad_norm > 0 else float("inf"))
            if torch.isfinite(grad_norm):  # one host sync per optimiser step
                grad_norms.append(grad_norm)
                policy.optimizer.step()
                policy.scheduler.step()
            else:  # a NaN/inf loss or gradient: skip this update, keep the weights as they were
                skipped["loss" if loss_bad.item() else "gradient"] += 1
            policy.optimizer.zero_grad(set_to_none=True)
    return _host_metrics(merger.result(), grad_norms, skipped, device), len(grad_norms)


def mini_batches(groups: Int[Tensor, " N"], n_mini: int, gen: torch.Generator) -> list[list[Int[Tensor, " G"]]]:
    """Split the rows into n_mini mini-batches of whole groups, in a seeded random order: each mini-batch a list
    of groups, each group the index tensor of its rows."""
    ids = sorted(set(groups.tolist()))
    order = [ids[i] for i in torch.randperm(len(ids), generator=gen).tolist()]
    chunks = [order[i::n_mini] for i in range(n_mini)]
    return [[torch.nonzero(groups == g).flatten() for g in chunk] for chunk in chunks if chunk]


def micro_batches(
    groups: list[Int[Tensor, " G"]], size: int, lengths: Optional[Int[Tensor, " N"]] = None, tokens: int = 0
) -> list[Int[Tensor, " M"]]:
    """Whole groups packed into micro-batches of at most `size` rows (at least one group each): groups are kept
    whole for readability, not for correctness (group statistics come from the whole batch). With a token budget
    `tokens` > 0, the mini-batch's rows (`lengths`: real tokens per row of the batch) in balanced micro-batches of
    at most that many tokens (`packing.token_batches`), groups split where the budget asks."""
    if tokens > 0:
        rows = torch.cat(groups)
        parts = token_batches(lengths[rows].tolist(), tokens)
        return [rows[torch.tensor(part)] for part in parts]
    out, cur, n = [], [], 0
    for g in groups:
        if cur and n + len(g) > size:
            out.append(torch.cat(cur))
            cur, n = [], 0
        cur.append(g)
        n += len(g)
    if cur:
        out.append(torch.cat(cur))
    return out


def _micro_step(policy: Policy, obj: objectives.Objective, batch: UpdateBatch, idx: Int[Tensor, " M"], norm):
    """Forward and backward of one micro-batch (rows `idx`), its loss the mini-batch share `norm`; for an objective
    with a sparse support, the forward also gives its supports (tether.model.support), and for one that distils
    to a teacher's top-k, the policy's log-probs of those tokens."""
    tokens, size, support, gathered = batch.tokens.select(idx), obj.config.sparse_support(), None, None
    ids = None if batch.teacher is None or batch.teacher.topk_ids is None else batch.teacher.topk_ids[idx]
    with policy.precision():
        if size is None:
            p = head_pass(policy.model, tokens, policy.logprob_settings, True, gather_ids=ids)
            lp, ent, gathered = p.logprobs, p.entropy, p.gathered
        else:
            old_lp = None if batch.old_logprobs is None else batch.old_logprobs[idx]
            old_set = rows_of(batch.old_set, idx)
            lp, ent, support = on_support(policy.model, tokens, policy.logprob_settings, size, old_set, old_lp)
    ent = ent if obj.config.trains_entropy else ent.detach()
    out = obj(batch.select(idx, lp, ent, norm, support, gathered))
    out.loss.backward()
    faults.point("update")
    return out


def _host_metrics(
    metrics: dict[str, Tensor], grad_norms: list[Tensor], skipped: dict[str, int], device: torch.device, flat=False
) -> dict[str, float]:
    """The merged metrics with the optimiser's, brought to the host in one sync (`flat`: the step took no optimiser
    step because every advantage was 0, trainer.skip_flat_steps)."""
    nan = torch.tensor(float("nan"), device=device)
    metrics["optim/flat_skipped"] = torch.tensor(float(flat), device=device)
    metrics["optim/grad_norm"] = torch.stack(grad_norms).float().mean() if grad_norms else nan
    metrics["optim/skipped_updates"] = torch.tensor(float(sum(skipped.values())), device=device)
    metrics["optim/skipped_nonfinite_loss"] = torch.tensor(float(skipped["loss"]), device=device)
    metrics["optim/skipped_nonfinite_grad"] = torch.tensor(float(skipped["gradient"]), device=device)
    keys = list(metrics)
    values = torch.stack([metrics[k].to(device).double() for k in keys]).tolist()  # the one host sync
    return dict(zip(keys, values))
