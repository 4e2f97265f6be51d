"""What a task is: a source of `Example`s with a verifiable answer, split into train and test.

Synthetic tasks (arithmetic, countdown) draw problems from a seeded `random.Random`, so a
(task knobs, split, seed) triple always gives the same examples. The train/test split is
decided per problem by a hash of its prompt, not by the draw order: a prompt lands in the same
split for every seed and every `n`, so no held-out prompt can ever be trained on, whatever
seeds the trainer and the evaluator use.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, Protocol

Split = Literal["train", "test"]


class DataError(ValueError):
    """A dataset that cannot be used, with where (file and line) and how to fix it."""


SPLITS: tuple[Split, ...] = ("train", "test")


@dataclass(frozen=True)
class Example:
    """One problem.

    Attributes:
        id: stable identifier (synthetic tasks derive it from the prompt).
        prompt: the exact text given to the model.
        answer: the gold answer as a string (for math often LaTeX).
        meta: task-specific data the reward needs (countdown: numbers and target).
    """

    id: str
    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


class Task(Protocol):
    """A verifiable task.

    `reward` names its default reward in `tether.rewards`; `finite` is True for a fixed
    dataset (iterate it in epochs) and False for a generator (draw as many as needed);
    `template` is the prompt template its prompts are rendered with (math's), None when they
    are not templated. A user's task (`data.task=MODULE:NAME`) gets what it leaves out
    (`tether.plugins.UserTask`).
    """

    name: str
    reward: str
    finite: bool
    template: str | None

    def examples(
        self, split: Split, n: int | None = None, *, seed: int | None = None, unique: bool = True
    ) -> list[Example]:
        """`n` examples of `split`, deterministic in `seed` (the task's own seed when None)."""
        ...

    def solution(self, example: Example) -> str:
        """Target completion text for supervised warm start (the caller appends eos)."""
        ...


def stable_hash(text: str) -> int:
    """A 64-bit hash that, unlike `hash()`, is the same in every process."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def split_of(salt: str, prompt: str, test_fraction: float) -> Split:
    """The split a prompt belongs to: "test" for a `test_fraction` share of prompts by hash."""
    return "test" if stable_hash(f"{salt}\x00{prompt}") < test_fraction * 2**64 else "train"


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {list(SPLITS)}")


def draw_examples(
    salt: str,
    draw: Callable[[random.Random], Example],
    split: Split,
    n: int | None,
    seed: int,
    unique: bool,
    test_fraction: float,
) -> list[Example]:
    """Draw `n` examples of `split` by rejection: problems hashed into the other split are skipped.

    With `unique`, prompts do not repeat; if the problem space runs out before `n` distinct
    prompts are found, raises with how many there were (ask for fewer or widen the task).
    """
    check_split(split)
    if n is None or n < 0:
        raise ValueError(f"synthetic tasks are unbounded: pass a number of examples, got n={n}")
    rng = random.Random(f"{salt}:{split}:{seed}")
    out: list[Example] = []
    seen: set[str] = set()
    max_draws = 200 * n + 20_000
    for _ in range(max_draws):
        if len(out) == n:
            return out
        example = draw(rng)
        if split_of(salt, example.prompt, test_fraction) != split:
            continue
        if unique:
            if example.prompt in seen:
                continue
            seen.add(example.prompt)
        out.append(example)
    if len(out) == n:
        return out
    raise ValueError(
        f"{salt}: found only {len(out)} distinct {split} problems of the {n} requested "
        f"after {max_draws} draws; ask for fewer, pass unique=False, or widen the task's knobs"
    )


class Synthetic:
    """What the generated tasks share. A subclass is a dataclass with `seed` and
    `test_fraction` fields, a `name`, and a `draw(rng)` that makes one problem of either split.
    """

    name: ClassVar[str]
    finite: ClassVar[bool] = False
    template: ClassVar[str | None] = None  # no prompt template: the answers are bare
    seed: int
    test_fraction: float

    def draw(self, rng: random.Random) -> Example:
        raise NotImplementedError

    def check_test_fraction(self) -> None:
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}")

    def make_example(self, prompt: str, answer: str, meta: dict[str, Any]) -> Example:
        """An example whose id is derived from its prompt (same problem, same id)."""
        return Example(id=f"{self.name}-{stable_hash(prompt):016x}", prompt=prompt, answer=answer, meta=meta)

    def examples(
        self, split: Split, n: int | None = None, *, seed: int | None = None, unique: bool = True
    ) -> list[Example]:
        """`n` problems of `split`, deterministic in `seed` (default: the task's seed)."""
        seed = self.seed if seed is None else seed
        return draw_examples(self.name, self.draw, split, n, seed, unique, self.test_fraction)
