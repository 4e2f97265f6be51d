"""Build and validate config dataclasses from plain dicts (YAML, command-line overrides).

One schema: the dataclasses (a docstring under every field) are the truth; YAML files and
`key=value` overrides only supply values. Errors name the offending key with its dotted
path, say what was expected, and for an unknown key list the nearest valid names.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union
import ast
import inspect
import textwrap

from .core.registry import did_you_mean


class ConfigError(ValueError):
    """A config value or key is wrong; the message says which and what would be right."""


class RunsFailed(Exception):
    """Some of `tether compare`'s child runs exited with an error (the message names each and its log)."""


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


SYNONYMS = {
    "rank": "r",
    "lora_r": "r",
    "lora_rank": "r",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "learning_rate": "lr",
    "epochs": "ppo_epochs",
    "num_iterations": "ppo_epochs",
    "steps": "total_steps",
    "max_steps": "total_steps",
    "max_tokens": "max_new_tokens",
    "max_completion_length": "max_new_tokens",
    "num_generations": "group_size",
    "beta": "coef",
    "kl_coef": "kl_penalty",
    "epsilon": "eps_low",
}
"""Names other frameworks and papers use for a key (TRL's, peft's, verl's), and the key they mean here: an unknown
key names it when it is valid where the typo was (issue 49: `model.lora.rank` suggested nothing, not `r`)."""


def unknown_key_error(path: str, key: str, valid: list[str]) -> ConfigError:
    meant = SYNONYMS.get(key)
    hint = f" Did you mean {meant!r}?" if meant in valid else did_you_mean(key, valid)
    return ConfigError(f"unknown key {_join(path, key)!r}.{hint} Valid keys: {', '.join(sorted(valid))}.")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field, read from the class source (for `--help` and docs)."""

    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _describe_type(tp: Any) -> str:
    """A type as a person reads it in an error message."""
    if typing.get_origin(tp) is Literal:
        return " or ".join(repr(c) for c in typing.get_args(tp))
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def coerce(value: Any, tp: Any, path: str) -> Any:
    """Convert `value` to type `tp` (str from the command line included) or raise ConfigError."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, path)
            except ConfigError as e:
                errors.append(str(e))
        expected = " or ".join(_describe_type(a) for a in args if a is not type(None))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: got {value!r}, expected {expected}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        raise ConfigError(f"{path}: {value!r} is not one of {', '.join(repr(c) for c in choices)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, path)
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v != ""]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        item = args[0] if args else Any
        items = [coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    return _coerce_scalar(value, tp, path)


def _coerce_scalar(value: Any, tp: Any, path: str) -> Any:
    """bool, int, float and str from their own type or from command-line text."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value)
            except ValueError:
                f = None
            if f is not None and f.is_integer():
                return int(f)
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    return value


def from_dict(cls: type, data: dict, path: str = "") -> Any:
    """Instantiate dataclass `cls` from `data`, recursing into nested dataclasses."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or cls.__name__}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            raise unknown_key_error(path, str(key), list(fields))
    kwargs = {key: coerce(value, hints[key], _join(path, key)) for key, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{path + ': ' if path else ''}{e}") from None


def to_dict(obj: Any) -> Any:
    """A dataclass (nested) as plain dicts/lists, for YAML output."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
