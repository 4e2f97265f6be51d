"""A training run's setup: what it holds (`Run`: its config, the parts each step reads, held-out evaluation, its
progress and bookkeeping) and `start_run`, which builds it, new or resumed from the latest checkpoint.

The order of `start_run` keeps resumed runs bitwise identical: the directory, the objective, task
and verifiers (checked before any model loads), the models, the optimiser, on resume the
checkpoint's state and random-number streams, then the engine and the prompt stream.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .. import objectives
from ..config.loading import check_resume, save_config
from ..config.sections import Config, ModelConfig, RolloutConfig, TrainerConfig
from ..envs import build_runner, env_label, environment_factory, judge_with
from ..model.causal_lm import LogProbSettings, Precision, fused_head_reason
from ..model.devices import cpu_threads, pick_device, place_model
from ..model.loading import apply_lora, char_tokenizer, check_model_loads, load_model, load_tokenizer
from ..plugins import check_task, is_import_path
from ..records import checkpoint
from ..records.sinks import wandb_problem
from ..rewards import RewardFn, check_user_rewards, strict_for_task, task_reward
from ..rollout import RolloutEngine, SamplingParams, get_engine
from ..schema import ConfigError
from ..tasks import DataError, Example, get_task, takes_tokenizer
from .data import PromptStream
from .limits import check_lengths, model_context
from .progress import Counters, Progress
from .sampling import make_sampler
from .step import Reference, RolloutSource, StepParts
from .teacher import check_teacher, load_teacher
from .update import Policy
from .warmstart import initial_model, warm_start_metrics


@dataclass(frozen=True)
class Evaluation:
    """Held-out accuracy: the policy's engine (greedy), the task's 0/1 verifier, the problems."""

    engine: RolloutEngine  # the policy's engine: held-out accuracy, and the on-policy and stale samplers
    verifier: RewardFn  # the task's 0/1 verifier (never a shaped training reward)
    examples: list[Example]
    lenient: bool = False  # whether the verifier reads answers leniently (what heldout.jsonl's answers follow)


@dataclass(frozen=True)
class Records:
    """Bookkeeping: where the run writes, and what it reports once."""

    run_dir: Path
    tokenizer: Any  # saved with every checkpoint
    created_dir: Optional[Path] = None  # the outermost directory this run made (run_dir or a parent): `discard`
    warm_start: dict[str, float] = dataclasses.field(default_factory=dict)  # warm_start/* metrics, logged at step 0
    unfused: str = ""  # why the fused head is off, or ""


@dataclass
class Run:
    """A training run, split by lifetime: its config, what each step reads (`StepParts`, built once), held-out
    evaluation, the progress that changes each step, and bookkeeping."""

    cfg: Config
    parts: StepParts
    evaluation: Evaluation
    progress: Progress
    records: Records

    def discard(self) -> str:
        """Remove what a new run wrote before its first step finished (a run that cannot start), and say
        what: the directory when this run created it, else only the files it wrote there."""
        created, run_dir = self.records.created_dir, self.records.run_dir
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
            return f"removed the run directory {run_dir}" + (
                f" and {created}, which it had made" if created != run_dir else ""
            )
        for name in ("config.yaml", "metrics.jsonl", "samples.jsonl", "tb", "checkpoints"):
            path = run_dir / name
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        return f"removed the files it had written in {run_dir}"

    def save(self, accuracy: Optional[float] = None) -> None:
        """A checkpoint of the weights, the optimiser and the counters after the last finished step
        (atomic), with the held-out accuracy measured on these weights when there is one (pruning
        keeps the best)."""
        progress, policy, source = self.progress, self.parts.policy, self.parts.source
        step = progress.saved_step = progress.counters.step
        if accuracy is not None:
            progress.best_accuracy = max(progress.best_accuracy, accuracy)
        progress.counters.position = source.stream.position
        state = {
            **progress.counters.state(),
            "optimizer": policy.optimizer.state_dict(),
            "scheduler": policy.scheduler.state_dict(),
        }
        sampler_state = source.sampler.state()
        if sampler_state is not None:
            state["stale_policies"] = sampler_state
        checkpoint.save(
            self.records.run_dir,
            step,
            policy.peft or policy.model,
            self.records.tokenizer,
            state,
            reference=self.parts.reference.model,
            keep_last=self.cfg.trainer.keep_last,
            accuracy=accuracy,
        )  # under LoRA: the adapter only


def start_run(cfg: Config, resume_dir: Optional[str] = None, log=print) -> Run:
    """Everything a run needs, in the order that keeps resumed runs bitwise identical (module docstring)."""
    run_dir = _run_path(cfg, resume_dir)
    checked = _checked(cfg, log)  # every check that needs no model: nothing is written before it passes
    created_dir = next((d for d in reversed([run_dir, *run_dir.parents]) if not d.exists()), None)
    _open_run_dir(cfg, run_dir, resume_dir, log)
    if checked.threads_note:
        log(checked.threads_note)
    ckpt = checkpoint.latest(run_dir, log=log) if resume_dir else None
    # The initial (warm-started) model: the policy of a new run, the base under LoRA, the reference.
    needs_base = ckpt is None or cfg.model.lora is not None or checked.obj.uses_reference()
    worked = lambda tok: episodes_of(cfg, tok, checked.task, log)  # noqa: E731 (the warm start's episodes)
    base = initial_model(cfg, checked.task, checked.verifier, log=log, episodes_for=worked) if needs_base else None
    model, tokenizer, device, peft, reference = _models(cfg, checked.obj, base, ckpt, log)
    t, r = cfg.trainer, cfg.rollout
    unfused = fused_head_reason(model) if t.fused_logprobs else ""
    if unfused:
        log(f"fused log-probs off: {unfused}; using the model's logits")
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=t.lr, weight_decay=t.weight_decay
    )
    scheduler = _scheduler(optimizer, t, t.total_steps * t.updates_per_batch)
    progress, state = Progress(Counters(), 0, 0), {}
    if ckpt:
        progress, state = _restore(run_dir, ckpt, optimizer, scheduler, log)
    params = SamplingParams(
        temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens, stop_strings=tuple(r.stop_strings)
    )
    stream = PromptStream(checked.task, t.seed, progress.counters.position)
    precision = Precision.of(t.autocast, device)
    episodes = episodes_of(cfg, tokenizer, checked.task, log)
    engine = episodes(_engine(r, model, tokenizer, device, log))  # an EpisodeRunner on it for multi-turn episodes
    policy = Policy(model, peft, optimizer, scheduler, device, precision, LogProbSettings.of(t, r))
    saved = state.get("stale_policies") if t.staleness else None
    sampler = make_sampler(cfg, engine, model, tokenizer, stream, params, precision, saved)
    source = RolloutSource(sampler, stream, checked.reward_fn, params, tokenizer.pad_token_id)
    teacher = load_teacher(cfg.teacher, checked.obj, device, model)  # frozen, never in the optimiser
    parts = StepParts(policy, source, checked.obj, Reference(reference), t, r, teacher)
    warm = warm_start_metrics(cfg.warm_start, base) if base is not None else {}
    records = Records(run_dir, tokenizer, created_dir, warm, unfused)
    lenient = not strict_for_task(checked.task, cfg.reward.strict)
    evaluation = Evaluation(engine, checked.verifier, checked.test_examples, lenient)
    return Run(cfg, parts, evaluation, progress, records)


@dataclass(frozen=True)
class Checked:
    """What `_checked` built while checking a config: the objective, the task, its rewards and held-out set."""

    obj: objectives.Objective
    task: Any
    reward_fn: RewardFn
    verifier: RewardFn
    test_examples: list[Example]
    threads_note: str  # why the thread count is what it is, or ""


def _checked(cfg: Config, log) -> Checked:
    """Every check a run can make before it writes anything or loads a model: the wandb setup, the thread
    count, the device, the model's source, the objective, the task and rewards (a missing data file), the
    held-out set, the lengths of the prompts against the model's context, and a distillation teacher's files and
    tokenizer. Warnings are logged here."""
    if cfg.trainer.wandb and wandb_problem():
        raise ConfigError(wandb_problem())
    t = cfg.trainer
    threads, why = cpu_threads(t.threads)
    if threads:
        torch.set_num_threads(threads)
    if t.device != "auto":
        pick_device(t.device, 0, 0)  # a missing CUDA device fails here, before any warm start
    if not cfg.model.builtin_tiny:
        check_model_loads(cfg.model.name_or_path)  # a hub id that does not resolve, too: nothing written yet
    torch.manual_seed(t.seed)
    obj = objectives.build(cfg.objective)  # resolved on load (tether.config.sections): every parameter is recorded
    task, reward_fn, verifier = build_task_and_reward(cfg)  # data errors (a missing file) end here: nothing written
    for warning in config_warnings(t, obj, cfg.rollout):
        log(f"warning: {warning}")
    test_examples = _eval_examples(task, cfg.data.eval_size)
    check_lengths(cfg, task, _tokenizer(cfg.model), test_examples)  # a run that could not progress
    if obj.uses_teacher():
        check_teacher(cfg.teacher, _tokenizer(cfg.model))  # its files, and the student's tokenizer
    return Checked(obj, task, reward_fn, verifier, test_examples, why or "")


def _models(cfg: Config, obj, base: Optional[str], ckpt: Optional[Path], log):
    """(policy, tokenizer, device, peft wrapper or None, frozen reference or None): the policy from the
    checkpoint or the initial model `base`; under LoRA the adapters on `base`, new or the checkpoint's."""
    lora = cfg.model.lora
    source = base if ckpt is None or lora is not None else str(ckpt / "model")
    model, tokenizer, device = _load_policy(cfg.model, cfg.trainer, source, log)
    peft = None
    if lora is not None:  # adapters on the base model: new, or the checkpoint's
        peft = apply_lora(model, lora, ckpt / "model" if ckpt else None)
        model = peft.get_base_model()
        log(
            f"LoRA: {sum(p.numel() for p in model.parameters() if p.requires_grad):_} trainable parameters of "
            f"{sum(p.numel() for p in model.parameters()):_}"
        )
    reference = None
    if obj.uses_reference() and lora is None:
        reference, _ = load_model(base, dtype=cfg.model.dtype, device="cpu")
        if ckpt:
            checkpoint.load_reference(ckpt, reference)
        reference.to(device).eval().requires_grad_(False)
    return model, tokenizer, device, peft, reference


def _restore(run_dir: Path, ckpt: Path, optimizer, scheduler, log) -> tuple[Progress, dict[str, Any]]:
    """The checkpoint's progress (its counters, and the best held-out accuracy a checkpoint of the run records,
    -inf: none) and its state, whose optimiser, schedule and random-number streams are restored here."""
    state = checkpoint.load_state(ckpt)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    checkpoint.set_rng_state(state["rng"])
    counters = Counters.from_state(state)
    log(f"resuming {run_dir} from step {counters.step}")
    kept = checkpoint.best(run_dir, log=log)
    best = checkpoint.recorded_accuracy(kept) if kept is not None else None
    return Progress(counters, counters.step, counters.step, -math.inf if best is None else best), state


# ---------------------------------------------------------------- the parts start_run builds


def _scheduler(optimizer, t: TrainerConfig, total_opt_steps: int):

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

    args = dict(cfg.data.task_args)
    if takes_tokenizer(cfg.data.task):
        if tokenizer is None and not cfg.model.builtin_tiny:
            tokenizer = _tokenizer(cfg.model)
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
        verifier = task_reward(task, timeout_s=r.timeout_s, strict=r.strict, isolated=r.isolate)
    except KeyError as err:  # a user's task that names a reward no registry has
        raise ConfigError(f"data.task={cfg.data.task}: its reward {task.reward!r}: {err.args[0]}") from None
    own = r.name in ("auto", task.reward) and not r.weights
    name = cfg.env.reward_name(r.name)
    reward = (
        verifier if own and name == r.name else task_reward(task, name, r.weights, r.timeout_s, r.strict, r.isolate)
    )
    if is_import_path(cfg.data.task) or any(map(is_import_path, [r.name, *r.weights])):
        for example in task.examples("test", 1)[:1]:  # none: _eval_examples says so
            check_user_rewards(reward, example)
            check_user_rewards(verifier, example)
    return task, reward, verifier


def _tokenizer(m: ModelConfig):
    """The tokenizer of model.name_or_path (for rendering prompts and checking lengths; the built-in tiny
    model's: the character tokenizer `init_model` saves), or ConfigError saying why not."""
    if m.builtin_tiny:
        return char_tokenizer()
    try:
        return load_tokenizer(m.name_or_path)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"model.name_or_path={m.name_or_path!r}: its tokenizer cannot be loaded "
            f"({str(err).splitlines()[0]}); check the path or hub id"
        ) from None


def _eval_examples(task, eval_size: int) -> list:
    """The held-out problems (`data.eval_size` of them), checked before any model is loaded."""
    try:
        return task.examples("test", eval_size)
    except ValueError as err:
        raise DataError(f"data.eval_size={eval_size}: {err}; lower data.eval_size") from None


def config_warnings(t: TrainerConfig, obj: objectives.Objective, r: Optional[RolloutConfig] = None) -> list[str]:
    """Settings that are valid but almost certainly not what was meant."""
    warnings = []
    if r is not None and obj.config.rollout_correction is not None and not r.full_softmax:
        warnings.append(
            f"objective.rollout_correction with rollout.top_p={r.top_p}, rollout.temperature={r.temperature}: the "
            "sampler's log-probs are its truncated distribution's, so the correction reweighs towards the full "
            "softmax but cannot recover the tokens outside the nucleus it never samples "
            "(docs/algorithms/rollout_correction.md); rollout.top_p=1 samples from the distribution it corrects"
        )
    if obj.has_trust_region() and t.ratio_is_one:
        warnings.append(
            f"objective {obj.name!r} clips by the ratio to the sampling policy, but trainer.ppo_epochs x "
            f"trainer.mini_batches = 1 update per batch: every update is on-policy (ratio 1), so the clip is "
            f"inactive and the objective reduces to its unclipped policy gradient. Set trainer.mini_batches>=2 "
            f"or trainer.ppo_epochs>=2 for an active trust region (or use objective=reinforce to say so)."
        )
    return warnings


def _run_path(cfg: Config, resume_dir: Optional[str]) -> Path:
    """The run directory's path, checked (a resume: the same run; a new run: not over an old one)."""
    if resume_dir is None and "{time}" in cfg.output_dir:
        cfg.output_dir = cfg.output_dir.replace("{time}", time.strftime("%Y%m%d-%H%M%S"))
    run_dir = Path(resume_dir or cfg.output_dir)
    if resume_dir:
        check_resume(cfg, run_dir)  # before anything in the directory is touched
    elif (run_dir / "metrics.jsonl").exists():
        raise FileExistsError(
            f"{run_dir} already holds a run; resume it with `tether train --resume {run_dir}` "
            f"or choose another output_dir=PATH"
        )
    return run_dir


def _open_run_dir(cfg: Config, run_dir: Path, resume_dir: Optional[str], log) -> Path:
    """The run directory, created, with config.yaml (written once the whole config has been checked)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log(f"run directory: {run_dir}")
    if resume_dir:
        checkpoint.remove_partial(run_dir, log=log)
    save_config(cfg, run_dir / "config.yaml")
    return run_dir


def _load_policy(m: ModelConfig, t: TrainerConfig, source: str, log):
    """The policy and tokenizer, loaded on the CPU (dtype auto: float32, the master weights under bf16
    autocast), then moved to the device `trainer.device` picks for a model of its size."""
    model, tokenizer = load_model(source, dtype=m.dtype, device="cpu", gradient_checkpointing=m.gradient_checkpointing)
    device = place_model(model, t.device, t.small_model_params, log=log)
    return model.train(), tokenizer, device


def episodes_of(cfg: Config, tokenizer, task, log) -> Callable[[Any], Any]:
    """What puts the run's `EpisodeRunner` (tether.envs) on an engine: identity for single-turn prompts. The
    environment is built and its chat-template check made here, once (a ConfigError before the first step)."""
    e = cfg.env
    if not e.enabled:
        return lambda engine: engine
    r = cfg.reward
    name = "auto" if r.name == "episode" else r.name  # the run's reward, its own copy, in this process
    judge = judge_with(
        task_reward(task, name, {k: v for k, v in r.weights.items() if k != "episode"}, r.timeout_s, r.strict)
    )
    context = model_context(cfg.model)
    environment_factory(e, judge)  # a bad env.args fails now, before the engine starts
    log(
        f"episodes: {env_label(e)}, at most {e.max_turns} turns of {e.turn_tokens(cfg.rollout)} tokens, "
        f"{e.episode_tokens(cfg.rollout)} in all; reward: {'the environment' if e.reward == 'env' else 'the task'}"
    )
    return lambda engine: build_runner(e, cfg.rollout, engine, tokenizer, judge, context)


def _engine(r: RolloutConfig, model, tokenizer, device: torch.device, log):
    """The rollout engine, with its decode path in a log line (static cache + compiled step, or eager)."""
    sized = {"kv_cache_bytes": r.vllm_kv_cache_mb << 20} if r.engine == "vllm" else {}  # hf's cache grows as it needs
    engine = get_engine(r.engine, model=model, tokenizer=tokenizer, compile=r.compile, **sized)
    log(f"rollout: {engine.decode_path(device)}")
    return engine
