"""tether's training loop: sample, score, advantage, update, log, checkpoint.

    for step in 1..total_steps:
        prompts  <- the data stream (resumable position)
        rollout  <- engine.generate(prompts, group_size)          sampler log-probs, finish reasons
        rewards  <- verifier(completion, example)                 (dynamic sampling: refill flat groups)
        A        <- objective.advantages(rewards, groups)
        old, ref <- log-probs recomputed before any update        (ref only when the objective needs it)
        for epoch in ppo_epochs, mini-batch in mini_batches:      one optimiser step per mini-batch
            micro-batches accumulate with the mini-batch normaliser (SPEC 4)
        reference refresh every K optimiser steps or on a KL threshold (SPEC 2.5)
        log metrics (one host sync), evaluate held-out accuracy, checkpoint

Log-probs are computed at the sampling temperature (logits / T), as the sampler drew them, by
tether.ops' chunked LM head (trainer.fused_logprobs): the (N, T, V) logits are never held; the
samples of one prompt run that prompt once (trainer.share_prompts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from . import checkpoint, faults, objectives
from .config import Config, check_resume, save_config
from .models import apply_lora, check_model_loads, pick_device
from .data import PromptStream
from .causal_lm import (Tokens, batched_logprobs, eval_mode, fused_head_reason, shared_prompt_reason, to_tokens,
                        token_logprobs)
from .evaluate import greedy_accuracy
from .rewards import RewardFn, score_rollout, verifier_faults
from .rollout import RolloutBatch, RolloutEngine, SamplingParams, get_engine
from .tasks import Example
from .sinks import JsonlSink, TensorBoardSink, WandbSink, make_progress, read_jsonl, truncate_jsonl, wandb_problem
from .schema import ConfigError, to_dict
from .overlap import OverlappedSampler, rollout_seed
from .staleness import StalePolicies, stale_metrics
from .stopping import Interrupted, StopSignals
from .summary import write_samples, write_summary


def old_policy_logprobs(model, tokens: Tokens, rollout, cfg: Config) -> Optional[torch.Tensor]:
    """pi_old's log-probs (N, T), before any update: recomputed in eval mode, as the sampler ran
    (a model with dropout would otherwise give a dropout sample of pi_old), or the sampler's own
    (trainer.old_logprobs=sampler: the same weights, no extra pass). None when there is a single
    update per rollout batch (ppo_epochs x mini_batches = 1): it is on-policy, pi_old is the policy
    being differentiated, and `update` uses its log-probs, detached (the pass is skipped)."""
    t = cfg.trainer
    if t.old_logprobs == "sampler":
        return rollout.sampler_logprobs.to(device=tokens.mask.device, dtype=torch.float32) * tokens.mask
    if t.ppo_epochs * t.mini_batches == 1 and t.staleness == 0:  # stale: pi_old (the current policy) is logged
        return None
    with eval_mode(model), precision(tokens.mask.device, cfg):
        return batched_logprobs(model, tokens, cfg.rollout.temperature, t.micro_batch_size, t.fused_logprobs,
                                t.logprob_chunk_size, t.share_prompts)


# ---------------------------------------------------------------- rollout and rewards


@dataclass
class Scored:
    """A rollout batch with its rewards, ready for advantages and the update."""

    rollout: RolloutBatch
    examples: list[Example]  # (N,) the example of each sample
    rewards: torch.Tensor  # (N,)
    group_ids: torch.Tensor  # (N,) prompt group of each sample
    metrics: dict[str, float]  # rollout and reward metrics, on the host


def _score(rollout: RolloutBatch, examples, reward_fn):
    """Rewards (N,), the example of each sample and the results (rewards.score_rollout)."""
    per_sample, results = score_rollout(reward_fn, rollout, examples)
    return torch.tensor([r.score for r in results], dtype=torch.float32), per_sample, results


def rollout_metrics(rollout, rewards: torch.Tensor, groups: torch.Tensor) -> dict[str, float]:
    from .core.advantages import zero_variance_fraction

    lengths = rollout.mask.sum(1).float()
    return {
        "reward/mean": rewards.mean().item(),
        "reward/pass_rate": (rewards >= 1.0).float().mean().item(),
        "rollout/len_mean": lengths.mean().item(),
        "rollout/len_max": lengths.max().item(),
        "rollout/truncation_rate": sum(r == "length" for r in rollout.finish_reasons) / len(rollout.finish_reasons),
        "adv/zero_var_frac": zero_variance_fraction(rewards, groups).item(),
    }


def collect(engine, stream: PromptStream, reward_fn, cfg: Config, params: SamplingParams, seed: int,
            pad_id: int) -> Scored:
    """Sample and score one batch; with dynamic sampling, drop flat groups and sample more."""
    r = cfg.rollout
    want = r.prompts_per_step
    kept_rollouts, kept_examples, kept_rewards = [], [], []
    first_metrics = None
    rounds = 1 + (r.dynamic_sampling_max_rounds if r.dynamic_sampling else 0)
    have = 0
    for k in range(rounds):
        examples = stream.take(want - have if k else want)
        rollout = engine.generate([e.prompt for e in examples], n=r.group_size, params=params, seed=seed + 7919 * k)
        faults.point("rollout")
        rewards, per_sample, results = _score(rollout, examples, reward_fn)
        groups = torch.tensor(rollout.prompt_index)
        if first_metrics is None:
            first_metrics = {**rollout_metrics(rollout, rewards, groups), **verifier_faults(results)}
        if not r.dynamic_sampling:
            return Scored(rollout, per_sample, rewards, groups, first_metrics)
        from .core.masked import group_stats

        s = group_stats(rewards, groups)
        live = s["max"] > s["min"]
        live_prompts = sorted(set(groups[live].tolist()))[: want - have]
        if live_prompts:
            keep = [i for i, g in enumerate(rollout.prompt_index) if g in set(live_prompts)]
            kept_rollouts.append(rollout.select(keep))
            kept_examples += [per_sample[i] for i in keep]
            kept_rewards.append(rewards[keep])
            have += len(live_prompts)
        if have >= want:
            break
    if not kept_rollouts:  # every group was flat: train on the last batch (zero advantages)
        return Scored(rollout, per_sample, rewards, groups, {**first_metrics, "rollout/dynamic_kept_frac": 0.0})
    merged = RolloutBatch.concat(kept_rollouts, pad_id)
    rewards = torch.cat(kept_rewards)
    groups = torch.tensor(merged.prompt_index)
    return Scored(merged, kept_examples, rewards, groups,
                  {**first_metrics, "rollout/dynamic_kept_frac": have / want})


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


@dataclass
class Optimiser:
    """What an optimiser step touches: the model, AdamW, the schedule, and a callback per step taken."""

    model: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    on_step: Callable[[], None] = lambda: None


def update(opt: Optimiser, obj, batch: UpdateBatch, cfg: Config, gen: torch.Generator) -> dict[str, float]:
    """ppo_epochs x mini-batches optimiser steps; returns the step's metrics on the host.

    Group statistics (ETR's nu_g - nu_bar) are computed once over the whole rollout batch and
    sliced per micro-batch; metrics merge exactly over micro-batches (`objectives.MetricMerger`:
    means weighted by their token or sequence counts, `loss/*` shares summed per mini-batch), so
    neither depends on `trainer.micro_batch_size`.
    """
    t = cfg.trainer
    device = batch.tokens.input_ids.device
    stats = obj.group_stats(batch.rewards, batch.group_ids)  # None unless the objective reads group statistics
    merger = objectives.MetricMerger()
    skipped = {"loss": 0, "gradient": 0}
    grad_norms = []
    params = [p for p in opt.model.parameters() if p.requires_grad]
    for _ in range(t.ppo_epochs):
        for mb_groups in _mini_batches(batch.group_ids.cpu(), t.mini_batches, gen):
            norm = obj.normalizer(batch.tokens.mask[torch.cat(mb_groups).to(device)])
            loss_bad = torch.zeros((), dtype=torch.bool, device=device)
            for idx in _micro_batches(mb_groups, t.micro_batch_size):
                out = _micro_step(opt.model, obj, batch, idx.to(device), norm, stats, cfg)
                loss_bad = loss_bad | ~torch.isfinite(out.loss.detach())
                merger.add(out)
            merger.end_mini_batch()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm if t.max_grad_norm > 0 else float("inf"))
            if torch.isfinite(grad_norm):  # one host sync per optimiser step
                grad_norms.append(grad_norm)
                opt.optimizer.step()
                opt.scheduler.step()
                opt.on_step()
            else:  # a NaN/inf loss or gradient: skip this update, keep the weights as they were
                skipped["loss" if loss_bad.item() else "gradient"] += 1
            opt.optimizer.zero_grad(set_to_none=True)
    metrics = merger.result()
    nan = torch.tensor(float("nan"), device=device)
    metrics["optim/grad_norm"] = torch.stack(grad_norms).float().mean() if grad_norms else nan
    metrics["optim/skipped_updates"] = torch.tensor(float(sum(skipped.values())), device=device)
    metrics["optim/skipped_nonfinite_loss"] = torch.tensor(float(skipped["loss"]), device=device)
    metrics["optim/skipped_nonfinite_grad"] = torch.tensor(float(skipped["gradient"]), device=device)
    keys = list(metrics)
    values = torch.stack([metrics[k].to(device).double() for k in keys]).tolist()  # the one host sync
    return dict(zip(keys, values))


def _micro_step(model, obj, batch: UpdateBatch, idx: torch.Tensor, norm, stats, cfg: Config):
    """Forward and backward of one micro-batch (rows `idx`), its loss the mini-batch share `norm`."""
    t = cfg.trainer
    sub = batch.tokens.select(idx)
    with precision(idx.device, cfg):
        lp, ent = token_logprobs(model, sub, cfg.rollout.temperature, True, t.fused_logprobs,
                                 t.logprob_chunk_size, t.share_prompts)
    out = obj(objectives.TokenBatch(
        logprobs=lp, old_logprobs=lp.detach() if batch.old_logprobs is None else batch.old_logprobs[idx],
        advantages=batch.advantages[idx], mask=sub.mask,
        ref_logprobs=None if batch.ref_logprobs is None else batch.ref_logprobs[idx],
        group_ids=batch.group_ids[idx], rewards=batch.rewards[idx],
        sampler_logprobs=None if batch.sampler_logprobs is None else batch.sampler_logprobs[idx],
        entropy=ent if obj.config.entropy_coef else ent.detach(), loss_norm=norm,
        group_stats=None if stats is None else stats.select(idx),
    ))
    out.loss.backward()
    faults.point("update")
    return out


# ---------------------------------------------------------------- the reference refresh


KL_WINDOW = 5
"""Rollout steps over which the KL-triggered reference refresh averages `kl/ref`."""


def refresh_reference(reference, model, t, opt_steps_before: int, opt_steps: int, kl_window: list[float],
                      kl_ref: Optional[float]) -> tuple[bool, list[float]]:
    """RPG's iterative reference update (SPEC 2.5), checked once per rollout step, after its updates.

    The reference becomes the current policy when this step's optimiser steps reached a multiple
    of `trainer.ref_update_every` (K), or when the mean `kl/ref` of the last KL_WINDOW rollout steps
    exceeds `trainer.ref_update_kl`. The reference log-probs are computed once per rollout step,
    so a refresh takes effect from the next rollout step on in either case; checking here, rather
    than inside the updates, makes that rounding explicit (K is rounded up to the end of the
    rollout step that reaches it). Returns (refreshed, the new KL window).
    """
    if reference is None:
        return False, kl_window
    if t.ref_update_kl > 0 and kl_ref is not None:
        kl_window = (kl_window + [kl_ref])[-KL_WINDOW:]
    due_k = t.ref_update_every > 0 and opt_steps // t.ref_update_every > opt_steps_before // t.ref_update_every
    due_kl = t.ref_update_kl > 0 and bool(kl_window) and sum(kl_window) / len(kl_window) > t.ref_update_kl
    if not (due_k or due_kl):
        return False, kl_window
    reference.load_state_dict(model.state_dict())
    return True, []


# ---------------------------------------------------------------- setup


def precision(device: torch.device, cfg: Config) -> contextlib.AbstractContextManager:
    """bf16 autocast for a forward pass when trainer.autocast says so (auto: on CUDA only)."""
    mode = cfg.trainer.autocast
    on = mode == "bf16" or (mode == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=on)


AUTO_THREADS_MAX = 8
"""trainer.threads=0 (auto) uses half the cores, at most this many."""


def cpu_threads(setting: int, cores: Optional[int] = None) -> tuple[int, str]:
    """torch's CPU threads for `trainer.threads` (0: auto) and a log line saying why, or (0, "") to
    keep torch's default (-1). Auto is half the cores this process may use, at least 1 and at most
    AUTO_THREADS_MAX: torch's default of every core makes each parallel region wait for its slowest
    thread, so one competing process (another run, a test suite, the verifier's worker) stalls them
    all (docs/performance.md, "CPU threads under contention"); past a few threads a small model's
    matmuls gain little."""
    import os

    if setting == -1:
        return 0, ""
    if setting > 0:
        return setting, ""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = min(AUTO_THREADS_MAX, max(1, cores // 2))
    return n, (f"torch threads: {n} of {cores} cores (trainer.threads=0: auto, half the cores, at most "
               f"{AUTO_THREADS_MAX}; -1 for torch's default of every core)")


def _scheduler(optimizer, cfg: Config, total_opt_steps: int):
    t = cfg.trainer

    def factor(i: int) -> float:
        if i < t.warmup_steps:
            return (i + 1) / (t.warmup_steps + 1)
        if t.schedule == "cosine":
            frac = (i - t.warmup_steps) / max(1, total_opt_steps - t.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_task_and_reward(cfg: Config, tokenizer=None):
    """The task (prompts rendered with the model's chat template when its class or factory takes a
    `tokenizer`, as math's does), the training reward, and the task's own 0/1 verifier that
    held-out accuracy uses (the same object when the reward is the task's own), each with
    `reward.timeout_s` and `reward.strict` where they take them (strict extraction only when the
    task's template asks for a final \\boxed{} answer). A task that cannot be built with its
    knobs, or a model whose tokenizer cannot be read, is a ConfigError: nothing is written yet."""
    from .plugins import check_task, is_import_path, parameters
    from .rewards import check_user_rewards, task_reward
    from .tasks import DataError, get_task, task_factory

    args = dict(cfg.data.task_args)
    if "tokenizer" in parameters(task_factory(cfg.data.task))[0]:
        if tokenizer is None and cfg.model.name_or_path != "tiny":
            tokenizer = _tokenizer(cfg.model.name_or_path)
        args.setdefault("tokenizer", tokenizer)
    try:
        task = get_task(cfg.data.task, **args)
    except (DataError, ConfigError):
        raise
    except ValueError as err:  # a knob's value the task refuses (test_fraction=2)
        raise ConfigError(f"data.task={cfg.data.task} with data.task_args {dict(cfg.data.task_args)}: {err}") from None
    if is_import_path(cfg.data.task):
        check_task(task, cfg.data.task, needs_solution=cfg.warm_start.enabled)
    r = cfg.reward
    try:
        verifier = task_reward(task, timeout_s=r.timeout_s, strict=r.strict)
    except KeyError as err:  # a user's task that names a reward no registry has
        raise ConfigError(f"data.task={cfg.data.task}: its reward {task.reward!r}: {err.args[0]}") from None
    own = r.name in ("auto", task.reward) and not r.weights
    reward = verifier if own else task_reward(task, r.name, r.weights, r.timeout_s, r.strict)
    if is_import_path(cfg.data.task) or any(map(is_import_path, [r.name, *r.weights])):
        for example in task.examples("test", 1)[:1]:  # none: _eval_examples says so
            check_user_rewards(reward, example)
            check_user_rewards(verifier, example)
    return task, reward, verifier


def _tokenizer(name_or_path: str):
    """The tokenizer of model.name_or_path (for rendering prompts), or ConfigError saying why not."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.name_or_path={name_or_path!r}: its tokenizer cannot be loaded "
                          f"({str(err).splitlines()[0]}); check the path or hub id") from None


def _eval_examples(task, cfg: Config) -> list:
    """The held-out problems, checked before any model is loaded."""
    from .tasks import DataError

    try:
        return task.examples("test", cfg.data.eval_size)
    except ValueError as err:
        raise DataError(f"data.eval_size={cfg.data.eval_size}: {err}; lower data.eval_size") from None


def config_warnings(cfg: Config, obj) -> list[str]:
    """Settings that are valid but almost certainly not what was meant."""
    t, warnings = cfg.trainer, []
    if obj.has_trust_region() and t.ppo_epochs * t.mini_batches == 1:
        warnings.append(
            f"objective {obj.name!r} clips by the ratio to the sampling policy, but trainer.ppo_epochs x "
            f"trainer.mini_batches = 1 update per batch: every update is on-policy (ratio 1), so the clip is "
            f"inactive and the objective reduces to its unclipped policy gradient. Set trainer.mini_batches>=2 "
            f"or trainer.ppo_epochs>=2 for an active trust region (or use objective=reinforce to say so)."
        )
    return warnings


def _sinks(cfg: Config, run_dir: Path, resume_after: Optional[int]):
    sinks = [JsonlSink(run_dir / "metrics.jsonl", resume_after)]
    if cfg.trainer.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tb"))
    if cfg.trainer.wandb:
        sinks.append(WandbSink(cfg.trainer.wandb_project, run_dir, to_dict(cfg)))
    return sinks


# ---------------------------------------------------------------- setup of a run


@dataclass
class Run:
    """What a training run holds while it runs: built once by `start_run`, then used by the loop."""

    cfg: Config
    run_dir: Path
    start: int  # the step the run resumes after (0 for a new run)
    obj: objectives.Objective
    reward_fn: RewardFn  # the training reward (may be shaped)
    verifier: RewardFn  # the task's 0/1 verifier: held-out accuracy
    test_examples: list[Example]
    model: Any
    tokenizer: Any
    reference: Any  # the frozen reference policy, or None
    engine: RolloutEngine
    optimizer: torch.optim.Optimizer
    scheduler: Any
    stream: PromptStream
    params: SamplingParams
    device: torch.device
    unfused: str  # why the fused head is off, or ""
    peft: Any = None  # the peft wrapper under model.lora (`model` is its base, adapters injected), else None
    stale: Optional[StalePolicies] = None  # the last trainer.staleness policies (None: on-policy sampling)
    overlap: Optional[OverlappedSampler] = None  # trainer.overlap: samples step t+1 while step t trains
    opt_steps: int = 0
    ref_updates: int = 0
    kl_window: list[float] = dataclasses.field(default_factory=list)
    saved_step: int = -1
    best_accuracy: float = -math.inf  # the best held-out accuracy a checkpoint holds
    warm_start: dict[str, float] = dataclasses.field(default_factory=dict)  # warm_start/* metrics, logged at step 0

    def save(self, step: int, accuracy: Optional[float] = None) -> None:
        """A checkpoint of the weights, the optimiser and every counter after `step` (atomic), with the
        held-out accuracy measured on these weights when there is one (pruning keeps the best)."""
        self.saved_step = step
        if accuracy is not None:
            self.best_accuracy = max(self.best_accuracy, accuracy)
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "position": self.stream.position, "opt_steps": self.opt_steps, "ref_updates": self.ref_updates}
        if self.stale is not None:
            state["stale_policies"] = self.stale.state()
        checkpoint.save(self.run_dir, step, self.peft or self.model, self.tokenizer, state, reference=self.reference,
                        keep_last=self.cfg.trainer.keep_last, accuracy=accuracy)  # under LoRA: the adapter only

    def reference_logprobs(self, tokens: Tokens) -> Optional[torch.Tensor]:
        """The reference policy's log-probs (N, T) when the objective uses one: the frozen copy, or under
        LoRA the base model itself with the adapters disabled (no second copy of the weights)."""
        if not self.obj.uses_reference():
            return None
        t = self.cfg.trainer
        args = (tokens, self.cfg.rollout.temperature, t.micro_batch_size, t.fused_logprobs, t.logprob_chunk_size,
                t.share_prompts)
        with precision(self.device, self.cfg):
            if self.reference is not None:
                return batched_logprobs(self.reference, *args)
            with self.peft.disable_adapter(), eval_mode(self.model):
                return batched_logprobs(self.model, *args)

    def evaluate(self) -> dict[str, float]:
        self.model.eval()
        with precision(self.device, self.cfg):
            return greedy_accuracy(self.engine, self.test_examples, self.verifier, self.cfg.rollout.max_new_tokens,
                                   self.cfg.rollout.stop_strings, seed=self.cfg.trainer.seed)


def _run_path(cfg: Config, resume_dir: Optional[str]) -> Path:
    """The run directory's path, checked (a resume: the same run; a new run: not over an old one)."""
    if resume_dir is None and "{time}" in cfg.output_dir:
        cfg.output_dir = cfg.output_dir.replace("{time}", time.strftime("%Y%m%d-%H%M%S"))
    run_dir = Path(resume_dir or cfg.output_dir)
    if resume_dir:
        check_resume(cfg, run_dir)  # before anything in the directory is touched
    elif (run_dir / "metrics.jsonl").exists():
        raise FileExistsError(f"{run_dir} already holds a run; resume it with `tether train --resume {run_dir}` "
                              f"or choose another output_dir=PATH")
    return run_dir


def _open_run_dir(cfg: Config, run_dir: Path, resume_dir: Optional[str], log) -> Path:
    """The run directory, created, with config.yaml (written once the whole config has been checked)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log(f"run directory: {run_dir}")
    if resume_dir:
        checkpoint.remove_partial(run_dir, log=log)
    save_config(cfg, run_dir / "config.yaml")
    return run_dir


def _load_policy(cfg: Config, source: str, log):
    """The policy and tokenizer, loaded on the CPU (dtype auto: float32, the master weights under bf16
    autocast), then moved to the device `trainer.device` picks for a model of its size."""
    from .models import load_model

    t = cfg.trainer
    model, tokenizer = load_model(source, dtype=cfg.model.dtype, device="cpu",
                                  gradient_checkpointing=cfg.model.gradient_checkpointing)
    device, why = pick_device(t.device, sum(p.numel() for p in model.parameters()), t.small_model_params)
    if why:
        log(why)
    return model.to(device).train(), tokenizer, device


def _engine(cfg: Config, model, tokenizer, device: torch.device, log):
    """The rollout engine, with its decode path in a log line (static cache + compiled step, or eager)."""
    engine = get_engine(cfg.rollout.engine, model=model, tokenizer=tokenizer, compile=cfg.rollout.compile)
    log(f"rollout: {engine.decode_path(device)}")
    return engine


def start_run(cfg: Config, resume_dir: Optional[str] = None, log=print) -> Run:
    """Everything a run needs, in the order that keeps resumed runs bitwise identical: the
    directory, the objective, task and verifiers (checked before any model loads), the models,
    the engine, the optimiser, and on resume the checkpoint's state and random-number streams."""
    from .models import load_model
    from .warmstart import initial_model, warm_start_metrics

    if cfg.trainer.wandb and wandb_problem():  # before anything is written
        raise ConfigError(wandb_problem())
    run_dir = _run_path(cfg, resume_dir)
    t = cfg.trainer
    threads, why = cpu_threads(t.threads)
    if threads:
        torch.set_num_threads(threads)
    if t.device != "auto":
        pick_device(t.device, 0, 0)  # a missing CUDA device fails here, before any warm start
    if cfg.model.name_or_path != "tiny":
        check_model_loads(cfg.model.name_or_path)  # a hub id that does not resolve, too: nothing written yet
    torch.manual_seed(t.seed)
    obj = objectives.build(cfg.objective)  # resolved on load (tether.config): every parameter is recorded
    task, reward_fn, verifier = build_task_and_reward(cfg)  # data errors (a missing file) end here: nothing written
    for warning in config_warnings(cfg, obj):
        log(f"warning: {warning}")
    test_examples = _eval_examples(task, cfg)
    _open_run_dir(cfg, run_dir, resume_dir, log)
    if why:
        log(why)
    ckpt = checkpoint.latest(run_dir, log=log) if resume_dir else None
    lora = cfg.model.lora
    # The initial (warm-started) model: the policy of a new run, the base under LoRA, the reference.
    needs_base = ckpt is None or lora is not None or obj.uses_reference()
    base = initial_model(cfg, task, verifier, log=log) if needs_base else None
    model, tokenizer, device = _load_policy(cfg, base if ckpt is None or lora is not None else str(ckpt / "model"),
                                            log)
    peft = None
    if lora is not None:  # adapters on the base model: new, or the checkpoint's
        peft = apply_lora(model, lora, ckpt / "model" if ckpt else None)
        model = peft.get_base_model()
        log(f"LoRA: {sum(p.numel() for p in model.parameters() if p.requires_grad):_} trainable parameters of "
            f"{sum(p.numel() for p in model.parameters()):_}")
    reference = None
    if obj.uses_reference() and lora is None:
        reference, _ = load_model(base, dtype=cfg.model.dtype, device="cpu")
        if ckpt:
            checkpoint.load_reference(ckpt, reference)
        reference.to(device).eval().requires_grad_(False)
    unfused = fused_head_reason(model) if t.fused_logprobs else ""
    if unfused:
        log(f"fused log-probs off: {unfused}; using the model's logits")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=t.lr,
                                  weight_decay=t.weight_decay)
    scheduler = _scheduler(optimizer, cfg, t.total_steps * t.ppo_epochs * t.mini_batches)
    state = {"step": 0, "position": 0, "opt_steps": 0, "ref_updates": 0}
    best_accuracy = None
    if ckpt:
        state = checkpoint.load_state(ckpt)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        checkpoint.set_rng_state(state["rng"])
        log(f"resuming {run_dir} from step {state['step']}")
        kept = checkpoint.best(run_dir, log=log)
        best_accuracy = checkpoint.recorded_accuracy(kept) if kept is not None else None
    stale = StalePolicies(model, t.staleness, state["stale_policies"] if ckpt else None) if t.staleness else None
    params = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                            max_new_tokens=cfg.rollout.max_new_tokens, stop_strings=tuple(cfg.rollout.stop_strings))
    stream = PromptStream(task, t.seed, state["position"])
    overlap = OverlappedSampler(cfg, model, tokenizer, stale, stream, params, lambda: precision(device, cfg)) \
        if t.overlap else None
    return Run(cfg, run_dir, state["step"], obj, reward_fn, verifier, test_examples, model, tokenizer, reference,
               _engine(cfg, model, tokenizer, device, log), optimizer, scheduler, stream, params, device, unfused,
               peft, stale=stale, overlap=overlap, opt_steps=state["opt_steps"], ref_updates=state["ref_updates"],
               saved_step=state["step"],
               best_accuracy=-math.inf if best_accuracy is None else best_accuracy,
               warm_start=warm_start_metrics(cfg, base) if base is not None else {})


# ---------------------------------------------------------------- one RL step


def rl_step(run: Run, step: int, log=print) -> tuple[Scored, dict[str, float]]:
    """Sample and score a batch, advantages, old and reference log-probs, the updates, the
    reference refresh; returns the batch and the step's metrics (one host sync in `update`)."""
    cfg, t, model, device = run.cfg, run.cfg.trainer, run.model, run.device
    tic = time.perf_counter()
    model.eval()
    sampler = (run.overlap.sampling(step) if run.overlap else run.stale.sampling(model, step) if run.stale
               else contextlib.nullcontext(step))
    with precision(device, cfg), sampler as sampler_step:  # the policy of step t - s (trainer.staleness)
        scored = collect(run.overlap or run.engine, run.stream, run.reward_fn, cfg, run.params,
                         rollout_seed(t.seed, step), run.tokenizer.pad_token_id)
    model.train()
    tokens = to_tokens(scored.rollout, run.tokenizer.pad_token_id, device)
    adv = run.obj.advantages(scored.rewards, scored.group_ids, scored.rollout.mask.sum(1).float()).to(device)
    old_lp = old_policy_logprobs(model, tokens, scored.rollout, cfg)
    ref_lp = run.reference_logprobs(tokens)
    gen = torch.Generator().manual_seed(t.seed * 7_000_003 + step)
    opt_steps_before = run.opt_steps

    def on_opt_step():
        run.opt_steps += 1

    sampler_lp = scored.rollout.sampler_logprobs.to(device=device, dtype=torch.float32) * tokens.mask
    batch = UpdateBatch(tokens, adv, scored.rewards.to(device), scored.group_ids.to(device), old_lp, ref_lp, sampler_lp)
    metrics = update(Optimiser(model, run.optimizer, run.scheduler, on_opt_step), run.obj, batch, cfg, gen)
    if step == run.start + 1 and t.share_prompts and t.fused_logprobs and not run.unfused and shared_prompt_reason(model):
        log(f"shared prompts off: {shared_prompt_reason(model)}; each row runs its prompt")
    metrics.update(scored.metrics)
    if run.stale is not None:
        metrics.update(stale_metrics(step - sampler_step, sampler_lp, old_lp, tokens.mask))
    if run.overlap is not None:
        metrics.update(run.overlap.metrics())
    refreshed, run.kl_window = refresh_reference(run.reference, model, t, opt_steps_before, run.opt_steps,
                                                 run.kl_window, metrics.get("kl/ref"))
    run.ref_updates += refreshed
    metrics.update({"optim/lr": run.scheduler.get_last_lr()[0], "ref/updates": float(run.ref_updates),
                    "time/step_s": time.perf_counter() - tic})
    return scored, metrics


FLAT_WARN_AFTER = 3
"""Rollout steps in a row with no reward variance in any group before the trainer warns."""


def flat_streak(metrics: dict[str, float], cfg: Config, streak: int) -> tuple[int, str]:
    """Count rollout steps in a row in which no group had reward variance (every advantage 0, so
    nothing trains): with dynamic sampling, no group was kept after every refill round; without,
    every group of the batch was flat. Returns the new count, logged as `rollout/flat_streak`, and a
    warning line at FLAT_WARN_AFTER steps in a row and every `trainer.log_every` steps after, else ""."""
    dynamic = cfg.rollout.dynamic_sampling
    flat = metrics.get("rollout/dynamic_kept_frac") == 0.0 if dynamic else metrics["adv/zero_var_frac"] == 1.0
    streak = streak + 1 if flat else 0
    due = streak >= FLAT_WARN_AFTER and (streak - FLAT_WARN_AFTER) % max(1, cfg.trainer.log_every) == 0
    if not due:
        return streak, ""
    what = (f"dynamic sampling kept 0 of {cfg.rollout.prompts_per_step} groups after "
            f"{cfg.rollout.dynamic_sampling_max_rounds} refill rounds" if dynamic else "every group was flat")
    return streak, (f"warning: {streak} steps in a row with no reward variance ({what}): every sample of a "
                    f"group got the same reward, so every advantage is 0 and nothing trains. The task is too "
                    f"hard or too easy for this policy (reward/mean {metrics['reward/mean']:.3f}): check the "
                    f"warm start and the reward, or raise rollout.group_size or rollout.temperature")


def _logged_at(run_dir: Path, step: int, key: str) -> int:
    """`key`'s value in metrics.jsonl at `step` (a resume continues a count where it was), else 0."""
    path = run_dir / "metrics.jsonl"
    if step == 0 or not path.exists():
        return 0
    return int(next((r.get(key) or 0 for r in reversed(read_jsonl(path)) if r.get("step") == step), 0))


def _skipped_updates(metrics: dict[str, float], step: int, scored: Scored) -> str:
    """A log line when this step skipped updates with a non-finite loss or gradient, else ""."""
    if metrics["optim/skipped_updates"] == 0:
        return ""
    return (f"step {step}: {int(metrics['optim/skipped_updates'])} update(s) skipped: "
            f"{int(metrics['optim/skipped_nonfinite_loss'])} with a non-finite loss, "
            f"{int(metrics['optim/skipped_nonfinite_grad'])} with a finite loss but a non-finite gradient "
            f"(loss/total={metrics.get('loss/total')}, reward/mean={scored.rewards.mean().item()})")


# ---------------------------------------------------------------- the loop


def train(cfg: Config, resume_dir: Optional[str] = None, log=print) -> Path:
    """Run (or resume) training; returns the run directory.

    SIGINT and SIGTERM stop it cleanly after the step under way (tether.stopping): a checkpoint
    of that step, the summary and the plots, then `Interrupted`.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # tether draws its own progress bar
    run, t = start_run(cfg, resume_dir, log), cfg.trainer
    # On resume, drop what was logged after the checkpoint (everything, when there is none).
    resume_after = run.start if run.start else (-1 if resume_dir else None)
    sinks = _sinks(cfg, run.run_dir, resume_after)
    if resume_after is not None and (run.run_dir / "samples.jsonl").exists():
        truncate_jsonl(run.run_dir / "samples.jsonl", resume_after)
    progress = make_progress(t.total_steps, run.start, t.progress, t.log_every, log)
    samples_file = (run.run_dir / "samples.jsonl").open("a")
    tic, last_step, bad_steps, stop = time.perf_counter(), run.start, 0, StopSignals()
    flat = _logged_at(run.run_dir, run.start, "rollout/flat_streak")  # steps in a row without reward variance
    try:
        with stop:
            if run.start == 0:
                m = {**run.evaluate(), **run.warm_start}
                for s in sinks:
                    s.log(0, m)
                progress.update(0, m)
                log(f"step 0: held-out accuracy {m['eval/accuracy']:.3f}")
            for step in range(run.start + 1, t.total_steps + 1):
                if stop.signum is not None:
                    break
                scored, metrics = rl_step(run, step, log)
                skipped = _skipped_updates(metrics, step, scored)
                bad_steps = bad_steps + 1 if skipped else 0
                if skipped:
                    log(skipped)
                flat, warning = flat_streak(metrics, cfg, flat)
                metrics["rollout/flat_streak"] = float(flat)
                if warning:
                    log(warning)
                if bad_steps >= t.max_nonfinite_steps:
                    _stop_nonfinite(run, step, bad_steps, metrics, sinks)
                if step % t.eval_every == 0 or step == t.total_steps:
                    metrics.update(run.evaluate())
                for s in sinks:
                    s.log(step, metrics)
                write_samples(samples_file, step, scored.rollout, scored.examples, scored.rewards, t.log_samples)
                progress.update(step, metrics)
                faults.point("logged")
                last_step = step
                acc = metrics.get("eval/accuracy")
                if step % t.save_every == 0 or step == t.total_steps or (acc is not None and acc > run.best_accuracy):
                    run.save(step, acc)  # also at every new best held-out accuracy: `tether export --step best`
            if stop.signum is not None and run.saved_step != last_step:
                run.save(last_step)  # the last finished step, so the resume loses nothing
    finally:
        if run.overlap is not None:
            run.overlap.close()  # a batch prefetched past a stop or an error: waited for, dropped
        progress.close()
        samples_file.close()
        for s in sinks:
            s.close()
    _finish(run, last_step, time.perf_counter() - tic, stop.signum, log)
    if stop.signum is not None:
        raise Interrupted(stop.signum, last_step, str(run.run_dir))
    return run.run_dir


def _stop_nonfinite(run: Run, step: int, bad_steps: int, metrics: dict[str, float], sinks) -> None:
    """trainer.max_nonfinite_steps bad steps in a row: log the step, checkpoint it, raise."""
    for sink in sinks:
        sink.log(step, metrics)
    run.save(step)
    raise RuntimeError(
        f"stopping at step {step}: {bad_steps} steps in a row had a non-finite loss or gradient "
        f"(see metrics.jsonl 'optim/skipped_updates'; check rewards for NaN, lower trainer.lr). The "
        f"weights are those of the last good update; a checkpoint was written to "
        f"{run.run_dir / 'checkpoints'}.")


def _finish(run: Run, last_step: int, wall_s: float, signum: Optional[int], log) -> None:
    """summary.md (what the run was, then the metrics table) and the plots."""
    log(write_summary(run.cfg, run.obj, run.run_dir, run.start, last_step, wall_s, run.device, signum))
    if run.cfg.trainer.plots:
        from .plots import plot_run

        plot_run(run.run_dir)
    log(f"run directory: {run.run_dir}")
