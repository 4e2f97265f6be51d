"""tether's arithmetic task as verl RL parquet files, for examples/verl/one_gpu.sh.

    python examples/verl/make_data.py OUT_DIR [--train N] [--val N]

Writes OUT_DIR/train.parquet and OUT_DIR/val.parquet in verl's RL format: `prompt` (a chat list),
`data_source` ("tether_arithmetic"), `reward_model.ground_truth` (the answer) and `extra_info`. The
problems are tether's own (`tether.tasks.get_task("arithmetic")`, generated, no download); the
prompt asks for the answer in \\boxed{}, which examples/verl/reward.py scores with tether's math
verifier. Validation problems come from the task's held-out split.
"""

from __future__ import annotations

import argparse
from pathlib import Path

DATA_SOURCE = "tether_arithmetic"
INSTRUCTION = "Compute {question} Put the final answer in \\boxed{{}}."


def rows(split: str, n: int) -> list[dict]:
    from tether.tasks import get_task

    task = get_task("arithmetic")
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": INSTRUCTION.format(question=ex.prompt)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ex.answer},
            "extra_info": {"split": split, "index": i, "id": ex.id},
        }
        for i, ex in enumerate(task.examples(split, n))
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--train", type=int, default=512, help="training problems (default 512)")
    p.add_argument("--val", type=int, default=64, help="held-out problems (default 64)")
    args = p.parse_args(argv)
    import pandas as pd

    args.out.mkdir(parents=True, exist_ok=True)
    for split, n, name in (("train", args.train, "train"), ("test", args.val, "val")):
        pd.DataFrame(rows(split, n)).to_parquet(args.out / f"{name}.parquet")
        print(f"wrote {args.out / f'{name}.parquet'} ({n} rows)")


if __name__ == "__main__":
    main()
