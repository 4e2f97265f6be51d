"""The tensor shapes in the step's signatures are checked, not just written: with jaxtyping's import hook
(beartype as the checker) on tether.trainer.step and tether.trainer.update, a short training run passes every
annotated call and dataclass, and a batch whose shapes disagree (an (N,) mask where (N, T) is declared) is an
error. In a fresh interpreter: the hook must see the modules before anything imports them."""

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
with install_import_hook(["tether.trainer.step", "tether.trainer.update"], "beartype.beartype"):
    import tether.trainer.step, tether.trainer.update
sys.path[:0] = [{tests!r}]
import torch
from conftest import train_config, metrics_rows
from tether.trainer.loop import train
from tether.trainer.update import UpdateBatch
run = train(train_config({tiny!r}, {out!r}, "trainer.total_steps=2", "objective=etr"), log=lambda *_: None)
assert [r["step"] for r in metrics_rows(run)][-1] == 2
tokens = type("T", (), {{}})()
try:
    UpdateBatch(tokens, torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.long), torch.zeros(3, 5))
except Exception as err:  # old log-probs of 3 rows where the advantages have 4
    print("caught", type(err).__name__)
else:
    raise SystemExit("a batch of mismatched shapes was accepted")
print("shapes ok")
"""


@pytest.mark.slow  # a fresh interpreter (imports torch and transformers): about 15 s
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
    assert "caught" in out.stdout
