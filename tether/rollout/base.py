"""The rollout-to-trainer contract: what an engine returns, at token level.

A `RolloutBatch` holds N = (number of prompts) x n samples; the n samples of one prompt are
contiguous (rows i*n ... i*n+n-1 come from prompt i), and `prompt_index` says so explicitly,
so the trainer can form groups without assumptions. Completion tensors are right-padded to the
longest completion, T <= max_new_tokens.

`sampler_logprobs` are the log-probabilities of the sampled tokens under the distribution the
engine actually sampled from: log_softmax(logits / temperature) after top-p filtering (so they
are <= 0 and renormalised over the nucleus). With temperature 0 (greedy) that distribution is
a point mass, which carries no information, so the engine stores log_softmax(logits) of the
unscaled model instead. At temperature 1 and top_p 1 they equal the model's own log-probs,
which is what the trainer recomputes; the trainer never relies on them being that.

The stop token counts: when generation stopped on eos, a stop token id or a stop string, the
token that ended it is in `completion_ids` with `mask` True (the policy chose to stop, and
that choice is trained). `completions` is the decoded text without the stop token, cut before
a stop string, without padding: what rewards see.

Multi-turn episodes (tether.envs): the completion holds every turn after the prompt, the model's and the
environment's, in order; `mask` marks every real token (the model reads them all) and `policy_mask` only the
tokens the policy sampled, which alone are trained. An environment's tokens carry sampler log-prob 0 and
`policy_mask` False. Single-turn batches leave `policy_mask` None: every real token is the policy's. Which of the
policy's tokens the loss counts is decided later, once (`Tokens.loss_mask`, `tether.trainer.step.tokens_for_update`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

FinishReason = Literal["stop", "length"]
TRUNCATED: FinishReason = "length"
"""The finish reason of a completion cut off by its token budget: THE test of truncation (`truncated`)."""


def truncated(reason: str) -> bool:
    """Whether a completion with this finish reason ran out of its token budget before it stopped."""
    return reason == TRUNCATED


@dataclass(frozen=True)
class SamplingParams:
    """How to sample.

    Attributes:
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        max_new_tokens: the most tokens generated per sample.
        stop_strings: generation stops once the decoded completion contains any of these.
        stop_token_ids: extra token ids that stop generation, besides the tokenizer's and the
            model's eos ids (None: eos only).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if isinstance(self.stop_strings, str) or any(not s for s in self.stop_strings):
            raise ValueError(f"stop_strings must be a tuple of non-empty strings, got {self.stop_strings!r}")


@dataclass
class RolloutBatch:
    """N sampled completions, token level (module docstring).

    Attributes:
        prompt_ids: N lists of prompt token ids, unpadded (one per sample).
        completion_ids: (N, T) long, right-padded with the pad id.
        sampler_logprobs: (N, T) float32, log-prob of each sampled token under the sampling
            distribution; 0 at padding.
        mask: (N, T) bool, True for real completion tokens (the stop token included).
        finish_reasons: N of "stop" (eos, stop token or stop string) or "length".
        completions: N decoded texts, without the stop token, stop string or padding (multi-turn: the
            model's last turn, what the task's verifier scores).
        prompt_index: N indices into the prompt list; a prompt's samples are contiguous.
        policy_mask: (N, T) bool, True for the tokens the policy sampled; None: `mask` (single turn).
        episodes: N dicts of an episode's facts (turns, tool calls, environment tokens, rewards by turn), or
            None for single-turn batches (tether.envs.episodes).
        examples: N `tether.tasks.Example`, the one each sample answers, with its completion length in tokens
            (`tether.rewards.rollout_examples`); None until the batch is scored (`tether.rewards.score_rollout`).
        results: N `tether.rewards.RewardResult`, each sample's reward; None until the batch is scored.

    One type from the engine to the trainer's update: scoring fills `examples` and `results` (`scored`), and
    `rewards` and `group_ids` read them as tensors.
    """

    prompt_ids: list[list[int]]
    completion_ids: Int[Tensor, "N T"]
    sampler_logprobs: Float[Tensor, "N T"]
    mask: Bool[Tensor, "N T"]
    finish_reasons: list[FinishReason]
    completions: list[str]
    prompt_index: list[int] = field(default_factory=list)
    policy_mask: Bool[Tensor, "N T"] | None = None
    episodes: list[dict] | None = None
    examples: list[Any] | None = None
    results: list[Any] | None = None

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        shapes = {self.completion_ids.shape, self.sampler_logprobs.shape, self.mask.shape}
        if self.policy_mask is not None:
            shapes.add(self.policy_mask.shape)
            if (self.policy_mask.bool() & ~self.mask.bool()).any():
                raise ValueError(
                    "policy_mask marks a token that mask does not: a token the policy sampled must be a real one"
                )
        if self.episodes is not None and len(self.episodes) != n:
            raise ValueError(f"episodes must have {n} entries, got {len(self.episodes)}")
        if len(shapes) != 1 or self.completion_ids.dim() != 2 or self.completion_ids.shape[0] != n:
            raise ValueError(f"inconsistent shapes for {n} samples: {sorted(map(tuple, shapes))}")
        lists = {len(self.finish_reasons), len(self.completions), len(self.prompt_index)}
        lists |= {len(x) for x in (self.examples, self.results) if x is not None}
        if lists != {n}:
            raise ValueError(f"per-sample lists must all have {n} entries")
        if (self.examples is None) != (self.results is None):
            raise ValueError("a scored batch has both examples and results (`scored`), an unscored one neither")

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def policy_tokens(self) -> torch.Tensor:
        """(N, T) bool: the tokens the policy sampled (`policy_mask`, else `mask`), the loss mask's start."""
        return self.mask if self.policy_mask is None else self.policy_mask

    def scored(self, examples: list[Any], results: list[Any]) -> "RolloutBatch":
        """This batch with each sample's example and reward result (`tether.rewards.score_rollout`)."""
        return dataclasses.replace(self, examples=list(examples), results=list(results))

    @property
    def rewards(self) -> torch.Tensor:
        """(N,) float32: each sample's score; the batch must be scored (`scored`)."""
        if self.results is None:
            raise ValueError("this batch is not scored yet: score it with tether.rewards.score_rollout")
        return torch.tensor([r.score for r in self.results], dtype=torch.float32)

    @property
    def group_ids(self) -> torch.Tensor:
        """(N,) int64: the prompt group of each sample (`prompt_index`)."""
        return torch.tensor(self.prompt_index, dtype=torch.long)

    @property
    def truncated(self) -> torch.Tensor:
        """(N,) bool: the samples cut off by their token budget (`truncated`)."""
        return torch.tensor([truncated(r) for r in self.finish_reasons], dtype=torch.bool)

    @property
    def completion_lengths(self) -> torch.Tensor:
        """(N,) number of tokens the policy sampled per sample (an environment's tokens left out)."""
        return self.policy_tokens.sum(-1)

    def select(self, idx: list[int]) -> "RolloutBatch":
        """The samples `idx`, in that order (prompt indices kept)."""
        return RolloutBatch(
            prompt_ids=[self.prompt_ids[i] for i in idx],
            completion_ids=self.completion_ids[idx],
            sampler_logprobs=self.sampler_logprobs[idx],
            mask=self.mask[idx],
            finish_reasons=[self.finish_reasons[i] for i in idx],
            completions=[self.completions[i] for i in idx],
            prompt_index=[self.prompt_index[i] for i in idx],
            policy_mask=None if self.policy_mask is None else self.policy_mask[idx],
            episodes=None if self.episodes is None else [self.episodes[i] for i in idx],
            examples=None if self.examples is None else [self.examples[i] for i in idx],
            results=None if self.results is None else [self.results[i] for i in idx],
        )

    @staticmethod
    def concat(parts: list["RolloutBatch"], pad_id: int) -> "RolloutBatch":
        """One batch from several, right-padded to the widest; prompt indices renumbered to stay distinct."""
        T = max(p.completion_ids.shape[1] for p in parts)

        def pad(x: torch.Tensor, value) -> torch.Tensor:
            return torch.nn.functional.pad(x, (0, T - x.shape[1]), value=value)

        offset, index = 0, []
        for p in parts:
            index += [offset + i for i in p.prompt_index]
            offset += max(p.prompt_index) + 1
        return RolloutBatch(
            prompt_ids=[ids for p in parts for ids in p.prompt_ids],
            completion_ids=torch.cat([pad(p.completion_ids, pad_id) for p in parts]),
            sampler_logprobs=torch.cat([pad(p.sampler_logprobs, 0.0) for p in parts]),
            mask=torch.cat([pad(p.mask, False) for p in parts]),
            finish_reasons=[r for p in parts for r in p.finish_reasons],
            completions=[c for p in parts for c in p.completions],
            prompt_index=index,
            policy_mask=None
            if all(p.policy_mask is None for p in parts)
            else torch.cat([pad(p.policy_tokens, False) for p in parts]),
            episodes=None
            if all(p.episodes is None for p in parts)
            else [e for p in parts for e in p.episodes or [{}] * len(p)],
            examples=_joined([p.examples for p in parts]),
            results=_joined([p.results for p in parts]),
        )


def _joined(lists: list[list[Any] | None]) -> list[Any] | None:
    """Per-sample lists of several batches end to end; None when any batch has none (not all scored)."""
    return None if any(x is None for x in lists) else [v for x in lists for v in x]


class RolloutEngine(Protocol):
    """Anything that samples completions and returns the token-level contract."""

    def generate(self, prompts: list[str], n: int, params: SamplingParams, seed: int | None = None) -> RolloutBatch:
        """Sample `n` completions for each prompt (samples of a prompt contiguous)."""
        ...


def draw(engine: Any, examples: Sequence[Any], n: int, params: SamplingParams, seed: int | None) -> RolloutBatch:
    """A batch for `examples` (tether.tasks.Example): an engine that plays episodes (`generate_examples`, the
    `tether.envs.EpisodeRunner`) gets the examples, any other engine samples their prompts (one turn). The one
    call the trainer's samplers, its held-out evaluation and `tether eval` make."""
    play = getattr(engine, "generate_examples", None)
    if play is not None:
        return play(list(examples), n, params, seed)
    return engine.generate([e.prompt for e in examples], n=n, params=params, seed=seed)


def episode_summary(facts: Sequence[dict]) -> dict[str, float]:
    """The metrics of multi-turn episodes' facts (`RolloutBatch.episodes`, docs/metrics.md): turns, model and
    environment tokens and each `Step.info` key per episode, the environment's faults, and the mean environment
    reward at each turn among the episodes that reached it (`env/reward_turn_<k>`); {} for none."""
    count = len(facts)
    if not count:
        return {}
    out = {
        "env/turns": sum(f["turns"] for f in facts) / count,
        "env/model_tokens": sum(f["model_tokens"] for f in facts) / count,
        "env/env_tokens": sum(f["env_tokens"] for f in facts) / count,
        "env/errors": float(sum(any(x.startswith("error") for x in f["faults"]) for f in facts)),
        "env/timeouts": float(sum(any(x.startswith("timeout") for x in f["faults"]) for f in facts)),
    }
    for key in sorted({k for f in facts for k in f["info"]}):
        out[f"env/{key}"] = sum(f["info"].get(key, 0.0) for f in facts) / count
    longest = max((len(f["rewards"]) for f in facts), default=0)
    for k in range(longest):
        at_k = [f["rewards"][k] for f in facts if len(f["rewards"]) > k and f["rewards"][k] is not None]
        if at_k:
            out[f"env/reward_turn_{k + 1}"] = sum(at_k) / len(at_k)
    return out
