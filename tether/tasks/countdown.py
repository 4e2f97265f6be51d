"""Countdown: reach a target from given numbers with + - * / and parentheses.

Prompt "9,8,7=016:" (numbers, "=", the target zero-padded to a fixed width, ":"), completion
an expression such as "(9-7)*8" using each given number at most once. The completion is checked
by the safe parser of `tether.tasks.expression` (exact fractions, never `eval`).

Only solvable instances are generated. For each drawn multiset of numbers, every value
reachable with positive-integer intermediate results (the classic game's rule) is enumerated by
dynamic programming over subsets of the numbers; the target is drawn uniformly from the values
in [1, max_target] whose cheapest solution needs at least `min_used` numbers (so the target is
never simply one of the given numbers). The reference solution is the first expression found
with that fewest number of operands, written with minimal parentheses. The checker is more
lenient than the generator: fractional intermediates such as "8/3*3" are accepted.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

from .base import Example, Synthetic

# (text, precedence): 3 atom, 2 product/quotient, 1 sum/difference.
_Expr = tuple[str, int]


def _combine(op: str, left: _Expr, right: _Expr) -> _Expr:
    """`left op right` with the parentheses the parser's precedence rules require."""
    (lt, lp), (rt, rp) = left, right
    if op in "*/" and lp == 1:
        lt = f"({lt})"
    if (op == "-" and rp == 1) or (op == "*" and rp == 1) or (op == "/" and rp < 3):
        rt = f"({rt})"
    return f"{lt}{op}{rt}", 1 if op in "+-" else 2


@lru_cache(maxsize=4096)
def solve_all(numbers: tuple[int, ...]) -> dict[int, tuple[str, int]]:
    """Every value reachable from `numbers` -> (an expression, how many numbers it uses).

    Intermediate results are positive integers; per value the expression with the fewest
    numbers is kept (the first found among equals). Cost grows fast: meant for <= 5 numbers.
    """
    k = len(numbers)
    table: dict[int, dict[int, _Expr]] = {1 << i: {n: (str(n), 3)} for i, n in enumerate(numbers)}
    for mask in sorted(range(1, 1 << k), key=lambda m: bin(m).count("1")):
        if mask in table:
            continue
        found: dict[int, _Expr] = {}
        sub = (mask - 1) & mask
        while sub:
            rest = mask ^ sub
            for a, ea in table[sub].items():
                for b, eb in table[rest].items():
                    candidates = [(a * b, "*")] if sub < rest else []
                    if sub < rest:
                        candidates.append((a + b, "+"))
                    if a > b:
                        candidates.append((a - b, "-"))
                    if b > 1 and a % b == 0:
                        candidates.append((a // b, "/"))
                    for value, op in candidates:
                        if value not in found:
                            found[value] = _combine(op, ea, eb)
            sub = (sub - 1) & mask
        table[mask] = found
    best: dict[int, tuple[str, int]] = {}
    for mask in sorted(table, key=lambda m: bin(m).count("1")):
        used = bin(mask).count("1")
        for value, (text, _) in table[mask].items():
            best.setdefault(value, (text, used))
    return best


@dataclass(frozen=True)
class Countdown(Synthetic):
    """Countdown task knobs (`data.task_args` when `data.task=countdown`)."""

    count: int = 3
    """How many numbers are given, 2 to 5."""
    min_number: int = 1
    """Smallest number drawn; numbers are uniform in [min_number, max_number], repeats allowed."""
    max_number: int = 9
    """Largest number drawn (see min_number)."""
    max_target: int = 999
    """Targets lie in [1, max_target]; the prompt zero-pads them to its width."""
    min_used: int = 2
    """The target's cheapest solution needs at least this many of the numbers, 1 to count."""
    test_fraction: float = 0.1
    """Share of all prompts held out as the test split (by hash of the prompt), in (0, 1)."""
    seed: int = 0
    """Default seed of `examples`; in training it picks the held-out problems of each evaluation
    (the stream of training problems is seeded by trainer.seed)."""
    name: ClassVar[str] = "countdown"
    reward: ClassVar[str] = "countdown"

    def __post_init__(self) -> None:
        if not 2 <= self.count <= 5:
            raise ValueError(f"count must be in [2, 5], got {self.count}")
        if not 1 <= self.min_number <= self.max_number:
            raise ValueError(f"need 1 <= min_number <= max_number, got {self.min_number}, {self.max_number}")
        if not 1 <= self.min_used <= self.count:
            raise ValueError(f"min_used must be in [1, count], got {self.min_used}")
        if self.max_target < 1:
            raise ValueError(f"max_target must be >= 1, got {self.max_target}")
        self.check_test_fraction()

    def draw(self, rng: random.Random) -> Example:
        """One random solvable problem (of either split)."""
        while True:
            numbers = tuple(rng.randint(self.min_number, self.max_number) for _ in range(self.count))
            solutions = solve_all(tuple(sorted(numbers)))
            targets = sorted(v for v, (_, used) in solutions.items() if used >= self.min_used and v <= self.max_target)
            if targets:
                break
        target = rng.choice(targets)
        width = len(str(self.max_target))
        prompt = f"{','.join(map(str, numbers))}={target:0{width}d}:"
        meta = {"numbers": list(numbers), "target": target, "solution": solutions[target][0]}
        return self.make_example(prompt, str(target), meta)

    def solution(self, example: Example) -> str:
        """The reference expression; the SFT loop appends the eos token."""
        return example.meta["solution"]
