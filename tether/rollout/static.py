"""A decode step without launch overhead: a preallocated KV cache and a compiled forward.

The eager decode (`tether.rollout.hf`, `DynamicCache`) launches every op of every layer from
Python on every token, and the cache grows by a `torch.cat` per layer per step; a model of a
few hundred million parameters then spends most of a step waiting for the host. Here the cache
is allocated once, at its final length, and the one-token forward is compiled
(`torch.compile(mode="reduce-overhead")` on CUDA, i.e. the whole step replayed as one CUDA
graph; inductor's fused kernels on CPU). A graph fixes its shapes, so:

  1. the cache is `transformers.StaticCache` of L = round_up(prompt + max_new_tokens, 64)
     columns, and L only grows over an engine's life: with reduce-overhead, a graph is tied to
     its cache tensors' identity, so a batch of shorter prompts reuses the longer buffers and
     their graphs rather than allocating (and recompiling) new ones;
  2. the batch dimension runs in buckets: the chunk's own size B, then powers of two. When at
     most half of a bucket's rows are still going, the running rows (and finished ones to fill
     up) move into the bucket `next_pow2(running)`, so finished rows still leave the batch, in
     at most log2(B) + 1 shapes (graphs) per chunk size;
  3. each bucket's cache is allocated once per model and reused across steps, calls and engines: a
     CUDA graph replays reads and writes at fixed addresses.

Everything else (sampling, stop tokens, stop strings, seeds) is the eager loop's own code in
`tether.rollout.hf`; only the forward and the cache differ, so both paths sample the same
tokens from logits equal up to the compiled kernels' rounding (the CPU test checks tokens
exactly and log-probs to 1e-5).

Departures from a plain `StaticCache` + compile, and why:
  1. The prompts are prefilled eagerly with the dynamic cache (each distinct prompt once, as in
     the eager path), then copied into the static buffers: prefill is one large forward, which
     compiling would not speed up, and a compiled prefill would need a graph per prompt length.
  2. The cache layers' tensors (`keys`, `values`, `cumulative_length`) are written directly
     when prefilling and when moving rows between buckets; `static_decode_reason` checks up
     front that the installed transformers has that layout and the model only full-attention
     layers (sliding-window or linear-attention layers are not supported; the engine then
     decodes eagerly).
  3. Attention reads all L columns every step (the static shapes), where the dynamic cache
     reads only the filled ones: more memory traffic per step at long lengths, traded for no
     launches (docs/performance.md, the decode's physical limit).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

LENGTH_MULTIPLE = 64
"""The cache length is rounded up to a multiple of this, so nearby prompt lengths share a graph."""

RECOMPILE_LIMIT = 64
"""Graphs the decode step may hold (torch's default of 8 is one cache length's buckets for 128 rows)."""


def compile_limits():
    """A context raising dynamo's recompile limit to RECOMPILE_LIMIT (entered once per call: it
    costs about 150 us, too much per step)."""
    return torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def bucket_size(running: int, rows: int) -> int | None:
    """The rows to decode next when `running` of the `rows` decoded now are unfinished; None: keep.

    Shrinks only when at most half are running, to the power of two that holds them:
    24 rows with 12 running -> 16, with 5 running -> 8; 16 rows with 9 running -> None.
    """
    if running > rows // 2:
        return None
    return min(next_pow2(running), rows)


def static_decode_reason(model: Any) -> str | None:
    """Why the compiled decode cannot run `model` (None: it can)."""
    try:
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer
    except ImportError:
        return "the installed transformers has no StaticCache layers (transformers >= 5 has)"
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"{type(model).__name__} does not declare support for a compiled static-cache forward"
    cache = StaticCache(config=model.config, max_cache_len=LENGTH_MULTIPLE)
    kinds = {type(layer).__name__ for layer in getattr(cache, "layers", [])}
    if kinds != {StaticLayer.__name__}:
        return f"the model's static cache has layers {sorted(kinds)}; only full-attention layers are supported"
    if not isinstance(getattr(cache.layers[0], "cumulative_length", None), torch.Tensor):
        return "the installed transformers' StaticLayer keeps no cumulative_length tensor"
    return None


def _decode_step(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache: Any
) -> torch.Tensor:
    """One token per row through the model and its static cache: (S, 1) ids -> (S, V) logits."""
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
    )
    return out.logits[:, -1]


def compile_step(fn: Callable, device: torch.device) -> Callable:
    """`fn` compiled for `device`: CUDA graphs on CUDA, inductor's default mode elsewhere.

    dynamic=False: every bucket is its own specialised graph, which is what CUDA graphs record.
    """
    return torch.compile(
        fn, mode="reduce-overhead" if device.type == "cuda" else "default", dynamic=False, fullgraph=True
    )


class StaticDecoder:
    """Decode steps on a static KV cache, one bucket of rows at a time (module docstring).

    One per model (`StaticDecoder.of(model)`): it holds each bucket's cache and the compiled
    step, reused across calls and across engines on the same model (the trainer's, the warm
    start's), since on CUDA a new cache would mean new graphs.
    The per-chunk protocol, shared with the eager decoder in `tether.rollout.hf`:
    `start(prefill_cache, attention, prompt_len, length)`, then per step
    `resize(running, rows)` (a bucket size or None), `select(keep)` and `step(ids, positions)`.
    """

    def __init__(self, model: Any):
        reason = static_decode_reason(model)
        if reason is not None:
            raise ValueError(f"compiled decode unavailable: {reason}; use compile=False")
        self.model = model
        self._step: Callable | None = None
        self._caches: dict[int, Any] = {}  # bucket rows -> StaticCache, all of length self._length
        self._length = 0
        self._cache: Any = None  # the bucket decoding now
        self._attention: torch.Tensor | None = None  # (S, L) its rows' padding mask

    _per_model: "weakref.WeakKeyDictionary[Any, StaticDecoder]" = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, model: Any) -> "StaticDecoder":
        """The decoder of `model`, built on first use (raises with the reason when it cannot run)."""
        if model not in cls._per_model:
            cls._per_model[model] = cls(model)
        return cls._per_model[model]

    def _bucket(self, rows: int, like: Any) -> Any:
        """The cache for `rows` rows (allocated the first time, shaped after a prefill layer)."""
        from transformers import StaticCache

        if rows not in self._caches:
            cache = StaticCache(config=self.model.config, max_cache_len=self._length)
            for layer, src in zip(cache.layers, like.layers):
                shape = (rows, *src.keys.shape[1:])
                layer.lazy_initialization(src.keys.new_empty(shape), src.values.new_empty(shape))
            self._caches[rows] = cache
        return self._caches[rows]

    def start(self, prefill_cache: Any, attention: torch.Tensor, prompt_len: int, length: int) -> None:
        """Load a chunk: the prefill's dynamic cache (B rows, P columns) into bucket B.

        attention: (B, P + new tokens) padding mask, 0 on left padding.
        """
        if length > self._length:  # grow only: a new buffer means a new graph (CUDA graphs guard on its identity)
            self._caches, self._length = {}, round_up(length, LENGTH_MULTIPLE)  # the old ones freed first
        length = self._length
        rows = attention.shape[0]
        self._cache = self._bucket(rows, prefill_cache)
        for layer, src in zip(self._cache.layers, prefill_cache.layers):
            layer.keys[:, :, :prompt_len].copy_(src.keys)
            layer.values[:, :, :prompt_len].copy_(src.values)
            layer.cumulative_length.fill_(prompt_len)
        self._attention = torch.nn.functional.pad(attention, (0, length - attention.shape[1]), value=1)
        if self._step is None:
            self._step = compile_step(_decode_step, attention.device)

    @staticmethod
    def resize(running: int, rows: int) -> int | None:
        return bucket_size(running, rows)

    def select(self, keep: torch.Tensor) -> None:
        """Move rows `keep` (indices into the current bucket) into the bucket of len(keep) rows."""
        src = self._cache
        dst = self._bucket(len(keep), src)
        filled = int(src.layers[0].cumulative_length)
        for d, s in zip(dst.layers, src.layers):
            d.keys[:, :, :filled] = s.keys[keep, :, :filled]
            d.values[:, :, :filled] = s.values[keep, :, :filled]
            d.cumulative_length.copy_(s.cumulative_length)
        self._cache, self._attention = dst, self._attention[keep]

    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """(S, 1) next tokens and their positions -> (S, V) logits; the cache advances one column.

        The logits live in the graph's output buffer until the next step: sample from them first.
        """
        if input_ids.is_cuda:
            torch.compiler.cudagraph_mark_step_begin()
        return self._step(self.model, input_ids, self._attention, position_ids, self._cache)
