"""A task of your own, in your own file: problems from a JSONL file, checked by the task's own verifier.

    tether train data.task=reverse_task:ReverseTask data.task_args.path=reverse.jsonl data.eval_size=50

tether calls the class (or any factory) with data.task_args as keywords and uses what it returns:
`reward` (here a method: the verifier of training and held-out accuracy; a reward name or an import
path also works), `examples(split, n, *, seed, unique)`, `finite` (a fixed dataset, read in epochs)
and `solution(example)`, the target of the supervised warm start (without one, set
warm_start.enabled=false).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from tether.tasks import Example, split_of


@dataclass
class ReverseTask:
    """Write a word backwards: {"word": "stone", "reversed": "enots"} per line."""

    path: str
    """The JSONL file of problems."""
    test_fraction: float = 0.2
    """Share of the problems held out (by a hash of the prompt, the same for every seed)."""
    name: ClassVar[str] = "reverse"
    finite: ClassVar[bool] = True
    _splits: dict = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._splits = {"train": [], "test": []}
        for i, line in enumerate(Path(self.path).read_text().splitlines()):
            if line.strip():
                row = json.loads(line)
                prompt = f"reverse {row['word']}="
                example = Example(id=f"reverse-{i}", prompt=prompt, answer=row["reversed"])
                self._splits[split_of(self.name, prompt, self.test_fraction)].append(example)

    def examples(
        self, split: str, n: int | None = None, *, seed: int | None = None, unique: bool = True
    ) -> list[Example]:
        pool = self._splits[split]
        rng = random.Random(f"{split}:{seed}")
        if n is None:
            return list(pool)
        if unique:
            return rng.sample(pool, n)  # more than the split holds: ValueError, which tether reports
        return [rng.choice(pool) for _ in range(n)]

    def solution(self, example: Example) -> str:
        return example.answer

    def reward(self, completion: str, example: Example) -> float:
        """The task's own verifier: 1 for the word reversed exactly, else 0."""
        return float(completion.strip() == example.answer)
