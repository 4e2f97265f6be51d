"""The trainer with environments: a user's environment named in the config trains and evaluates; the loss mask
the step builds is the episode's (the environment's tokens never in it, through every mask the step applies);
a run killed mid-way resumes bitwise; a broken environment is an `error:` at the first step.
"""

import dataclasses
import json
import signal
import textwrap

import pytest
import torch

from conftest import DIGIT_REWARD, metrics_rows, tether_child, train_config, untimed
from conftest import checkpoint_weights, kill_resume_overrides
from tether.config.loading import load_config
from tether.schema import ConfigError

ENV_MODULE = '''
from tether.envs import Step


class Countdown:
    """Deterministic: asks for another try twice, then ends; reward 1 for a reply that starts with a digit."""

    def __init__(self, feedback="go on"):
        self.feedback = feedback

    def reset(self, example):
        self.turn = 0

    def step(self, reply):
        self.turn += 1
        ok = float(reply[:1].isdigit())
        if self.turn == 3:
            return Step(reward=ok, done=True, info={"asked": 2.0})
        return Step(observation=self.feedback, reward=ok)


class Broken:
    def reset(self, example):
        pass

    def step(self, reply):
        raise ZeroDivisionError("the board is empty")
'''

ENV = [
    "env.name=mtenvs:Countdown",
    "env.reward=env",
    "env.max_turn_tokens=4",
    "env.max_episode_tokens=40",
    "env.args={feedback: again}",
]


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    (tmp_path / "mtenvs.py").write_text(textwrap.dedent(ENV_MODULE))
    monkeypatch.chdir(tmp_path)  # found from the current directory, as the `tether` command finds it
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_users_environment_trains_and_evaluates_with_episode_metrics(tiny_dir, tmp_path, env_module):
    from tether.trainer.loop import train

    run = train(train_config(tiny_dir, tmp_path / "run", "trainer.total_steps=2", *ENV), log=lambda *_: None)
    rows = metrics_rows(run)
    step = rows[1]
    assert step["env/turns"] == 3 and step["env/env_tokens"] == 14 and step["env/asked"] == 2
    assert step["rollout/len_mean"] == step["env/model_tokens"]  # lengths count the model's tokens only
    assert 0 <= step["env/reward_turn_1"] <= 1 and step["env/errors"] == 0
    assert "eval/turns" in rows[0] and "eval/accuracy" in rows[0]
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    assert sample["turns"][0][0] == "model" and len(sample["env_rewards"]) <= 3
    assert all(t[1] == "again" for t in sample["turns"][1::2])


def _multi_turn_batch(tiny_dir, tmp_path, *extra):
    """A run's first step's scored batch and its parts (a deterministic environment, 3 turns)."""
    from tether.trainer.setup import start_run
    from tether.trainer.step import collect, tokens_for_update
    from tether.trainer import seeds

    cfg = train_config(tiny_dir, tmp_path / "run", *ENV, *extra)
    run = start_run(cfg, log=lambda *_: None)
    parts = run.parts
    scored, _ = collect(parts.source, cfg.rollout, seeds.rollout(seeds.sampling_root(cfg.trainer), 1))
    return scored, parts, lambda rollout: tokens_for_update(rollout, parts)


def test_the_steps_loss_mask_is_the_models_tokens_through_every_mask_it_applies(tiny_dir, tmp_path, env_module):
    rollout, parts, tokens_of = _multi_turn_batch(tiny_dir, tmp_path)
    assert rollout.episodes is not None and (rollout.mask & ~rollout.policy_mask).any()
    tokens, excluded = tokens_of(rollout)
    assert torch.equal(tokens.loss_mask.bool().cpu(), rollout.policy_mask.cpu())
    # each position of the completion columns is counted or excluded for one named reason
    assert excluded["environment"] == float((rollout.mask & ~rollout.policy_mask).sum()) > 0
    assert excluded["padding"] == float((~rollout.mask).sum())
    assert sum(excluded.values()) + float(tokens.loss_mask.sum()) == rollout.mask.numel()
    assert torch.equal(
        tokens.attention_mask[:, tokens.prompt_len :].bool().cpu(), rollout.mask.cpu()
    )  # read, not trained
    # a non-finite sampler log-prob at an environment token is not a model token's: nothing is masked for it
    lp = rollout.sampler_logprobs.clone()
    lp[rollout.mask & ~rollout.policy_mask] = float("nan")
    tokens2, excluded2 = tokens_of(dataclasses.replace(rollout, sampler_logprobs=lp))
    assert excluded2["nonfinite_sampler"] == 0 and torch.equal(tokens2.loss_mask, tokens.loss_mask)
    # trainer.mask_truncated takes a truncated episode out whole, the environment's tokens were never in
    parts_cut = dataclasses.replace(parts, trainer=dataclasses.replace(parts.trainer, mask_truncated=True))
    from tether.trainer.step import tokens_for_update

    stopped = ["stop"] * len(rollout)
    cut = dataclasses.replace(rollout, finish_reasons=["length"] + stopped[1:])
    tokens3, excluded3 = tokens_for_update(cut, parts_cut)
    assert excluded3["truncated"] == float(tokens.loss_mask[0].sum())  # the episode's model tokens, named
    tokens4, _ = tokens_for_update(dataclasses.replace(rollout, finish_reasons=stopped), parts_cut)
    assert tokens3.loss_mask[0].sum() == 0 and torch.equal(tokens3.loss_mask[1:], tokens.loss_mask[1:])
    assert torch.equal(tokens4.loss_mask, tokens.loss_mask)


def test_an_environment_token_gets_no_gradient_in_a_whole_update(tiny_dir, tmp_path, env_module, monkeypatch):
    """The update of a step, through the trainer's own `update`: the gradient of the loss with respect to the
    log-prob and the entropy of every environment token is exactly 0 (hooks on the micro-steps' log-probs), with
    GRPO's clip and KL penalty and an entropy bonus."""
    import tether.trainer.update as upd
    from tether.trainer.step import old_logprobs_of, sampler_logprobs

    rollout, parts, tokens_of = _multi_turn_batch(
        tiny_dir, tmp_path, "objective={preset: grpo, entropy_coef: 0.01}", "trainer.ppo_epochs=2"
    )
    tokens, _ = tokens_of(rollout)
    policy, obj, t = parts.policy, parts.objective, parts.trainer
    grads = []
    original = upd.head_pass

    def capture(model, toks, settings, with_entropy=True, **kw):
        out = original(model, toks, settings, with_entropy, **kw)
        for x in (out.logprobs, out.entropy):
            if x.requires_grad:
                x.register_hook(lambda g, m=toks.loss_mask: grads.append((g.detach().clone(), m.detach().clone())))
        return out

    monkeypatch.setattr(upd, "head_pass", capture)
    rewards = torch.tensor([float(f["reward"]) for f in rollout.episodes])
    groups = torch.tensor(rollout.prompt_index)
    adv = obj.advantages(rewards, groups, rollout.completion_lengths.float(), None)
    old = old_logprobs_of(policy, tokens, rollout, t)
    ref = parts.reference.ref_logprobs(policy, tokens)  # grpo's KL penalty reads it
    batch = upd.UpdateBatch(tokens, adv, rewards, groups, old, ref, sampler_logprobs(rollout, tokens))
    upd.update(policy, obj, batch, t, torch.Generator().manual_seed(0))
    assert len(grads) >= 4, "no log-prob or entropy gradient was captured"
    for g, mask in grads:  # a micro-batch's rows: only its trained tokens may carry gradient
        assert torch.all(g[mask == 0] == 0)
    assert any(g.abs().sum() > 0 for g, _ in grads)


def test_an_environment_that_fails_on_every_episode_is_an_error_naming_it(tiny_dir, tmp_path, env_module):
    out = tmp_path / "run"
    args = [a for a in kill_resume_overrides(tiny_dir, out)] + ["env.name=mtenvs:Broken"]
    done = tether_child("train", *args, timeout=600)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: the environment mtenvs:Broken failed on every episode" in done.stderr
    assert "ZeroDivisionError: the board is empty" in done.stderr and not out.exists()


def test_bad_environment_settings_fail_on_load(tiny_dir, tmp_path, env_module):
    base = [f"model.name_or_path={tiny_dir}", f"output_dir={tmp_path / 'x'}", f"reward.name={DIGIT_REWARD}"]
    cases = {
        "env.name=mtenvs:Countdwn": "has no attribute 'Countdwn'",
        "env.name=retyr": "Did you mean 'retry'",
        "env.tools=[mtenvs:Countdown]": "no type hint|docstring",
        "env.args={colour: red}": "unknown: colour",
        "env.max_turns=0": "max_turns >= 1",
        "env.reward=env": None,
    }
    for override, message in cases.items():
        extra = (
            [override]
            if override.startswith("env.name") or override.startswith("env.tools")
            else ["env.name=mtenvs:Countdown", override]
        )
        if message is None:
            load_config(None, [*base, override, "env.name=retry"])
            with pytest.raises(ConfigError, match="no env.name or env.tools"):
                load_config(None, [*base, override])
            continue
        with pytest.raises(ConfigError, match=message):
            load_config(None, [*base, *extra])
    assert not (tmp_path / "x").exists()


def test_an_episode_budget_past_the_models_context_is_refused_at_start(tiny_dir, tmp_path, env_module):
    from tether.trainer.loop import train

    cfg = train_config(tiny_dir, tmp_path / "run", *ENV, "env.max_episode_tokens=400")  # the tiny model: 256
    with pytest.raises(ConfigError, match="env.max_episode_tokens=400 .* context of 256"):
        train(cfg, log=lambda *_: None)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_multi_turn_run_killed_mid_rollout_resumes_bitwise(tiny_dir, tmp_path):
    """The built-in retry environment (deterministic, judged by the run's reward) through SIGKILL and resume."""
    env = ["env.name=retry", "env.reward=env", "env.max_turn_tokens=4", "env.max_turns=2"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    done = tether_child("train", *kill_resume_overrides(tiny_dir, full), *env, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    cut = tether_child("train", *kill_resume_overrides(tiny_dir, killed), *env, kill_at="rollout:3", timeout=900)
    assert cut.returncode == -signal.SIGKILL, cut.stderr[-2000:]
    resumed = tether_child("train", "--resume", str(killed), timeout=900)
    assert resumed.returncode == 0 and f"resuming {killed} from step 2" in resumed.stdout, resumed.stderr[-2000:]
    a, b = metrics_rows(full), metrics_rows(killed)
    assert [r["step"] for r in b] == [r["step"] for r in a] and "env/turns" in a[1]
    for ra, rb in zip(a, b):
        assert untimed(ra) == untimed(rb), ra["step"]
    wa, wb = checkpoint_weights(full, 5), checkpoint_weights(killed, 5)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_tether_eval_plays_the_same_episodes_and_records_the_env(tiny_dir, tmp_path, env_module):
    from tether.evaluation import EvalError, evaluate
    from tether.evaluation.data import eval_env

    env = eval_env(["name=mtenvs:Countdown", "max_turn_tokens=4", "max_episode_tokens=40", "args={feedback: again}"])
    out = tmp_path / "eval"
    kw = dict(n=2, limit=3, progress=False, out_dir=out, max_new_tokens=4, reward=DIGIT_REWARD)
    results = evaluate(tiny_dir, ["task:arithmetic"], env=env, **kw)
    rows = [json.loads(line) for line in (out / "problems.jsonl").read_text().splitlines()]
    for row in rows:
        for turns in row["turns"]:
            assert [role for role, _ in turns] == ["model", "user", "model", "user", "model"]
            assert all(text == "again" for _, text in turns[1::2])
    assert json.loads((out / "settings.json").read_text())["env"]["name"] == "mtenvs:Countdown"
    assert results["summary"]
    with pytest.raises(EvalError, match="env"):  # another env is another evaluation: refused in the same directory
        evaluate(tiny_dir, ["task:arithmetic"], env={**env, "max_turns": 2}, **kw)
    with pytest.raises(EvalError, match="max_turns"):
        eval_env(["name=retry", "max_turns=0"])
    assert eval_env([]) is None
