"""From what a user writes to a built objective: presets (short YAML files in `tether/presets/`,
each choosing one value per axis), the spec an objective is chosen by (a preset name, an objective
name, or a mapping {preset|name, params...}), the resolved mapping a run records, and how a
report shows it."""

from __future__ import annotations

from importlib import resources
from typing import Optional, Union

import yaml

from ..core.registry import unknown_name_message
from ..schema import ConfigError, from_dict, to_dict
from .base import OBJECTIVES
from .runtime import Objective


def preset_names() -> list[str]:
    files = resources.files("tether").joinpath("presets").iterdir()
    return sorted(f.name[: -len(".yaml")] for f in files if f.name.endswith(".yaml"))


def load_preset(name: str) -> dict:
    """The preset's YAML as a dict (`name` is the objective it selects)."""
    if name not in preset_names():
        raise KeyError(unknown_name_message("preset", name, preset_names()))
    text = resources.files("tether").joinpath("presets", f"{name}.yaml").read_text()
    return yaml.safe_load(text)


def names() -> list[str]:
    """Registered objective names (the surrogates; presets are listed by `preset_names`)."""
    return OBJECTIVES.names()


def label_of(spec: Union[str, dict]) -> str:
    """The name a spec was chosen by, which reports show: its recorded `label`, else the preset's
    name, else the objective's (`objective=grpo` is labelled grpo, though it builds ppo_clip)."""
    if isinstance(spec, str):
        return spec
    label = spec.get("label") or spec.get("preset") or spec.get("name")
    if not isinstance(label, str):
        raise ConfigError(f"objective.label: expected a string (the name reports show), got {label!r}")
    return label


def resolve(spec: Union[str, dict]) -> dict:
    """A preset name, objective name, or dict -> the full dict {name, **params} it stands for
    (without its `label`, which names it in reports and is no parameter)."""
    if isinstance(spec, str):
        spec = {"preset": spec} if spec in preset_names() else {"name": spec}
    if not isinstance(spec, dict):
        raise ConfigError(f"an objective is a preset name, an objective name or a mapping; got {spec!r}")
    spec = {k: v for k, v in spec.items() if k != "label"}
    if "preset" in spec:
        base = load_preset(spec.pop("preset"))
        if "name" in spec and spec["name"] != base["name"]:
            raise ConfigError(f"preset selects objective {base['name']!r} but 'name' says {spec['name']!r}; drop one")
        if isinstance(spec.get("kl_penalty"), dict) and isinstance(base.get("kl_penalty"), dict):
            spec["kl_penalty"] = {**base["kl_penalty"], **spec["kl_penalty"]}
        spec = {**base, **spec}
    if "name" not in spec:
        raise ConfigError(
            f"an objective mapping needs 'name' ({', '.join(names())}) or 'preset' ({', '.join(preset_names())})"
        )
    return spec


def build(spec: Union[str, dict]) -> Objective:
    """Build an objective from a preset name, an objective name, or a config mapping."""
    spec = resolve(spec)
    name = spec.pop("name")
    if name not in OBJECTIVES:
        raise ConfigError(unknown_name_message("objective or preset", name, names() + preset_names()))
    config = from_dict(OBJECTIVES.get(name).config, spec, "objective")
    return Objective(name, config)


def resolved(spec: Union[str, dict], max_len: Optional[int] = None) -> dict:
    """THE place a preset or objective spec is interpreted: the full mapping {label, name, every
    parameter} it stands for, with `max_len` filled in when the spec leaves it null. A config records
    this, so a run never depends on what a preset says later; `build(resolved(spec))` is the same
    objective. `label` is the name the user chose (`label_of`): reports show it, with `name` and the
    parameters beside it, so a run of the atr_grpo preset reads as atr_grpo, not divergence_clip."""
    label = label_of(spec)
    obj = build(spec)
    if max_len is not None and obj.config.max_len is None:
        obj.config.max_len = max_len
    return {"label": label, **describe(obj)}


def describe(obj: Objective) -> dict:
    """The objective's full resolved config as plain data (for run directories and reports)."""
    d = {"name": obj.name, **to_dict(obj.config)}
    if callable(d.get("measure")):
        d["measure"] = getattr(d["measure"], "__name__", "callable")
    return d


def display(spec: dict, width: Optional[int] = None, skip: tuple[str, ...] = ()) -> tuple[str, str]:
    """A resolved objective for a reader, as (head, parameters): ('atr_grpo (divergence_clip)',
    'measure=kl3, delta=0.0231, ...'), the head just the name when the label is the objective's own.
    The objective's own parameters come first, then the axes every objective has; nulls and `skip`
    are left out, and the parameters are cut at `width` characters."""
    name, label = str(spec.get("name") or ""), str(spec.get("label") or spec.get("preset") or spec.get("name") or "")
    head = label if label == name or not name else f"{label} ({name})"
    shared = ("advantage", "aggregation", "kl_penalty", "entropy_coef", "rollout_correction", "max_len")
    keys = [k for k in spec if k not in shared] + [k for k in shared if k in spec]
    params = ", ".join(f"{k}={_compact(spec[k])}" for k in keys
                       if k not in ("label", "name", "preset", *skip) and spec[k] is not None)
    if width is not None and len(params) > width:
        params = params[: width - 3] + "..."
    return head, params


def _compact(v) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_compact(x)}" for k, x in v.items() if x is not None) + "}"
    return format(v, "g") if isinstance(v, float) else str(v)
