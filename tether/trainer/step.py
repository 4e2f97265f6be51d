"""One RL step: sample and score a batch, advantages, old and reference log-probs, the optimiser
steps, the reference refresh (the loop around it is `tether.trainer.loop`, the run it reads `tether.trainer.setup`).

    collect          engine.generate -> rewards (dynamic sampling: refill flat groups)      -> Scored
    advantages       objective.advantages(rewards, groups, lengths, the reward's parts when it reads them)
    old, ref         log-probs recomputed before any update (`LogProbSettings`, built once per run)
    update           ppo_epochs x mini_batches optimiser steps; micro-batches accumulate with the
                     mini-batch normaliser (SPEC 4); returns its metrics and the steps it took
    refresh          the reference becomes the policy every K optimiser steps or on a KL threshold (SPEC 2.5)

Log-probs are computed at the sampling temperature (logits / T), as the sampler drew them, by
tether.model.ops' chunked LM head (trainer.fused_logprobs): the (N, T, V) logits are never held; the
samples of one prompt run that prompt once (trainer.share_prompts).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import faults, objectives
from ..config.sections import RolloutConfig, TrainerConfig
from ..core.advantages import zero_variance_fraction
from ..core.etr import GroupStats
from ..core.masked import group_summary
from ..model.causal_lm import (
    LogProbSettings,
    Precision,
    Tokens,
    batched_logprobs,
    eval_mode,
    shared_prompt_reason,
    to_tokens,
    token_logprobs,
)
from ..rewards import Scored, reward_parts, score_rollout, verifier_faults
from ..rollout import RolloutBatch, SamplingParams
from .data import PromptStream
from . import seeds
from .sampling import Sampler
from .setup import Counters, Run


def old_policy_logprobs(
    model, tokens: Tokens, rollout: RolloutBatch, t: TrainerConfig, logprobs: LogProbSettings, precision: Precision
) -> Optional[torch.Tensor]:
    """pi_old's log-probs (N, T), before any update: recomputed in eval mode, as the sampler ran
    (a model with dropout would otherwise give a dropout sample of pi_old), or the sampler's own
    (trainer.old_logprobs=sampler: the same weights, no extra pass). None when there is a single
    update per rollout batch (ppo_epochs x mini_batches = 1): it is on-policy, pi_old is the policy
    being differentiated, and `update` uses its log-probs, detached (the pass is skipped)."""
    if t.old_logprobs == "sampler":
        return sampler_logprobs(rollout, tokens)
    if t.ppo_epochs * t.mini_batches == 1 and t.staleness == 0:  # stale: pi_old (the current policy) is logged
        return None
    with eval_mode(model), precision():
        return batched_logprobs(model, tokens, logprobs)


def finite_sampler_tokens(rollout, tokens: Tokens) -> tuple[Tokens, float]:
    """`tokens` with every counted token whose sampler log-prob is not finite (NaN, +-inf) taken out of the loss
    mask, and how many there were (`rollout/nonfinite_sampler_logprobs`). Such a token has no trustworthy
    sampler probability: under trainer.old_logprobs=sampler it has no pi_old, and its rollout-correction
    weight, off-policy drift or M2 statistic would be a guess (TRL counts a NaN as no drift, 0), so it leaves
    the loss like padding, in every setting, rather than train on a made-up number (docs/metrics.md)."""
    lp = rollout.sampler_logprobs.to(device=tokens.mask.device, dtype=torch.float32)
    bad = ~torch.isfinite(lp) & tokens.mask.bool()
    n_bad = float(bad.sum().item())
    if n_bad:
        tokens = dataclasses.replace(tokens, mask=torch.where(bad, torch.zeros_like(tokens.mask), tokens.mask))
    return tokens, n_bad


def truncated_out(rollout, tokens: Tokens) -> tuple[Tokens, float]:
    """`tokens` with every token of a completion that stopped on its length budget (finish reason `length`) out
    of the loss mask, and how many such completions there were (`trainer.mask_truncated`: overlong filtering).
    The advantages are computed from the rewards before this, so a truncated completion still counts in its
    group's baseline, as in TRL, NeMo-RL and SkyRL; a row left with no token leaves the seq-mean normalisers."""
    cut = torch.tensor([r == "length" for r in rollout.finish_reasons], device=tokens.mask.device)  # (N,)
    n_cut = float(cut.sum().item())
    if n_cut:
        tokens = dataclasses.replace(tokens, mask=torch.where(cut[:, None], torch.zeros_like(tokens.mask), tokens.mask))
    return tokens, n_cut


def sampler_logprobs(rollout, tokens: Tokens) -> torch.Tensor:
    """The sampler's log-probs (N, T) float32, 0 wherever `tokens.mask` does not count (padding, and a
    non-finite value `finite_sampler_tokens` took out: NaN * 0 would still be NaN)."""
    lp = rollout.sampler_logprobs.to(device=tokens.mask.device, dtype=torch.float32)
    return torch.where(tokens.mask.bool(), lp, torch.zeros_like(lp))


# ---------------------------------------------------------------- rollout and rewards


def rollout_metrics(rollout: RolloutBatch, rewards: torch.Tensor, groups: torch.Tensor) -> dict[str, float]:
    lengths = rollout.mask.sum(1).float()
    return {
        "reward/mean": rewards.mean().item(),
        "reward/pass_rate": (rewards >= 1.0).float().mean().item(),
        "rollout/len_mean": lengths.mean().item(),
        "rollout/len_max": lengths.max().item(),
        "rollout/truncation_rate": sum(r == "length" for r in rollout.finish_reasons) / len(rollout.finish_reasons),
        "adv/zero_var_frac": zero_variance_fraction(rewards, groups).item(),
    }


def _clocked(device: torch.device) -> float:
    """`time.perf_counter()` after the device's queued work is done (CUDA runs asynchronously: without
    the wait, one phase's kernels would be billed to the next)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def collect(
    sampler: Sampler, stream: PromptStream, reward_fn, r: RolloutConfig, params: SamplingParams, seed: int, pad_id: int
) -> tuple[Scored, dict[str, float]]:
    """Sample and score one batch; with dynamic sampling, drop flat groups and sample more. Returns the
    batch and its rollout and reward metrics, with the seconds spent sampling (`time/sample_s`) and
    scoring (`time/score_s`)."""
    want = r.prompts_per_step
    kept_rollouts, kept_examples, kept_results = [], [], []
    first_metrics = None
    rounds = 1 + (r.dynamic_sampling_max_rounds if r.dynamic_sampling else 0)
    have = 0
    seconds = {"time/sample_s": 0.0, "time/score_s": 0.0}  # summed over dynamic sampling's rounds
    for k in range(rounds):
        examples = stream.take(want - have if k else want)
        tic = time.perf_counter()
        rollout = sampler.generate(
            [e.prompt for e in examples], n=r.group_size, params=params, seed=seeds.refill(seed, k)
        )
        faults.point("rollout")
        seconds["time/sample_s"] += _clocked(rollout.mask.device) - tic
        tic = time.perf_counter()
        scored = score_rollout(reward_fn, rollout, examples)
        seconds["time/score_s"] += time.perf_counter() - tic
        rewards, per_sample, results = scored.rewards, scored.examples, scored.results
        groups = torch.tensor(rollout.prompt_index)
        if first_metrics is None:
            first_metrics = {**rollout_metrics(rollout, rewards, groups), **verifier_faults(results)}
            first_metrics.update(seconds)  # the same dict: the later rounds' seconds add to it
            seconds = first_metrics
        if not r.dynamic_sampling:
            return scored, first_metrics
        s = group_summary(rewards, groups)
        live = s["max"] > s["min"]
        live_prompts = sorted(set(groups[live].tolist()))[: want - have]
        if live_prompts:
            keep = [i for i, g in enumerate(rollout.prompt_index) if g in set(live_prompts)]
            kept_rollouts.append(rollout.select(keep))
            kept_examples += [per_sample[i] for i in keep]
            kept_results += [results[i] for i in keep]
            have += len(live_prompts)
        if have >= want:
            break
    if not kept_rollouts:  # every group was flat: train on the last batch (zero advantages)
        return scored, {**first_metrics, "rollout/dynamic_kept_frac": 0.0}
    merged = RolloutBatch.concat(kept_rollouts, pad_id)
    return Scored(merged, kept_examples, kept_results), {**first_metrics, "rollout/dynamic_kept_frac": have / want}


# ---------------------------------------------------------------- the update


def _mini_batches(groups: torch.Tensor, n_mini: int, gen: torch.Generator) -> list[list[torch.Tensor]]:
    """Split samples into n_mini mini-batches of whole groups, in a seeded random order.

    Each mini-batch is a list of groups (index tensors), and micro-batches keep groups whole
    (not needed for correctness: group statistics come from the whole rollout batch).
    """
    ids = sorted(set(groups.tolist()))
    order = [ids[i] for i in torch.randperm(len(ids), generator=gen).tolist()]
    chunks = [order[i::n_mini] for i in range(n_mini)]
    return [[torch.nonzero(groups == g).flatten() for g in chunk] for chunk in chunks if chunk]


def _micro_batches(groups: list[torch.Tensor], size: int) -> list[torch.Tensor]:
    """Whole groups packed into micro-batches of at most `size` sequences (at least one group)."""
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


@dataclass
class UpdateBatch:
    """A scored rollout batch as the updates read it, on the training device."""

    tokens: Tokens
    advantages: torch.Tensor  # (N,) or (N, T)
    rewards: torch.Tensor  # (N,)
    group_ids: torch.Tensor  # (N,)
    old_logprobs: Optional[torch.Tensor]  # (N, T); None: one update per batch, on-policy (pi_old = pi_theta)
    ref_logprobs: Optional[torch.Tensor] = None  # (N, T), when the objective uses a reference
    sampler_logprobs: Optional[torch.Tensor] = None  # (N, T), the engine's, for rollout_correction
    group_stats: Optional[GroupStats] = None  # over the whole batch (`Objective.group_stats`), set by `update`

    def select(
        self, idx: torch.Tensor, logprobs: torch.Tensor, entropy: torch.Tensor, loss_norm
    ) -> objectives.TokenBatch:
        """Rows `idx` (a micro-batch) as the objective reads them, around their log-probs and entropy
        (N, T) under the policy being updated; `loss_norm` is the mini-batch normaliser."""

        def rows(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if x is None else x[idx]

        return objectives.TokenBatch(
            logprobs=logprobs,
            old_logprobs=logprobs.detach() if self.old_logprobs is None else self.old_logprobs[idx],
            advantages=self.advantages[idx],
            mask=self.tokens.mask[idx],
            ref_logprobs=rows(self.ref_logprobs),
            group_ids=self.group_ids[idx],
            rewards=self.rewards[idx],
            sampler_logprobs=rows(self.sampler_logprobs),
            entropy=entropy,
            loss_norm=loss_norm,
            group_stats=None if self.group_stats is None else self.group_stats.select(idx),
        )


@dataclass
class Optimiser:
    """What an optimiser step touches: the model, AdamW and the schedule."""

    model: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any


@dataclass
class Updated:
    """What `update` did: the step's metrics on the host, and the optimiser steps it took (a step
    skipped for a non-finite loss or gradient is not one)."""

    metrics: dict[str, float]
    opt_steps: int


def update(
    opt: Optimiser,
    obj,
    batch: UpdateBatch,
    t: TrainerConfig,
    gen: torch.Generator,
    logprobs: LogProbSettings,
    precision: Precision,
) -> Updated:
    """ppo_epochs x mini-batches optimiser steps; returns the step's metrics and the steps taken.

    Group statistics (ETR's nu_g - nu_bar) are computed once over the whole rollout batch and
    sliced per micro-batch; metrics merge exactly over micro-batches (`objectives.MetricMerger`:
    means weighted by their token or sequence counts, `loss/*` shares summed per mini-batch), so
    neither depends on `trainer.micro_batch_size`.
    """
    device = batch.tokens.input_ids.device
    # None unless the objective reads group statistics
    batch = dataclasses.replace(batch, group_stats=obj.group_stats(batch.rewards, batch.group_ids))
    merger = objectives.MetricMerger()
    skipped = {"loss": 0, "gradient": 0}
    grad_norms = []
    params = [p for p in opt.model.parameters() if p.requires_grad]
    for _ in range(t.ppo_epochs):
        for mb_groups in _mini_batches(batch.group_ids.cpu(), t.mini_batches, gen):
            norm = obj.normalizer(batch.tokens.mask[torch.cat(mb_groups).to(device)])
            loss_bad = torch.zeros((), dtype=torch.bool, device=device)
            for idx in _micro_batches(mb_groups, t.micro_batch_size):
                out = _micro_step(opt.model, obj, batch, idx.to(device), norm, logprobs, precision)
                loss_bad = loss_bad | ~torch.isfinite(out.loss.detach())
                merger.add(out)
            merger.end_mini_batch()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm if t.max_grad_norm > 0 else float("inf"))
            if torch.isfinite(grad_norm):  # one host sync per optimiser step
                grad_norms.append(grad_norm)
                opt.optimizer.step()
                opt.scheduler.step()
            else:  # a NaN/inf loss or gradient: skip this update, keep the weights as they were
                skipped["loss" if loss_bad.item() else "gradient"] += 1
            opt.optimizer.zero_grad(set_to_none=True)
    return Updated(_host_metrics(merger.result(), grad_norms, skipped, device), len(grad_norms))


def _host_metrics(
    metrics: dict[str, torch.Tensor], grad_norms: list[torch.Tensor], skipped: dict[str, int], device: torch.device
) -> dict[str, float]:
    """The merged metrics with the optimiser's, brought to the host in one sync."""
    nan = torch.tensor(float("nan"), device=device)
    metrics["optim/grad_norm"] = torch.stack(grad_norms).float().mean() if grad_norms else nan
    metrics["optim/skipped_updates"] = torch.tensor(float(sum(skipped.values())), device=device)
    metrics["optim/skipped_nonfinite_loss"] = torch.tensor(float(skipped["loss"]), device=device)
    metrics["optim/skipped_nonfinite_grad"] = torch.tensor(float(skipped["gradient"]), device=device)
    keys = list(metrics)
    values = torch.stack([metrics[k].to(device).double() for k in keys]).tolist()  # the one host sync
    return dict(zip(keys, values))


def _micro_step(
    model, obj, batch: UpdateBatch, idx: torch.Tensor, norm, logprobs: LogProbSettings, precision: Precision
):
    """Forward and backward of one micro-batch (rows `idx`), its loss the mini-batch share `norm`."""
    with precision():
        lp, ent = token_logprobs(model, batch.tokens.select(idx), logprobs, with_entropy=True)
    out = obj(batch.select(idx, lp, ent if obj.config.entropy_coef else ent.detach(), norm))
    out.loss.backward()
    faults.point("update")
    return out


# ---------------------------------------------------------------- the reference refresh


KL_WINDOW = 5
"""Rollout steps over which the KL-triggered reference refresh averages `kl/ref`."""


def refresh_reference(
    reference, model, t: TrainerConfig, counters: Counters, taken: int, kl_ref: Optional[float]
) -> bool:
    """RPG's iterative reference update (SPEC 2.5), checked once per rollout step, after its `taken`
    optimiser steps (already counted in `counters.opt_steps`).

    The reference becomes the current policy when this step's optimiser steps reached a multiple
    of `trainer.ref_update_every` (K), or when the mean `kl/ref` of the last KL_WINDOW rollout steps
    exceeds `trainer.ref_update_kl`. The reference log-probs are computed once per rollout step,
    so a refresh takes effect from the next rollout step on in either case; checking here, rather
    than inside the updates, makes that rounding explicit (K is rounded up to the end of the
    rollout step that reaches it). Updates `counters.kl_window` and `counters.ref_updates`;
    returns whether it refreshed. The window is part of `Counters`, so it is checkpointed and a resume
    continues it.
    """
    if reference is None:
        return False
    if t.ref_update_kl > 0 and kl_ref is not None:
        counters.kl_window = (counters.kl_window + [kl_ref])[-KL_WINDOW:]
    window, every, now = counters.kl_window, t.ref_update_every, counters.opt_steps
    due_k = every > 0 and now // every > (now - taken) // every
    due_kl = t.ref_update_kl > 0 and bool(window) and sum(window) / len(window) > t.ref_update_kl
    if not (due_k or due_kl):
        return False
    reference.load_state_dict(model.state_dict())
    counters.ref_updates += 1
    counters.kl_window = []
    return True


# ---------------------------------------------------------------- one RL step


def reference_logprobs(run: Run, tokens: Tokens) -> Optional[torch.Tensor]:
    """The reference policy's log-probs (N, T) when the objective uses one: the frozen copy, or under
    LoRA the base model itself with the adapters disabled (no second copy of the weights)."""
    if not run.obj.uses_reference():
        return None
    with run.precision():
        if run.reference is not None:
            return batched_logprobs(run.reference, tokens, run.logprobs)
        with run.peft.disable_adapter(), eval_mode(run.model):
            return batched_logprobs(run.model, tokens, run.logprobs)


def rl_step(run: Run, step: int, log=print) -> tuple[Scored, dict[str, float]]:
    """Sample and score a batch, advantages, old and reference log-probs, the updates, the
    reference refresh; returns the batch and the step's metrics (one host sync in `update`).
    Counts the step, its optimiser steps and refreshes in `run.counters`."""
    t, model, device, sampler = run.cfg.trainer, run.model, run.device, run.sampler
    tic = time.perf_counter()
    model.eval()
    with run.precision(), sampler.sampling(step) as sampler_step:  # the policy of step t - s (trainer.staleness)
        scored, sampled_metrics = collect(
            sampler,
            run.stream,
            run.reward_fn,
            run.cfg.rollout,
            run.params,
            seeds.rollout(seeds.sampling_root(t), step),
            run.tokenizer.pad_token_id,
        )
    model.train()
    tokens, nonfinite = finite_sampler_tokens(
        scored.rollout, to_tokens(scored.rollout, run.tokenizer.pad_token_id, device)
    )
    if t.mask_truncated:
        tokens, _ = truncated_out(scored.rollout, tokens)
    parts = reward_parts(run.reward_fn, scored.results) if run.obj.needs_reward_parts() else None
    adv = run.obj.advantages(scored.rewards, scored.group_ids, scored.rollout.mask.sum(1).float(), parts).to(device)
    clock = {"start": _clocked(device)}
    old_lp = old_policy_logprobs(model, tokens, scored.rollout, t, run.logprobs, run.precision)
    clock["old"] = _clocked(device)
    ref_lp = reference_logprobs(run, tokens)
    clock["ref"] = _clocked(device)
    gen = torch.Generator().manual_seed(seeds.minibatch_order(seeds.sampling_root(t), step))
    sampler_lp = sampler_logprobs(scored.rollout, tokens)
    batch = UpdateBatch(tokens, adv, scored.rewards.to(device), scored.group_ids.to(device), old_lp, ref_lp, sampler_lp)
    done = update(Optimiser(model, run.optimizer, run.scheduler), run.obj, batch, t, gen, run.logprobs, run.precision)
    metrics, run.counters.step = done.metrics, step
    metrics.update(
        {
            "time/old_logprobs_s": 0.0 if old_lp is None else clock["old"] - clock["start"],
            "time/ref_logprobs_s": 0.0 if ref_lp is None else clock["ref"] - clock["old"],
            "time/update_s": _clocked(device) - clock["ref"],
        }
    )  # a skipped pass: 0
    run.counters.opt_steps += done.opt_steps
    first = step == run.start + 1
    if first and t.share_prompts and t.fused_logprobs and not run.unfused and shared_prompt_reason(model):
        log(f"shared prompts off: {shared_prompt_reason(model)}; each row runs its prompt")
    metrics.update(sampled_metrics)
    metrics["rollout/nonfinite_sampler_logprobs"] = nonfinite
    metrics.update(sampler.metrics(step - sampler_step, sampler_lp, old_lp, tokens.mask))
    refresh_reference(run.reference, model, t, run.counters, done.opt_steps, metrics.get("kl/ref"))
    metrics.update(
        {
            "optim/lr": run.scheduler.get_last_lr()[0],
            "ref/updates": float(run.counters.ref_updates),
            "time/step_s": time.perf_counter() - tic,
        }
    )
    return scored, metrics
