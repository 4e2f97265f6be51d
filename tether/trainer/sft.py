"""Supervised warm start: teach a tiny model the task's format and some of its answers.

RL with verifiable rewards needs a policy that already solves some problems: if every sample
of every group scores 0, every advantage is 0 and nothing is learned. So before RL the model
is fine-tuned on `prompt + task.solution(example) + eos` with the loss on the solution tokens
only (the prompt is context, not a target), and stopped as soon as greedy accuracy on held-out
problems reaches `target_accuracy`. The threshold, not a step or time budget, is the stopping
rule because the accuracy curve of small models is a step function (CPU-NOTES: 3-digit
addition sits at 0% for 2.5 minutes and then jumps to 78% within one), and RL is most visible
when it starts from a model that solves some but not all problems.

Loss (per batch of B examples, solution tokens S_i with eos):
    L = sum_i sum_{t in S_i} -log p(y_t | y_<t) / sum_i |S_i|        (token mean)
Greedy accuracy uses the same engine and verifier as RL evaluation: temperature 0, the
task's reward, a completion counts as solved when its score is >= 1.

With an environment (`episodes`, which puts the run's `EpisodeRunner` on an engine) and worked episodes
(`demonstrate(example)`: the model's turns, such as a tool call and then the answer), the warm start teaches the
turns: each worked episode is played through the environment by `Demonstrations`, an engine that answers with
the example's turns, so the environment's replies (a tool's result) come from the environment and the tokens are
laid out exactly as the trainer's episodes are (tether.envs.episodes). The loss is on the model's tokens only
(the episode's loss mask), and the accuracy checks play greedy episodes. A turn that ends on one of the sampling
stop strings (a tool call's `</tool_call>`) ends there, as a sampled turn would; the last turn ends on eos.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..rewards import RewardFn, task_reward, verdicts
from ..rollout import HFEngine, RolloutBatch, SamplingParams, encode_prompts
from ..tasks import Example, Task
from . import seeds


def greedy_accuracy(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    reward: RewardFn,
    max_new_tokens: int,
    batch_size: int | None = None,
    episodes: Callable[[Any], Any] = lambda engine: engine,
) -> float:
    """Greedy accuracy on `examples`, measured as the trainer measures held-out accuracy
    (`tether.rewards.greedy_accuracy`: the share the 0/1 verifier `reward` accepts); `episodes` puts the run's
    episode runner on the engine (identity: single-turn prompts)."""
    engine = episodes(HFEngine(model, tokenizer, batch_size=batch_size))
    return verdicts.greedy_accuracy(engine, examples, reward, max_new_tokens)["eval/accuracy"]


class Demonstrations:
    """A rollout engine that answers one episode with its worked turns, in order (module docstring)."""

    def __init__(self, tokenizer: Any, turns: Sequence[str]):
        self.tokenizer, self.turns, self.taken = tokenizer, list(turns), 0

    def generate_ids(self, rows: list[list[int]], params: SamplingParams, seed: int | None = None) -> RolloutBatch:
        text = self.turns[min(self.taken, len(self.turns) - 1)]
        self.taken += 1
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not any(text.endswith(stop) for stop in params.stop_strings):  # the answer ends the turn on eos
            ids = ids + [self.tokenizer.eos_token_id]
        ids = torch.tensor([ids] * len(rows))
        return RolloutBatch(
            prompt_ids=[list(r) for r in rows],
            completion_ids=ids,
            sampler_logprobs=torch.zeros(ids.shape),
            mask=torch.ones(ids.shape, dtype=torch.bool),
            finish_reasons=["stop"] * len(rows),
            completions=[text] * len(rows),
            prompt_index=list(range(len(rows))),
        )


def episode_batch(
    tokenizer: Any,
    episodes: Callable[[Any], Any],
    examples: Sequence[Example],
    demonstrate: Callable[[Example], Sequence[str]],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, targets) of each example's worked episode, played through the
    environment (module docstring): targets hold the model's tokens and -100 at the prompt, the environment's
    tokens and the padding."""
    params = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=10_000)
    rows, trained = [], []
    for ex in examples:
        runner = episodes(Demonstrations(tokenizer, demonstrate(ex)))
        played = runner.run([ex], 1, params, seed=0)
        k = int(played.mask[0].sum())
        rows.append(list(played.prompt_ids[0]) + played.completion_ids[0, :k].tolist())
        trained.append([False] * len(played.prompt_ids[0]) + played.policy_mask[0, :k].tolist())
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    targets = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row, mask) in enumerate(zip(rows, trained)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        for t in range(1, len(row)):  # position t - 1 predicts token t
            if mask[t]:
                targets[i, t - 1] = row[t]
    return input_ids.to(device), attention.to(device), targets.to(device)


def sft_batch(
    tokenizer: Any, prompts: Sequence[str], solutions: Sequence[str], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, targets), each (B, L).

    input_ids = prompt + solution + eos; targets hold the next token where it is a solution
    token (eos included) and -100 elsewhere, so the loss sees only the solution.
    """
    prompt_ids = encode_prompts(tokenizer, list(prompts))
    solution_ids = encode_prompts(tokenizer, list(solutions))
    rows = [p + s + [tokenizer.eos_token_id] for p, s in zip(prompt_ids, solution_ids)]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    targets = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row, p) in enumerate(zip(rows, prompt_ids)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        # position t predicts token t+1: solution tokens sit at len(p) .. len(row)-1
        targets[i, len(p) - 1 : len(row) - 1] = torch.tensor(row[len(p) :])
    return input_ids.to(device), attention.to(device), targets.to(device)


def sft_loss(model: Any, input_ids: torch.Tensor, attention: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy over the solution tokens (targets != -100)."""
    logits = model(input_ids=input_ids, attention_mask=attention).logits.float()  # (B, L, V)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


@dataclass(frozen=True)
class SFTSettings:
    """How `sft` trains and when it stops (the warm start fills it from `warm_start.*`)."""

    steps_max: int = 1500  # stop after this many optimiser steps even below the target
    batch_size: int = 64  # examples per step (a fresh seeded draw of train examples each step)
    lr: float = 1e-3  # AdamW's learning rate (no weight decay; gradients clipped to norm 1)
    eval_every: int = 25  # steps between greedy accuracy checks (and after the last step)
    target_accuracy: float = 0.25  # stop at the first check reaching it
    seed: int = 0  # the train draws' and the default held-out split's seed
    max_new_tokens: int = 32  # greedy completion length at the checks
    n_eval: int = 200  # held-out problems checked (unless `sft` is given `eval_examples`)
    give_up_checks: int = (
        10  # stop early after this many checks with the loss converged and no new best accuracy (0: never)
    )

    def __post_init__(self) -> None:
        if self.steps_max < 1 or self.eval_every < 1 or self.batch_size < 1:
            raise ValueError(
                f"steps_max, eval_every and batch_size must be >= 1, got {self.steps_max}, "
                f"{self.eval_every}, {self.batch_size}"
            )


def sft(
    model: Any,
    tokenizer: Any,
    task: Task,
    settings: SFTSettings = SFTSettings(),
    *,
    reward: RewardFn | None = None,
    eval_examples: Sequence[Example] | None = None,
    log: Callable[[str], Any] | None = None,
    episodes: Callable[[Any], Any] | None = None,
    demonstrate: Callable[[Example], Sequence[str]] | None = None,
) -> dict[str, Any]:
    """Fine-tune `model` in place on the task's solutions until greedy held-out accuracy is reached: the task gives
    train examples (a fresh seeded draw per step), `solution()`, the default reward and held-out split; `settings`
    the steps, batch, learning rate, checks and target; `reward` the verifier (default the task's own);
    `eval_examples` the problems the checks score (default `settings.n_eval` held out); `log` a line per check;
    `episodes` and `demonstrate` the environment and the worked turns it trains on (module docstring).

    Returns {"accuracy" (the last), "steps", "reached", "seconds", "history": [{"step", "loss" (the mean since the
    last check), "accuracy", "seconds"}, ...], "gave_up": why it stopped early (`stalled`), or ""}.
    """
    s, log = settings, log or (lambda _: None)
    reward = task_reward(task) if reward is None else reward
    held_out = list(eval_examples) if eval_examples is not None else task.examples("test", s.n_eval, seed=s.seed)
    device, optimizer = (
        next(model.parameters()).device,
        torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0),
    )
    history, losses = [], []  # the checks' rows; the losses since the last check
    start, accuracy, step, gave_up = time.perf_counter(), 0.0, 0, ""
    model.train()
    for step in range(1, s.steps_max + 1):
        examples = task.examples("train", s.batch_size, seed=seeds.sft_batch(s.seed, step), unique=False)
        losses.append(_sft_step(model, optimizer, _batch(tokenizer, task, examples, device, episodes, demonstrate)))
        if step % s.eval_every and step != s.steps_max:
            continue
        loss = torch.stack(losses).mean().item()
        row = _check(model, tokenizer, held_out, reward, s, {"step": step, "loss": loss}, start, log, episodes)
        history.append(row)
        accuracy, losses = row["accuracy"], []
        if accuracy >= s.target_accuracy:
            break
        gave_up = stalled(history, s.give_up_checks)
        if gave_up:
            log(f"sft step {step}: giving up: {gave_up}")
            break
    model.eval()
    seconds = time.perf_counter() - start
    reached = accuracy >= s.target_accuracy
    return {
        "accuracy": accuracy,
        "steps": step,
        "reached": reached,
        "seconds": seconds,
        "history": history,
        "gave_up": gave_up,
    }


def _batch(tokenizer, task: Task, examples, device, episodes, demonstrate) -> tuple[torch.Tensor, ...]:
    """A step's training batch: worked episodes played through the environment, or prompt + solution."""
    if episodes is not None and demonstrate is not None:
        return episode_batch(tokenizer, episodes, examples, demonstrate, device)
    return sft_batch(tokenizer, [e.prompt for e in examples], [task.solution(e) for e in examples], device)


def _check(model, tokenizer, held_out, reward, s: SFTSettings, row: dict, start: float, log, episodes=None) -> dict:
    """One check of the warm start: `row` (its step, the mean loss since the last check) with the greedy
    held-out accuracy (greedy episodes with `episodes`) and the seconds so far, logged."""
    wrap = episodes or (lambda engine: engine)
    row = {**row, "accuracy": greedy_accuracy(model, tokenizer, held_out, reward, s.max_new_tokens, episodes=wrap)}
    row["seconds"] = time.perf_counter() - start
    model.train()
    if log is not None:
        log(
            f"sft step {row['step']}: loss {row['loss']:.4f}, greedy accuracy {row['accuracy']:.3f} "
            f"({row['seconds']:.1f} s)"
        )
    return row


CONVERGED_LOSS = 0.05
"""A token-mean loss below this (nats per solution token) is converged: the model reproduces the solutions."""
FLAT_LOSS = 0.02
"""A loss that fell by less than this fraction over the window has converged too."""


def stalled(history: Sequence[dict[str, float]], checks: int) -> str:
    """Why the warm start should stop short of its target, or "": over the last `checks` checks the loss
    has converged (below CONVERGED_LOSS, or down by less than FLAT_LOSS of itself) and no check beat the
    best accuracy before them. More steps then only memorise further: what is wrong is elsewhere (a
    solution longer than the check's budget, a verifier that rejects the reference solutions). The
    accuracy of small models jumps late (module docstring), but not after the loss has converged."""
    if checks <= 0 or len(history) <= checks:
        return ""
    before, window = history[:-checks], history[-checks:]
    first, last = before[-1]["loss"], window[-1]["loss"]
    best_before, best_now = max(r["accuracy"] for r in before), max(r["accuracy"] for r in window)
    converged = last < CONVERGED_LOSS or last > (1 - FLAT_LOSS) * first
    if not converged or best_now > best_before:
        return ""
    steps = window[-1]["step"] - before[-1]["step"]
    return (
        f"over the last {checks} checks ({steps} steps) the loss went from {first:.4f} to {last:.4f} (converged) "
        f"while greedy accuracy stayed at most {best_now:.3f} (best before: {best_before:.3f}); more steps would "
        "only memorise the solutions further. Check that the task's reference solutions pass its verifier and "
        "fit rollout.max_new_tokens"
    )


def _sft_step(model: Any, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """One optimiser step on the token-mean loss of `batch` (`sft_batch`); returns the loss, detached."""
    loss = sft_loss(model, *batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.detach()
