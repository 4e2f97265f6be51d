"""Math word problems from files or the Hugging Face hub, and the prompts around them.

`load_math_dataset` reads JSONL (no extra dependency), Parquet (pyarrow or pandas) or a
`datasets` hub name, each imported only when that format is asked for, so the core install
stays small. Gold answers stay strings (often LaTeX); the `math` reward verifies them with
math-verify.

Prompts are built in two steps: a named template wraps the problem ("boxed" asks for a
`\\boxed{}` answer, which math-verify extracts most reliably), then, when the tokenizer has a
chat template, `apply_chat_template` turns it into a user turn with the generation prompt.
`MathTask` does both once at construction, so every `Example.prompt` is exactly what the
engine sees; the raw problem stays in `meta["problem"]`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from .base import DataError, Example, Split, check_split, split_of

TEMPLATES: dict[str, str] = {
    "plain": "{problem}",
    "boxed": "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}.",
    "qa": "Question: {problem}\nAnswer:",
}


def apply_template(template: str, problem: str) -> str:
    """Fill a template: a name from `TEMPLATES` or a literal string containing "{problem}"."""
    text = TEMPLATES.get(template, template)
    if "{problem}" not in text:
        raise ValueError(
            f"unknown template {template!r}; valid names: {sorted(TEMPLATES)}, "
            "or a literal template containing '{problem}'"
        )
    return text.replace("{problem}", problem)  # not str.format: templates contain "\boxed{}"


def render_prompt(tokenizer: Any, template: str, problem: str) -> str:
    """The prompt text for `problem`: the template, inside the chat template if the tokenizer has one."""
    text = apply_template(template, problem)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    return text


BUILTIN = "tether:"
"""The prefix of a problem file shipped with tether (`tether:word1_train.jsonl`: tether/tasks/data/), found
wherever the command runs and in an installed package; tether/tasks/word_problems.py writes them."""
DATA_DIR = Path(__file__).resolve().parent / "data"


def builtin(name: str) -> Path:
    """The packaged file `tether:NAME`; a DataError listing the shipped files when there is none."""
    path = DATA_DIR / name[len(BUILTIN) :]
    if not path.is_file():
        shipped = ", ".join(f"{BUILTIN}{p.name}" for p in sorted(DATA_DIR.glob("*.jsonl")))
        raise DataError(f"{name!r}: tether ships no such problem file; the shipped ones: {shipped}")
    return path


def _read_rows(path_or_name: str, split: str | None) -> tuple[list[tuple[str, Any]], str]:
    """(location, row) pairs of a JSONL / Parquet file or a hub dataset, and a stem for default ids.

    A location is "FILE:LINE" for JSONL and "FILE row I" otherwise, for error messages.
    """
    path = builtin(path_or_name) if path_or_name.startswith(BUILTIN) else Path(path_or_name).expanduser()
    if path.exists():
        if split is not None:
            raise ValueError(
                f"split={split!r} selects a hub dataset's split; {path} is a file: pass the file of that split"
            )
        if path.is_dir():
            raise DataError(f"{path} is a directory; pass a .jsonl or .parquet file")
        if path.suffix == ".parquet":
            return [(f"{path} row {i}", row) for i, row in enumerate(_read_parquet(path))], path.stem
        return _read_jsonl(path), path.stem
    if path.suffix in (".jsonl", ".json", ".parquet") or path_or_name.startswith(("/", ".", "~")):
        raise FileNotFoundError(f"math dataset file {path_or_name!r} does not exist")
    try:
        import datasets
    except ImportError as err:
        raise ImportError(
            f"{path_or_name!r} is not a file, so it is read as a Hugging Face dataset name, "
            "which needs the `datasets` package: pip install datasets"
        ) from err
    rows = datasets.load_dataset(path_or_name, split=split or "train")
    return [(f"{path_or_name} row {i}", dict(row)) for i, row in enumerate(rows)], path_or_name.replace("/", "_")


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    rows = []
    with path.open(encoding="utf-8", errors="strict") as f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append((f"{path}:{lineno}", json.loads(line)))
                except json.JSONDecodeError as err:
                    raise DataError(
                        f"{path}:{lineno}: not valid JSON ({err.msg} at column {err.colno}); "
                        "each line must be one JSON object"
                    ) from None
        except UnicodeDecodeError as err:
            raise DataError(
                f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); save the file as UTF-8"
            ) from None
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    except ImportError:
        pass
    try:
        import pandas as pd
    except ImportError as err:
        raise ImportError(f"reading {path} needs pyarrow (or pandas): pip install pyarrow") from err
    return pd.read_parquet(path).to_dict(orient="records")


def load_math_dataset(
    path_or_name: str | Path,
    problem_field: str = "problem",
    answer_field: str = "answer",
    split: str | None = None,
    limit: int | None = None,
) -> list[Example]:
    """Examples from a JSONL/Parquet file or a `datasets` hub name.

    `Example.prompt` is the raw problem (use `render_prompt`, or `MathTask`, for the model's
    prompt); `meta` holds the row's other fields plus "problem". `split` applies to hub names only.
    """
    rows, stem = _read_rows(str(path_or_name), split)
    rows = rows if limit is None else rows[:limit]
    if not rows:
        raise DataError(f"{path_or_name}: no rows; point the task at a file with problems in it")
    examples = []
    for i, (where, row) in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(
                f"{where}: expected a JSON object with {problem_field!r} and {answer_field!r}, got {type(row).__name__}"
            )
        missing = [f for f in (problem_field, answer_field) if row.get(f) is None or str(row[f]).strip() == ""]
        if missing:
            raise DataError(
                f"{where}: row has no (or an empty) {' and '.join(repr(m) for m in missing)}; its fields are "
                f"{sorted(row)}. Fix the row, or name the fields with data.task_args.problem_field / answer_field"
            )
        problem, answer = str(row[problem_field]), str(row[answer_field])
        meta = {k: v for k, v in row.items() if k not in (problem_field, answer_field)}
        meta["problem"] = problem
        examples.append(Example(id=str(row.get("id", f"{stem}-{i}")), prompt=problem, answer=answer, meta=meta))
    return examples


@dataclass
class MathTask:
    """Math problems with prompts rendered for a tokenizer (`data.task_args` when `data.task=math`)."""

    train: str
    """JSONL or Parquet file, or Hugging Face hub dataset name, of the training problems."""
    test: str | None = None
    """File or hub name of the held-out problems; when None, a `test_fraction` share of `train`'s
    problems (by hash of the problem) is held out instead."""
    template: str = "boxed"
    """Prompt template: a `TEMPLATES` name (plain, boxed, qa) or a literal string containing
    "{problem}". Strict answer extraction (reward.strict) applies only when it asks for \\boxed{}."""
    tokenizer: Any = None
    """Not set in the config: the trainer passes the tokenizer of model.name_or_path. When it has a
    chat template, each prompt is rendered as a user turn with the generation prompt."""
    problem_field: str = "problem"
    """Name of the field that holds the problem text in each row."""
    answer_field: str = "answer"
    """Name of the field that holds the gold answer in each row."""
    limit: int | None = None
    """Read at most this many rows per source (None: all of them)."""
    test_fraction: float = 0.1
    """Share of `train`'s problems held out as the test split; used only when `test` is None."""
    seed: int = 0
    """Default seed of the shuffle in `examples`; in training it picks the held-out problems of
    each evaluation (the order of training problems is seeded by trainer.seed)."""
    name: ClassVar[str] = "math"
    reward: ClassVar[str] = "math"
    finite: ClassVar[bool] = True
    _splits: dict[str, list[Example]] = field(init=False, repr=False)

    def _load(self, source: str, knob: str) -> list[Example]:
        try:
            rows = load_math_dataset(source, self.problem_field, self.answer_field, limit=self.limit)
        except FileNotFoundError as err:  # name the config key to change, not only the file
            raise FileNotFoundError(
                f"data.task_args.{knob}: {err}; set data.task_args.{knob}=PATH to an existing "
                ".jsonl or .parquet file, or a Hugging Face dataset name"
            ) from None
        return [
            replace(
                ex,
                prompt=render_prompt(self.tokenizer, self.template, ex.prompt),
                meta={**ex.meta, "user_message": apply_template(self.template, ex.prompt)},
            )
            for ex in rows
        ]

    def __post_init__(self) -> None:
        train = self._load(self.train, "train")
        if self.test is None:
            self._splits = {"train": [], "test": []}
            for ex in train:
                self._splits[split_of(self.name, ex.meta["problem"], self.test_fraction)].append(ex)
        else:
            test = self._load(self.test, "test")
            held_out = {ex.meta["problem"] for ex in test}
            self._splits = {"train": [ex for ex in train if ex.meta["problem"] not in held_out], "test": test}
        for split, source in (("train", self.train), ("test", self.test or self.train)):
            if not self._splits[split]:
                raise DataError(
                    f"the {split} split is empty ({len(train)} rows read from {source}"
                    + (
                        ", every one of them also in the test file)"
                        if split == "train"
                        else f", test_fraction={self.test_fraction})"
                    )
                    + "; give more problems, a separate test file, or a larger test_fraction"
                )

    def examples(
        self, split: Split, n: int | None = None, *, seed: int | None = None, unique: bool = True
    ) -> list[Example]:
        """`n` examples of `split` in a seeded shuffle (all of them when n is None).

        With `unique=False`, `n` may exceed the split's size (sampling with replacement).
        """
        check_split(split)
        pool = self._splits[split]
        rng = random.Random(f"{self.name}:{split}:{self.seed if seed is None else seed}")
        if n is None:
            n = len(pool)
        if unique:
            if n > len(pool):
                raise ValueError(f"{split} has {len(pool)} problems, {n} requested")
            return rng.sample(pool, n)
        return [rng.choice(pool) for _ in range(n)]

    def demonstration(self, example: Example) -> list[str] | None:
        """The model's turns of a worked episode: the row's "turns" (a tool call, then the answer, ...), which the
        warm start of an environment teaches (tether.trainer.sft); None when the row has none."""
        turns = example.meta.get("turns")
        return [str(t) for t in turns] if isinstance(turns, list) and turns else None

    def solution(self, example: Example) -> str:
        """A reference solution: the row's "solution" if any, ending in the boxed answer."""
        reasoning = str(example.meta.get("solution", "")).strip()
        boxed = f"The answer is \\boxed{{{example.answer}}}."
        return f"{reasoning}\n{boxed}" if reasoning else boxed
