"""One RL step, top to bottom: `rl_step(parts, counters, step)`.

    1. collect    the sampler draws prompts_per_step x group_size completions       -> RolloutBatch (sampled)
                  (the policy of step t - s under trainer.staleness s), the reward
                  scores them (dynamic sampling: refill groups with one reward)     -> RolloutBatch (scored)
    2. tokens     the batch as model inputs and a loss mask: padding, a token with
                  a non-finite sampler log-prob and (trainer.mask_truncated) a
                  truncated completion do not count                                 -> Tokens (N rows, T tokens)
    3. advantages objective.advantages(rewards, groups, lengths)                    (N,) or (N, T)
    4. log-probs  pi_old's (recomputed before any update, or the sampler's), the
                  reference's when the objective uses one, and the teacher's when it
                  distills (with its top-k for forward_kl_topk)                     -> UpdateBatch (for the update)
    5. update     ppo_epochs x mini_batches optimiser steps (tether.trainer.update)
    6. refresh    the reference becomes the policy (or moves part of the way to it) every K optimiser steps or
                  on a KL threshold
    7. metrics    one dict: the update's, the batch's, the sampler's, the seconds of each phase

What it needs comes in `StepParts`, named parts: the `Policy` and what updates it, where the batch comes
from (`RolloutSource`), the objective, the `Reference`, the settings (the trainer and rollout sections) and the
distillation `Teacher` when there is one (tether.trainer.teacher). The trainer's loop calls it, and so do the
benchmarks (benchmarks/rl_step.py, benchmarks/overlap.py): every timing of "tether's step" is of this function.

Log-probs are computed at the sampling temperature (logits / T), as the sampler drew them, by tether.model.ops'
chunked LM head (trainer.fused_logprobs): the (N, T, V) logits are never held; the samples of one prompt run
that prompt once (trainer.share_prompts). Shapes: N rows, T completion tokens (`jaxtyping` annotations).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
from jaxtyping import Float
from torch import Tensor

from .. import faults, objectives
from ..config.sections import RolloutConfig, TrainerConfig
from ..core import entropy as _entropy
from ..core.advantages import zero_variance_fraction
from ..core.masked import group_summary
from ..core.troll import SparseSet
from ..envs import episode_metrics
from ..objectives import SupportSize
from ..model.causal_lm import LogProbSettings, Tokens, batched_logprobs, eval_mode, to_tokens
from ..model.packing import forward_rows, padding_share
from ..rewards import Reward, reward_parts, score_rollout, solved, verifier_faults
from ..rollout import RolloutBatch, SamplingParams
from . import seeds
from .data import PromptStream
from .sampling import Sampler
from .progress import Counters
from ..model.support import old_with_set
from .teacher import Teacher
from .update import Policy, UpdateBatch, update


@dataclass(frozen=True)
class RolloutSource:
    """Where each step's batch comes from: the sampler (on-policy, stale or overlapped), the prompt stream,
    the training reward and how to sample."""

    sampler: Sampler
    stream: PromptStream
    reward_fn: Reward
    params: SamplingParams
    pad_id: int


@dataclass(frozen=True)
class Reference:
    """The reference policy when the objective uses one: a frozen copy (`model`), or under LoRA the policy's
    base model with its adapters disabled (`model` None: no second copy of the weights)."""

    model: Any = None

    def ref_logprobs(self, policy: Policy, tokens: Tokens) -> Float[Tensor, "N T"]:
        with policy.precision():
            if self.model is not None:
                return batched_logprobs(self.model, tokens, policy.logprob_settings)
            with policy.peft.disable_adapter(), eval_mode(policy.model):
                return batched_logprobs(policy.model, tokens, policy.logprob_settings)


@dataclass(frozen=True)
class StepParts:
    """Everything one RL step reads (module docstring)."""

    policy: Policy
    source: RolloutSource
    objective: objectives.Objective
    reference: Reference
    trainer: TrainerConfig
    rollout: RolloutConfig
    teacher: Optional[Teacher] = None  # on-policy distillation's (objective.distill), else None


def rl_step(parts: StepParts, counters: Counters, step: int) -> tuple[RolloutBatch, dict[str, float]]:
    """RL step `step` (module docstring); returns the scored batch and the step's metrics (one host sync, in the
    update). Counts the step, its optimiser steps and reference refreshes in `counters`."""
    policy, obj, t, sampler = parts.policy, parts.objective, parts.trainer, parts.source.sampler
    tic = time.perf_counter()
    policy.model.eval()
    with policy.precision(), sampler.sampling(step) as sampler_step:  # the policy of step t - s (trainer.staleness)
        scored, sampled = collect(parts.source, parts.rollout, seeds.rollout(seeds.sampling_root(t), step))
    policy.model.train()
    tokens, excluded = tokens_for_update(scored, parts)
    by_part = reward_parts(parts.source.reward_fn, scored.results) if obj.needs_reward_parts() else None
    lengths = scored.completion_lengths.float()  # the policy's tokens
    advantages = obj.advantages(scored.rewards, scored.group_ids, lengths, by_part).to(policy.device)
    clock = {"start": _clocked(policy.device)}
    old_lp, old_set = old_logprobs_and_set(policy, tokens, scored, t, obj.config.sparse_support())
    clock["old"] = _clocked(policy.device)
    ref_lp = parts.reference.ref_logprobs(policy, tokens) if obj.uses_reference() else None
    clock["ref"] = _clocked(policy.device)
    teacher = parts.teacher.scores(policy, tokens) if parts.teacher is not None else None
    clock["teacher"] = _clocked(policy.device)
    sampler_lp = sampler_logprobs(scored, tokens)
    rewards, groups = scored.rewards.to(policy.device), scored.group_ids.to(policy.device)
    batch = UpdateBatch(
        tokens, advantages, rewards, groups, old_lp, ref_lp, sampler_lp, old_set=old_set, teacher=teacher
    )
    gen = torch.Generator().manual_seed(seeds.minibatch_order(seeds.minibatch_root(t), step))
    step_obj, control = entropy_control(obj, t, counters, sampler_lp, tokens.loss_mask)  # obj unless adaptive
    metrics, taken = update(policy, step_obj, batch, t, gen)
    metrics["time/old_logprobs_s"] = 0.0 if old_lp is None else clock["old"] - clock["start"]  # a skipped pass: 0
    metrics["time/ref_logprobs_s"] = 0.0 if ref_lp is None else clock["ref"] - clock["old"]
    metrics["time/teacher_logprobs_s"] = 0.0 if teacher is None else clock["teacher"] - clock["ref"]
    metrics["time/update_s"] = _clocked(policy.device) - clock["teacher"]
    counters.step, counters.opt_steps = step, counters.opt_steps + taken
    metrics.update(entropy_advanced(control, counters, taken))
    metrics.update(sampled)
    metrics["rollout/nonfinite_sampler_logprobs"] = excluded["nonfinite_sampler"]
    metrics["tokens/counted"] = float(tokens.loss_mask.sum())
    metrics.update({f"tokens/excluded_{reason}": excluded[reason] for reason in EXCLUDED})
    metrics.update(padding_metrics(tokens, policy.logprob_settings))
    metrics.update(sampler.metrics(step - sampler_step, sampler_lp, old_lp, tokens.loss_mask))
    refresh_reference(parts.reference, policy.model, t, counters, taken, metrics.get("kl/ref"))
    metrics["optim/lr"] = policy.scheduler.get_last_lr()[0]
    metrics["ref/updates"] = float(counters.ref_updates)
    metrics["time/step_s"] = time.perf_counter() - tic
    return scored, metrics


# ---------------------------------------------------------------- 1. collect


def rollout_metrics(rollout: RolloutBatch, rewards: torch.Tensor, groups: torch.Tensor) -> dict[str, float]:
    lengths = rollout.completion_lengths.float()
    return {
        "reward/mean": rewards.mean().item(),
        "reward/pass_rate": solved(rewards).float().mean().item(),
        "rollout/len_mean": lengths.mean().item(),
        "rollout/len_max": lengths.max().item(),
        "rollout/truncation_rate": rollout.truncated.float().mean().item(),
        "adv/zero_var_frac": zero_variance_fraction(rewards, groups).item(),
    }


def _clocked(device: torch.device) -> float:
    """`time.perf_counter()` after the device's queued work is done (CUDA runs asynchronously: without
    the wait, one phase's kernels would be billed to the next)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def collect(source: RolloutSource, r: RolloutConfig, seed: int) -> tuple[RolloutBatch, dict[str, float]]:
    """Sample and score one batch; with dynamic sampling, drop flat groups and sample more. Returns the
    batch and its rollout and reward metrics, with the seconds spent sampling (`time/sample_s`) and
    scoring (`time/score_s`)."""
    sampler, stream, reward_fn, params = source.sampler, source.stream, source.reward_fn, source.params
    want = r.prompts_per_step
    kept: list[RolloutBatch] = []  # the live groups of each round, scored
    first_metrics = None
    rounds = 1 + (r.dynamic_sampling_max_rounds if r.dynamic_sampling else 0)
    have = 0
    seconds = {"time/sample_s": 0.0, "time/score_s": 0.0}  # summed over dynamic sampling's rounds
    for k in range(rounds):
        examples = stream.take(want - have if k else want)
        tic = time.perf_counter()
        rollout = sampler.generate(examples, n=r.group_size, params=params, seed=seeds.refill(seed, k))
        faults.point("rollout")
        seconds["time/sample_s"] += _clocked(rollout.mask.device) - tic
        tic = time.perf_counter()
        scored = score_rollout(reward_fn, rollout, examples)
        seconds["time/score_s"] += time.perf_counter() - tic
        rewards, groups = scored.rewards, scored.group_ids
        if first_metrics is None:
            first_metrics = {
                **rollout_metrics(rollout, rewards, groups),
                **verifier_faults(scored.results),
                **episode_metrics(rollout),
            }
            first_metrics.update(seconds)  # the same dict: the later rounds' seconds add to it
            seconds = first_metrics
        if not r.dynamic_sampling:
            return scored, first_metrics
        s = group_summary(rewards, groups)
        live = s["max"] > s["min"]
        live_prompts = set(sorted(set(groups[live].tolist()))[: want - have])
        if live_prompts:
            keep = [i for i, g in enumerate(rollout.prompt_index) if g in live_prompts]
            kept.append(scored.select(keep))  # its examples and results travel with the rows
            have += len(live_prompts)
        if have >= want:
            break
    if not kept:  # every group was flat: train on the last batch (zero advantages)
        return scored, {**first_metrics, "rollout/dynamic_kept_frac": 0.0}
    merged = RolloutBatch.concat(kept, source.pad_id)
    return merged, {**first_metrics, "rollout/dynamic_kept_frac": have / want}


# ---------------------------------------------------------------- 2. tokens and 4. log-probs


def padding_metrics(tokens: Tokens, settings: LogProbSettings) -> dict[str, float]:
    """The share of padding in the positions each pass computes (`packing.padding_share`): the sampler's prefill
    (its left-padded distinct prompts, `rollout/prefill_pad_frac`), the log-prob passes and the update, both in
    the log-prob passes' forwards (`tokens/pad_frac`; the update's micro-batches are cut the same way within each
    mini-batch), packed or padded as `trainer.packing` says."""
    p = tokens.prompt_len
    prompts = torch.unique(torch.cat([tokens.input_ids[:, :p], tokens.attention_mask[:, :p]], 1), dim=0)  # (U, 2P)
    real = int(prompts[:, p:].sum())
    return {
        "rollout/prefill_pad_frac": 1.0 - real / max(prompts.shape[0] * p, 1),
        "tokens/pad_frac": padding_share(
            tokens, forward_rows(tokens, settings), settings.share_prompts, settings.pack, settings.pack_width
        ),
    }


def tokens_for_update(rollout: RolloutBatch, parts: StepParts) -> tuple[Tokens, dict[str, float]]:
    """The batch as model inputs with its loss mask, `Tokens.loss_mask`, the one definition of the tokens that count
    (module docstring, 2), and how many completion positions left it, by reason (`EXCLUDED`): padding, an
    environment's tokens, a non-finite sampler log-prob, a truncated completion (trainer.mask_truncated). A token
    leaves for the first reason that applies, in that order. (The objective's own masks, the off-policy sequence
    mask and rollout-correction rejection, act inside the loss and log their own fractions.)"""
    tokens = to_tokens(rollout, parts.source.pad_id, parts.policy.device)
    real = rollout.mask.bool().to(tokens.loss_mask.device)
    excluded = {"padding": float((~real).sum()), "environment": float((real & (tokens.loss_mask == 0)).sum())}
    tokens, excluded["nonfinite_sampler"] = finite_sampler_tokens(rollout, tokens)
    before = float(tokens.loss_mask.sum())
    if parts.trainer.mask_truncated:
        tokens, _ = truncated_out(rollout, tokens)
    excluded["truncated"] = before - float(tokens.loss_mask.sum())
    return tokens, excluded


EXCLUDED = ("padding", "environment", "nonfinite_sampler", "truncated")
"""The reasons a completion position is not counted, each logged as `tokens/excluded_<reason>` (positions of the
batch's (N, T) completion columns), beside `tokens/counted`."""


def old_logprobs_of(policy: Policy, tokens: Tokens, rollout: RolloutBatch, t: TrainerConfig) -> Optional[Tensor]:
    """pi_old's log-probs (N, T), before any update: recomputed in eval mode, as the sampler ran
    (a model with dropout would otherwise give a dropout sample of pi_old), or the sampler's own
    (trainer.old_logprobs=sampler: the same weights, no extra pass). None when there is a single
    update per rollout batch (ppo_epochs x mini_batches = 1): it is on-policy, pi_old is the policy
    being differentiated, and `update` uses its log-probs, detached (the pass is skipped)."""
    if t.old_logprobs == "sampler":
        return sampler_logprobs(rollout, tokens)
    if t.ratio_is_one and t.staleness == 0:  # stale: pi_old (the current policy) is logged
        return None
    with eval_mode(policy.model), policy.precision():
        return batched_logprobs(policy.model, tokens, policy.logprob_settings)


def old_logprobs_and_set(
    policy: Policy, tokens: Tokens, rollout: RolloutBatch, t: TrainerConfig, support: Optional[SupportSize]
) -> tuple[Optional[Tensor], Optional[SparseSet]]:
    """`old_logprobs_of` and, for an objective with a sparse support (`support`, its `sparse_support()`: TROLL),
    pi_old's most probable tokens per position kept by the same recompute (`tether.model.support.old_with_set`),
    else None. The sampler has no such set (refused); on-policy the pass is skipped, as `old_logprobs_of` skips it."""
    if support is None:
        return old_logprobs_of(policy, tokens, rollout, t), None
    if t.old_logprobs == "sampler":
        raise ValueError(SAMPLER_HAS_NO_SET)
    if t.ratio_is_one and t.staleness == 0:
        return None, None
    with eval_mode(policy.model), policy.precision():
        return old_with_set(policy.model, tokens, policy.logprob_settings, support)


SAMPLER_HAS_NO_SET = (
    "the objective reads pi_old's most probable tokens at every position (a sparse support: TROLL), and "
    "trainer.old_logprobs=sampler gives only the sampled token's log-prob from the engine; set "
    "trainer.old_logprobs=recompute"
)
"""The refusal of a sparse-support objective with the sampler's log-probs as pi_old (`config.loading` checks it
before a run starts, with the objective's name)."""


def finite_sampler_tokens(rollout, tokens: Tokens) -> tuple[Tokens, float]:
    """`tokens` with every counted token whose sampler log-prob is not finite (NaN, +-inf) taken out of the loss
    mask, and how many there were (`rollout/nonfinite_sampler_logprobs`). Such a token has no trustworthy
    sampler probability: under trainer.old_logprobs=sampler it has no pi_old, and its rollout-correction
    weight, off-policy drift or M2 statistic would be a guess (TRL counts a NaN as no drift, 0), so it leaves
    the loss like padding, in every setting, rather than train on a made-up number (docs/metrics.md)."""
    lp = rollout.sampler_logprobs.to(device=tokens.loss_mask.device, dtype=torch.float32)
    bad = ~torch.isfinite(lp) & tokens.loss_mask.bool()
    n_bad = float(bad.sum().item())
    if n_bad:
        tokens = dataclasses.replace(
            tokens, loss_mask=torch.where(bad, torch.zeros_like(tokens.loss_mask), tokens.loss_mask)
        )
    return tokens, n_bad


def truncated_out(rollout, tokens: Tokens) -> tuple[Tokens, float]:
    """`tokens` with every token of a completion that stopped on its length budget (finish reason `length`) out
    of the loss mask, and how many such completions there were (`trainer.mask_truncated`: overlong filtering).
    The advantages are computed from the rewards before this, so a truncated completion still counts in its
    group's baseline, as in TRL, NeMo-RL and SkyRL; a row left with no token leaves the seq-mean normalisers."""
    cut = rollout.truncated.to(tokens.loss_mask.device)  # (N,)
    n_cut = float(cut.sum().item())
    if n_cut:
        tokens = dataclasses.replace(
            tokens, loss_mask=torch.where(cut[:, None], torch.zeros_like(tokens.loss_mask), tokens.loss_mask)
        )
    return tokens, n_cut


def sampler_logprobs(rollout, tokens: Tokens) -> torch.Tensor:
    """The sampler's log-probs (N, T) float32, 0 wherever `tokens.loss_mask` does not count (padding, and a
    non-finite value `finite_sampler_tokens` took out: NaN * 0 would still be NaN)."""
    lp = rollout.sampler_logprobs.to(device=tokens.loss_mask.device, dtype=torch.float32)
    return torch.where(tokens.loss_mask.bool(), lp, torch.zeros_like(lp))


# ---------------------------------------------------------------- 5. adaptive entropy control


@dataclass(frozen=True)
class EntropyStep:
    """One rollout step of adaptive entropy control (`trainer.entropy_target`; `tether.core.entropy`)."""

    entropy: float  # e_k, the sampling policy's entropy estimated from the batch (NaN: no counted token)
    coef: float  # c_k, carried from the previous step (objective.entropy_coef at the first)
    alpha: float  # the bonus coefficient this step applies, c_k 1[e_k <= target]
    coef_next: float  # c_{k+1}, if this step takes an optimiser step


def entropy_control(
    obj: objectives.Objective, t: TrainerConfig, counters: Counters, sampler_lp: Float[Tensor, "N T"], mask: Tensor
) -> tuple[objectives.Objective, Optional[EntropyStep]]:
    """The objective this step trains with, its entropy bonus set by adaptive entropy control, and that step of
    the control; `obj` itself and None when `trainer.entropy_target` is null. `mask` (N, T) marks the counted
    tokens. The entropy is -mean_m(log pi_sampler) over them (`core.entropy.sampled_entropy`; one host sync), the
    full softmax's (the config requires rollout.top_p = 1): the rollout's own estimate, before any update."""
    if t.entropy_target is None:
        return obj, None
    c = obj.config.entropy_coef if counters.entropy_coef is None else counters.entropy_coef
    e = float(_entropy.sampled_entropy(sampler_lp, mask))
    alpha, c_next = _entropy.adaptive_entropy_coef(
        c, e, t.entropy_target, t.entropy_coef_step, t.entropy_coef_min, t.entropy_coef_max
    )
    return obj.with_entropy_coef(alpha), EntropyStep(e, c, alpha, c_next)


def entropy_advanced(control: Optional[EntropyStep], counters: Counters, taken: int) -> dict[str, float]:
    """Carries the coefficient to the next step in `counters` (checkpointed: a resume continues it), moved only
    when the step took an optimiser step (a flat or non-finite step trained nothing, as Skywork-OR1 skips a batch
    left with no signal); the control's metrics (docs/metrics.md). Nothing when the control is off."""
    if control is None:
        return {}
    counters.entropy_coef = control.coef_next if taken else control.coef
    return {
        "policy/entropy_coef": control.alpha,
        "policy/entropy_coef_next": counters.entropy_coef,
        "policy/entropy_rollout": control.entropy,
    }


# ---------------------------------------------------------------- 6. the reference refresh


KL_WINDOW = 5
"""Rollout steps over which the KL-triggered reference refresh averages `kl/ref`."""


def refresh_reference(
    reference: Reference, model, t: TrainerConfig, counters: Counters, taken: int, kl_ref: Optional[float]
) -> bool:
    """RPG's iterative reference update (docs/algorithms/rpg.md), checked once per rollout step, after its `taken`
    optimiser steps (already counted in `counters.opt_steps`).

    The reference becomes the current policy (with `trainer.ref_update_mix` a < 1, TR-DPO's soft update
    ref <- a policy + (1 - a) ref, `mix_into`) when this step's optimiser steps reached a multiple
    of `trainer.ref_update_every` (K), or when the mean `kl/ref` of the last KL_WINDOW rollout steps
    exceeds `trainer.ref_update_kl`. The reference log-probs are computed once per rollout step,
    so a refresh takes effect from the next rollout step on in either case; checking here, rather
    than inside the updates, makes that rounding explicit (K is rounded up to the end of the
    rollout step that reaches it). Updates `counters.kl_window` and `counters.ref_updates`;
    returns whether it refreshed. The window is part of `Counters`, so it is checkpointed and a resume
    continues it.
    """
    if reference.model is None:  # no reference, or LoRA's base model (the policy without adapters): nothing to copy
        return False
    if t.ref_update_kl > 0 and kl_ref is not None:
        counters.kl_window = (counters.kl_window + [kl_ref])[-KL_WINDOW:]
    window, every, now = counters.kl_window, t.ref_update_every, counters.opt_steps
    due_k = every > 0 and now // every > (now - taken) // every
    due_kl = t.ref_update_kl > 0 and bool(window) and sum(window) / len(window) > t.ref_update_kl
    if not (due_k or due_kl):
        return False
    if t.ref_update_mix == 1:
        reference.model.load_state_dict(model.state_dict())  # the hard copy, bitwise
    else:
        mix_into(reference.model, model, t.ref_update_mix)
    counters.ref_updates += 1
    counters.kl_window = []
    return True


@torch.no_grad()
def mix_into(reference, model, a: float) -> None:
    """TR-DPO's soft update [arXiv 2404.09656]: every floating-point weight and buffer of `reference` becomes
    a * the policy's + (1 - a) * its own, in place, as TRL's SyncRefModelCallback computes it
    (ref.mul_(1 - a).add_(policy, alpha=a)); other tensors (integer buffers) are copied. A tensor two names share
    (tied embeddings) is mixed once."""
    source, seen = model.state_dict(), set()
    for name, ref in reference.state_dict().items():
        if ref.data_ptr() in seen:
            continue
        seen.add(ref.data_ptr())
        new = source[name].to(device=ref.device, dtype=ref.dtype)
        if ref.is_floating_point():
            ref.mul_(1 - a).add_(new, alpha=a)
        else:
            ref.copy_(new)
