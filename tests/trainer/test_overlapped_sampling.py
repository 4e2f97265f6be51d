"""Issue 26, item 2: `trainer.overlap` (step t+1 sampled in a background thread while step t trains).

5. behaviour of rollouts: the background batch is sampled by the policy of step t+1-s held in the sampler's own
   copy, even when the live policy is updated while it samples (a gate holds the background read until after
   the update); nothing is prefetched past the last step; a prefetch that does not match the trainer's call, or
   that raised, is an error on the trainer's thread;
6. end to end: a run with overlap has the same metrics (time/* aside) and final weights, bitwise, as the same
   run without it (the sequential lag), with dynamic sampling's refill rounds and under LoRA too;
7. resume: a run with overlap killed after its step-2 checkpoint and resumed (with or without overlap) matches
   the uninterrupted run without overlap: the prefetched batch is regenerated from the saved FIFO.
"""

import contextlib
import json
import signal
import threading
from types import SimpleNamespace

import pytest
import torch

from tether.trainer.overlap import OverlappedSampler
from tether.trainer.seeds import rollout as rollout_seed
from tether.rollout import SamplingParams
from tether.schema import ConfigError
from tether.trainer.staleness import StalePolicies

from conftest import metrics_rows, untimed

PARAMS = SamplingParams(max_new_tokens=3)


class _Policy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))


class _Stream:
    """Prompts p0, p1, ... in order; `position` is what a checkpoint records."""

    def __init__(self):
        self.position = 0

    def take(self, n):
        out = [SimpleNamespace(prompt=f"p{self.position + i}") for i in range(n)]
        self.position += n
        return out


class _Engine:
    """Returns the weights its model holds when `gate` opens, with the call's prompts and seed."""

    def __init__(self, model, gate, fail_seed=None):
        self.model, self.gate, self.fail_seed = model, gate, fail_seed
        self.threads = []

    def generate(self, prompts, n, params, seed=None):
        assert self.gate.wait(10), "the test never opened the gate"
        self.threads.append(threading.current_thread().name)
        if seed == self.fail_seed:
            raise ValueError(f"engine failure at seed {seed}")
        return {"w": self.model.w.detach().clone(), "prompts": list(prompts), "seed": seed}


def _sampler(monkeypatch, s, total_steps, fail_seed=None):
    gate = threading.Event()
    gate.set()
    engines = []

    def get_engine(name, model, tokenizer, compile):
        engines.append(_Engine(model, gate, fail_seed))
        return engines[-1]

    monkeypatch.setattr("tether.trainer.overlap.get_engine", get_engine)
    cfg = SimpleNamespace(
        rollout=SimpleNamespace(engine="stub", compile=False, prompts_per_step=2, group_size=2),
        trainer=SimpleNamespace(seed=0, sampling_seed=None, total_steps=total_steps),
    )
    model, stream = _Policy(), _Stream()
    overlap = OverlappedSampler(cfg, model, None, StalePolicies(model, s), stream, PARAMS, contextlib.nullcontext)
    return overlap, model, stream, gate, engines[0]


def _collect(overlap, stream, step):
    return overlap.generate(stream.take(2), 2, PARAMS, rollout_seed(0, step))


@pytest.mark.parametrize("s", [1, 2, 3])
def test_the_background_batch_is_the_stale_policys_even_while_the_live_one_trains(monkeypatch, s):
    overlap, model, stream, gate, engine = _sampler(monkeypatch, s, total_steps=7)
    policy_of = {}
    for t in range(1, 8):
        policy_of[t] = model.w.detach().clone()
        with overlap.sampling(t) as sampler_step:
            batch = _collect(overlap, stream, t)
            gate.clear()  # step t+1's background read waits until step t's update is done
        assert sampler_step == max(1, t - s)
        assert torch.equal(batch["w"], policy_of[sampler_step]), (t, batch["w"])
        assert batch["seed"] == rollout_seed(0, t) and batch["prompts"] == [f"p{2 * t - 2}", f"p{2 * t - 1}"]
        assert stream.position == 2 * t  # the prefetch read its prompts from a copy of the stream
        assert (overlap.pending is None) == (t == 7)  # nothing is prefetched past the last step
        with torch.no_grad():
            model.w.add_(torch.tensor([1.0, 0.1, 0.01]) * t)  # "the update of step t", while t+1 samples
        gate.set()
    # the first batch was sampled on the trainer's thread, every later one in the background
    assert engine.threads[0] == threading.current_thread().name
    assert all(name.startswith("tether-overlap") for name in engine.threads[1:]) and len(engine.threads) == 7
    overlap.close()


def test_a_prefetch_that_does_not_match_the_trainers_call_is_an_error(monkeypatch):
    overlap, _, stream, _, _ = _sampler(monkeypatch, 2, total_steps=3)
    with overlap.sampling(1):
        _collect(overlap, stream, 1)
    with pytest.raises(RuntimeError, match="prefetched batch"), overlap.sampling(2):
        overlap.generate(
            [SimpleNamespace(prompt="another prompt"), SimpleNamespace(prompt="p3")], 2, PARAMS, rollout_seed(0, 2)
        )
    overlap.close()


def test_an_error_in_the_background_is_raised_on_the_trainers_thread(monkeypatch):
    overlap, _, stream, _, _ = _sampler(monkeypatch, 1, total_steps=3, fail_seed=rollout_seed(0, 2))
    with overlap.sampling(1):
        _collect(overlap, stream, 1)
    with pytest.raises(ValueError, match="engine failure"), overlap.sampling(2):
        _collect(overlap, stream, 2)
    assert overlap.pending is None  # an error leaves nothing in flight (and prefetches nothing more)
    overlap.close()


def test_overlap_needs_a_lag_and_the_hf_engine(tiny_dir, tmp_path):
    from conftest import train_config as _cfg

    with pytest.raises(ConfigError, match="trainer.staleness=1 or more"):
        _cfg(tiny_dir, tmp_path / "run", "trainer.overlap=true")
    with pytest.raises(ConfigError, match="rollout.engine=hf"):
        _cfg(tiny_dir, tmp_path / "run", "trainer.overlap=true", "trainer.staleness=1", "rollout.engine=vllm")


# ---------------------------------------------------------------- end to end


def _rows(run):
    return [untimed(r) for r in metrics_rows(run)]


def _same_run(tiny_dir, tmp_path, *extra):
    from conftest import train_config as _cfg

    from tether.trainer.loop import train

    runs = {}
    for overlap in ("false", "true"):
        runs[overlap] = train(
            _cfg(
                tiny_dir,
                tmp_path / overlap,
                "trainer.total_steps=4",
                "trainer.staleness=2",
                f"trainer.overlap={overlap}",
                "trainer.plots=false",
                *extra,
            ),
            log=lambda *_: None,
        )
    a, b = _rows(runs["false"]), _rows(runs["true"])
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert ra == rb, (ra["step"], {k: (ra.get(k), rb.get(k)) for k in {*ra, *rb} if ra.get(k) != rb.get(k)})
    assert [r["stale/lag"] for r in b[1:]] == [0.0, 1.0, 2.0, 2.0]
    last = [sorted((runs[o] / "checkpoints").glob("step_*"))[-1] / "model" for o in ("false", "true")]
    files = sorted(p.name for p in last[0].glob("*.safetensors"))
    assert files and all((last[0] / f).read_bytes() == (last[1] / f).read_bytes() for f in files)
    assert "time/overlap_wait_s" in json.loads((runs["true"] / "metrics.jsonl").read_text().splitlines()[2])
    samples = [(runs[o] / "samples.jsonl").read_text() for o in ("false", "true")]
    assert samples[0] == samples[1]  # the same completions


def test_an_overlapped_run_is_the_sequential_lag_bitwise(tiny_dir, tmp_path):
    _same_run(tiny_dir, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ["rollout.dynamic_sampling=true", "rollout.dynamic_sampling_max_rounds=2"],
        ["model.lora={r: 4, alpha: 8}", "trainer.lr=3e-2"],
        ["env.name=retry", "env.reward=env", "env.max_turn_tokens=4", "env.max_turns=2"],  # multi-turn episodes
    ],
    ids=["dynamic_sampling", "lora", "episodes"],
)
def test_an_overlapped_run_is_the_sequential_lag_bitwise_with(tiny_dir, tmp_path, extra):
    _same_run(tiny_dir, tmp_path, *extra)


@pytest.mark.slow
@pytest.mark.parametrize("resume_overlap", ["true", "false"])
def test_an_overlapped_run_killed_and_resumed_matches_the_sequential_one(tiny_dir, tmp_path, resume_overlap):
    from test_kill_and_resume_match_an_uninterrupted_run import STEPS, _overrides, _tether, _weights

    full, killed = tmp_path / "full", tmp_path / "killed"
    done = _tether("train", *_overrides(tiny_dir, full), "trainer.staleness=2")
    assert done.returncode == 0, done.stderr[-2000:]
    cut = _tether(
        "train", *_overrides(tiny_dir, killed), "trainer.staleness=2", "trainer.overlap=true", kill_at="rollout:3"
    )  # step 3 has taken its prefetched batch; the step-2 checkpoint is written
    assert cut.returncode == -signal.SIGKILL, cut.stderr[-2000:]
    resumed = _tether("train", "--resume", str(killed), f"trainer.overlap={resume_overlap}")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming {killed} from step 2" in resumed.stdout
    a, b = _rows(full), _rows(killed)
    assert [r["step"] for r in b] == list(range(STEPS + 1))
    for ra, rb in zip(a, b):
        assert ra == rb, (ra["step"], {k: (ra.get(k), rb.get(k)) for k in {*ra, *rb} if ra.get(k) != rb.get(k)})
    wa, wb = _weights(full, STEPS), _weights(killed, STEPS)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
