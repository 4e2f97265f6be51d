"""A reward of your own, in your own file: `tether train reward.name=my_rewards:near_miss`.

tether imports it by its import path, MODULE:FUNCTION, from the current directory or PYTHONPATH.
A reward takes (completion, example) and returns a number (or a tether.rewards.RewardResult);
it must not raise on whatever the model writes: text it cannot read scores 0.
"""

from tether.tasks import Example


def near_miss(completion: str, example: Example) -> float:
    """1 for the exact answer, 0.5 for an integer within 10% of it, 0 otherwise (arithmetic tasks)."""
    text = completion.strip()
    if text == example.answer:
        return 1.0
    try:
        guess, gold = int(text), int(example.answer)
    except ValueError:  # not an integer: no credit
        return 0.0
    return 0.5 if abs(guess - gold) <= 0.1 * abs(gold) else 0.0
