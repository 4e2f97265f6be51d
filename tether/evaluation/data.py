"""Data specs: which problems an evaluation samples, each with `meta["source"]` (its benchmark)
and `meta["task"]` (which picks its verifier), keyed by (source, id)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from ..config.loading import parse_override
from ..config.sections import EnvConfig
from ..records.runlog import read_config
from ..schema import ConfigError, from_dict
from ..tasks import Example, apply_template, get_task, load_math_dataset, render_prompt, takes_tokenizer

DEFAULT_TASK_PROBLEMS = 200  # = the trainer's data.eval_size default: `task:X` is its held-out set


class EvalError(ValueError):
    """A user error: a bad data spec, or an output directory holding other settings' results."""


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def _task_examples(spec: str, limit: int | None) -> list[Example]:
    """`task:NAME[:KEY=VALUE...]`: the held-out ("test") split of a synthetic task."""
    name, *parts = spec[len("task:") :].split(":")
    knobs = {}
    for item in (p for part in parts for p in part.split(",") if p):
        key, sep, value = item.partition("=")
        if not sep:
            raise EvalError(f"{spec!r}: task knobs are KEY=VALUE, got {item!r}")
        knobs[key.strip()] = _parse_value(value.strip())
    if name == "math":
        raise EvalError(f"{spec!r}: give math data as a JSONL/Parquet path or a dataset name, not task:math")
    try:
        task = get_task(name, **knobs)
        examples = task.examples("test", DEFAULT_TASK_PROBLEMS if limit is None else limit)
    except KeyError as err:
        raise EvalError(f"{spec!r}: {err.args[0]}") from None
    except ValueError as err:
        raise EvalError(f"{spec!r}: {err}") from None
    source = spec[len("task:") :] if knobs else name
    return [replace(ex, meta={**ex.meta, "source": source, "task": name}) for ex in examples]


def _run_examples(spec: str, tokenizer: Any, limit: int | None) -> list[Example]:
    """`run:RUN_DIR`: the held-out problems a training run scores (its task, `data.eval_size` of the test split,
    in the trainer's order), prompts rendered as the trainer rendered them (the task's template, the model's
    chat template). Source: `run:` and the run directory's name."""
    run_dir = Path(spec[len("run:") :]).expanduser()
    if not (run_dir / "config.yaml").is_file():
        raise EvalError(f"{spec!r}: {run_dir} is not a run directory (it has no config.yaml)")
    data = read_config(run_dir)["data"]
    knobs = dict(data.get("task_args") or {})
    if takes_tokenizer(data["task"]):
        knobs["tokenizer"] = tokenizer
    try:
        examples = get_task(data["task"], **knobs).examples("test", data["eval_size"])
    except (KeyError, ValueError, FileNotFoundError) as err:
        raise EvalError(f"{spec!r}: the run's task {data['task']!r} cannot be built here: {err}") from None
    source = f"run:{run_dir.name}"
    examples = examples if limit is None else examples[:limit]
    return [
        replace(ex, meta={**ex.meta, "source": source, "task": ex.meta.get("task", data["task"])}) for ex in examples
    ]


def run_template(spec: str) -> str | None:
    """The prompt template of the run a `run:RUN_DIR` spec names (its math task's `template`), None for a task
    without one or a directory without a config: with it, `tether eval` extracts answers as that run's trainer
    did (strict only when the template asks for \\boxed{})."""
    config = Path(spec[len("run:") :]).expanduser() / "config.yaml"
    if not config.is_file():
        return None
    data = read_config(config.parent)["data"]
    return (data.get("task_args") or {}).get("template", "boxed") if data["task"] == "math" else None


def run_rollout(spec: str) -> dict[str, Any]:
    """The rollout settings of the run a `run:RUN_DIR` spec names that `tether eval` takes when not given: its
    `max_new_tokens` and `stop_strings` (the answer budget the model was trained and scored with; issue 49: a
    48-token run was evaluated with 2048 tokens, 12.5% of completions ran to the limit); {} without a config."""
    config = Path(spec[len("run:") :]).expanduser() / "config.yaml"
    if not config.is_file():
        return {}
    rollout = read_config(config.parent).get("rollout") or {}
    return {k: rollout[k] for k in ("max_new_tokens", "stop_strings") if k in rollout}


def eval_env(settings: Sequence[str], run_spec: str | None = None) -> dict[str, Any] | None:
    """The env section `tether eval` plays episodes with: `--env KEY=VALUE` settings over the env section of the
    run a `run:RUN_DIR` spec names (its episodes, as its trainer played them); None for single-turn prompts.
    An EvalError names a bad setting."""
    section: dict[str, Any] = {}
    if run_spec is not None and (Path(run_spec[len("run:") :]).expanduser() / "config.yaml").is_file():
        section = dict(read_config(Path(run_spec[len("run:") :]).expanduser()).get("env") or {})
    for text in settings:
        try:
            key, value = parse_override(text)
        except ConfigError as err:
            raise EvalError(f"--env {text!r}: {err}") from None
        section[key.removeprefix("env.")] = value
    try:
        env = from_dict(EnvConfig, section, "env")
    except (ConfigError, TypeError) as err:
        raise EvalError(f"--env: {err}") from None
    return section if env.enabled else None


def _math_examples(
    spec: str, tokenizer: Any, template: str, limit: int | None, problem_field: str, answer_field: str
) -> list[Example]:
    """A JSONL/Parquet file, or a `datasets` hub name with an optional `@split` (default test)."""
    split, stem = None, spec
    if Path(spec).expanduser().exists():
        stem = Path(spec).stem
    elif "@" in spec:
        stem, split = spec.rsplit("@", 1)
    elif not spec.startswith(("/", ".", "~")) and Path(spec).suffix not in (".jsonl", ".json", ".parquet"):
        split = "test"
    rows = load_math_dataset(stem if split else spec, problem_field, answer_field, split=split, limit=limit)
    return [
        replace(
            ex,
            prompt=render_prompt(tokenizer, template, ex.prompt),
            # the user message before the chat template, which an environment with tools renders them into
            meta={
                **ex.meta,
                "source": str(ex.meta.get("source") or stem),
                "task": "math",
                "user_message": apply_template(template, ex.prompt),
            },
        )
        for ex in rows
    ]


def load_eval_data(
    spec: str,
    tokenizer: Any = None,
    template: str = "boxed",
    limit: int | None = None,
    *,
    problem_field: str = "problem",
    answer_field: str = "answer",
) -> list[Example]:
    """The problems of one data spec, with `meta["source"]` and `meta["task"]` set.

    spec:
        `task:NAME[:KEY=VALUE...]`  the held-out split of a synthetic task (`task:arithmetic`,
            `task:countdown:count=4:max_target=99`); `limit` problems, default 200. Prompts are
            the task's own (no template). Source: NAME, or NAME:knobs when knobs are given.
        `run:RUN_DIR`  the held-out problems a training run scores, exactly: its task and knobs,
            `data.eval_size` of them in the trainer's order, rendered as it rendered them.
        a `.jsonl` / `.parquet` path  rows with `problem_field` and `answer_field`; the first
            `limit` rows. Source: the row's `source` field, else the file stem.
        a `datasets` hub name  `owner/name` or `owner/name@split` (default split "test").
    Math prompts are `render_prompt(tokenizer, template, problem)`; `meta["task"]` is "math"
    for them and the task name for synthetic ones (it picks the verifier).
    """
    if limit is not None and limit < 1:
        raise EvalError(f"limit must be >= 1 or None, got {limit}")
    if spec.startswith("task:"):
        return _task_examples(spec, limit)
    if spec.startswith("run:"):
        return _run_examples(spec, tokenizer, limit)
    return _math_examples(spec, tokenizer, template, limit, problem_field, answer_field)


def problem_key(ex: Example) -> tuple[str, str]:
    """(source, id): a problem's identity in `problems.jsonl`."""
    return ex.meta["source"], ex.id


def unique_problems(examples: list[Example]) -> list[Example]:
    """Examples keyed by (source, id), first kept; the same key with another prompt is an error."""
    seen: dict[tuple[str, str], Example] = {}
    for ex in examples:
        old = seen.setdefault(problem_key(ex), ex)
        if old.prompt != ex.prompt:
            raise EvalError(f"two different problems share source {problem_key(ex)[0]!r} and id {ex.id!r}")
    return list(seen.values())


__all__ = ["DEFAULT_TASK_PROBLEMS", "EvalError", "load_eval_data", "problem_key", "run_template", "unique_problems"]
