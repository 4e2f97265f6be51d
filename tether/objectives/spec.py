"""From what a user writes to a built objective: presets (short YAML files in `tether/presets/`,
each choosing one value per axis), the spec an objective is chosen by (a preset name, an objective
name, or a mapping {preset|name, params...}), the resolved mapping a run records, and how a
report shows it."""

from __future__ import annotations

import dataclasses
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


Spec = Union[str, dict, Objective]
"""How an objective is chosen: a preset name, an objective name, a mapping {preset|name, params...}
(a resolved record, with `label`, is one), or an `Objective` already built."""


def spec_mapping(name: str) -> dict:
    """A name as a spec mapping: {preset: name} for a preset, else {name: name} (the one place that decides)."""
    return {"preset": name} if name in preset_names() else {"name": name}


def label_of(spec: Union[str, dict]) -> str:
    """The name a spec was chosen by, which reports show: its recorded `label`, else the preset's
    name, else the objective's (`objective=grpo` is labelled grpo, though it builds ppo_clip)."""
    if isinstance(spec, str):
        return spec
    label = spec.get("label") or spec.get("preset") or spec.get("name")
    if not isinstance(label, str):
        raise ConfigError(f"objective.label: expected a string (the name reports show), got {label!r}")
    return label


def build(spec: Spec, *, max_len: Optional[int] = None, default: Optional[str] = None) -> Objective:
    """THE place an objective spec is interpreted, for every caller (tether's config and trainer, the
    verl plugin, the TRL adapter): a preset name, objective name, mapping or built `Objective` -> the
    `Objective`, labelled with the name it was chosen by (`label_of`).

    max_len: the generation budget, the objective's `max_len` when the spec leaves it null, applied
        before the config validates (Dr. GRPO's constant T_max).
    default: the preset or objective a mapping with neither `preset` nor `name` overrides
        (`objective.eps_high=0.3` on the command line overrides the config's default objective).
    """
    if isinstance(spec, Objective):
        if max_len is None or spec.config.max_len is not None:
            return spec
        return Objective(spec.name, dataclasses.replace(spec.config, max_len=max_len), spec.label)
    spec = _with_default(spec, default)
    params = _expand(spec)
    label = label_of(spec)
    name = params.pop("name")
    if name not in OBJECTIVES:
        raise ConfigError(unknown_name_message("objective or preset", name, names() + preset_names()))
    if max_len is not None and params.get("max_len") is None:
        params["max_len"] = max_len
    return Objective(name, from_dict(OBJECTIVES.get(name).config, params, "objective"), label)


def resolve(spec: Spec, *, max_len: Optional[int] = None, default: Optional[str] = None) -> dict:
    """The full mapping {label, name, every parameter} a spec stands for (`build`'s objective, as
    plain data). A config records this, so a run never depends on what a preset says later, and
    `build(resolve(spec))` is the same objective. `label` is the name the user chose: reports show
    it, with `name` and the parameters beside it, so a run of the atr_grpo preset reads as
    atr_grpo, not divergence_clip."""
    return describe(build(spec, max_len=max_len, default=default))


def _with_default(spec: Union[str, dict], default: Optional[str]) -> dict:
    if isinstance(spec, str):
        return spec_mapping(spec)
    if not isinstance(spec, dict):
        raise ConfigError(f"an objective is a preset name, an objective name or a mapping; got {spec!r}")
    if default is not None and "preset" not in spec and "name" not in spec:
        return {**spec_mapping(default), **spec}
    return spec


def _expand(spec: dict) -> dict:
    """A spec mapping -> {name, **params} with its preset's values under its own (without `label`)."""
    spec = {k: v for k, v in spec.items() if k != "label"}
    if "preset" in spec:
        base = load_preset(spec.pop("preset"))
        if "name" in spec and spec["name"] != base["name"]:
            raise ConfigError(f"preset selects objective {base['name']!r} but 'name' says {spec['name']!r}; drop one")
        for key in ("kl_penalty", "distill"):  # a section the preset sets: an override changes its keys, not all
            if isinstance(spec.get(key), dict) and isinstance(base.get(key), dict):
                spec[key] = {**base[key], **spec[key]}
        spec = {**base, **spec}
    if "name" not in spec:
        raise ConfigError(
            f"an objective mapping needs 'name' ({', '.join(names())}) or 'preset' ({', '.join(preset_names())})"
        )
    return spec


def describe(obj: Objective) -> dict:
    """The objective's full resolved config as plain data, with its label (for run directories and reports)."""
    d = {"label": obj.label, "name": obj.name, **to_dict(obj.config)}
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
    shared = (
        "advantage",
        "reward_aggregation",
        "aggregation",
        "kl_penalty",
        "entropy_coef",
        "sampler_kl_coef",
        "top_entropy_frac",
        "rollout_correction",
        "distill",
        "max_len",
    )
    keys = [k for k in spec if k not in shared] + [k for k in shared if k in spec]
    params = ", ".join(
        f"{k}={_compact(spec[k])}" for k in keys if k not in ("label", "name", "preset", *skip) and spec[k] is not None
    )
    if width is not None and len(params) > width:
        params = params[: width - 3] + "..."
    return head, params


def _compact(v) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_compact(x)}" for k, x in v.items() if x is not None) + "}"
    return format(v, "g") if isinstance(v, float) else str(v)
