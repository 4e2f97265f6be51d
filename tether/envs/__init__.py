"""Environments that talk back: multi-turn episodes and tools (docs/environments.md).

    env: {name: retry, reward: env, max_turns: 3}                   # built-in retry on feedback
    env: {tools: [calculator]}                                       # the model may call a calculator
    env: {name: myenv:Game, args: {level: 2}}                        # your own environment

Two layers: tools are plain functions (`tether.envs.tools`); an environment is any class with
`reset(example)` and `step(reply) -> Step` (`tether.envs.base`). Both plug in as rewards and tasks do:
a registered name, or `module:name` (tether.plugins). `EpisodeRunner` (`tether.envs.episodes`) plays the
episodes token in, token out, on the hf or vllm engine; the trainer and `tether eval` call it through
`tether.rollout.draw` wherever they would sample a prompt.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from ..config.sections import EnvConfig, RolloutConfig
from ..core.registry import Registry
from ..plugins import entry, parameters
from ..schema import ConfigError
from ..tasks import Example
from .base import Environment, EnvironmentBroken, SingleTurn, Step
from ..rollout import draw, episode_summary
from .episodes import ChatTurns, EnvWarnings, EpisodeRunner, Limits, episode_metrics
from .retry import Retry
from .tools import Tools, calculator, plain_instructions, tool_schema
from .towns import town_population

ENVIRONMENTS: Registry[Callable[..., Any]] = Registry("environment")
ENVIRONMENTS.register("retry")(Retry)
ENVIRONMENTS.register("tools")(Tools)
ENVIRONMENTS.register("single_turn")(SingleTurn)

TOOLS: Registry[Callable[..., Any]] = Registry("tool")
TOOLS.register("calculator")(calculator)
TOOLS.register("town_population")(town_population)


def env_label(e: EnvConfig) -> str:
    """The environment's name as messages show it."""
    return e.name or "tools"


def resolve_tools(e: EnvConfig) -> list[Callable]:
    """The functions `env.tools` names (ConfigError naming a bad one: an import, a missing type hint)."""
    tools = []
    for i, name in enumerate(e.tools):
        try:
            fn = entry(TOOLS, name, f"env.tools[{i}]")
            tool_schema(fn)
        except KeyError as err:
            raise ConfigError(
                f"env.tools[{i}]: {err.args[0].rstrip('.')}. Or a tool of your own, MODULE:NAME"
            ) from None
        except ValueError as err:
            raise ConfigError(f"env.tools[{i}]={name!r}: {err}") from None
        tools.append(fn)
    return tools


def environment_factory(e: EnvConfig, judge: Optional[Callable[[str, Example], float]]) -> Callable[[], Any]:
    """A function that builds one episode's environment (checked now: ConfigError naming what is wrong)."""
    tools = resolve_tools(e)
    name = e.name or "tools"
    try:
        factory = entry(ENVIRONMENTS, name, "env.name")
    except KeyError as err:
        raise ConfigError(f"env.name: {err.args[0].rstrip('.')}. Or an environment of your own, MODULE:NAME") from None
    named, required, var_kw = parameters(factory)
    args = dict(e.args)
    if "tools" in named and tools:
        args.setdefault("tools", tools)
    if "max_turns" in named:
        args.setdefault("max_turns", e.max_turns)
    if "judge" in named and "judge" not in args:
        if judge is None:
            raise ConfigError(f"env.name={name}: it takes `judge` (the run's reward), which this run has none of")
        args["judge"] = judge
    unknown = [k for k in args if k not in named] if not var_kw else []
    missing = [k for k in required if k not in args]
    if unknown or missing:
        raise ConfigError(
            f"env.args: the environment {name} takes {', '.join(named) or 'no arguments'}; "
            + (f"unknown: {', '.join(unknown)}" if unknown else f"missing: {', '.join(missing)}")
        )
    return functools.partial(factory, **args)


def build_runner(
    e: EnvConfig,
    r: RolloutConfig,
    engine: Any,
    tokenizer: Any,
    judge: Optional[Callable[[str, Example], float]],
    context: Optional[int],
) -> EpisodeRunner:
    """The run's episode runner on `engine` (the `env` section; `context`: the model's, None if unknown)."""
    make = environment_factory(e, judge)
    limits = Limits(e.max_turns, e.turn_tokens(r), e.episode_tokens(r), context, e.timeout_s)
    try:
        return EpisodeRunner(engine, tokenizer, make, limits, env_label(e), resolve_tools(e))
    except ValueError as err:  # the chat template cannot be used token in, token out
        raise ConfigError(f"env: {err}") from None


def judge_with(reward: Any) -> Callable[[str, Example], float]:
    """The run's reward as a judge for environments: (reply, example) -> score (0 when it fails)."""
    from ..rewards import score_batch  # lazy: rewards' workers load only when an environment judges

    def judge(reply: str, example: Example) -> float:
        return float(score_batch(reward, [reply], [example])[0].score)

    return judge


__all__ = [
    "ENVIRONMENTS",
    "TOOLS",
    "ChatTurns",
    "Environment",
    "EnvWarnings",
    "EnvironmentBroken",
    "EpisodeRunner",
    "Limits",
    "Retry",
    "SingleTurn",
    "Step",
    "Tools",
    "build_runner",
    "calculator",
    "draw",
    "env_label",
    "environment_factory",
    "episode_metrics",
    "episode_summary",
    "judge_with",
    "plain_instructions",
    "resolve_tools",
    "tool_schema",
]
