"""Multi-digit arithmetic: "23+58=" -> "81".

The compact prompt suits a character-level model: one token per digit and no words to learn.
Operands are drawn uniformly from [0, 10**digits), the operator uniformly from `ops`. Without
`allow_negative`, a subtraction's operands are ordered so the answer is >= 0 (the model then
never needs a minus sign). Answers are checked by exact string match.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from .base import Example, Synthetic

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class Arithmetic(Synthetic):
    """Arithmetic task knobs (`data.task_args` when `data.task=arithmetic`)."""

    digits: int = 2
    """Operands are drawn uniformly from [0, 10**digits)."""
    ops: str = "+-"
    """The operators to draw from, any of "+", "-", "*" (e.g. "+-*")."""
    allow_negative: bool = False
    """If false, "a-b" is drawn with a >= b, so no answer needs a minus sign."""
    test_fraction: float = 0.1
    """Share of all prompts held out as the test split (by hash of the prompt), in (0, 1)."""
    seed: int = 0
    """Default seed of `examples`; in training it picks the held-out problems of each evaluation
    (the stream of training problems is seeded by trainer.seed)."""
    name: ClassVar[str] = "arithmetic"
    reward: ClassVar[str] = "exact_match"

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise ValueError(f"digits must be >= 1, got {self.digits}")
        bad = sorted(set(self.ops) - set(_OPS))
        if not self.ops or bad:
            raise ValueError(f"ops must be a non-empty string over {sorted(_OPS)}, got {self.ops!r}")
        self.check_test_fraction()

    def draw(self, rng: random.Random) -> Example:
        """One random problem (of either split)."""
        high = 10**self.digits - 1
        a, b = rng.randint(0, high), rng.randint(0, high)
        op = rng.choice(self.ops)
        if op == "-" and not self.allow_negative and a < b:
            a, b = b, a
        prompt = f"{a}{op}{b}="
        return self.make_example(prompt, str(_OPS[op](a, b)), {"a": a, "b": b, "op": op})

    def solution(self, example: Example) -> str:
        """The answer digits; the SFT loop appends the eos token."""
        return example.answer
