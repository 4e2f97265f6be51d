"""`trainer.staleness` (bounded-lag rollouts, issue 26, item 1): the sampler lags the policy by s steps,
its mismatch is measured, and a stale run resumes exactly.

5. behaviour of rollouts: the sampler of step t is the policy of step t - s (the first s + 1 steps: the initial
   policy), and the current weights come back bitwise after sampling;
1. hand-computed stale metrics (KL(pi_sampler || pi_old), k1 and k3);
6. end to end: `stale/lag` in metrics.jsonl is min(s, t - 1); bypass anchoring gives KL 0;
7. resume: a run killed after its step-2 checkpoint and resumed with s = 2 matches the uninterrupted run bitwise
   (metrics and weights), so the FIFO of stale policies is part of the checkpoint.
"""

import json
import math
import signal
from pathlib import Path

import pytest
import torch

from tether.schema import ConfigError
from tether.trainer.staleness import StalePolicies, stale_metrics


class _Policy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))
        self.frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)  # not trainable: never copied


@pytest.mark.parametrize("s", [1, 2, 3])
def test_the_sampler_of_step_t_is_the_policy_of_step_t_minus_s(s):
    model = _Policy()
    fifo = StalePolicies(model, s)
    policy_of = {}  # step -> the weights step t's updates start from
    for t in range(1, 9):
        policy_of[t] = model.w.detach().clone()
        with fifo.sampling(model, t) as sampler_step:
            seen = model.w.detach().clone()
        assert sampler_step == max(1, t - s)
        assert torch.equal(seen, policy_of[max(1, t - s)]), (t, seen, policy_of)
        assert torch.equal(model.w.detach(), policy_of[t])  # the current weights are back, bitwise
        with torch.no_grad():
            model.w.add_(torch.tensor([1.0, 0.1, 0.01]) * t)  # "the update of step t"
    assert len(fifo.state()["weights"]) == s and "frozen" not in fifo.state()["weights"][0]
    # the first s + 1 steps (not s: issue 30) sample with the initial policy, zeros; step s + 2 with step 2's
    initial = [t for t in range(1, 9) if max(1, t - s) == 1]
    assert initial == list(range(1, s + 2)) and all(not policy_of[max(1, t - s)].any() for t in initial)


def test_a_fifo_restored_from_its_state_continues_exactly():
    a, b = _Policy(), _Policy()
    fa = StalePolicies(a, 2)
    for t in range(1, 4):
        with fa.sampling(a, t):
            pass
        with torch.no_grad():
            a.w.add_(float(t))
    b.load_state_dict(a.state_dict())
    fb = StalePolicies(b, 2, fa.state())
    for t in range(4, 7):
        with fa.sampling(a, t) as sa, fb.sampling(b, t) as sb:
            assert sa == sb == t - 2 and torch.equal(a.w, b.w)
        with torch.no_grad():
            a.w.add_(float(t))
            b.w.add_(float(t))
    with pytest.raises(ValueError, match="trainer.staleness=3"):
        StalePolicies(b, 3, fa.state())


def test_stale_metrics_hand_computed():
    # d = lp_old - lp_sampler on counted tokens: 0.2, -0.1 (the padding's 5.0 does not count)
    # k1 = mean(-d) = (-0.2 + 0.1) / 2 = -0.05 ; k3 = mean(e^d - 1 - d)
    old = torch.tensor([[-1.0, -2.0, 0.0]], dtype=torch.float64)
    sampler = old - torch.tensor([[0.2, -0.1, 5.0]], dtype=torch.float64)
    m = stale_metrics(2, sampler, old, torch.tensor([[1, 1, 0]]))
    k3 = ((math.exp(0.2) - 1.2) + (math.exp(-0.1) - 0.9)) / 2
    assert m == pytest.approx({"stale/lag": 2.0, "stale/kl_k1": -0.05, "stale/kl_k3": k3}, rel=1e-12)


def test_negative_staleness_is_refused(tiny_dir, tmp_path):
    from conftest import train_config as _cfg

    with pytest.raises(ConfigError, match="trainer.staleness"):
        _cfg(tiny_dir, tmp_path / "run", "trainer.staleness=-1")


# ---------------------------------------------------------------- end to end


def _rows(run):
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize(
    "anchor,extra",
    [("recompute", []), ("sampler", []), ("recompute", ["model.lora={r: 4, alpha: 8}", "trainer.lr=3e-2"])],
)
def test_stale_run_logs_the_lag_and_the_sampler_mismatch(tiny_dir, tmp_path, anchor, extra):
    from conftest import train_config as _cfg

    from tether.trainer.loop import train

    run = train(
        _cfg(
            tiny_dir,
            tmp_path / "run",
            "trainer.total_steps=4",
            "trainer.staleness=2",
            f"trainer.old_logprobs={anchor}",
            "objective=grpo",
            *extra,
        ),
        log=lambda *_: None,
    )
    rows = _rows(run)[1:]
    assert [r["stale/lag"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
    if anchor == "sampler":  # bypass: pi_old is pi_sampler
        assert all(r["stale/kl_k1"] == 0.0 and r["stale/kl_k3"] == 0.0 for r in rows)
    else:  # decoupled: pi_old is the current policy; once the sampler lags, they differ
        assert rows[0]["stale/kl_k3"] < 1e-5  # step 1: the same weights (the decode's rounding only)
        assert all(r["stale/kl_k3"] > 1e-4 for r in rows[1:])


@pytest.mark.slow
def test_a_stale_run_killed_and_resumed_matches_the_uninterrupted_one(tiny_dir, tmp_path):
    from conftest import KILL_RESUME_STEPS as STEPS
    from conftest import checkpoint_weights as _weights
    from conftest import kill_resume_overrides as _overrides
    from conftest import tether_child as _tether
    from conftest import untimed

    args = ["trainer.staleness=2"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    done = _tether("train", *_overrides(tiny_dir, full), *args)
    assert done.returncode == 0, done.stderr[-2000:]
    cut = _tether("train", *_overrides(tiny_dir, killed), *args, kill_at="rollout:3")  # after the step-2 checkpoint
    assert cut.returncode == -signal.SIGKILL, cut.stderr[-2000:]
    resumed = _tether("train", "--resume", str(killed))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming {killed} from step 2" in resumed.stdout
    a, b = _rows(full), _rows(killed)
    assert [r["step"] for r in b] == list(range(STEPS + 1))
    for ra, rb in zip(a, b):
        ra, rb = (untimed(r) for r in (ra, rb))  # wall clock
        assert ra == rb, (ra["step"], {k: (ra[k], rb.get(k)) for k in ra if ra[k] != rb.get(k)})
    assert [r["stale/lag"] for r in b[1:]] == [0.0, 1.0, 2.0, 2.0, 2.0]
    wa, wb = _weights(full, STEPS), _weights(killed, STEPS)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
