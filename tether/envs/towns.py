"""A tool the model needs: the census of invented towns, and the questions about it (the tool-use job).

    python -m tether.envs.towns      # writes tether/tasks/data/towns_{train,heldout}.jsonl (`tether:NAME`)

200 invented towns (a prefix and a suffix, "Bralwick", "Fenholm") with seeded populations: no model can know
them, so a correct answer needs a call of `town_population` (built in, `env.tools: [town_population]`). The
tool answers in a sentence, "The population of Bralwick is 48120.", and the prompt asks for the number within
\\boxed{} (configs/tool_use.yaml), so that the strict verifier (only the final \\boxed{} counts) accepts the answer
and not an echo of the tool's response. 150 towns are
for training, the other 50 are held out (each town asked about once, in one of two wordings).

Each row also holds `turns`: the model's turns of one worked episode, the call and then the answer. The warm
start of an environment with tools trains on them (tether.trainer.sft: the episode is played through the
environment, so the tool's response comes from the tool and the layout is the trainer's own), to teach a small
model the call format before RL.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PREFIXES = ["Bral", "Ash", "Cor", "Dun", "Elm", "Fen", "Gar", "Hol", "Iver", "Kel"]
PREFIXES += ["Lin", "Mor", "Nor", "Oak", "Pem", "Quar", "Ros", "Sel", "Thorn", "Wen"]
SUFFIXES = ["wick", "ford", "by", "ton", "mere", "stead", "holm", "bury", "field", "dale"]
SEED = 49
TRAIN_TOWNS = 150
QUESTIONS = ["What is the population of {town}?", "How many people live in {town}?"]


def census() -> dict[str, int]:
    """Every town and its population, seeded (the same on every machine)."""
    rng = random.Random(SEED)
    towns = [p + s for p in PREFIXES for s in SUFFIXES]
    rng.shuffle(towns)
    return {town: rng.randint(1200, 98000) for town in towns}


CENSUS = census()


def town_population(town: str) -> str:
    """Look up the population of a town in the census.

    Args:
        town: the town's name, for example Bralwick.

    Example:
        {"town": "Ashford"}
    """
    name = town.strip().title()
    if name not in CENSUS:
        raise KeyError(f"no town named {town!r} in the census")
    return f"The population of {name} is {CENSUS[name]}."


def rows(towns: list[str], split: str, rng: random.Random) -> list[dict]:
    """The question rows of `towns`: problem, answer, and the worked episode's model turns."""
    out = []
    for i, town in enumerate(towns):
        call = json.dumps({"name": "town_population", "arguments": {"town": town}})
        out.append(
            {
                "id": f"towns-{split}-{i}",
                "problem": rng.choice(QUESTIONS).format(town=town),
                "answer": str(CENSUS[town]),
                "turns": [f"<tool_call>{call}</tool_call>", f"\\boxed{{{CENSUS[town]}}}"],
            }
        )
    return out


def write(directory: Path) -> None:
    towns, rng = list(CENSUS), random.Random(SEED + 1)
    for split, part in (("train", towns[:TRAIN_TOWNS]), ("heldout", towns[TRAIN_TOWNS:])):
        with open(directory / f"towns_{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows(part, split, rng))


if __name__ == "__main__":
    write(Path(__file__).resolve().parents[1] / "tasks" / "data")
