"""Step 0's held-out evaluation, shared between runs that start from the same model (`trainer.step0_cache`).

Every run of a comparison evaluates its initial model at step 0, and where that model does not depend on the
method or the seed (a pretrained model without warm start: LoRA starts with B = 0, an exact no-op), every run
evaluates the same model on the same problems: `tether compare` of 6 methods x 6 seeds made 36 identical
evaluations. With `trainer.step0_cache=DIR` the first run stores its step-0 metrics in DIR under a key of every
setting they depend on, and the others read them.

The key (`key`): the model, warm-start, data and reward sections, the rollout section without the settings only
sampling reads (temperature, top_p, prompts_per_step, group_size), the trainer's evaluation and numerics
settings (eval_batch_size, device, autocast, threads), tether's version, and the seed where the initial model
depends on it (a warm start, or the built-in tiny model's random initialisation). Greedy decoding does not read
the seed. Two runs with one key evaluate the same model the same way, so sharing changes no number.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Optional

from .. import __version__
from ..config.sections import Config
from ..schema import to_dict

SAMPLING_ONLY = ("temperature", "top_p", "prompts_per_step", "group_size")
"""Rollout settings greedy evaluation never reads."""


def key(cfg: Config) -> str:
    """The digest of every setting step 0's evaluation depends on (module docstring)."""
    t = cfg.trainer
    seeded = cfg.warm_start.enabled or cfg.model.builtin_tiny
    parts = {
        "tether": __version__,
        "model": to_dict(cfg.model),
        "warm_start": to_dict(cfg.warm_start),
        "data": to_dict(cfg.data),
        "reward": to_dict(cfg.reward),
        "rollout": {k: v for k, v in to_dict(cfg.rollout).items() if k not in SAMPLING_ONLY},
        "trainer": {
            "eval_batch_size": t.eval_batch_size,
            "device": t.device,
            "autocast": t.autocast,
            "threads": t.threads,
        },
        "seed": t.seed if seeded else None,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


Evaluated = tuple[dict[str, float], dict[str, list]]
"""An evaluation's metrics and its per-problem outcomes (`rewards.greedy_evaluation`)."""


def shared(cfg: Config, evaluate: Callable[[], Evaluated]) -> tuple[Evaluated, Optional[Path]]:
    """Step 0's metrics and per-problem outcomes: read from `trainer.step0_cache` when a run with the same key stored
    them, else from `evaluate()` (then stored, atomically: two runs that race both write the same values). Returns
    them and the cache file they were read from (None when evaluated here). A file an older tether wrote (metrics
    alone, no outcomes) is evaluated again and replaced."""
    if cfg.trainer.step0_cache is None:
        return evaluate(), None
    directory = Path(cfg.trainer.step0_cache).expanduser()
    path = directory / f"{key(cfg)}.json"
    if path.exists():
        stored = json.loads(path.read_text())
        if "outcomes" in stored:
            return (stored["metrics"], stored["outcomes"]), path
    metrics, outcomes = evaluate()
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False) as f:
        json.dump({"metrics": metrics, "outcomes": outcomes}, f)
    os.replace(f.name, path)
    return (metrics, outcomes), None
