"""verl's custom reward function for examples/verl/one_gpu.sh: tether's math verifier.

verl calls `compute_score(data_source, solution_str, ground_truth, extra_info)` for every response
(`reward.custom_reward_function.path=examples/verl/reward.py`). The score is tether's `math` reward
(`tether.rewards.math_verifier.Math`): 1 when math-verify finds the completion's final \\boxed{}
answer equal to the ground truth, else 0, with a hard per-item time bound. One verifier worker is
started per process that calls it, on first use.
"""

from __future__ import annotations

from typing import Any, Optional

_MATH = None


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Optional[dict] = None, **kwargs: Any
) -> float:
    global _MATH
    from tether.rewards.math_verifier import Math
    from tether.tasks import Example

    if _MATH is None:
        _MATH = Math()
    return _MATH(solution_str, Example(id=str((extra_info or {}).get("id", "")), prompt="", answer=ground_truth)).score
