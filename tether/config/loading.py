"""From YAML and `key=value` overrides to a checked `Config`, and a run's config.yaml written and read.

Sources, later ones winning: the dataclass defaults, a YAML file, `key=value` overrides with dotted keys
(`trainer.total_steps=50`, `objective=dapo`, `objective.eps_high=0.3`). An unknown key names the nearest
valid ones, a bad value says what was expected, a YAML syntax error names FILE:LINE:COLUMN.

`check_config` runs, once, the checks a value cannot make alone: task, task knobs, reward and engine exist
and a user's task or reward (`module:name`, tether.plugins) imports and takes what it is given; the
objective, resolved to every parameter, fits the trainer's settings (a teacher exactly when it distills);
`model.name_or_path` and `teacher.name_or_path` can be models (no network) and `trainer.device` names a
device. Each raises ConfigError naming the key and the fix, and all of them run before any directory is written.
The ones that need torch come last, so a config error is reported before torch is imported (docs/performance.md,
"Time to an error").
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import yaml

from .. import __version__
from ..core.registry import unknown_name_message
from ..plugins import entry, is_import_path
from ..rewards import REWARDS, check_reward_params, get_reward
from ..schema import ConfigError, from_dict, to_dict, unknown_key_error
from ..tasks import TASKS, check_task_knobs
from .sections import DEFAULT_OBJECTIVE, RESUMABLE_KEYS, Config, config_differences


def check_config(cfg: Config) -> Config:
    """`cfg` with its objective resolved (the full mapping {label, name, every parameter} a run records;
    `max_len` defaults to the generation budget, Dr. GRPO's constant T_max; a mapping without preset or
    name overrides the default objective), after every check that asks the rest of tether (module
    docstring), the torch-free ones first."""
    check_names(cfg)
    from .. import objectives  # lazy: torch, imported after the checks that need none

    objective = objectives.resolve(cfg.objective, max_len=cfg.rollout.max_new_tokens, default=DEFAULT_OBJECTIVE)
    cfg = dataclasses.replace(cfg, objective=objective)
    _check_objective_with_trainer(cfg)
    check_model_and_device(cfg)
    return cfg


def _check_objective_with_trainer(cfg: Config) -> None:
    """The checks of the resolved objective against the trainer's and the rollout's settings."""
    from .. import objectives  # lazy: torch, imported after the checks that need none

    t, r = cfg.trainer, cfg.rollout
    if t.old_logprobs == "sampler":  # a constraint measured against pi_sampler would be identically inactive
        built = objectives.build(cfg.objective).config
        for key, why in built.vanishes_when_old_is_sampler().items():
            raise ConfigError(f"objective.{key} with trainer.old_logprobs=sampler (pi_old = pi_sampler): {why}")
        support = built.sparse_support()
        if support is not None:  # the engines return the sampled token's log-prob only
            raise ConfigError(
                f"objective {cfg.objective['name']!r} with trainer.old_logprobs=sampler: it reads pi_old's top "
                f"{support.top_k} tokens at every position (a sparse support), and the sampler gives only the "
                "sampled token's log-prob; set trainer.old_logprobs=recompute (pi_old's set is kept by that pass)"
            )
    if cfg.objective.get("sampler_kl_coef") and not r.full_softmax:
        raise ConfigError(
            f"objective.sampler_kl_coef={cfg.objective['sampler_kl_coef']}: the penalty compares log pi_theta "
            "with the sampler's log-probs, which are those of the full softmax only with rollout.top_p=1 and "
            f"rollout.temperature>0 (got top_p={r.top_p}, temperature={r.temperature}); against a top-p "
            "renormalised sampler it penalises even an on-policy update. Set rollout.top_p=1 or sampler_kl_coef=0"
        )
    _check_teacher_with_objective(cfg)
    c0 = cfg.objective.get("entropy_coef", 0.0)
    if t.entropy_target is not None and not t.entropy_coef_min <= c0 <= t.entropy_coef_max:
        raise ConfigError(
            f"objective.entropy_coef={c0} is where trainer.entropy_target's adaptive coefficient starts, which stays "
            f"within [trainer.entropy_coef_min, trainer.entropy_coef_max] = [{t.entropy_coef_min}, "
            f"{t.entropy_coef_max}]; set objective.entropy_coef in that range (the paper starts at 0)"
        )


def _check_teacher_with_objective(cfg: Config) -> None:
    """A teacher exactly when the objective distills to one."""
    distill, teacher = cfg.objective.get("distill"), cfg.teacher.name_or_path
    if distill and not teacher:
        raise ConfigError(
            f"objective.distill (signal {distill.get('signal')!r}) scores the student's samples with a teacher, but "
            "teacher.name_or_path is empty; set it (a run's checkpoint RUN/checkpoints/step_N/model, a model "
            "directory, hub id or tether:NAME), or objective.distill=null"
        )
    if teacher and not distill:
        raise ConfigError(
            f"teacher.name_or_path={teacher!r} is set, but the objective does not distill; set objective.distill "
            "(e.g. objective.distill.signal=reverse_kl, or objective=opd), or teacher.name_or_path=''"
        )


def check_model_and_device(cfg: Config) -> None:
    """model.name_or_path and teacher.name_or_path can be models (a directory with config.json, or a hub id; no
    network) and trainer.device names a device (whether this machine has it is checked when a run starts)."""
    from ..model.devices import device_problem  # lazy: torch
    from ..model.loading import model_source_problem  # lazy: torch

    if not cfg.model.builtin_tiny:
        problem = model_source_problem(cfg.model.name_or_path)
        if problem:
            raise ConfigError(f"model.name_or_path: {problem}")
    if cfg.teacher.enabled:
        problem = model_source_problem(cfg.teacher.name_or_path)
        if problem:
            raise ConfigError(
                f"teacher.name_or_path: {problem} (A run's checkpoint, RUN/checkpoints/step_N/model, is there once "
                "that run has saved it: train the teacher's run first.)"
            )
    if cfg.trainer.device != "auto":
        problem = device_problem(cfg.trainer.device, available=False)
        if problem:
            raise ConfigError(problem)


def check_names(cfg: Config) -> None:
    """Task, task knobs, reward and engine exist, a user's (`module:name`, tether.plugins) imports
    and takes what it is given: checked on load, before any directory is written."""

    def name(registry, value: str, key: str, extra: tuple[str, ...] = ()) -> None:  # tasks and rewards plug in
        if value not in registry and value not in extra and not is_import_path(value):
            raise ConfigError(
                f"{key}: {unknown_name_message(registry.kind, value, [*extra, *registry.names()])}"
                f" Or a {registry.kind} of your own as an import path, MODULE:NAME (docs/rewards.md)."
            )

    name(TASKS, cfg.data.task, "data.task")
    check_task_knobs(cfg.data.task, cfg.data.task_args, key="data.task_args", types=True)
    name(REWARDS, cfg.reward.name, "reward.name", ("auto",))
    if cfg.reward.name != "auto":
        _check_reward(cfg.reward.name, {}, "reward.name")
    for reward, spec in cfg.reward.weights.items():
        name(REWARDS, reward, "reward.weights")
        _check_reward(reward, spec, f"reward.weights.{reward}")
    from ..rollout import engine_problem  # lazy: torch, imported after the checks that need none

    problem = engine_problem(cfg.rollout.engine)  # unknown, or its package (vLLM) not installed
    if problem:
        raise ConfigError(f"rollout.engine: {problem}")
    if cfg.env.enabled:
        from ..envs import environment_factory  # lazy: torch, and a user's environment module, only for an env

        environment_factory(cfg.env, judge=lambda reply, example: 0.0)  # names, imports, tools' schemas, args


def _check_reward(reward: str, spec: Any, key: str) -> None:
    """A part of the reward: its parameters exist; a user's reward (an import path) also imports,
    is built with them and takes (completion, example)."""
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


VERSION_KEY = "tether_version"
"""Written at the top of a run's config.yaml: the tether version that ran it (not a config key)."""


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    """tree["a"]["b"] = value for "a.b", creating mappings on the way.

    `objective.KEY=V` on an objective given by name turns it into {preset|name: NAME, KEY: V}.
    A reward part named by an import path keeps its dots: `reward.weights.pkg.mod:fn.PARAM`.
    """
    keys = dotted.split(".")
    if keys[:2] == ["reward", "weights"] and any(":" in k for k in keys[2:]):
        end = next(i for i, k in enumerate(keys) if ":" in k) + 1
        keys = [*keys[:2], ".".join(keys[2:end]), *keys[end:]]
    node = tree
    for k in keys[:-1]:
        current = node.get(k)
        if current is None:
            node[k] = {}
        elif k == "objective" and isinstance(current, str):
            from .. import objectives  # lazy: torch (a name given on the command line)

            node[k] = objectives.spec_mapping(current)
        elif not isinstance(current, dict):
            raise ConfigError(f"{dotted}: {k!r} is not a section that has keys")
        node = node[k]
    node[keys[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` with the value read as YAML (numbers, lists, mappings, null)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not key=value (e.g. trainer.total_steps=50)")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _yaml_error(path: str, err: yaml.YAMLError) -> str:
    """`FILE:LINE:COLUMN: not valid YAML: the problem (while ...)` from a YAML error (1-based)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None)
    if mark is None or problem is None:
        return f"{path}: not valid YAML ({str(err).splitlines()[0]}); fix the file"
    context, cmark = getattr(err, "context", None), getattr(err, "context_mark", None)
    opened = f" ({context}, opened at line {cmark.line + 1}, column {cmark.column + 1})" if context and cmark else ""
    return f"{path}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {problem}{opened}; fix the file"


def load_config(path: Optional[str] = None, overrides: tuple[str, ...] | list[str] = ()) -> Config:
    """Defaults <- YAML file <- dotted overrides: the `Config` (its values checked as it is built), then
    `check_config`'s checks, and the objective resolved."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {path!r} not found; pass a YAML file path or omit it to use the defaults")
        try:  # safe_load: a YAML tag can never construct Python objects or run code
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(_yaml_error(path, err)) from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
        loaded.pop(VERSION_KEY, None)  # a run directory's config.yaml records its version
        tree = _data_files_beside(loaded, p.parent)
    for text in overrides:
        key, value = parse_override(text)
        top = key.split(".")[0]
        if top not in Config.__dataclass_fields__:
            raise unknown_key_error("", top, list(Config.__dataclass_fields__))
        _set_dotted(tree, key, value)
    return check_config(from_dict(Config, tree))


DATA_FILE_KEYS = ("train", "test", "path")
"""The data.task_args keys that name a data file."""


def _data_files_beside(tree: dict, config_dir: Path) -> dict:
    """A config file's data files found wherever the command runs: a relative `data.task_args.train` (or
    `test`, `path`) that is not there from the working directory but is from the config file's own
    directory is read from there (recorded as that absolute path). Overrides on the command line stay
    relative to the working directory, as the user typed them."""
    args = (tree.get("data") or {}).get("task_args")
    if not isinstance(args, dict):
        return tree
    for key in DATA_FILE_KEYS:
        value = args.get(key)
        if isinstance(value, str) and not value.startswith(("/", "~", "tether:")) and not Path(value).exists():
            beside = (config_dir / value).resolve()
            if beside.exists():
                args[key] = str(beside)
    return tree


def check_resume(cfg: Config, run_dir: Path) -> None:
    """A resumed run must be the run its directory records: only the budget, logging and
    checkpointing (RESUMABLE_KEYS) may differ from RUN_DIR/config.yaml. Raises ConfigError naming
    the keys and the way to train with the new values (a new run)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there; is it a tether run directory?")
    diff = config_differences(cfg, load_config(str(path)), ignore=(*RESUMABLE_KEYS, "output_dir"))
    if diff:
        changed = [k for k, _, _ in diff]
        shown = ", ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in diff[:5])
        raise ConfigError(
            f"--resume {run_dir}: a resumed run cannot change {shown}{' ...' if len(changed) > 5 else ''} "
            f"(it would no longer be the run {path} records); only {', '.join(RESUMABLE_KEYS)} can change. "
            f"To train with the new values start a new run: tether train {path} KEY=VALUE ... output_dir=NEW_DIR"
        )


def save_config(cfg: Config, path: Path) -> None:
    """The resolved config (the objective with every parameter) and the tether version."""
    path.write_text(yaml.safe_dump({VERSION_KEY: __version__, **to_dict(cfg)}, sort_keys=False))
