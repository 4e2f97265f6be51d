"""tether.trainer.sft: the supervised warm start trains on solution tokens only and stops on accuracy."""

from __future__ import annotations

import pytest
import torch

from tether.model.loading import init_model, load_model
from tether.rewards import RewardResult, get_reward
from tether.trainer.sft import SFTSettings, greedy_accuracy, sft, sft_batch, sft_loss
from tether.tasks import Example, get_task


@pytest.fixture()
def tiny(tmp_path):
    return load_model(init_model(tmp_path / "m", hidden_size=64, num_layers=2, num_heads=4, seed=0))


def test_batch_masks_the_prompt(tiny):
    _, tok = tiny
    ids, attention, targets = sft_batch(tok, ["12+3=", "1+1="], ["15", "2"], torch.device("cpu"))
    assert ids.shape == attention.shape == targets.shape == (2, 8)
    assert tok.decode(ids[0]) == "12+3=15<eos>"
    # position t predicts token t+1: only "1", "5", <eos> are targets in row 0
    assert targets[0].tolist() == [-100] * 4 + tok.encode("15") + [tok.eos_token_id, -100]
    assert targets[1].tolist() == [-100] * 3 + tok.encode("2") + [tok.eos_token_id] + [-100] * 3
    assert attention[1].tolist() == [1] * 6 + [0] * 2 and (ids[1, 6:] == tok.pad_token_id).all()


@pytest.mark.slow
def test_a_few_steps_reduce_the_loss(tiny):
    model, tok = tiny
    task = get_task("arithmetic", digits=2, ops="+")
    probe = task.examples("test", 64)
    batch = sft_batch(tok, [e.prompt for e in probe], [task.solution(e) for e in probe], torch.device("cpu"))
    with torch.no_grad():
        before = sft_loss(model, *batch).item()
    result = sft(
        model,
        tok,
        task,
        SFTSettings(
            steps_max=40, batch_size=32, lr=3e-3, eval_every=20, target_accuracy=1.01, max_new_tokens=4, n_eval=32
        ),
    )
    with torch.no_grad():
        after = sft_loss(model, *batch).item()
    assert after < 0.6 * before  # held-out loss: about 4.6 (uniform over 100 tokens) -> below 2
    assert result["steps"] == 40 and not result["reached"]
    assert [row["step"] for row in result["history"]] == [20, 40]
    assert result["history"][1]["loss"] < result["history"][0]["loss"]
    assert 0.0 <= result["accuracy"] <= 1.0


def test_stops_at_target_accuracy(tiny):
    model, tok = tiny
    task = get_task("countdown")
    lines = []
    result = sft(
        model,
        tok,
        task,
        SFTSettings(steps_max=50, batch_size=8, lr=1e-3, eval_every=5, target_accuracy=0.0, max_new_tokens=4, n_eval=8),
        log=lines.append,
    )
    assert result["steps"] == 5 and result["reached"] and len(lines) == 1 and "greedy accuracy" in lines[0]


def test_greedy_accuracy_uses_the_reward(tiny):
    model, tok = tiny
    examples = [Example("a", "1+1=", "2"), Example("b", "2+2=", "4")]

    def always(completion: str, example: Example) -> RewardResult:
        return RewardResult(1.0)

    def shaped(completion: str, example: Example) -> RewardResult:
        return RewardResult(0.5)  # a shaped score: a reward, never an accuracy

    assert greedy_accuracy(model, tok, examples, always, max_new_tokens=3) == 1.0
    with pytest.raises(ValueError, match="accuracy needs a 0/1 verifier"):  # one definition (rewards.accuracy)
        greedy_accuracy(model, tok, examples, shaped, max_new_tokens=3)
    assert greedy_accuracy(model, tok, examples, get_reward("exact_match"), max_new_tokens=3) == 0.0  # untrained


def test_worked_episodes_are_played_through_the_tool_and_train_the_models_tokens_only(tmp_path):
    """Issue 49: the warm start of a tool job teaches the call format on worked episodes (a row's `turns`). Each is
    played through the environment, so the tool's response comes from the tool, and the targets are the model's
    turns alone: the call (ending on its stop string, as a sampled call does) and the answer (ending on eos)."""
    from tether.envs import EpisodeRunner, Limits, Tools
    from tether.envs.towns import CENSUS, town_population
    from tether.trainer.sft import episode_batch

    model, tok = load_model(init_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, max_positions=1024))
    town = next(iter(CENSUS))
    call = f'<tool_call>{{"name": "town_population", "arguments": {{"town": "{town}"}}}}</tool_call>'
    example = Example("t", f"How many people live in {town}?", str(CENSUS[town]), meta={"turns": [call, "\\boxed{7}"]})

    def episodes(engine):
        return EpisodeRunner(engine, tok, lambda: Tools([town_population]), Limits(3, 200, 600), "t", [town_population])

    ids, attention, targets = episode_batch(tok, episodes, [example], lambda ex: ex.meta["turns"], torch.device("cpu"))
    text = tok.decode(ids[0][attention[0].bool()])
    response = f"<tool_response>The population of {town} is {CENSUS[town]}.</tool_response>"
    assert text.startswith(example.prompt) and call in text and response in text and text.endswith("\\boxed{7}<eos>")
    trained = tok.decode([int(t) for t in targets[0] if t != -100])
    # the model's tokens: the call (no eos: it stopped on </tool_call>) and the answer with its eos; never the tool's
    assert trained == call + "\\boxed{7}<eos>"
