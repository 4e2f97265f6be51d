"""A resumable, deterministic stream of training prompts.

Synthetic tasks are unbounded: chunk k of the stream is `task.examples("train", CHUNK,
seed=f(seed, k), unique=False)`. Finite datasets (math) are read in a fresh seeded
permutation per epoch. Either way the stream's whole state is one integer, `position`,
which the checkpoint stores; resuming at the same position yields the same prompts.
"""

from __future__ import annotations

import random

from ..tasks import DataError, Example, Task
from . import seeds

CHUNK = 1024


class PromptStream:
    def __init__(self, task: Task, seed: int, position: int = 0):
        self.task = task
        self.seed = seed
        self.position = position
        self._chunk_id = -1
        self._chunk: list[Example] = []
        self._finite = task.finite

    def _load(self, k: int) -> None:
        if self._finite:
            rows = list(self.task.examples("train"))
            if not rows:
                raise DataError("the training split is empty: check data.task_args (path, split, fields)")
            random.Random(f"{self.seed}:epoch:{k}").shuffle(rows)
            self._chunk = rows
        else:
            self._chunk = self.task.examples("train", CHUNK, seed=seeds.data_chunk(self.seed, k), unique=False)
        self._chunk_id = k

    def take(self, n: int) -> list[Example]:
        out = []
        while len(out) < n:
            if not self._finite:
                k, i = divmod(self.position, CHUNK)
            else:
                if self._chunk_id < 0:
                    self._load(0)
                size = len(self._chunk)
                k, i = divmod(self.position, size)
            if k != self._chunk_id:
                self._load(k)
            out.append(self._chunk[i])
            self.position += 1
        return out
