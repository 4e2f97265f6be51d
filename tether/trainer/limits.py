"""Settings checked against the model and the data before anything is written: those that would
let a run start but never progress. Each is a ConfigError naming both
values and the fix, raised by `tether.trainer.setup.start_run` before the run directory is made.

- `rollout.max_new_tokens` against the model's context (`max_position_embeddings` of its
  config.json; the tiny model's is `init_model`'s `max_positions`): the longest prompt (of the
  held-out ones and the first `PROMPT_SAMPLE` training ones) plus the completion must fit, or
  the model reads positions it has no embedding for (`max_new_tokens=100000` with a
  256-position model never finished step 1).
- The warm start's reference solutions against the budget its greedy check generates with
  (`rollout.max_new_tokens`, `tether.trainer.warmstart`): a solution longer than the budget is cut, so
  it scores 0 however well the model learned it. When fewer than `warm_start.target_accuracy`
  of the problems it checks have a solution that fits, the target can never be reached (the
  math task's `The answer is \\boxed{N}.` is 25 tokens for the character model: with the
  budget of 16 the loss fell to 0.03 while accuracy stayed 0.000 for 3000 steps).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from ..config.sections import ModelConfig
from ..schema import ConfigError
from ..model.loading import init_model, local_source
from ..rollout.hf import encode_prompts
from ..tasks import Task

PROMPT_SAMPLE = 512
"""Training prompts whose length is checked (with every held-out one): a sample, not the whole split."""


def model_context(m: ModelConfig) -> Optional[int]:
    """Positions the model can read (`max_position_embeddings`, or the older names of it), None when its
    config does not say; the built-in tiny model's is what `init_model` builds."""
    if m.builtin_tiny:
        return int(init_model.__kwdefaults__["max_positions"])
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(local_source(m.name_or_path), trust_remote_code=False)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _first_prompts(env: Any, tokenizer: Any, examples: Sequence[Any]) -> list[str]:
    """The prompts runs start from: the examples', or with env.tools the episodes' (the tools described in them)."""
    if not env.tools:
        return [e.prompt for e in examples]
    from ..envs import ChatTurns, resolve_tools  # lazy: the tools are a user's code, imported only for them

    turns = ChatTurns(tokenizer, resolve_tools(env))
    return [turns.prompt(e, None) for e in examples]


def check_lengths(cfg: Any, task: Task, tokenizer: Any, eval_examples: Sequence[Any]) -> None:
    """ConfigError when the run cannot progress for a length (module docstring): the prompts and the token budget
    must fit the model's context (`_check_context`), and the warm start's reference solutions its budget
    (`_check_warm_start`)."""
    budget = cfg.env.episode_tokens(cfg.rollout) if cfg.env.enabled else cfg.rollout.max_new_tokens
    context = model_context(cfg.model)
    if context is not None:
        _check_context(cfg, task, tokenizer, eval_examples, budget, context)
    if cfg.warm_start.enabled:
        _check_warm_start(cfg, task, tokenizer, budget)


def _check_context(
    cfg: Any, task: Task, tokenizer: Any, eval_examples: Sequence[Any], budget: int, context: int
) -> None:
    """The longest prompt (of the held-out problems and a sample of the training ones) and the token budget of a
    completion, or of an episode, must fit the model's context."""
    env, seed = cfg.env, cfg.trainer.seed
    train = task.examples("train")[:PROMPT_SAMPLE] if task.finite else task.examples("train", PROMPT_SAMPLE, seed=seed)
    prompts = _first_prompts(env, tokenizer, [*eval_examples, *train])
    longest = max(map(len, encode_prompts(tokenizer, prompts)), default=0)
    if longest + budget <= context:
        return
    room = context - longest
    if env.enabled:
        raise ConfigError(
            f"an episode of env.max_episode_tokens={budget} tokens (the model's turns and the environment's; "
            f"0 means 2 x env.max_turns x the turn's tokens) after prompts of up to {longest} tokens needs "
            f"{longest + budget} positions, but the model {cfg.model.name_or_path!r} has a context of {context}: "
            + (
                f"set env.max_episode_tokens to at most {room}, or fewer or shorter turns"
                if room > 0
                else "the prompts alone fill it (with env.tools, their description is part of the prompt): "
                "use a model with a longer context, or shorter prompts or fewer tools"
            )
        )
    fix = (
        f"lower rollout.max_new_tokens to at most {room}"
        if room > 0
        else "use a model with a longer context or shorter prompts"
    )
    raise ConfigError(
        f"rollout.max_new_tokens={budget} with prompts of up to {longest} tokens needs "
        f"{longest + budget} positions, but the model {cfg.model.name_or_path!r} has a context of "
        f"{context} (max_position_embeddings): generation past it cannot work. {fix.capitalize()}"
    )


def _check_warm_start(cfg: Any, task: Task, tokenizer: Any, budget: int) -> None:
    """Enough of the reference solutions the warm start's greedy check generates must fit its token budget for it
    to reach warm_start.target_accuracy."""
    ws = cfg.warm_start
    try:
        checked = task.examples("train", cfg.data.eval_size, seed=cfg.trainer.seed + 1)  # what the warm start checks
    except ValueError:  # fewer training problems than that: the data checks say so
        return
    solutions = [task.solution(e) for e in checked]
    lengths = [len(ids) for ids in encode_prompts(tokenizer, solutions)]
    fits = sum(n <= budget for n in lengths)
    if checked and fits / len(checked) < ws.target_accuracy:
        worst = max(range(len(lengths)), key=lengths.__getitem__)
        raise ConfigError(
            f"the warm start can never reach warm_start.target_accuracy={ws.target_accuracy}: its greedy check "
            f"generates rollout.max_new_tokens={budget} tokens, but only {fits} of the {len(checked)} reference "
            f"solutions it checks fit in that (the longest is {lengths[worst]} tokens: "
            f"{solutions[worst][-60:]!r}), and a cut solution scores 0. Raise rollout.max_new_tokens to at least "
            f"{sorted(lengths)[max(1, math.ceil(ws.target_accuracy * len(lengths))) - 1]} (all fit at "
            f"{max(lengths)}), or set warm_start.enabled=false"
        )
