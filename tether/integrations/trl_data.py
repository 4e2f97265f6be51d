"""tether tasks and rewards as TRL reads them: a dataset of tether `Example`s (`to_dataset`) and a TRL reward
function from a tether reward (`reward_func`), so TRL's `GRPOTrainer` trains on tether's tasks with the verifier
tether's own trainer uses. Re-exported by `tether.integrations.trl`; only `datasets` is imported, when called."""

from __future__ import annotations

import json
from typing import Any, Callable, Optional, Sequence

from ..rewards import get_reward, score_batch
from ..tasks import Example


def to_dataset(examples: Sequence[Any]):
    """A `datasets.Dataset` of tether `Example`s: columns prompt, answer, id, meta (JSON text)."""
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "prompt": [e.prompt for e in examples],
            "answer": [e.answer for e in examples],
            "id": [e.id for e in examples],
            "meta": [json.dumps(e.meta) for e in examples],
        }
    )


def reward_func(reward: Any, name: Optional[str] = None) -> Callable[..., list[float]]:
    """A TRL reward function from a tether reward (a name, a weighted config or a `RewardFn`).

    It reads the dataset columns `to_dataset` writes, so training and evaluation share one verifier.
    For a tether task pass `tether.rewards.task_reward(task)`: the verifier tether's own trainer
    uses (strict final-\\boxed{} extraction only when the task's template asks for a box).
    """

    fn = get_reward(reward) if isinstance(reward, (str, dict)) else reward

    def score(prompts, completions, answer, id=None, meta=None, **_):
        examples = [
            Example(
                id=id[i] if id else str(i),
                prompt=_text(prompts[i]),
                answer=answer[i],
                meta=json.loads(meta[i]) if meta else {},
            )
            for i in range(len(completions))
        ]
        return [r.score for r in score_batch(fn, [_text(c) for c in completions], examples)]

    score.__name__ = name or (reward if isinstance(reward, str) else getattr(fn, "__name__", type(fn).__name__))
    return score


def _text(x: Any) -> str:
    """A plain prompt or completion as is; a conversational one (a list of messages): its last message."""
    return x if isinstance(x, str) else x[-1]["content"]
