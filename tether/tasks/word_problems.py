"""Easy arithmetic word problems for a small real model (configs/real_model.yaml), as math-task JSONL.

    python -m tether.tasks.word_problems      # writes tether/tasks/data/*.jsonl (`tether:NAME` in a config)

Three levels, each with its own train and test file (seeded, disjoint by problem text):
  sum1:  "What is 3 + 4?"                           one-digit addition, bare
  word1: "Tom has 3 apples. He gets 4 more. ..."    one-digit addition, in words
  word2: two-digit addition and subtraction (non-negative results), in words
word1 also has a held-out file of 400 problems (word1_heldout.jsonl), disjoint from its train and test files: a
comparison's evaluation set large enough that one model's accuracy on it carries a binomial standard error of
0.02-0.025 (at accuracy 0.5-0.8), against 0.06-0.08 on 40 problems. The problems continue the same seeded stream
after train and test, so those two files are what they were before it existed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent / "data"
NAMES = ["Tom", "Anna", "Sam", "Maria", "Ben", "Lily", "Omar", "Zoe"]
THINGS = ["apples", "books", "coins", "pencils", "stickers", "marbles", "cards", "shells"]


def sum1(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return f"What is {a} + {b}?", a + b


def word1(rng: random.Random) -> tuple[str, int]:
    a, b, who, what = rng.randint(1, 9), rng.randint(1, 9), rng.choice(NAMES), rng.choice(THINGS)
    return f"{who} has {a} {what}. {who} gets {b} more. How many {what} does {who} have now?", a + b


def word2(rng: random.Random) -> tuple[str, int]:
    a, b, who, what = rng.randint(10, 99), rng.randint(10, 99), rng.choice(NAMES), rng.choice(THINGS)
    if rng.random() < 0.5:
        return f"{who} has {a} {what}. {who} gets {b} more. How many {what} does {who} have now?", a + b
    a, b = max(a, b), min(a, b)
    return f"{who} has {a} {what}. {who} gives away {b}. How many {what} does {who} have left?", a - b


def write(level: str, make, n_train: int, n_test: int, seed: int, n_heldout: int = 0) -> None:
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < n_train + n_test + n_heldout:
        problem, answer = make(rng)
        if problem not in seen:
            seen.add(problem)
            rows.append({"problem": problem, "answer": str(answer)})
    parts = [("train", rows[:n_train]), ("test", rows[n_train : n_train + n_test])]
    for split, part in parts + ([("heldout", rows[n_train + n_test :])] if n_heldout else []):
        with open(HERE / f"{level}_{split}.jsonl", "w") as f:
            f.writelines(json.dumps({"id": f"{level}-{split}-{i}", **r}) + "\n" for i, r in enumerate(part))


if __name__ == "__main__":
    write("sum1", sum1, 41, 40, seed=1)  # 81 distinct one-digit sums exist
    write("word1", word1, 400, 100, seed=2, n_heldout=400)
    write("word2", word2, 400, 100, seed=3)
