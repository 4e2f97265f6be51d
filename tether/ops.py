"""Fused, chunked token log-probs and entropy: the LM head without the (N, T, V) logits.

For hidden states h_t (H,), head weight W (V, H), target y_t and temperature tau, with
z_t = W h_t / tau (V,) the scaled logits:

    log p_t(y_t) = z_t[y_t] - lse_t,                 lse_t = logsumexp_v z_t[v]
    H_t          = -sum_v p_t[v] log p_t[v] = lse_t - sum_v p_t[v] z_t[v]

Gradients with respect to the logits, for upstream gradients g_t (of log p) and e_t (of H):

    d log p_t(y) / d z_t[v] = 1[v = y] - p_t[v]
    d H_t / d z_t[v]        = -p_t[v] (log p_t[v] + H_t)
    G_t[v]                  = g_t 1[v = y_t] - p_t[v] (g_t + e_t (log p_t[v] + H_t))

and then dL/dh_t = W^T G_t / tau, dL/dW = sum_t G_t h_t^T / tau. The naive computation keeps the
(N, T, V) logits, log-softmax, probabilities and their gradients alive at once; for a
151,936-token vocabulary that is 0.6 MB per token per copy in float32. Here tokens are processed
in chunks of C rows: the forward keeps only lse_t and H_t per token (8 bytes), the backward
recomputes each chunk's logits, so no more than two (C, V) float32 buffers exist at a time.

Where this departs from the naive `log_softmax` path:
1. The backward recomputes the logits: four (tokens x V x H) matmuls instead of three, so the
   head costs about a third more FLOPs in exchange for O(C V) instead of O(N T V) memory.
2. Everything is computed in float32 (float64 for float64 inputs), whatever the input dtype: a bfloat16 hidden chunk is
   upcast before its matmul and a bfloat16 weight once per call (a (V, H) float32 copy). This is
   more precise than a bfloat16 head whose logits are rounded before the softmax, so results
   differ from that path by bfloat16 rounding. Gradients come back in the inputs' dtypes.
3. The temperature scales the hidden chunk (C, H) instead of the logits (C, V): cheaper, equal
   up to float rounding.
4. Targets equal to `ignore_index` skip the head altogether and give log-prob 0 and entropy 0
   (and no gradient), where the naive path computes values that a loss mask then discards.
5. Only a plain linear head is fused: no bias, no logit scaling or soft-capping.
   `causal_lm_token_logprobs` checks the model and otherwise falls back to the model's own logits.

Shared prompts (`causal_lm_token_logprobs(..., share_prompts=True)`). GRPO scores G completions
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
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

IGNORE_INDEX = -100
# Bytes of one (C, V) float32 buffer when chunk_size is None: C = this / (4 V), e.g. 441 rows
# for a 151,936-token vocabulary and every row at once for a 100-character vocabulary.
DEFAULT_CHUNK_BYTES = 256 * 2**20


def auto_chunk_size(rows: int, vocab: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Rows per chunk so that one (C, V) float32 buffer takes about `chunk_bytes`."""
    return max(1, min(rows, chunk_bytes // (4 * vocab)))


def _acc_dtype(*xs: torch.Tensor) -> torch.dtype:
    """float32, or float64 when an input is float64 (so float64 tests can be tight)."""
    return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32


def _chunk_forward(h, w, targets, z, p, with_entropy: bool):
    """lse (C,), log p(targets) (C,) and entropy (C,) or None of one chunk; z and p are scratch.

    h: (C, H), already divided by the temperature; w: (V, H); z, p: (C, V); one float dtype.
    With z' = z - max z and S = sum exp z': lse = max z + log S, log p(y) = z'_y - log S and
    H = log S - sum exp(z') z' / S. Five passes over (C, V) after the matmul.
    """
    torch.mm(h, w.t(), out=z)  # (C, V) scaled logits
    m = z.amax(-1)
    z.sub_(m[:, None])
    total = torch.exp(z, out=p).sum(-1)
    log_total = total.log()
    lp = z.gather(1, targets[:, None]).squeeze(1) - log_total
    ent = log_total - p.mul_(z).sum(-1) / total if with_entropy else None
    return m + log_total, lp, ent


class _FusedHead(torch.autograd.Function):
    """(hidden (M, H), weight (V, H), targets (M,)) -> (logprobs (M,), entropy (M,) or empty)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp: float, chunk: int, with_entropy: bool):
        M, V = hidden.shape[0], weight.shape[0]
        acc = _acc_dtype(hidden, weight)
        w = weight.to(acc)
        lse = hidden.new_empty(M, dtype=acc)
        lp = torch.empty_like(lse)
        ent = torch.empty_like(lse) if with_entropy else lse.new_empty(0)
        z = lse.new_empty(min(chunk, M), V)
        p = torch.empty_like(z)
        for s in range(0, M, chunk):
            e = min(s + chunk, M)
            c_lse, c_lp, c_ent = _chunk_forward(hidden[s:e].to(acc) * inv_temp, w, targets[s:e],
                                                z[: e - s], p[: e - s], with_entropy)
            lse[s:e], lp[s:e] = c_lse, c_lp
            if with_entropy:
                ent[s:e] = c_ent
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.inv_temp, ctx.chunk, ctx.with_entropy = inv_temp, chunk, with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        inv_temp, chunk = ctx.inv_temp, ctx.chunk
        use_ent = ctx.with_entropy and g_ent is not None
        if g_lp is None and not use_ent:
            return None, None, None, None, None, None
        M, V = hidden.shape[0], weight.shape[0]
        acc = lse.dtype
        w = weight.to(acc)
        g_lp = lse.new_zeros(M) if g_lp is None else g_lp.to(acc)
        if use_ent:  # G = g 1[v=y] - p (e log p + (g + e H)): the row constant once per token
            g_ent = g_ent.to(acc)
            const = g_lp + g_ent * ent
        grad_h = hidden.new_empty(hidden.shape, dtype=acc) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
        z = lse.new_empty(min(chunk, M), V)
        p = torch.empty_like(z)
        for s in range(0, M, chunk):
            e = min(s + chunk, M)
            zc, pc = z[: e - s], p[: e - s]
            h = hidden[s:e].to(acc) * inv_temp  # (C, H)
            torch.mm(h, w.t(), out=zc)
            zc.sub_(lse[s:e, None])  # log p
            torch.exp(zc, out=pc)
            g = g_lp[s:e, None]
            if use_ent:  # -p (e log p + const), in z's buffer
                grad = zc.mul_(-g_ent[s:e, None]).sub_(const[s:e, None]).mul_(pc)
            else:  # -p g
                grad = pc.mul_(-g)
            grad.scatter_add_(1, targets[s:e, None], g)
            if grad_h is not None:
                torch.mm(grad, w, out=grad_h[s:e]).mul_(inv_temp)
            if grad_w is not None:
                grad_w.addmm_(grad.t(), h)  # h carries the 1/tau already
        grad_h = None if grad_h is None else grad_h.to(hidden.dtype)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None


def token_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    with_entropy: bool = True,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log-probs of `targets` and entropies under softmax(hidden @ weight.T / temperature).

    Never holds more than two (chunk_size, V) float32 buffers; exact gradients for `hidden` and
    `weight` (module docstring).

    Args:
        hidden: (N, T, H) final hidden states (any float dtype).
        weight: (V, H) the LM head's weight.
        targets: (N, T) token ids; `ignore_index` marks tokens to skip (log-prob and entropy 0).
        temperature: > 0; logits are divided by it.
        chunk_size: tokens per chunk; None sizes a (chunk, V) float32 buffer to 256 MiB.
        with_entropy: also return the entropy (its gradient flows too).

    Returns:
        logprobs (N, T) and entropy (N, T) (or None without `with_entropy`), float32, or float64
        when an input is float64.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hidden.dim() != 3 or targets.shape != hidden.shape[:2] or weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(f"expected hidden (N, T, H), weight (V, H), targets (N, T); got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(targets.shape)}")
    N, T, H = hidden.shape
    flat_t = targets.reshape(-1)
    keep = flat_t != ignore_index
    all_kept = bool(keep.all())
    rows = hidden.reshape(N * T, H)  # (M, H)
    idx = None
    if not all_kept:
        idx = keep.nonzero().squeeze(1)
        rows, flat_t = rows.index_select(0, idx), flat_t.index_select(0, idx)
    chunk = chunk_size or auto_chunk_size(max(rows.shape[0], 1), weight.shape[0])
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    lp, ent = _FusedHead.apply(rows.contiguous(), weight, flat_t, 1.0 / temperature, chunk, with_entropy)
    if not all_kept:  # scatter the kept tokens back; skipped ones are 0
        lp = lp.new_zeros(N * T).index_copy(0, idx, lp)
        ent = ent.new_zeros(N * T).index_copy(0, idx, ent) if with_entropy else ent
    return lp.view(N, T), (ent.view(N, T) if with_entropy else None)


# ---------------------------------------------------------------- on a Hugging Face causal LM

# Config fields of transformers models that transform the logits after the head
# (Gemma 2/3 soft-capping, Cohere's logit_scale, Granite's logits_scaling, Falcon-H1's multiplier).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")
_PROBED: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
_SHARE_PROBED: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


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
    return _PROBED.get(model, "")


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


def _hidden(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
            start: int, groups=None) -> tuple[torch.Tensor, str]:
    """The decoder body's final hidden states at columns start - 1 .. L - 1 (N, L - start + 1, H).

    With `groups` (from `prompt_groups`), each distinct prompt runs once and the completion
    columns run on its copied cache (module docstring). Returns (hidden, reason): reason is ""
    when the groups were used, else why not (the unshared forward was then run)."""
    body = _decoder(model)
    if groups is not None:
        first, inverse = groups
        pre = body(input_ids=input_ids[first, :start], attention_mask=attention_mask[first, :start],
                   position_ids=position_ids[first, :start], use_cache=True)
        reason = _cache_reason(pre.past_key_values)
        if not reason:
            last = pre.last_hidden_state[:, -1:].index_select(0, inverse)  # (N, 1, H): predicts column start
            if input_ids.shape[1] == start:
                return last, ""
            cache = pre.past_key_values
            cache.reorder_cache(inverse)  # (U, ...) -> (N, ...) per layer, through autograd
            rest = body(input_ids=input_ids[:, start:], attention_mask=attention_mask,
                        position_ids=position_ids[:, start:], past_key_values=cache, use_cache=True)
            return torch.cat([last, rest.last_hidden_state], 1), ""
    else:
        reason = "no two rows share a prompt"
    out = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state[:, start - 1:], reason


def shared_prompt_reason(model: Any) -> str:
    """Why prompts are not shared for this model, or "" when they are (or it has not run yet)."""
    if getattr(model, "is_gradient_checkpointing", False):
        return "gradient checkpointing is on (Hugging Face models then run without a cache)"
    return _SHARE_PROBED.get(model, "")


@torch.no_grad()
def _share_probe(model: Any, input_ids, attention_mask, position_ids, start: int, groups) -> str:
    """Compare the shared and unshared forward on one shared prompt's rows (once per model)."""
    if model in _SHARE_PROBED:
        return _SHARE_PROBED[model]
    first, inverse = groups
    g = int(torch.bincount(inverse).argmax())
    rows = (inverse == g).nonzero().flatten()[:4]
    sub = [x[rows] for x in (input_ids, attention_mask, position_ids)]
    was_training = model.training
    model.eval()
    try:
        ours, reason = _hidden(model, *sub, start, prompt_groups(sub[0], sub[1], start))
        if not reason:
            plain, _ = _hidden(model, *sub, start)
            keep = sub[1][:, start - 1:].bool()
            keep[:, 0] = True  # the last prompt position always predicts
            err = (ours.float() - plain.float()).abs()[keep].max().item()
            scale = max(plain.float().abs()[keep].max().item(), 1.0)
            tol = 1e-4 if model.dtype in (torch.float32, torch.float64) else 2e-2
            if err > tol * scale:
                reason = f"the cached forward differs from the full one by {err:.3g}"
    finally:
        model.train(was_training)
    _SHARE_PROBED[model] = reason
    return reason


@torch.no_grad()
def _probe(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> str:
    """Compare the model's logits with body @ head.weight on a few tokens of one row (once per model)."""
    if model in _PROBED:
        return _PROBED[model]
    row = input_ids[0][attention_mask[0] != 0][:8][None]  # (1, k) real tokens of the first row
    args = dict(input_ids=row, attention_mask=torch.ones_like(row),
                position_ids=torch.arange(row.shape[1], device=row.device)[None], use_cache=False)
    was_training = model.training
    model.eval()  # no dropout in the comparison
    try:
        logits = model(**args).logits.float()
        h = _decoder(model)(**args).last_hidden_state.float()
        ours = h @ model.get_output_embeddings().weight.float().t()
    finally:
        model.train(was_training)
    tol = 1e-4 if model.dtype in (torch.float32, torch.float64) else 2e-2
    err = (logits - ours).abs().max().item()
    scale = max(logits.abs().max().item(), 1.0)
    reason = "" if err <= tol * scale else f"model logits differ from hidden @ head.weight by {err:.3g}"
    _PROBED[model] = reason
    return reason


def causal_lm_token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    start: int,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    mask: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    fused: bool = True,
    share_prompts: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor], bool]:
    """log pi(targets) (N, T) and entropy (N, T) of a causal LM, through the fused head when possible.

    The same numbers as `tether.train.token_logprobs`: the token at column `start + t` of
    `input_ids` (N, P + T) is predicted from position `start - 1 + t`, and logits are divided by
    `temperature` unless it is 0 or 1.

    Args:
        model: a Hugging Face causal LM (`get_decoder()` body + `get_output_embeddings()` head).
        input_ids, attention_mask, position_ids: (N, L) model inputs.
        start: column of the first target token (the prompt width P); >= 1.
        targets: (N, T) the tokens to score, normally `input_ids[:, start:start + T]`.
        temperature: the sampling temperature.
        with_entropy: also return per-token entropy.
        mask: (N, T), optional; where 0, the head is skipped and log-prob and entropy are 0.
        chunk_size: tokens per head chunk (None: see `token_logprobs_and_entropy`).
        fused: False forces the model's own logits.
        share_prompts: run each distinct prompt once when rows share it (module docstring;
            fused path only, exact up to rounding).

    Returns:
        (logprobs (N, T) float32, entropy (N, T) float32 or None, fused): `fused` is False when
        the model's head could not be fused (see `fused_head_reason`) and its logits were used.
    """
    if start < 1:
        raise ValueError(f"start must be >= 1 (the first target is predicted from position start - 1), got {start}")
    T = targets.shape[1]
    tau = temperature if temperature > 0 else 1.0
    # Columns after start - 2 + T predict nothing that is scored (the last is always one of them):
    # a causal model's outputs at earlier positions do not depend on them, so they are not run.
    end = start - 1 + T
    input_ids, attention_mask, position_ids = input_ids[:, :end], attention_mask[:, :end], position_ids[:, :end]
    if fused and not fused_head_reason(model) and not _probe(model, input_ids, attention_mask):
        groups = None
        if share_prompts and not shared_prompt_reason(model):
            groups = prompt_groups(input_ids, attention_mask, start)
            if groups is not None and _share_probe(model, input_ids, attention_mask, position_ids, start, groups):
                groups = None
        hidden, _ = _hidden(model, input_ids, attention_mask, position_ids, start, groups)  # (N, T, H)
        if mask is not None:
            targets = targets.masked_fill(mask == 0, IGNORE_INDEX)
        lp, ent = token_logprobs_and_entropy(hidden, model.get_output_embeddings().weight, targets,
                                             temperature=tau, chunk_size=chunk_size, with_entropy=with_entropy)
        return lp, ent, True
    args = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    try:  # the head on the completion positions only
        logits = model(**args, logits_to_keep=T).logits
    except TypeError:  # a model without logits_to_keep
        logits = model(**args).logits[:, start - 1:]
    logits = logits.float() / tau  # (N, T, V): positions start - 1 .. start - 2 + T
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1) if with_entropy else None
    if mask is not None:
        keep = mask != 0
        lp = lp.masked_fill(~keep, 0.0)
        ent = None if ent is None else ent.masked_fill(~keep, 0.0)
    return lp, ent, False
