"""The model RL starts from: a hub/local model as given, or a tiny model, optionally warm-started.

RL with verifiable rewards needs a policy that already solves some problems: with a reward
of 0 everywhere every advantage is 0. The warm start fine-tunes on the task's reference
solutions until greedy held-out accuracy reaches `warm_start.target_accuracy` (CPU-NOTES:
stop on an accuracy threshold, not a time budget), then caches the result keyed by
everything that determines it, so the second run starts RL at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from ..config.sections import Config, WarmStartConfig
from ..schema import to_dict
from ..model.loading import init_model, load_model
from .sft import SFTSettings, sft


def cache_root(ws: WarmStartConfig) -> Path:
    """Where warm-started (and tiny) models are cached: `warm_start.cache_dir`, else $TETHER_CACHE or
    ~/.cache/tether."""
    root = ws.cache_dir or os.environ.get("TETHER_CACHE") or Path.home() / ".cache" / "tether"
    return Path(root).expanduser()


def _key(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _tiny_model(cfg: Config) -> Path:
    m = cfg.model
    spec = {"arch": m.tiny_arch, "hidden": m.tiny_hidden_size, "layers": m.tiny_layers, "seed": cfg.trainer.seed}
    path = cache_root(cfg.warm_start) / "tiny" / _key(spec)
    if not (path / "config.json").exists():
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        init_model(
            tmp, arch=m.tiny_arch, hidden_size=m.tiny_hidden_size, num_layers=m.tiny_layers, seed=cfg.trainer.seed
        )
        _publish(tmp, path)
    return path


def _publish(tmp: Path, final: Path) -> None:
    """Atomic rename; if another process got there first, keep theirs."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def warm_start_key(cfg: Config, base: str) -> dict:
    """Everything a warm-started model depends on (its cache key). LoRA is applied after the warm
    start and does not change it, so `model.lora` is not part of it (nor are new model keys with
    their defaults: a cached warm start stays valid across tether versions that add them)."""
    model = {k: v for k, v in to_dict(cfg.model).items() if k != "lora"}
    return {
        "base": model if cfg.model.builtin_tiny else base,
        "task": cfg.data.task,
        "task_args": cfg.data.task_args,
        "warm_start": {k: v for k, v in to_dict(cfg.warm_start).items() if k != "cache_dir"},
        "seed": cfg.trainer.seed,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        **({"env": to_dict(cfg.env)} if cfg.env.enabled else {}),  # worked episodes are played through it
    }


def below_target_warning(ws: WarmStartConfig, info: dict) -> str:
    """A warning line when the warm start ended below `warm_start.target_accuracy` (its step budget,
    `warm_start.max_steps`, ran out first, or it gave up early: `tether.trainer.sft.stalled`), else "". RL from such a
    policy sees reward 0 in most
    groups, whose advantages are then 0: the run trains on little or nothing."""
    if info["accuracy"] >= ws.target_accuracy:
        return ""
    if info.get("gave_up"):
        return (
            f"warning: the warm start gave up after {info['steps']} steps with greedy accuracy {info['accuracy']:.3f}, "
            f"below warm_start.target_accuracy={ws.target_accuracy}: {info['gave_up']}. RL starts from a policy "
            f"that rarely solves a problem, so most groups score 0 everywhere and learn nothing"
        )
    return (
        f"warning: the warm start stopped at warm_start.max_steps={ws.max_steps} with greedy accuracy "
        f"{info['accuracy']:.3f} after {info['steps']} steps, below warm_start.target_accuracy="
        f"{ws.target_accuracy}: RL starts from a policy that rarely solves a problem, so most groups score 0 "
        f"everywhere and learn nothing. Raise warm_start.max_steps (or lower warm_start.target_accuracy)"
    )


def warm_start_metrics(ws: WarmStartConfig, path: str) -> dict[str, float]:
    """The warm start's outcome as step-0 metrics (docs/metrics.md), {} when `path` is no warm start:
    `warm_start/accuracy`, `warm_start/steps` and `warm_start/below_target` (1.0 or 0.0)."""
    record = Path(path) / "warmstart.json"
    if not ws.enabled or not record.is_file():
        return {}
    info = json.loads(record.read_text())
    return {
        "warm_start/accuracy": float(info["accuracy"]),
        "warm_start/steps": float(info["steps"]),
        "warm_start/below_target": float(info["accuracy"] < ws.target_accuracy),
    }


def initial_model(cfg: Config, task, verifier, log=print, episodes_for=None) -> str:
    """Path or hub id of the model RL starts from (building and warm-starting it if needed); a
    warm start that ended below its target accuracy logs a warning, cached or not. `episodes_for(tokenizer)`:
    what puts the run's episode runner on an engine; with it and a task whose examples carry worked turns
    (`demonstration`), the warm start teaches those turns through the environment (tether.trainer.sft)."""
    base = str(_tiny_model(cfg)) if cfg.model.builtin_tiny else cfg.model.name_or_path
    ws = cfg.warm_start
    if not ws.enabled:
        return base
    payload = warm_start_key(cfg, base)
    path = cache_root(cfg.warm_start) / "warmstart" / _key(payload)
    if (path / "warmstart.json").exists():
        info = json.loads((path / "warmstart.json").read_text())
        log(f"warm start: cached model {path} (greedy accuracy {info['accuracy']:.3f})")
        if warning := below_target_warning(cfg.warm_start, info):
            log(warning)
        return str(path)

    log(f"warm start: supervised fine-tuning until held-out accuracy >= {ws.target_accuracy} (cached afterwards)")
    model, tokenizer = load_model(base, dtype="float32", device="cpu")
    tic = time.perf_counter()
    result = _fine_tune(cfg, task, verifier, model, tokenizer, log, episodes_for)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    info = {
        "accuracy": result["accuracy"],
        "steps": result["steps"],
        "seconds": time.perf_counter() - tic,
        "gave_up": result["gave_up"],
        **payload,
    }
    (tmp / "warmstart.json").write_text(json.dumps(info, indent=1, default=str))
    _publish(tmp, path)
    log(f"warm start: accuracy {result['accuracy']:.3f} after {result['steps']} steps ({info['seconds']:.0f} s)")
    if warning := below_target_warning(cfg.warm_start, info):
        log(warning)
    return str(path)


def _fine_tune(cfg: Config, task, verifier, model, tokenizer, log, episodes_for) -> dict:
    """The warm start's SFT of `model` in place (tether.trainer.sft): on the task's solutions, or on its worked
    episodes through the environment when the run has one and the task's rows carry them."""
    ws = cfg.warm_start
    settings = SFTSettings(
        steps_max=ws.max_steps,
        batch_size=ws.batch_size,
        lr=ws.lr,
        eval_every=ws.eval_every,
        target_accuracy=ws.target_accuracy,
        seed=cfg.trainer.seed,
        max_new_tokens=cfg.rollout.max_new_tokens,
    )
    demonstrate = getattr(task, "demonstration", None)
    worked = cfg.env.enabled and episodes_for is not None and demonstrate is not None
    worked = worked and demonstrate(task.examples("train", 1, seed=0)[0]) is not None
    if worked:
        log("warm start: on the task's worked episodes (their turns), played through the environment")
    return sft(
        model,
        tokenizer,
        task,
        settings,
        reward=verifier,
        log=log,
        # Stop on accuracy over train problems: the held-out split stays unseen until RL's eval.
        eval_examples=task.examples("train", ws.eval_size or cfg.data.eval_size, seed=cfg.trainer.seed + 1),
        episodes=episodes_for(tokenizer) if worked else None,
        demonstrate=demonstrate if worked else None,
    )
