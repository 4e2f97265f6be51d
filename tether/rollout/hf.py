"""A rollout engine on a plain Hugging Face causal LM: our own decode loop over the KV cache.

Why not `model.generate`: the trainer needs the exact log-prob of every sampled token under the
distribution it was drawn from, the stop token kept in the loss mask, text-level stop strings,
and seeded reproducibility; owning the ~40-line loop gives all four without post-hoc
recomputation, on CPU or CUDA alike (everything lives on the model's device).

The loop, per chunk of B rows (prompts repeated n times, left-padded to length P):
  1. one forward over the distinct prompts with attention mask and position ids counted from
     each row's first real token (left padding must not shift positions), keeping only the last
     logits; the cache and those logits are then copied to every row that repeats the prompt;
  2. each step: sample a token per row from softmax(logits / temperature) restricted to the
     top-p nucleus (greedy at temperature 0), record its log-prob, and feed it back through the
     cache. Rows that have finished receive pad (their logits are ignored) until at most half
     of the rows the model runs are still going; then the finished ones leave the batch and
     the KV cache, so long-tailed lengths do not decode dead rows;
  3. stop when every row has stopped or `max_new_tokens` is reached.
Per step this is one forward plus a few vectorised ops and one host sync (the "all finished"
test); stop strings add a batch decode of the last few tokens of the active rows.

The forward of step 2 and its cache are a decoder, one of two behind the same four methods
(`start`, `resize`, `select`, `step`): `_EagerDecoder` runs the model eagerly on the prefill's
`DynamicCache` and drops finished rows exactly (`batch_select_indices`); `StaticDecoder`
(`tether.rollout.static`) runs a compiled step on a preallocated cache, CUDA graphs on a GPU,
and drops them in power-of-two buckets. The engine's `compile` picks one ("auto": compiled on
CUDA, eager on CPU, where compiling gains little and costs seconds per bucket). Sampling, stop
handling and bookkeeping are this loop's in both, so they guarantee the same things.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from ..model.causal_lm import eval_mode, left_pad, prompt_groups
from .base import TRUNCATED, FinishReason, RolloutBatch, SamplingParams
from .static import StaticDecoder, compile_limits, static_decode_reason


def encode_prompts(tokenizer: Any, prompts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
    """Token ids of each prompt, unpadded: the one encoding shared by rollouts and SFT.

    Prompts are expected to be complete (a chat template already applied, which carries its own
    BOS), hence no special tokens by default.
    """
    return tokenizer(list(prompts), add_special_tokens=add_special_tokens)["input_ids"]


class PromptsOrIds:
    """`generate` (text prompts, `n` samples each) and `generate_ids` (token ids in, token ids out: the
    multi-turn episodes of tether.envs) over an engine's `_sample(rows, prompt_index, params, seed)`; the
    engine has `tokenizer` and `add_special_tokens`. Shared by the hf and vllm engines."""

    tokenizer: Any
    add_special_tokens: bool

    def generate(self, prompts: list[str], n: int, params: SamplingParams, seed: int | None = None) -> RolloutBatch:
        """Sample `n` completions per prompt from the current policy; the same seed gives the same tokens."""
        if n < 1 or not prompts:
            raise ValueError(f"need at least one prompt and n >= 1, got {len(prompts)} prompts, n={n}")
        encoded = encode_prompts(self.tokenizer, prompts, self.add_special_tokens)
        prompt_index = [i for i in range(len(prompts)) for _ in range(n)]
        return self._sample([encoded[i] for i in prompt_index], prompt_index, params, seed)

    def generate_ids(self, rows: list[list[int]], params: SamplingParams, seed: int | None = None) -> RolloutBatch:
        """One completion per row of token ids, sampled from exactly those ids; `prompt_index` is the row's
        index."""
        if not rows or not all(rows):
            raise ValueError("need at least one row, and no empty row, of token ids")
        return self._sample([list(r) for r in rows], list(range(len(rows))), params, seed)

    def _sample(
        self, rows: list[list[int]], prompt_index: list[int], params: SamplingParams, seed: int | None
    ) -> RolloutBatch:
        raise NotImplementedError


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits with every token outside the top-p nucleus set to -inf.

    The nucleus is the smallest set of most likely tokens whose probability reaches `top_p`;
    the most likely token is always kept. logits: (B, V) -> (B, V).
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (B, V) probability of strictly more likely tokens
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def _below(x: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """x clamped to lie strictly below `limit` (float rounding must not reach an interval's end)."""
    return torch.minimum(x, torch.nextafter(limit, torch.zeros_like(limit)))


def sample_categorical(
    logits: torch.Tensor, generator: torch.Generator | None, block: int = 1024, uniform: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw per row from softmax(logits), by a two-level inverse CDF; (tokens (B,), log-probs (B,)).

    logits: (B, V) float, -inf where a token is excluded. With m the row max and
    w = exp(logits - m) (excluded tokens weigh 0), the vocabulary is cut into blocks of `block`
    tokens (the last may be shorter). With u ~ U[0, 1) scaled to the total weight W, the block
    is the first whose cumulative weight exceeds u, and the token the first in that block whose
    cumulative weight exceeds what is left of u. Each token is drawn with probability w_i / W;
    its log-prob is logits_i - m - log W. Block sums are float32 (pairwise, relative error about
    1e-6 of a block's mass); the cumulative sums and u are float64; an interval's end is never
    reached by rounding, so a token of weight 0 is never drawn. `uniform` (B,) float64 in [0, 1)
    supplies u per row; None draws them from `generator`.

    Why not `torch.multinomial`: on CPU it draws one exponential variate per vocabulary entry,
    and a full-vocabulary cumulative sum is a second pass; at V = 151,936 and 128 rows on 2 cores
    this takes about 40 ms against 440 ms for log_softmax + exp + multinomial.
    """
    rows, vocab = logits.shape
    block = min(block, vocab)
    peak = logits.max(dim=-1, keepdim=True).values  # (B, 1)
    weights = (logits - peak).exp_()  # (B, V) in [0, 1]
    whole = vocab // block * block
    sums = [weights[:, :whole].view(rows, -1, block).sum(-1)] if whole else []
    if whole < vocab:
        sums.append(weights[:, whole:].sum(-1, keepdim=True))
    block_cdf = torch.cat(sums, dim=1).double().cumsum(dim=-1)  # (B, n_blocks)
    total = block_cdf[:, -1:]
    if uniform is None:
        uniform = torch.rand(rows, generator=generator, dtype=torch.float64, device=logits.device)
    u = _below(uniform[:, None] * total, total)  # (B, 1)
    chosen = torch.searchsorted(block_cdf, u, right=True)  # (B, 1)
    u = u - torch.where(chosen > 0, block_cdf.gather(-1, (chosen - 1).clamp(min=0)), 0.0)
    index = chosen * block + torch.arange(block, device=logits.device)  # (B, block)
    inside = index < vocab
    cdf = weights.gather(-1, index.clamp(max=vocab - 1)).masked_fill(~inside, 0.0).double().cumsum(dim=-1)
    tokens = (chosen * block + torch.searchsorted(cdf, _below(u, cdf[:, -1:]), right=True)).squeeze(-1)
    logprobs = logits.gather(-1, tokens[:, None]).squeeze(-1) - peak.squeeze(-1) - total.squeeze(-1).log().float()
    return tokens, logprobs


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns (tokens (B,), log-probs (B,) float32).

    The log-prob is under the distribution sampled from (temperature, top-p); greedy returns
    the unscaled model's log-prob of the argmax (see `tether.rollout.base`). `uniform`: each
    row's (B,) random number, as in `sample_categorical`.
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / temperature if temperature != 1 else logits
    if top_p < 1:
        scaled = top_p_filter(scaled, top_p)
    return sample_categorical(scaled, generator, uniform=uniform)


def _eos_ids(model: Any, tokenizer: Any, extra: tuple[int, ...] | None) -> list[int]:
    ids = {tokenizer.eos_token_id, *(extra or ())}
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(config_eos if isinstance(config_eos, (list, tuple)) else [config_eos])
    return sorted(i for i in ids if i is not None)


def completion_texts(
    tokenizer: Any,
    ids: list[list[int]],
    lengths: list[int],
    stopped: list[bool],
    stop_ids: set[int],
    stop_strings: tuple[str, ...],
) -> list[str]:
    """Completion texts as rewards see them: the first `length` ids of each row, the stop token
    dropped, decoded without special tokens, cut before the first stop string (every engine's)."""
    texts = []
    for row, length, stop in zip(ids, lengths, stopped):
        row = row[:length]
        if stop and row and row[-1] in stop_ids:
            row = row[:-1]
        text = tokenizer.decode(row, skip_special_tokens=True)
        for s in stop_strings:
            cut = text.find(s)
            if cut != -1:
                text = text[:cut]
        texts.append(text)
    return texts


class _EagerDecoder:
    """Decode steps on the prefill's dynamic cache, every op launched from Python (module docstring).

    The protocol `tether.rollout.static.StaticDecoder` shares: `start`, `resize`, `select`, `step`.
    """

    def __init__(self, model: Any):
        self.model = model

    def start(self, cache: Any, attention: torch.Tensor, prompt_len: int, length: int) -> None:
        self.cache, self.attention, self.columns = cache, attention, prompt_len  # (B, P + new tokens) padding mask

    def resize(self, running: int, rows: int) -> int | None:
        """Drop finished rows once at most half of the decoded rows are running (None: keep all)."""
        return running if running <= rows // 2 and hasattr(self.cache, "batch_select_indices") else None

    def select(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep)
        self.attention = self.attention[keep]

    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """(S, 1) next tokens and their positions -> (S, V) logits; the cache grows one column."""
        self.columns += 1
        out = self.model(
            input_ids=input_ids,
            attention_mask=self.attention[:, : self.columns],
            position_ids=position_ids,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache = out.past_key_values
        return out.logits[:, -1]


class HFEngine(PromptsOrIds):
    """Batched sampling from a Hugging Face causal LM with the KV cache (module docstring).

    Args:
        model: a causal LM; generation runs on its device, in eval mode (restored afterwards).
        tokenizer: its tokenizer; needs a pad token (see `tether.model.loading.prepare_tokenizer`).
        batch_size: rows (prompts x samples) per forward; None means all at once.
        add_special_tokens: passed to the tokenizer when encoding prompts.
        compile: decode with a static KV cache and a compiled step (`tether.rollout.static`):
            "auto" (the default) on CUDA when the model supports it, eager elsewhere; True
            always (an error, with the reason, for a model that cannot); False never.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        batch_size: int | None = None,
        add_special_tokens: bool = False,
        compile: bool | Literal["auto"] = "auto",
    ):
        if tokenizer.pad_token_id is None:
            raise ValueError("tokenizer has no pad token; load it with tether.model.loading.load_model or set one")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        if compile not in (True, False, "auto"):
            raise ValueError(f"compile must be true, false or 'auto', got {compile!r}")
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.add_special_tokens, self.compile = batch_size, add_special_tokens, compile
        self._static: StaticDecoder | None = None  # the model's, once used (it holds the graphs and caches)
        self._static_reason = static_decode_reason(model) if compile == "auto" else None

    def _sample(
        self, rows: list[list[int]], prompt_index: list[int], params: SamplingParams, seed: int | None
    ) -> RolloutBatch:
        device = self.model.device
        generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
        size = self.batch_size or len(rows)
        with eval_mode(self.model), torch.inference_mode(), compile_limits():
            chunks = [self._generate_chunk(rows[s : s + size], params, generator) for s in range(0, len(rows), size)]
        return self._assemble(rows, prompt_index, chunks, params)

    def _generate_chunk(
        self, rows: list[list[int]], params: SamplingParams, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode one chunk; returns tokens (B, S), log-probs (B, S), lengths (B,), stopped (B,)."""
        device, pad = self.model.device, self.tokenizer.pad_token_id
        batch, plen, steps = len(rows), max(len(r) for r in rows), params.max_new_tokens
        input_ids, prompt_mask, positions = left_pad(rows, pad)  # (B, P) each
        attention = torch.cat([prompt_mask, torch.ones((batch, steps), dtype=torch.long)], 1)
        input_ids, attention, positions = input_ids.to(device), attention.to(device), positions.to(device)
        out = self._prefill(input_ids, attention[:, :plen], positions)
        logits = out.logits[:, -1, :]  # (B, V)
        decoder = self._decoder(device)
        decoder.start(out.past_key_values, attention, plen, plen + steps)
        del out
        stop_ids = torch.tensor(_eos_ids(self.model, self.tokenizer, params.stop_token_ids), device=device)
        tokens = torch.full((batch, steps), pad, dtype=torch.long, device=device)
        logprobs = torch.zeros((batch, steps), dtype=torch.float32, device=device)
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        next_pos = positions[:, -1:] + 1  # (B, 1)
        live = torch.arange(batch, device=device)  # the rows the model still runs (some may be finished)
        for t in range(steps):
            # one number per row of the chunk, live or not: a row's draws do not depend on which
            # rows the decoder runs, so both decoders sample the same tokens from the same logits
            uniform = torch.rand(batch, generator=generator, dtype=torch.float64, device=device)[live]
            token, logprob = sample_tokens(logits, params.temperature, params.top_p, generator, uniform)
            done = finished[live]
            token = token.masked_fill(done, pad)
            tokens[live, t], logprobs[live, t] = token, logprob.masked_fill(done, 0.0)
            lengths = torch.where(finished, lengths, t + 1)
            stopped = ~finished & torch.isin(tokens[:, t], stop_ids)
            if params.stop_strings:
                stopped |= self._hit_stop_string(tokens[:, : t + 1], finished, params.stop_strings)
            finished |= stopped
            if t + 1 == steps:
                break
            running = ~finished[live]
            n_running = int(running.sum())  # the step's one host sync
            if n_running == 0:
                break
            size = decoder.resize(n_running, len(live))
            if size is not None:  # finished rows leave the batch; finished ones fill a bucket up
                keep = torch.cat([running.nonzero(), (~running).nonzero()[: size - n_running]]).squeeze(1).sort().values
                decoder.select(keep)
                live, token, next_pos = live[keep], token[keep], next_pos[keep]
            logits = decoder.step(token[:, None], next_pos)
            next_pos = next_pos + 1
        return tokens[:, : t + 1], logprobs[:, : t + 1], lengths, finished

    def decode_path(self, device: torch.device) -> str:
        """One line saying how `generate` decodes on `device`, and why (for a log)."""
        if self.compile is False:
            return "eager decode (compile=false)"
        if self.compile == "auto" and device.type != "cuda":
            return f"eager decode (compile=auto on {device.type}; compiled only on CUDA)"
        if self.compile == "auto" and self._static_reason is not None:
            return f"eager decode (compile=auto: {self._static_reason})"
        return "compiled decode (static KV cache" + (", CUDA graphs)" if device.type == "cuda" else ", inductor)")

    def _decoder(self, device: torch.device) -> "_EagerDecoder | StaticDecoder":
        """The compiled decoder where it is on (see `compile`), else a fresh eager one."""
        on = self.compile if self.compile != "auto" else device.type == "cuda" and self._static_reason is None
        if not on:
            return _EagerDecoder(self.model)
        self._static = StaticDecoder.of(self.model)  # raises with the reason when it cannot run
        return self._static

    def _prefill(self, input_ids, attention, positions):
        """The prompts' forward, each distinct prompt once: its cache and last logits are then
        copied to the rows that repeat it (the n samples of a prompt share it)."""

        def forward(rows=slice(None)):
            return self.model(
                input_ids=input_ids[rows],
                attention_mask=attention[rows],
                position_ids=positions[rows],
                use_cache=True,
                logits_to_keep=1,
            )

        groups = prompt_groups(input_ids, attention, input_ids.shape[1])
        if groups is None:
            return forward()
        first, inverse = groups
        out = forward(first)
        if not hasattr(out.past_key_values, "reorder_cache"):  # a legacy cache: prefill every row
            return forward()
        out.past_key_values.reorder_cache(inverse)
        out.logits = out.logits.index_select(0, inverse)
        return out

    def _hit_stop_string(self, tokens: torch.Tensor, finished: torch.Tensor, stops: tuple[str, ...]) -> torch.Tensor:
        """(B,) bool: active rows whose last few decoded tokens contain a stop string.

        The window spans as many tokens as the longest stop string has characters, plus slack;
        checking every step means a stop string is found on the step that completes it.
        """
        window = max(len(s) for s in stops) + 2
        active = (~finished).nonzero().squeeze(-1).tolist()
        texts = self.tokenizer.batch_decode(tokens[active, -window:].tolist(), skip_special_tokens=True)
        hit = torch.zeros_like(finished)
        for row, text in zip(active, texts):
            if any(s in text for s in stops):
                hit[row] = True
        return hit

    def _assemble(
        self,
        rows: list[list[int]],
        prompt_index: list[int],
        chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
        params: SamplingParams,
    ) -> RolloutBatch:
        pad = self.tokenizer.pad_token_id
        width = max(c[0].shape[1] for c in chunks)  # = the longest completion: a chunk stops when all rows have
        ids = torch.cat([torch.nn.functional.pad(c[0], (0, width - c[0].shape[1]), value=pad) for c in chunks])
        logprobs = torch.cat([torch.nn.functional.pad(c[1], (0, width - c[1].shape[1])) for c in chunks])
        lengths = torch.cat([c[2] for c in chunks])
        stopped = torch.cat([c[3] for c in chunks]).tolist()
        mask = torch.arange(width, device=ids.device)[None, :] < lengths[:, None]  # (N, T)
        stop_ids = set(_eos_ids(self.model, self.tokenizer, params.stop_token_ids))
        completions = completion_texts(
            self.tokenizer, ids.tolist(), lengths.tolist(), stopped, stop_ids, params.stop_strings
        )
        reasons: list[FinishReason] = ["stop" if s else TRUNCATED for s in stopped]
        return RolloutBatch(
            prompt_ids=[list(r) for r in rows],
            completion_ids=ids,
            sampler_logprobs=logprobs,
            mask=mask,
            finish_reasons=reasons,
            completions=completions,
            prompt_index=prompt_index,
        )
