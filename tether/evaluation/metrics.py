"""Per-problem metrics: pass@k from n samples of which c are correct, and maj@k over extracted answers.

    pass@k = 1 - C(n-c, k) / C(n, k)     (Chen et al. 2021, arXiv 2107.03374, eq. 1)
    maj@k  = 1 if the most frequent answer among the first k samples is correct, else 0
                                          (self-consistency, Wang et al. 2022, arXiv 2203.11171)

The departures (the product form of pass@k; votes on extracted strings) are numbered in the
package header, `tether.evaluation`.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which never forms a binomial coefficient.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n (k samples out of the n drawn), got n={n}, k={k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def majority_vote(answers: Sequence[str | None], k: int) -> int | None:
    """Index of the sample carrying the majority answer among `answers[:k]`, None if none has one.

    The most frequent non-None answer wins; among equally frequent ones, the first to appear.
    The index returned is that answer's first occurrence.
    """
    if not 1 <= k <= len(answers):
        raise ValueError(f"need 1 <= k <= {len(answers)} (the number of answers), got k={k}")
    counts = Counter(a for a in answers[:k] if a is not None)
    if not counts:
        return None
    first = {}
    for i, a in enumerate(answers[:k]):
        first.setdefault(a, i)
    winner = max(counts, key=lambda a: (counts[a], -first[a]))
    return first[winner]


def maj_at_k(answers: Sequence[str | None], correct_flags: Sequence[bool | int], k: int) -> float:
    """1.0 if the majority answer of the first k samples was judged correct, else 0.0.

    `answers[i]` is sample i's extracted answer (None: no answer), `correct_flags[i]` the
    verifier's verdict on sample i. See `majority_vote` for the vote and its tie-break.
    """
    if len(answers) != len(correct_flags):
        raise ValueError(f"{len(answers)} answers but {len(correct_flags)} correctness flags")
    index = majority_vote(answers, k)
    return float(index is not None and bool(correct_flags[index]))


__all__ = ["maj_at_k", "majority_vote", "pass_at_k"]
