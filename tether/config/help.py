"""`tether train --help-config`: every config key, task knob and reward parameter with its default
and the docstring under its field (the dataclasses are the one source of both)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..schema import field_docs
from ..tasks import TASKS
from .sections import Config, RewardConfig
from ..rewards import REWARDS


def describe_fields(cls: Optional[type] = None, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, docstring) for every field of `cls` (default: the whole `Config`)."""
    if cls is None:
        cls = Config
    docs = field_docs(cls)
    rows = []
    for f in dataclasses.fields(cls):
        default = _default(f)
        key = prefix + f.name
        if dataclasses.is_dataclass(default):
            rows.extend(describe_fields(type(default), key + "."))
        else:
            rows.append((key, repr(None if default is dataclasses.MISSING else default), docs.get(f.name, "")))
    return rows


def _default(f: dataclasses.Field):
    """A field's default value (its factory's product), or dataclasses.MISSING when it has none."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _default_text(f: dataclasses.Field) -> str:
    default = _default(f)
    return "(required)" if default is dataclasses.MISSING else repr(default)


def describe_task_knobs() -> list[tuple[str, str, str, str]]:
    """(data.task_args.KNOB, "task NAME", default, docstring) for every knob of every registered
    task, for `tether train --help-config`."""

    rows = []
    for name in TASKS.names():
        cls = TASKS.get(name)
        docs = field_docs(cls)
        rows.extend(
            (f"data.task_args.{f.name}", f"task {name}", _default_text(f), docs.get(f.name, ""))
            for f in dataclasses.fields(cls)
            if f.init
        )
    return rows


def describe_reward_params() -> list[tuple[str, str, str, str]]:
    """(reward.weights.NAME.PARAM, "reward NAME", default, docstring) for every parameter of every
    registered reward, for `tether train --help-config`.

    A parameter that `RewardConfig` also has (timeout_s, strict) is passed from there to every part
    that takes it (`rewards.task_reward`), so its default is that key, not the dataclass default.
    """

    shared = {f.name for f in dataclasses.fields(RewardConfig)} - {"name", "weights"}
    rows = []
    for name in REWARDS.names():
        entry = REWARDS.get(name)
        if not isinstance(entry, type):
            continue  # a plain function: a weight, no parameters
        docs = field_docs(entry)
        for f in dataclasses.fields(entry):
            if not f.init:
                continue
            default, doc = _default_text(f), docs.get(f.name, "")
            if f.name in shared:
                default = f"reward.{f.name}"
                doc += (
                    f" Unset, it is reward.{f.name}, passed to every reward that takes it"
                    " (also one named by reward.name)."
                )
            rows.append((f"reward.weights.{name}.{f.name}", f"reward {name}", default, doc))
    return rows
