"""An episode's row holds the ids the model sampled, exactly, and what the environment wrote, tokenised only
as the chat template's difference; the loss mask covers the model's ids and nothing else.

The tiny model's character tokenizer is given a ChatML-like template (turns between <bos> and <eos>, a newline
after each <eos>, as ChatML writes "\\n" after <|im_end|>), so the separator after an assistant turn is tested
the way verl PR #6921's bug dropped it.
"""

import pytest
import torch

from tether.envs import ChatTurns, EpisodeRunner, Limits, Step, Tools, calculator
from tether.model.loading import load_model
from tether.rollout import SamplingParams, get_engine

from conftest import Scripted
from tether.tasks import Example

CHATML = (
    "{% for m in messages %}<bos>{{ m.role }}:{{ m.content }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant:{% endif %}"
)
# A template that rewrites earlier assistant turns (as reasoning templates drop an old turn's thinking):
# rendering one more turn changes the ids of the turns before it.
REWRITING = (
    "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}<bos>assistant:<eos>\n"
    "{% else %}<bos>{{ m.role }}:{{ m.content }}<eos>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant:{% endif %}"
)
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6)


class Echo:
    """Answers every turn with a fixed observation; done after `turns` turns, reward 1 on the last."""

    def __init__(self, turns=3, text="again: 7+5"):
        self.turns, self.text = turns, text

    def reset(self, example):
        self.k = 0

    def step(self, reply):
        self.k += 1
        if self.k >= self.turns:
            return Step(reward=1.0, done=True)
        return Step(observation=self.text, reward=0.0)


@pytest.fixture(scope="module")
def chat_model(tiny_dir):
    model, tok = load_model(tiny_dir)
    tok.chat_template = CHATML
    return model.eval(), tok


def _examples(tok, n=3):
    return [
        Example(
            f"e{i}",
            tok.apply_chat_template(
                [{"role": "user", "content": f"{i}+{i}="}], tokenize=False, add_generation_prompt=True
            ),
            str(2 * i),
            {"user_message": f"{i}+{i}="},
        )
        for i in range(n)
    ]


def _runner(model, tok, env=Echo, turns=3, turn_tokens=6, episode_tokens=60, tools=None):
    engine = get_engine("hf", model=model, tokenizer=tok)
    return EpisodeRunner(engine, tok, env, Limits(turns, turn_tokens, episode_tokens), "echo", tools), engine


def test_model_turns_are_the_sampled_ids_and_env_turns_the_template_difference(chat_model):
    model, tok = chat_model
    runner, engine = _runner(model, tok)
    examples = _examples(tok)
    batch = runner.run(examples, 2, PARAMS, seed=5)
    obs = runner.turns.observation("again: 7+5", "user", tok.eos_token_id)
    assert tok.decode(obs) == "\n<bos>user:again: 7+5<eos>\n<bos>assistant:"  # the separator kept
    # turn 1 of every episode is exactly what the engine samples from the prompts with the batch's seed
    first = engine.generate([e.prompt for e in examples], n=2, params=PARAMS, seed=5)
    for row in range(len(batch)):
        k = int(first.mask[row].sum())
        assert batch.completion_ids[row, :k].tolist() == first.completion_ids[row, :k].tolist()
        assert torch.equal(batch.sampler_logprobs[row, :k], first.sampler_logprobs[row, :k])
    # every row: model segments (loss mask on, the sampler's log-probs) and env segments (off, 0) alternate,
    # and an env segment is the template difference, byte for byte
    for row, facts in enumerate(batch.episodes):
        ids = batch.completion_ids[row][batch.mask[row]].tolist()
        trained = batch.policy_mask[row][batch.mask[row]].tolist()
        lp = batch.sampler_logprobs[row][batch.mask[row]]
        env_ids = [t for t, m in zip(ids, trained) if not m]
        assert len(env_ids) == facts["env_tokens"] and sum(trained) == facts["model_tokens"]
        assert torch.all(lp[~torch.tensor(trained)] == 0)
        segments, start = [], 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or trained[i] != trained[start]:
                segments.append((trained[start], ids[start:i]))
                start = i
        for is_model, seg in segments:
            if not is_model:
                ended_on_eos = seg[0] != tok.eos_token_id
                assert seg == (obs if ended_on_eos else [tok.eos_token_id, *obs])
        assert facts["turns"] == sum(m for m, _ in segments)


def test_a_whole_episode_decodes_to_the_rendered_conversation(chat_model):
    """No drift: prompt + row decodes to the template's rendering of the whole conversation, the model's replies
    as they were sampled and the separator after each of its turns included."""
    _, tok = chat_model
    runner = EpisodeRunner(Scripted(tok), tok, Echo, Limits(3, 8, 80), "echo")
    examples = _examples(tok, 2)
    batch = runner.run(examples, 2, PARAMS, seed=1)
    for row, facts in enumerate(batch.episodes):
        assert facts["turns"] == 3 and batch.finish_reasons[row] == "stop"
        ids = batch.prompt_ids[row] + batch.completion_ids[row][batch.mask[row]].tolist()
        messages = [{"role": "user", "content": examples[row // 2].meta["user_message"]}]
        for role, text in facts["transcript"]:
            messages.append({"role": "assistant" if role == "model" else role, "content": text})
        assert [m["content"] for m in messages[1::2]] == ["4", " x y", "7+5=12"]
        rendered = tok.apply_chat_template(messages, tokenize=False)
        assert tok.decode(ids) == rendered.rstrip("\n")  # the last turn's eos ends the row
        assert ids == tok(rendered.rstrip("\n"), add_special_tokens=False)["input_ids"]


def test_a_template_that_rewrites_earlier_turns_is_refused(tiny_dir):
    _, tok = load_model(tiny_dir)
    tok.chat_template = REWRITING
    with pytest.raises(ValueError, match="not prefix-preserving"):
        ChatTurns(tok)


def test_without_a_chat_template_observations_are_plain_text(tiny_dir):
    model, tok = load_model(tiny_dir)
    runner, _ = _runner(model.eval(), tok)
    assert tok.decode(runner.turns.observation("no", "user", None)) == "\nno\n"
    ex = [Example("a", "1+1=", "2")]
    batch = runner.run(ex, 2, PARAMS, seed=0)
    assert batch.prompt_ids[0] == tok("1+1=", add_special_tokens=False)["input_ids"]  # the task's prompt, as is


def test_limits_end_episodes_with_length(chat_model):
    model, tok = chat_model
    runner, _ = _runner(model, tok, turn_tokens=6, episode_tokens=14)
    batch = runner.run(_examples(tok), 2, PARAMS, seed=2)
    assert batch.mask.sum(1).max() <= 14
    assert all(f["turns"] <= 3 for f in batch.episodes)
    long = [r for r in range(len(batch)) if int(batch.mask[r].sum()) > 8]
    assert all(batch.finish_reasons[r] == "length" for r in long if batch.episodes[r]["turns"] < 3) or not long


def test_the_same_seed_gives_the_same_episodes(chat_model):
    model, tok = chat_model
    runner, _ = _runner(model, tok)
    a = runner.run(_examples(tok), 2, PARAMS, seed=9)
    b = runner.run(_examples(tok), 2, PARAMS, seed=9)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.policy_mask, b.policy_mask)
    assert a.episodes == b.episodes


def test_tools_go_into_the_prompt_in_the_plain_text_format_and_calls_stop_the_turn(chat_model):
    model, tok = chat_model
    runner, _ = _runner(model, tok, env=lambda: Tools([calculator]), tools=[calculator])
    assert not runner.turns.template_tools  # this template does not render tools
    prompt = runner.turns.prompt(_examples(tok)[1], None)
    assert (
        "<tool_call>" in prompt and "calculator(expression: string)" in prompt and prompt.startswith("<bos>user:1+1=")
    )
    batch = runner.run(_examples(tok), 2, PARAMS, seed=0)
    assert batch.episodes[0]["info"] == {} or set(batch.episodes[0]["info"]) <= {"tool_calls", "tool_errors"}
