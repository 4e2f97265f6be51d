"""Each decision the step makes in several places is made by one function or property that every consumer calls
(issue 50): a second copy of a test is where the next defect hides. The home's behaviour is checked, and the
spelled-out test it replaces is found nowhere else in tether/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tether.config.loading import load_config
from tether.rewards import solved
from tether.rollout import RolloutBatch, truncated

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {p: p.read_text() for p in sorted((ROOT / "tether").rglob("*.py"))}

# (the decision, a regular expression of the spelled-out test, the one module allowed to spell it)
SPELLED = [
    ("pi_old is the policy being trained", r"updates_per_batch == 1", "config/sections/trainer.py"),
    ("the sampler's log-probs are full-softmax", r"\.top_p < 1|\.top_p == 1 and", "config/sections/__init__.py"),
    ("truncated", r'== "length"|== TRUNCATED', "rollout/base.py"),
    (
        "entropy keeps its gradient",
        r"(cfg|config|self)\.entropy_coef != 0|if obj\.config\.entropy_coef|entropy_coef else",
        "objectives/base.py",
    ),
    ("solved", r">= 1\.0\)|>= SOLVED", "rewards/verdicts.py"),
]


@pytest.mark.parametrize("decision, pattern, home", SPELLED, ids=[s[0] for s in SPELLED])
def test_a_decision_is_spelled_out_in_its_home_only(decision, pattern, home):
    found = [str(p.relative_to(ROOT / "tether")) for p, text in SOURCES.items() if re.search(pattern, text)]
    assert found == [home], f"{decision!r} is decided in {found}, not only in {home}"


@pytest.mark.parametrize(
    "overrides, one",
    [
        (["trainer.mini_batches=1"], True),
        (["trainer.mini_batches=2"], False),
        (["trainer.mini_batches=1", "trainer.staleness=2"], True),  # pi_old recomputed: the policy it starts from
        (["trainer.mini_batches=1", "trainer.staleness=2", "trainer.old_logprobs=sampler"], False),  # a stale sampler
        (["trainer.mini_batches=1", "trainer.old_logprobs=sampler"], True),
    ],
)
def test_the_ratio_to_pi_old_is_one_exactly_when_pi_old_is_the_policy_updated(overrides, one):
    assert load_config(None, overrides).trainer.ratio_is_one is one


def test_the_other_homes():
    r = load_config(None, ["rollout.top_p=1", "rollout.temperature=0.7"]).rollout
    assert r.full_softmax
    assert not load_config(None, ["rollout.top_p=0.9"]).rollout.full_softmax
    assert not load_config(None, ["rollout.temperature=0"]).rollout.full_softmax
    assert truncated("length") and not truncated("stop")
    batch = RolloutBatch(
        [[1], [2]], torch.zeros(2, 1), torch.zeros(2, 1), torch.ones(2, 1), ["length", "stop"], ["a", "b"], [0, 1]
    )
    assert batch.truncated.tolist() == [True, False]
    assert solved(1.0) and not solved(0.99) and solved(torch.tensor([1.0, 0.0])).tolist() == [True, False]
    from tether import objectives

    assert objectives.build({"preset": "grpo", "entropy_coef": 0.01}).config.trains_entropy
    assert not objectives.build("grpo").config.trains_entropy
