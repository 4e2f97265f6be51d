"""A Hugging Face causal LM as per-token log-probs: the model plumbing shared by the trainer and
the rollout engine.

A rollout row is [left-padded prompt (P) | right-padded completion (T)] (`Tokens`, `left_pad`):
prompts are padded on the left so that every row's last prompt token sits in column P - 1 and
position ids count real tokens only (a row's first real token has position 0, whatever its
padding). The token at column P + t is predicted from position P - 1 + t:

    log pi(o_t | q, o_<t) = log_softmax(W h_{P-1+t} / tau)[o_t]

with h the decoder body's final hidden states, W the output embedding and tau the sampling
temperature. `causal_lm_token_logprobs` computes it through `tether.model.ops`' fused head when the
model's head is a plain bias-free linear layer (checked once per model against its own logits,
`fused_head_reason`), and through the model's own logits otherwise.

Shared prompts (`LogProbSettings.share_prompts`, the trainer's `trainer.share_prompts`). GRPO scores G completions
of every prompt, and a causal model's states at the prompt's positions do not depend on what
follows them. So the decoder runs once per distinct prompt (U rows instead of N), its key/value
cache is copied out to the N rows with `index_select`, and the completion columns run on top of
that cache. Autograd's backward of the copy sums the N rows' gradients into their prompt's, so
log-probs, entropies and gradients equal the unshared ones up to float rounding: the same
arithmetic, with the prompt part done U instead of N times (the idea of Prefix Grouper,
arXiv 2506.05433). Where this departs from that paper: instead of a grouped attention kernel
that lets the suffixes read one shared prefix, the prefix's keys and values are copied to each
row (G x the prompt's K/V memory per layer) and a stock Hugging Face model attends through its
own cache, so any model with a plain cache works unmodified. It applies to the fused path when
some rows share a prompt, the model's cache is a plain `DynamicCache` and gradient checkpointing
is off (HF turns the cache off with it); a one-off comparison with the unshared forward on the
first call guards against models whose cached forward differs (the reason is then in
`shared_prompt_reason`, and the unshared path is used).

Departures: none from the math above; the fused path and the shared prompts are exact up to
float rounding (tests/model/test_fused_head.py, tests/model/test_shared_prompts_are_exact.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence

import torch
from jaxtyping import Float, Int, Shaped
from torch import Tensor

from . import packing as _packing
from .head import CompletionHead
from .probes import Probed, disagreement


# ---------------------------------------------------------------- left padding and rollout tensors


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-id lists as a left-padded batch: (ids (B, P), mask (B, P), positions (B, P)), long,
    P the longest row. Positions count real tokens from 0 (padding gets 0)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row):
            ids[i, width - len(row) :] = torch.as_tensor(row, dtype=torch.long)
            mask[i, width - len(row) :] = 1
    return ids, mask, positions(mask)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a (left-padded) attention mask: real tokens count from 0, padding gets 0."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


@dataclass
class Tokens:
    """A rollout as model inputs: [left-padded prompt (P) | right-padded completion (T)]."""

    input_ids: Int[Tensor, "N L"]  # L = P + T
    attention_mask: Shaped[Tensor, "N L"]
    position_ids: Int[Tensor, "N L"]
    completion_ids: Int[Tensor, "N T"]
    loss_mask: Float[Tensor, "N T"]  # 1 for the tokens that count (`trainer.step.tokens_for_update`)
    prompt_len: int

    def select(self, idx: torch.Tensor) -> "Tokens":
        return Tokens(
            self.input_ids[idx],
            self.attention_mask[idx],
            self.position_ids[idx],
            self.completion_ids[idx],
            self.loss_mask[idx],
            self.prompt_len,
        )


def to_tokens(rollout, pad_id: int, device: torch.device) -> Tokens:
    """A rollout's prompts (left-padded, `left_pad`) and completions as model inputs on `device`: attention over
    every real token, the loss mask (`Tokens.loss_mask`) over the tokens the policy sampled (`policy_tokens`)."""
    prompt, prompt_mask, _ = left_pad(rollout.prompt_ids, pad_id)
    completion = rollout.completion_ids.cpu()
    mask = rollout.mask.cpu().long()  # every real token: the model reads an environment's tokens too
    trained = rollout.policy_tokens.cpu().long()  # the loss counts only the policy's own
    input_ids = torch.cat([prompt, completion], 1)
    attention = torch.cat([prompt_mask, mask], 1)
    return Tokens(
        input_ids.to(device),
        attention.to(device),
        positions(attention).to(device),
        completion.to(device),
        trained.to(device=device, dtype=torch.float32),
        prompt.shape[1],
    )


@dataclass(frozen=True)
class LogProbSettings:
    """How the trainer's log-prob passes run (old policy, reference, update), built once from the
    config (`of`) and passed down whole. The defaults are the config's."""

    temperature: float = 1.0  # rollout.temperature: logits / T, as the sampler drew them (0: 1)
    micro_batch_size: int = 64  # trainer.micro_batch_size: rows per forward of `batched_logprobs`
    fused: bool = True  # trainer.fused_logprobs: the chunked head of tether.model.ops (else the model's logits)
    chunk_size: Optional[int] = None  # trainer.logprob_chunk_size: tokens per head tile (None: tile_shape's)
    share_prompts: bool = True  # trainer.share_prompts: rows with the same prompt run it once
    pack: bool = False  # trainer.packing: each forward runs its rows' real tokens only (tether.model.packing)
    micro_batch_tokens: int = 0  # trainer.micro_batch_tokens: real tokens per forward (0: micro_batch_size rows)
    pack_width: int = 512  # trainer.pack_width: tokens per packed row (at least the longest row)

    @classmethod
    def of(cls, trainer: Any, rollout: Any) -> "LogProbSettings":
        """The settings a run's `TrainerConfig` and `RolloutConfig` (tether.config.sections) name."""
        return cls(
            rollout.temperature,
            trainer.micro_batch_size,
            trainer.fused_logprobs,
            trainer.logprob_chunk_size,
            trainer.share_prompts,
            trainer.packing,
            trainer.micro_batch_tokens,
            trainer.pack_width,
        )


@dataclass(frozen=True)
class Precision:
    """How a run's forward passes run, resolved once from `trainer.autocast` and the device: bf16 autocast
    (`bf16`, auto: on CUDA only) or the weights' dtype. Calling it gives a new autocast context (autocast
    is per thread, so the overlap's sampler thread enters its own)."""

    device_type: str  # "cpu", "cuda", ...
    bf16: bool

    @classmethod
    def of(cls, autocast: str, device: torch.device) -> "Precision":
        """`trainer.autocast` (auto, bf16, off) on `device`."""
        return cls(device.type, autocast == "bf16" or (autocast == "auto" and device.type == "cuda"))

    def __call__(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.bf16)


def token_logprobs(model, tokens: Tokens, settings: LogProbSettings = LogProbSettings(), with_entropy: bool = True):
    """log pi(o_t | h) (N, T) and, optionally, the per-token entropy (N, T); 0 at padding.

    With `settings.fused`, the LM head runs chunked (tether.model.ops) and the (N, T, V) logits never
    exist; otherwise (or for a head that cannot be fused) the model's own logits are used. With
    `settings.share_prompts`, rows with the same prompt run it once (module docstring; exact up to rounding).
    """
    lp, ent, _ = causal_lm_token_logprobs(model, tokens, settings, with_entropy)
    return lp, ent


@torch.no_grad()
def batched_logprobs(model, tokens: Tokens, settings: LogProbSettings = LogProbSettings()) -> torch.Tensor:
    """log pi(o_t | h) (N, T) without gradient, `settings.micro_batch_size` rows per forward."""
    parts, order = _forwards(tokens, settings)
    return torch.cat([token_logprobs(model, part, settings, with_entropy=False)[0] for part in parts])[order]


@torch.no_grad()
def batched_topk(
    model, tokens: Tokens, settings: LogProbSettings, k: int
) -> tuple[torch.Tensor, Optional[tuple[torch.Tensor, torch.Tensor]]]:
    """(log pi(o_t | h) (N, T), and with k > 0 the K largest log-probs and their ids at each counted position, each
    (N, T, K), else None) without gradient, in the forwards of `packing.forward_rows` (`head_pass`)."""
    parts, order = _forwards(tokens, settings)
    passes = [head_pass(model, part, settings, with_entropy=False, topk=k) for part in parts]
    lp = torch.cat([p.logprobs for p in passes])[order]
    if not k:
        return lp, None
    return lp, (torch.cat([p.topk[0] for p in passes])[order], torch.cat([p.topk[1] for p in passes])[order])


@torch.no_grad()
def batched_logprobs_and_top(
    model, tokens: Tokens, k: int, settings: LogProbSettings = LogProbSettings()
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`batched_logprobs` and, from the same forwards, each position's k most probable tokens
    (`CompletionHead.top`): (logprobs (N, T), ids (N, T, k) int32, their log-probs (N, T, k) float32), ids and
    log-probs 0 where `tokens.loss_mask` is 0. Memory: (N, T, k), never (N, T, V) (the fused head's tiles, or one
    forward's logits for a head that cannot be fused)."""
    lps, ids, tops = [], [], []
    parts, order = _forwards(tokens, settings)
    for part in parts:
        head = completion_head(model, part, settings)
        lps.append(head.logprobs(part.completion_ids)[0])
        i, v = head.top(k)
        ids.append(i.to(torch.int32))
        tops.append(v)
    return torch.cat(lps)[order], torch.cat(ids)[order], torch.cat(tops)[order]


def _forwards(tokens: Tokens, settings: LogProbSettings) -> tuple[list[Tokens], torch.Tensor]:
    """The batch cut into forwards (`packing.forward_rows`) and the permutation that puts their concatenated results
    back in the batch's row order."""
    rows = _packing.forward_rows(tokens, settings)
    return [tokens.select(idx) for idx in rows], torch.argsort(torch.cat(rows))


@contextlib.contextmanager
def eval_mode(model):
    """Run a block with the model in eval mode (no dropout), then restore the mode it had."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


# ---------------------------------------------------------------- the model: fused head, shared prompts

# Config fields of transformers models that transform the logits after the head
# (Gemma 2/3 soft-capping, Cohere's logit_scale, Granite's logits_scaling, Falcon-H1's multiplier).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")
_PROBED = Probed()
_SHARE_PROBED = Probed()


def fused_head_reason(model: Any) -> str:
    """Why the fused op cannot stand in for this model's head, or "" when it can.

    The output embedding must be a bias-free `nn.Linear` and the config must name no logit
    scaling or soft-capping; after `causal_lm_token_logprobs` has run once on the model, this also
    reports the result of its one-off comparison of the model's logits with hidden @ weight.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:
        return f"output head is {type(head).__name__}, not a plain nn.Linear"
    if head.bias is not None:
        return "output head has a bias"
    configs = [getattr(model, "config", None)]
    if configs[0] is not None and hasattr(configs[0], "get_text_config"):
        configs.append(configs[0].get_text_config())
    for cfg in configs:
        for name in _LOGIT_TRANSFORMS:
            value = getattr(cfg, name, None)
            if value is not None and value != 1.0:
                return f"config.{name}={value} transforms the logits"
    if _decoder(model) is model:
        return "no separate decoder body (get_decoder() returns the model itself)"
    return _PROBED.reason(model)


def _decoder(model: Any) -> Any:
    body = model.get_decoder() if hasattr(model, "get_decoder") else None
    return body if body is not None else getattr(model, "base_model", model)


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int):
    """(first (U,), inverse (N,)): rows whose first `start` columns (ids and mask) are identical
    share a prompt; `first` holds one row of each distinct prompt and row i's prompt is
    first[inverse[i]]. None when no two rows share a prompt."""
    key = torch.cat([input_ids[:, :start], attention_mask[:, :start].to(input_ids.dtype)], 1)
    distinct, inverse = torch.unique(key, dim=0, return_inverse=True)
    n, u = key.shape[0], distinct.shape[0]
    if u == n:
        return None
    rows = torch.arange(n, device=key.device)
    first = torch.full((u,), n, dtype=torch.long, device=key.device).scatter_reduce(0, inverse, rows, "amin")
    return first, inverse


def _cache_reason(cache: Any) -> str:
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if type(cache) is not DynamicCache:
        return f"the model's cache is {type(cache).__name__}, not a plain DynamicCache"
    odd = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
    return f"the model's cache has {sorted(odd)} layers, not only DynamicLayer" if odd else ""


def _hidden(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    start: int,
    groups=None,
) -> tuple[torch.Tensor, str]:
    """The decoder body's final hidden states at columns start - 1 .. L - 1 (N, L - start + 1, H).

    With `groups` (from `prompt_groups`), each distinct prompt runs once and the completion
    columns run on its copied cache (module docstring). Returns (hidden, reason): reason is ""
    when the groups were used, else why not (the unshared forward was then run)."""
    body = _decoder(model)
    if groups is not None:
        first, inverse = groups
        pre = body(
            input_ids=input_ids[first, :start],
            attention_mask=attention_mask[first, :start],
            position_ids=position_ids[first, :start],
            use_cache=True,
        )
        reason = _cache_reason(pre.past_key_values)
        if not reason:
            last = pre.last_hidden_state[:, -1:].index_select(0, inverse)  # (N, 1, H): predicts column start
            if input_ids.shape[1] == start:
                return last, ""
            cache = pre.past_key_values
            cache.reorder_cache(inverse)  # (U, ...) -> (N, ...) per layer, through autograd
            rest = body(
                input_ids=input_ids[:, start:],
                attention_mask=attention_mask,
                position_ids=position_ids[:, start:],
                past_key_values=cache,
                use_cache=True,
            )
            return torch.cat([last, rest.last_hidden_state], 1), ""
    else:
        reason = "no two rows share a prompt"
    out = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state[:, start - 1 :], reason


def shared_prompt_reason(model: Any) -> str:
    """Why prompts are not shared for this model, or "" when they are (or it has not run yet)."""
    if getattr(model, "is_gradient_checkpointing", False):
        return "gradient checkpointing is on (Hugging Face models then run without a cache)"
    return _SHARE_PROBED.reason(model)


@torch.no_grad()
def _share_probe(model: Any, input_ids, attention_mask, position_ids, start: int, groups) -> str:
    """Compare the shared and unshared forward on one shared prompt's rows (once per model, `probes`)."""

    def compare() -> str:
        _, inverse = groups
        rows = (inverse == int(torch.bincount(inverse).argmax())).nonzero().flatten()[:4]
        sub = [x[rows] for x in (input_ids, attention_mask, position_ids)]
        with eval_mode(model):
            ours, reason = _hidden(model, *sub, start, prompt_groups(sub[0], sub[1], start))
            if reason:
                return reason
            plain, _ = _hidden(model, *sub, start)
        keep = sub[1][:, start - 1 :].bool()
        keep[:, 0] = True  # the last prompt position always predicts
        return disagreement(ours, plain, keep, model.dtype, "the cached forward differs from the full one")

    return _SHARE_PROBED.once(model, compare)


@torch.no_grad()
def _probe(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> str:
    """Compare the model's logits with body @ head.weight on a few tokens of one row (once per model, `probes`)."""

    def compare() -> str:
        row = input_ids[0][attention_mask[0] != 0][:8][None]  # (1, k) real tokens of the first row
        positions = torch.arange(row.shape[1], device=row.device)[None]
        args = dict(input_ids=row, attention_mask=torch.ones_like(row), position_ids=positions, use_cache=False)
        with eval_mode(model):  # no dropout in the comparison
            logits = model(**args).logits.float()
            h = _decoder(model)(**args).last_hidden_state.float()
            ours = h @ model.get_output_embeddings().weight.float().t()
        return disagreement(ours, logits, None, model.dtype, "model logits differ from hidden @ head.weight")

    return _PROBED.once(model, compare)


class HeadPass(NamedTuple):
    """What one forward of a causal LM gives (`head_pass`): the sampled tokens' log-probs and entropy, whether the
    fused head ran, and on request the K largest log-probs at each position or the log-probs of given tokens."""

    logprobs: torch.Tensor  # (N, T)
    entropy: Optional[torch.Tensor]  # (N, T) or None
    fused: bool
    topk: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (values, ids), each (N, T, K), no gradient
    gathered: Optional[torch.Tensor] = None  # (N, T, K) log-probs of `gather_ids`, with gradient


def causal_lm_token_logprobs(
    model: Any, tokens: Tokens, settings: LogProbSettings = LogProbSettings(), with_entropy: bool = True
) -> tuple[torch.Tensor, Optional[torch.Tensor], bool]:
    """log pi(targets) (N, T), entropy (N, T) and whether the fused head ran: `head_pass`'s first three."""
    return head_pass(model, tokens, settings, with_entropy)[:3]


def head_pass(
    model: Any,
    tokens: Tokens,
    settings: LogProbSettings = LogProbSettings(),
    with_entropy: bool = True,
    topk: int = 0,
    gather_ids: Optional[torch.Tensor] = None,
) -> HeadPass:
    """log pi(targets) (N, T) and entropy (N, T) of a causal LM, through the fused head when possible; with `topk`
    > 0 also the K largest log-probs at each counted position, with `gather_ids` (N, T, K) the log-probs of those
    tokens, with gradient (`CompletionHead.top` and `.logprobs`: in tiles, never the (N, T, V) logits on the fused
    path).

    The token at column `start + t` of `tokens.input_ids` (N, P + T) is predicted from position
    `start - 1 + t`, with start = `tokens.prompt_len` (>= 1) and the targets `tokens.completion_ids`
    (N, T); logits are divided by `settings.temperature` unless it is 0 or 1. Where `tokens.loss_mask` is
    0 the head is skipped and log-prob and entropy are 0 (an all-ones mask scores every column).
    `settings.fused=False` forces the model's own logits; `settings.share_prompts` runs each distinct
    prompt once when rows share it (module docstring; fused path only, exact up to rounding);
    `settings.chunk_size`: tokens per head chunk (None: see `token_logprobs_and_entropy`).

    Returns:
        `HeadPass`: log-probs (N, T) float32, entropy (N, T) float32 or None, `fused` False when the model's head could
        not be fused (see `fused_head_reason`) and its logits were used, and the top-k or gathered log-probs asked for.
    """
    head = completion_head(model, tokens, settings)
    lp, ent = head.logprobs(tokens.completion_ids, with_entropy)
    top = None
    if topk:
        ids, values = head.top(topk)
        top = (values, ids)
    got = None if gather_ids is None else head.logprobs(gather_ids)[0]
    return HeadPass(lp, ent, head.fused, top, got)


def completion_head(model: Any, tokens: Tokens, settings: LogProbSettings = LogProbSettings()) -> CompletionHead:
    """The model run on `tokens` up to its head (`CompletionHead`): through the fused head's inputs when the model
    allows it (`fused_head_reason`, `settings.fused`), with shared prompts (`settings.share_prompts`), else the
    model's own logits (`causal_lm_token_logprobs` says what is computed where)."""
    start, T = tokens.prompt_len, tokens.completion_ids.shape[1]
    if start < 1:
        raise ValueError(f"start must be >= 1 (the first target is predicted from position start - 1), got {start}")
    tau = settings.temperature if settings.temperature > 0 else 1.0
    # Columns after start - 2 + T predict nothing that is scored (the last is always one of them):
    # a causal model's outputs at earlier positions do not depend on them, so they are not run.
    end = start - 1 + T
    inputs = (tokens.input_ids[:, :end], tokens.attention_mask[:, :end], tokens.position_ids[:, :end])
    mask = tokens.loss_mask != 0
    if settings.fused and not fused_head_reason(model) and not _probe(model, *inputs[:2]):
        body = _decoder(model)
        if settings.pack and not _packing.probe(model, body, *inputs, start):
            hidden = _packing.packed_hidden(body, *inputs, start, settings.share_prompts, settings.pack_width)
        else:
            groups = _shared_groups(model, inputs, start) if settings.share_prompts else None
            hidden, _ = _hidden(model, *inputs, start, groups)  # (N, T, H)
        weight = model.get_output_embeddings().weight
        return CompletionHead(mask, tau, settings.chunk_size, hidden=hidden, weight=weight)
    return CompletionHead(mask, tau, settings.chunk_size, logits=_model_logits(model, inputs, T, tau))


def _shared_groups(model: Any, inputs: tuple[torch.Tensor, ...], start: int):
    """`prompt_groups` of the rows when this model shares prompts (its one-off check passed), else None."""
    if shared_prompt_reason(model):
        return None
    groups = prompt_groups(inputs[0], inputs[1], start)
    if groups is not None and _share_probe(model, *inputs, start, groups):
        return None
    return groups


def _model_logits(model: Any, inputs: tuple[torch.Tensor, ...], T: int, tau: float) -> torch.Tensor:
    """The model's own logits at the T completion positions, in float32 or wider (a float64 model's stay float64)
    and divided by tau (N, T, V)."""
    args = dict(input_ids=inputs[0], attention_mask=inputs[1], position_ids=inputs[2], use_cache=False)
    try:  # the head on the completion positions only
        logits = model(**args, logits_to_keep=T).logits
    except TypeError:  # a model without logits_to_keep
        logits = model(**args).logits[:, -T:]
    wide = torch.promote_types(logits.dtype, torch.float32)
    return logits.to(wide) / tau  # (N, T, V): positions start - 1 .. start - 2 + T
