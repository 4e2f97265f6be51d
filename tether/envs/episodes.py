"""Multi-turn episodes, token in and token out: `EpisodeRunner.run(examples, n, params, seed) -> RolloutBatch`.

An episode's row of the batch is its prompt, then every turn after it in order:

    prompt ids | model turn 1 (sampled) | env turn 1 (template) | model turn 2 (sampled) | ...
    policy_mask:    1 1 1 ... 1 <eos>       0 0 0 0 0 0 0 0       1 1 1 ... <eos>
    sampler lp:     the sampler's             0                    the sampler's

Token in, token out: each model turn is sampled by the engine from the ids of the episode so far
(`engine.generate_ids`), and its ids are kept exactly as sampled; they are never decoded and encoded again
(decoding then encoding is not a round trip for BPE tokenisers, and chat templates that rewrite earlier
turns would change what the model saw). Only what the environment adds is tokenised, as the difference of
the chat template with and without it (`ChatTurns`):

    ids(template(conversation + observation, generation prompt)) - ids(template(conversation))

preceded by what the template writes after an assistant turn's end-of-turn token (ChatML's "\\n" after
<|im_end|>: dropping it is the separator bug of verl PR #6921), and by the end-of-turn token itself when the
model's turn ended on a stop string rather than on it. At start-up `ChatTurns` checks on a probe conversation
that the template is prefix-preserving for each role it will append (rendering the conversation with one
more turn starts with the ids of the conversation without it); a template that is not is an `error:` naming
the role, never silent drift. Without a chat template (plain-text prompts, the tiny model) an observation is
appended as the plain text "\\n{observation}\\n" (tokenised alone, with no special tokens).

Limits (`env` section): at most `max_turns` model turns, each at most `max_turn_tokens` tokens, and at most
`max_episode_tokens` completion tokens in all (the model's and the environment's). A model turn cut by its
`max_turn_tokens` still goes to the environment as it is (the template's end-of-turn token is added as
environment context). A model turn or an observation that would pass the episode's budget, or ids that would
pass the model's context, end the episode there. An episode finishes "length" (so `trainer.mask_truncated`
masks it) when a budget ended it or its last model turn was cut, and "stop" otherwise.

Each turn samples every episode still running in one engine call, seeded from the batch's seed and the turn
number, so a batch is a function of the policy, the examples and the seed for a deterministic environment
(the resume guarantee); an environment that is not deterministic (a clock, a network, a random source of its
own) makes the batch differ where it differs. The completion the reward sees (`RolloutBatch.completions`) is
the model's last turn; `RolloutBatch.episodes` holds each episode's facts (turns, rewards by turn, tokens of
each side, faults, the transcript).
"""

from __future__ import annotations

import threading
import traceback
from pathlib import Path
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch

from ..tasks.base import stable_hash
from ..rollout import TRUNCATED, RolloutBatch, SamplingParams, episode_summary, truncated
from ..rollout.hf import encode_prompts
from ..tasks import Example
from .base import EnvironmentBroken, Step
from .tools import CALL_END, plain_instructions, tool_schema

PROBE = ("What is 1 + 1?", "2", "Probe observation.")
"""The probe conversation `ChatTurns` checks the template on: a user turn, the assistant's, an observation."""


@dataclass(frozen=True)
class Limits:
    """An episode's bounds (the `env` section): turns, tokens per model turn, completion tokens in all, the
    model's context, and seconds per environment call."""

    max_turns: int
    max_turn_tokens: int
    max_episode_tokens: int
    context: Optional[int] = None
    timeout_s: float = 10.0


class ChatTurns:
    """Prompts and environment turns as token ids by the model's chat template (module docstring)."""

    def __init__(self, tokenizer: Any, tools: Optional[list[Callable]] = None):
        self.tokenizer, self.tools = tokenizer, tools or []
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self.schemas = [tool_schema(fn) for fn in self.tools]
        self.template_tools = self.chat and bool(self.schemas) and self._renders_tools()
        self.roles: dict[str, str] = {}
        self.closing: list[int] = []
        if self.chat:
            self._check_prefix_preserving()

    def _render(self, messages: list[dict], generation: bool) -> list[int]:
        kwargs = {"tools": self.schemas} if self.template_tools else {}
        out = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation, **kwargs)
        if hasattr(out, "keys") and "input_ids" in out:  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        return list(out)

    def _renders_tools(self) -> bool:
        """Whether the chat template writes the tools into the prompt (their names appear in its text)."""
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], tools=self.schemas, tokenize=False, add_generation_prompt=True
        )
        return all(s["function"]["name"] in text for s in self.schemas)

    def _check_prefix_preserving(self) -> None:
        user, assistant, observation = PROBE
        base = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        before = self._render(base, generation=False)
        eos = _end_of_turn(self.tokenizer, before)
        if eos is None:
            raise ValueError(
                "the chat template does not end an assistant turn with the tokenizer's eos token, so tether "
                "cannot tell where the model's turn ends and the environment's begins; use a chat model whose "
                "template ends turns with eos (ChatML, Llama 3), or plain-text prompts"
            )
        self.closing = before[eos:]  # the end-of-turn token and what the template writes after it
        for role in ("user", "tool"):
            try:
                after = self._render(base + [{"role": role, "content": observation}], generation=True)
            except Exception:  # a template without this role
                after = None
            if after is not None and after[: len(before)] == before and len(after) > len(before):
                self.roles[role] = role
            elif role == "user":
                raise ValueError(
                    "the chat template is not prefix-preserving for a user turn after the assistant's: "
                    "rendering the conversation with one more turn changes the ids of the turns before it, so "
                    "the ids the model sampled would not be what a re-rendered conversation shows (the "
                    "re-tokenisation drift tether avoids); use a template that renders earlier turns unchanged"
                )
        self.roles.setdefault("tool", "user")  # no tool role: a tool's result is a user turn
        self._before = before

    def prompt(self, example: Example, first: Optional[str]) -> str:
        """The episode's prompt text: the task's own, or `first` (the environment's first user message), with
        the tools in the template or in the documented plain-text format."""
        if first is None and not self.tools:
            return example.prompt
        message = first if first is not None else example.meta.get("user_message")
        if message is None:
            if self.chat:
                raise ValueError(
                    f"example {example.id!r}: an environment with tools needs the first user message to render "
                    "the tools into (the task's meta['user_message'], as tether's math task keeps it, or a "
                    "string from the environment's reset)"
                )
            message = example.prompt  # a plain-text prompt: the tools' format goes after it
        if self.tools and not self.template_tools:
            message = f"{message}\n\n{plain_instructions(self.tools)}"
        if not self.chat:
            return message
        kwargs = {"tools": self.schemas} if self.template_tools else {}
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True, **kwargs
        )

    def observation(self, text: str, role: str, last_id: Optional[int]) -> list[int]:
        """The ids of an environment turn after a model turn whose last id is `last_id` (module docstring)."""
        if not self.chat:
            return list(self.tokenizer(f"\n{text}\n", add_special_tokens=False)["input_ids"])
        user, assistant, _ = PROBE
        base = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        after = self._render(base + [{"role": self.roles.get(role, "user"), "content": text}], generation=True)
        closing = self.closing[1:] if last_id == self.closing[0] else self.closing
        return closing + after[len(self._before) :]


def _end_of_turn(tokenizer: Any, ids: list[int]) -> Optional[int]:
    """The index of the last eos token in `ids` (the assistant turn's end), None when there is none."""
    eos = {tokenizer.eos_token_id} | set(getattr(tokenizer, "additional_eos_ids", []) or [])
    hits = [i for i, t in enumerate(ids) if t in eos]
    return hits[-1] if hits else None


@dataclass
class _Episode:
    example: Example
    env: Any
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)
    finish: str = ""
    cut: bool = False
    last_reply: str = ""
    turns: int = 0
    env_rewards: list[Optional[float]] = field(default_factory=list)
    info: dict[str, float] = field(default_factory=dict)
    faults: list[str] = field(default_factory=list)
    transcript: list[tuple[str, str]] = field(default_factory=list)
    prompt: str = ""  # the first prompt as the model saw it: the task's, with the tools' description
    tracebacks: list[str] = field(default_factory=list)  # one per fault that raised ("" for a time-out)

    def fail(self, fault: str, trace: str = "") -> None:
        self.faults.append(fault)
        self.tracebacks.append(trace)

    def add(self, ids: list[int], logprobs: list[float], trained: bool) -> None:
        self.ids += ids
        self.logprobs += logprobs
        self.trained += [trained] * len(ids)

    def facts(self) -> dict:
        model = sum(self.trained)
        return {
            "turns": self.turns,
            "model_tokens": model,
            "env_tokens": len(self.ids) - model,
            "rewards": list(self.env_rewards),
            "reward": float(sum(r for r in self.env_rewards if r is not None)),
            "info": dict(self.info),
            "faults": list(self.faults),
            "transcript": list(self.transcript),
            "prompt": self.prompt,
            "tracebacks": list(self.tracebacks),
        }


def _guarded(call: Callable[[], Any], timeout_s: float, what: str) -> tuple[Any, str, str]:
    """(call's result, "", "") or (None, fault, traceback): "timeout: WHAT gave no answer within ..." past
    `timeout_s` (the call's thread is abandoned: a Python thread cannot be killed; the environment object is not
    used again) or "error: WHAT raised TYPE: MESSAGE" with its traceback if it raised. `what` names the method
    (`reset`, `step`, or the environment's construction), which the fault and the warning say (issue 49)."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = call()
        except BaseException as err:  # noqa: BLE001 - a user's environment may raise anything
            box["error"], box["traceback"] = err, traceback.format_exc()

    thread = threading.Thread(target=target, daemon=True, name="tether-env")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return None, f"timeout: {what} gave no answer within env.timeout_s={timeout_s:g} s", ""
    if "error" in box:
        err = box["error"]
        return None, f"error: {what} raised {type(err).__name__}: {err}", box["traceback"]
    return box.get("value"), "", ""


class EpisodeRunner:
    """Plays a batch of episodes on an engine (module docstring).

    Args:
        engine: a rollout engine with `generate_ids(rows, params, seed) -> RolloutBatch` (hf, vllm).
        tokenizer: the policy's tokenizer.
        make_env: builds one episode's environment.
        limits: the episodes' bounds.
        name: the environment's name, for messages.
        tools: the environment's tools (their schemas go into the prompt).
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        make_env: Callable[[], Any],
        limits: Limits,
        name: str,
        tools: Optional[list[Callable]] = None,
    ):
        if not hasattr(engine, "generate_ids"):
            raise ValueError(f"the rollout engine {type(engine).__name__} cannot sample from token ids (generate_ids)")
        self.engine, self.tokenizer, self.make_env, self.limits, self.name = engine, tokenizer, make_env, limits, name
        self.turns = ChatTurns(tokenizer, tools)
        self.first_batch = True

    def on(self, engine: Any) -> "EpisodeRunner":
        """The same episodes on another engine (the overlapped sampler's copy of the policy)."""
        return EpisodeRunner(engine, self.tokenizer, self.make_env, self.limits, self.name, self.turns.tools)

    def generate_examples(
        self, examples: list[Example], n: int, params: SamplingParams, seed: Optional[int]
    ) -> RolloutBatch:
        """n episodes per example, contiguous per example (`prompt_index`), as one `RolloutBatch` (what
        `tether.rollout.draw` asks of an engine that plays episodes)."""
        return self.run(examples, n, params, seed)

    def run(self, examples: list[Example], n: int, params: SamplingParams, seed: Optional[int]) -> RolloutBatch:
        """n episodes per example, contiguous per example (`prompt_index`), as one `RolloutBatch`."""
        episodes = [self._start(ex) for ex in examples for _ in range(n)]
        stops = params.stop_strings + ((CALL_END,) if self.turns.tools and CALL_END not in params.stop_strings else ())
        turn_params = replace(params, max_new_tokens=self.limits.max_turn_tokens, stop_strings=stops)
        for turn in range(self.limits.max_turns):
            for e in episodes:  # the next turn could pass the model's context: the episode ends here
                if not e.finish and self.limits.context and len(e.prompt_ids) + len(e.ids) + 1 > self.limits.context:
                    e.finish = TRUNCATED
            live = [e for e in episodes if not e.finish]
            if not live:
                break
            rows = [e.prompt_ids + e.ids for e in live]
            longest = max(map(len, rows))
            cap = self.limits.context - longest if self.limits.context else turn_params.max_new_tokens
            params_now = replace(turn_params, max_new_tokens=max(1, min(turn_params.max_new_tokens, cap)))
            batch = self.engine.generate_ids(rows, params_now, None if seed is None else _turn_seed(seed, turn))
            for row, e in enumerate(live):
                self._model_turn(e, batch, row, last_turn=turn + 1 == self.limits.max_turns)
        for e in episodes:
            e.finish = e.finish or (TRUNCATED if e.cut else "stop")
        self._check_first_batch(episodes)
        return self._assemble(episodes, n, params)

    def _start(self, example: Example) -> _Episode:
        e = _Episode(example, None)
        env, fault, trace = _guarded(self.make_env, self.limits.timeout_s, f"building {self.name}")
        if not fault:
            first, fault, trace = _guarded(lambda: env.reset(example), self.limits.timeout_s, "reset")
        else:
            first = None
        e.env = env
        e.prompt = self.turns.prompt(example, first if isinstance(first, str) else None)
        e.prompt_ids = encode_prompts(self.tokenizer, [e.prompt])[0]
        if fault:
            e.fail(fault, trace)
            e.finish = "stop"
        elif self.limits.context and len(e.prompt_ids) + 1 > self.limits.context:
            e.finish = TRUNCATED
        return e

    def _model_turn(self, e: _Episode, batch: RolloutBatch, row: int, last_turn: bool) -> None:
        length = int(batch.mask[row].sum())
        room = self._room(e)
        ids = batch.completion_ids[row, : min(length, room)].tolist()
        e.add(ids, batch.sampler_logprobs[row, : len(ids)].tolist(), trained=True)
        e.turns += 1
        e.last_reply = batch.completions[row]
        e.transcript.append(("model", e.last_reply))
        e.cut = truncated(batch.finish_reasons[row])  # the turn ran out of env.max_turn_tokens (or the context)
        if length > room:  # out of the episode's tokens: it ends here
            e.finish = TRUNCATED
            return
        step, fault, trace = _guarded(lambda: e.env.step(e.last_reply), self.limits.timeout_s, "step")
        if fault or not isinstance(step, Step):
            e.fail(fault or f"error: step returned {type(step).__name__}, not a tether.envs.Step", trace)
            e.finish = "stop"
            return
        e.env_rewards.append(step.reward)
        for key, value in step.info.items():
            e.info[key] = e.info.get(key, 0.0) + float(value)
        if step.done or step.observation is None or last_turn:
            e.finish = TRUNCATED if e.cut else "stop"
            return
        obs = self.turns.observation(step.observation, step.role, ids[-1] if ids else None)
        if len(obs) > self._room(e) - 1:  # room for the observation and at least one token of the next turn
            e.finish = TRUNCATED
            return
        e.add(obs, [0.0] * len(obs), trained=False)
        e.transcript.append((step.role, step.observation))

    def _room(self, e: _Episode) -> int:
        room = self.limits.max_episode_tokens - len(e.ids)
        if self.limits.context:
            room = min(room, self.limits.context - len(e.prompt_ids) - len(e.ids))
        return max(room, 0)

    def _check_first_batch(self, episodes: list[_Episode]) -> None:
        if self.first_batch and episodes and all(e.faults for e in episodes):
            raise EnvironmentBroken(self.name, episodes[0].faults[0], episodes[0].tracebacks[0])
        self.first_batch = False

    def _assemble(self, episodes: list[_Episode], n: int, params: SamplingParams) -> RolloutBatch:
        pad = self.tokenizer.pad_token_id
        width = max(1, max(len(e.ids) for e in episodes))
        ids = torch.full((len(episodes), width), pad, dtype=torch.long)
        logprobs = torch.zeros((len(episodes), width), dtype=torch.float32)
        mask = torch.zeros((len(episodes), width), dtype=torch.bool)
        trained = torch.zeros((len(episodes), width), dtype=torch.bool)
        for i, e in enumerate(episodes):
            k = len(e.ids)
            ids[i, :k] = torch.tensor(e.ids, dtype=torch.long)
            logprobs[i, :k] = torch.tensor(e.logprobs, dtype=torch.float32)
            mask[i, :k] = True
            trained[i, :k] = torch.tensor(e.trained, dtype=torch.bool)
        device = getattr(self.engine, "device", None) or ids.device
        return RolloutBatch(
            prompt_ids=[e.prompt_ids for e in episodes],
            completion_ids=ids.to(device),
            sampler_logprobs=logprobs.to(device),
            mask=mask.to(device),
            finish_reasons=[e.finish for e in episodes],  # type: ignore[misc]
            completions=[e.last_reply for e in episodes],
            prompt_index=[i // n for i in range(len(episodes))],
            policy_mask=trained.to(device),
            episodes=[e.facts() for e in episodes],
        )


def _turn_seed(seed: int, turn: int) -> int:
    """Turn `turn`'s engine seed in a batch seeded `seed` (turn 0 samples as a single-turn batch would)."""
    return seed if turn == 0 else stable_hash(f"{seed}:turn:{turn}") % 2**63


def episode_metrics(rollout: RolloutBatch) -> dict[str, float]:
    """A multi-turn batch's metrics (`tether.rollout.episode_summary`); {} for a single-turn batch."""
    return {} if rollout.episodes is None else episode_summary(rollout.episodes)


@dataclass
class EnvWarnings:
    """`warning:` lines for an environment's faults, rate-limited: one the first time each kind (an error, a
    time-out) occurs in a run, naming the environment and the fault; later ones are only counted (env/errors,
    env/timeouts)."""

    name: str
    seen: set[str] = field(default_factory=set)
    log_file: Optional[Path] = None
    """Where `write_tracebacks` appends each fault with its traceback (the run's errors.log); None: nowhere."""

    def lines(self, step: int, facts: list[dict]) -> list[str]:
        out = []
        for fault in (f for episode in facts for f in episode["faults"]):
            kind = fault.split(":", 1)[0]
            if kind in self.seen:
                continue
            self.seen.add(kind)
            where = f"; its traceback is in {self.log_file}" if self.log_file and kind == "error" else ""
            out.append(
                f"warning: step {step}: the environment {self.name}: {fault} (the episode ended there; counted in "
                f"env/{kind}s, warned once per run{where})"
            )
        return out

    def write_tracebacks(self, step: int, facts: list[dict]) -> None:
        """Append every fault of the step with its traceback to `log_file` (the run's errors.log)."""
        if not self.log_file:
            return
        entries = [
            (i, fault, trace)
            for i, episode in enumerate(facts)
            for fault, trace in zip(episode["faults"], episode.get("tracebacks") or [""] * len(episode["faults"]))
        ]
        if not entries:
            return
        with open(self.log_file, "a") as f:
            for i, fault, trace in entries:
                f.write(f"step {step}, episode {i}: the environment {self.name}: {fault}\n{trace}\n")
