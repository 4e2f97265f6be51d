"""The config's checks on load that ask the rest of tether (`Config.__post_init__` calls them).

Task, task knobs, reward and engine exist and a user's task or reward (`module:name`,
tether.plugins) imports and takes what it is given; `model.name_or_path` can be a model (no
network) and `trainer.device` names a device. Every check runs before any directory is written
and raises ConfigError naming the key and the fix. The checks of single values (ranges, pairs of
settings) stay in `Config.__post_init__`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..schema import ConfigError

if TYPE_CHECKING:
    from .sections import Config


def check_model_and_device(cfg: Config) -> None:
    """model.name_or_path can be a model (a directory with config.json, or a hub id; no network) and
    trainer.device names a device (whether this machine has it is checked when a run starts)."""
    from ..model.loading import device_problem, model_source_problem

    if cfg.model.name_or_path != "tiny":
        problem = model_source_problem(cfg.model.name_or_path)
        if problem:
            raise ConfigError(f"model.name_or_path: {problem}")
    if cfg.trainer.device != "auto":
        problem = device_problem(cfg.trainer.device, available=False)
        if problem:
            raise ConfigError(problem)


def check_names(cfg: Config) -> None:
    """Task, task knobs, reward and engine exist, a user's (`module:name`, tether.plugins) imports
    and takes what it is given: checked on load, before any directory is written."""
    from ..core.registry import unknown_name_message
    from ..plugins import is_import_path
    from ..rewards import REWARDS
    from ..tasks import TASKS, check_task_knobs

    def name(registry, value: str, key: str, extra: tuple[str, ...] = ()) -> None:  # tasks and rewards plug in
        if value not in registry and value not in extra and not is_import_path(value):
            raise ConfigError(f"{key}: {unknown_name_message(registry.kind, value, [*extra, *registry.names()])}"
                              f" Or a {registry.kind} of your own as an import path, MODULE:NAME (docs/rewards.md).")

    name(TASKS, cfg.data.task, "data.task")
    check_task_knobs(cfg.data.task, cfg.data.task_args, key="data.task_args", types=True)
    name(REWARDS, cfg.reward.name, "reward.name", ("auto",))
    if cfg.reward.name != "auto":
        _check_reward(cfg.reward.name, {}, "reward.name")
    for reward, spec in cfg.reward.weights.items():
        name(REWARDS, reward, "reward.weights")
        _check_reward(reward, spec, f"reward.weights.{reward}")
    from ..rollout import engine_problem  # torch: after the checks that need none (issue 32, item 6)

    problem = engine_problem(cfg.rollout.engine)  # unknown, or its package (vLLM) not installed
    if problem:
        raise ConfigError(f"rollout.engine: {problem}")


def _check_reward(reward: str, spec: Any, key: str) -> None:
    """A part of the reward: its parameters exist; a user's reward (an import path) also imports,
    is built with them and takes (completion, example)."""
    from ..plugins import entry, is_import_path
    from ..rewards import REWARDS, check_reward_params, get_reward

    if is_import_path(reward):
        entry(REWARDS, reward, key)  # an import error names this key
    check_reward_params(reward, spec if isinstance(spec, dict) else (), key, also=("weight",))
    if is_import_path(reward):
        try:
            get_reward(reward, **{k: v for k, v in spec.items() if k != "weight"} if isinstance(spec, dict) else {})
        except ConfigError:
            raise
        except ValueError as err:
            raise ConfigError(f"{key}: {err}") from None
