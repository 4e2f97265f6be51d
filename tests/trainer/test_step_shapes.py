"""The tensor shapes in the step's signatures are checked, not just written: with jaxtyping's import hook
(beartype as the checker) on the step, the update and the four batch types between sampler and loss
(`RolloutBatch`, `Tokens`, `UpdateBatch`, `TokenBatch`, docs/architecture.md), short training runs pass every
annotated call and dataclass, and for each type a batch whose shapes disagree is an error. In a fresh
interpreter: the hook must see the modules before anything imports them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("beartype")

HERE = Path(__file__).resolve().parent

CHILD = """
import sys
from jaxtyping import install_import_hook
CHECKED = ["tether.trainer.step", "tether.trainer.update", "tether.rollout.base", "tether.model.causal_lm",
           "tether.objectives.batch"]
with install_import_hook(CHECKED, "beartype.beartype"):
    import tether.rollout.base, tether.model.causal_lm, tether.objectives.batch, tether.trainer.step
    import tether.trainer.update
sys.path[:0] = [{tests!r}]
import torch
from conftest import train_config, metrics_rows
from tether.trainer.loop import train
from tether.trainer.update import UpdateBatch
from tether.rollout import RolloutBatch
from tether.model.causal_lm import Tokens
from tether.objectives import TokenBatch
for name, extra in [("etr", ["objective=etr"]), ("troll", ["objective=troll", "trainer.micro_batch_size=4"])]:
    run = train(train_config({tiny!r}, {out!r} + name, "trainer.total_steps=2", *extra), log=lambda *_: None)
    assert [r["step"] for r in metrics_rows(run)][-1] == 2
z, zl = torch.zeros, lambda *s: torch.zeros(*s, dtype=torch.long)
wrong = {{  # each with one tensor of 3 rows where the others have 4
    "UpdateBatch": lambda: UpdateBatch(type("T", (), {{}})(), z(4), z(4), zl(4), z(3, 5)),
    "RolloutBatch": lambda: RolloutBatch([[1]] * 4, zl(4, 5), z(4, 5), torch.ones(3, 5, dtype=torch.bool),
                                         ["stop"] * 4, [""] * 4, [0] * 4),
    "Tokens": lambda: Tokens(zl(4, 7), z(4, 7), zl(4, 7), zl(4, 5), z(3, 5), 2),
    "TokenBatch": lambda: TokenBatch(z(4, 5), z(4, 5), z(4), z(4, 5), group_ids=zl(3)),
}}
for name, build in wrong.items():
    try:
        build()
    except Exception as err:
        print("caught", name, type(err).__name__)
    else:
        raise SystemExit(f"a {{name}} of mismatched shapes was accepted")
print("shapes ok")
"""


@pytest.mark.slow  # a fresh interpreter (imports torch and transformers), two short runs: about 30 s
def test_a_run_passes_the_checked_shapes_and_a_mismatch_is_an_error(tiny_dir, tmp_path):
    code = CHILD.format(tests=str(HERE.parent), tiny=str(tiny_dir), out=str(tmp_path / "run"))
    root = str(HERE.parents[1])
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert out.returncode == 0 and "shapes ok" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    for name in ("UpdateBatch", "RolloutBatch", "Tokens", "TokenBatch"):
        assert f"caught {name}" in out.stdout


def test_the_padding_share_of_a_pass_by_hand():
    """Issue 50, measure first: the share of the positions a log-prob or update pass computes that are padding."""
    import torch

    from tether.model.causal_lm import Tokens, positions
    from tether.model.packing import padding_share

    # two groups of two rows; prompts of 3 and 2 tokens (P = 3, left-padded), completions of 2, 1, 3, 1 (T = 3)
    prompt = torch.tensor([[1, 2, 3]] * 2 + [[0, 4, 5]] * 2)
    prompt_mask = torch.tensor([[1, 1, 1]] * 2 + [[0, 1, 1]] * 2)
    completion_mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    ids = torch.cat([prompt, torch.full((4, 3), 7) * completion_mask], 1)
    attention = torch.cat([prompt_mask, completion_mask], 1)
    tokens = Tokens(ids, attention, positions(attention), ids[:, 3:], completion_mask.float(), 3)
    # shared prompts, one forward: 2 distinct prompts x 3 + 4 rows x 3 = 18 positions; real 3 + 2 + (2+1+3+1) = 12
    assert padding_share(tokens, 4) == pytest.approx(1 - 12 / 18)
    # without sharing: 4 x 3 + 4 x 3 = 24 positions, real 3 + 3 + 2 + 2 + 7 = 17
    assert padding_share(tokens, 4, share_prompts=False) == pytest.approx(1 - 17 / 24)
    # two rows per forward: each forward holds one distinct prompt: (3 + 6) + (3 + 6) = 18, real the same 12
    assert padding_share(tokens, 2) == pytest.approx(1 - 12 / 18)
    # packed, prompts shared, rows as wide as the longest (5): no two completions fit beside one copy of their prompt
    # (3 + 2 + 1, 2 + 3 + 1 > 5), so each row takes its own: [5], [5], [4], [3], 20 positions, 17 real
    assert padding_share(tokens, 4, pack=True) == pytest.approx(1 - 17 / 20)
    # in packed rows of 12: one row holds both prompts once and the four completions, all 12 positions real
    assert padding_share(tokens, 4, pack=True, width=12) == pytest.approx(0.0)
    # packed, unshared: rows of 5, 4, 5, 3 real tokens in rows of width 5, first-fit decreasing: [5], [5], [4], [3]:
    # 20 positions, 17 real (each row's prompt counted: it runs it)
    assert padding_share(tokens, 4, share_prompts=False, pack=True) == pytest.approx(1 - 17 / 20)
    # forwards given as rows: {0, 3} (5 and 3 tokens, no shared prompt) and {1, 2} (4 and 5): two rows of 5 each
    assert padding_share(tokens, [torch.tensor([0, 3]), torch.tensor([1, 2])], pack=True) == pytest.approx(1 - 17 / 20)
