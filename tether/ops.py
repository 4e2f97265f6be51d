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
# The tile heuristic (departure 2, `tile_shape`): tokens per tile, and bytes of one (R, C) float32
# logits tile, by device type. CPU: 1024 x 16,384 at most (timed on the 2-core CPU: 4 MiB tiles, whose
# passes stay in cache, were 1.35x slower, as the narrower GEMMs lose more than the cache gains);
# elsewhere (CUDA): 4096 tokens x 8192 entries, so every kernel launch has millions of elements.
TILE_ROWS = {"cpu": 1024, "other": 4096}
TILE_BYTES = {"cpu": 64 * 2**20, "other": 128 * 2**20}
_COL_ALIGN = 128  # vocabulary entries per tile: a multiple of this (and at least this), or all of V


def tile_shape(rows: int, vocab: int, device: torch.device, chunk_size: Optional[int] = None,
               vocab_chunk_size: Optional[int] = None) -> tuple[int, int]:
    """(R, C): tokens and vocabulary entries per (R, C) tile of the fused head (departure 2).

    R is `chunk_size`, else at most TILE_ROWS[device] tokens; C is `vocab_chunk_size`, else
    TILE_BYTES[device] / (4 R) rounded down to a multiple of 128 (at least 128), at most V.
    """
    kind = "cpu" if torch.device(device).type == "cpu" else "other"
    R = min(max(rows, 1), chunk_size or TILE_ROWS[kind])
    if vocab_chunk_size is not None:
        C = vocab_chunk_size
    else:
        C = max(_COL_ALIGN, TILE_BYTES[kind] // (4 * R) // _COL_ALIGN * _COL_ALIGN)
    return R, min(C, vocab)


_FP32_OUT: dict = {}


def _fp32_out_matmul(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch.mm(a, b, out_dtype=torch.float32)` runs for `dtype` inputs on this device
    (CUDA's bf16/fp16 GEMMs in torch >= 2.8; not on CPU). Probed once per (device type, dtype)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    key = (device.type, dtype)
    if key not in _FP32_OUT:
        a = torch.ones(2, 2, device=device, dtype=dtype)
        try:
            _FP32_OUT[key] = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, NotImplementedError, TypeError):
            _FP32_OUT[key] = False
    return _FP32_OUT[key]


def _mm_out(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a @ b with a float32 result from bf16/fp16 inputs (where `_fp32_out_matmul` said so)."""
    return torch.mm(a, b, out_dtype=dtype)


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool, fp32_out: bool) -> None:
    """out = a @ b (first) or out += a @ b; a, b in the matmul dtype, out in its own (>= a's)."""
    if a.dtype == out.dtype:
        torch.mm(a, b, out=out) if first else out.addmm_(a, b)
        return
    prod = _mm_out(a, b, out.dtype) if fp32_out else torch.mm(a, b)
    out.copy_(prod) if first else out.add_(prod)


def native_low_precision_matmul(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `dtype` (bf16/fp16) GEMMs run natively on this device: always off the CPU; on a CPU
    when oneDNN supports them (AVX512-BF16 / AMX). Without that torch emulates them at a few
    GFLOP/s, far below float32 GEMMs."""
    if torch.device(device).type != "cpu":
        return True
    ops = torch.ops.mkldnn
    return bool(ops._is_mkldnn_bf16_supported() if dtype == torch.bfloat16 else ops._is_mkldnn_fp16_supported())


def _matmul_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The inputs' (promoted) dtype, except bf16/fp16 on a CPU without native GEMMs: float32 (departure 2)."""
    if dtype in (torch.bfloat16, torch.float16) and not native_low_precision_matmul(device, dtype):
        return torch.float32
    return dtype


def _softmax_dtype(mm_dtype: torch.dtype) -> torch.dtype:
    """The softmax's and the accumulators' dtype: float64 for float64 matmuls, else float32."""
    return torch.float64 if mm_dtype == torch.float64 else torch.float32


class _Tiles:
    """The (R, C) tiles of one call: shapes, dtypes, scratch buffers, and the logits of a tile."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, rows: int, cols: int):
        self.M, self.V = hidden.shape[0], weight.shape[0]
        self.R, self.C = rows, cols
        self.mm_dtype = _matmul_dtype(torch.promote_types(hidden.dtype, weight.dtype), hidden.device)
        self.acc = _softmax_dtype(self.mm_dtype)
        self.fp32_out = _fp32_out_matmul(hidden.device, self.mm_dtype)
        self.h = hidden.to(self.mm_dtype)  # (M, H)
        self.weight = weight
        n = min(rows, self.M) * min(cols, self.V)
        self._z = hidden.new_empty(n, dtype=self.acc)  # flat, so every tile's view is contiguous
        self._p = torch.empty_like(self._z)
        low = self.mm_dtype != self.acc
        self._raw = hidden.new_empty(n, dtype=self.mm_dtype) if low and not self.fp32_out else None
        self._g = hidden.new_empty(n, dtype=self.mm_dtype) if low else None

    def cols(self):
        """(v0, v1, w_c (C, H) in the matmul dtype) for each vocabulary chunk."""
        for v0 in range(0, self.V, self.C):
            v1 = min(v0 + self.C, self.V)
            yield v0, v1, self.weight[v0:v1].to(self.mm_dtype)

    def rows(self):
        return [(r0, min(r0 + self.R, self.M)) for r0 in range(0, self.M, self.R)]

    def buffers(self, r: int, c: int):
        """Views (r, c) of the scratch: z and p in the softmax dtype, g in the matmul dtype."""
        z, p = self._z[: r * c].view(r, c), self._p[: r * c].view(r, c)
        return z, p, (None if self._g is None else self._g[: r * c].view(r, c))

    def logits(self, r0: int, r1: int, w_c: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Unscaled logits h[r0:r1] @ w_c.T (r, c): in z (softmax dtype) when the matmul can write
        it there, else rounded to the matmul dtype (CPU bf16)."""
        h = self.h[r0:r1]
        if self.mm_dtype == self.acc:
            return torch.mm(h, w_c.t(), out=z)
        if self.fp32_out:
            return _mm_out(h, w_c.t(), self.acc)
        r, c = z.shape
        return torch.mm(h, w_c.t(), out=self._raw[: r * c].view(r, c))


def _in_chunk(targets: torch.Tensor, v0: int, c: int):
    """(column of each target within the chunk [v0, v0 + c), clamped; whether it is inside)."""
    idx = targets - v0
    inside = (idx >= 0) & (idx < c)
    return idx.clamp(0, c - 1)[:, None], inside


class _FusedHead(torch.autograd.Function):
    """(hidden (M, H), weight (V, H), targets (M,)) -> (logprobs (M,), entropy (M,) or empty)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, scale: float, rows: int, cols: int, with_entropy: bool):
        t = _Tiles(hidden, weight, rows, cols)
        # Online softmax over vocabulary chunks (departure 2), per token: m the running max of the
        # scaled logits, s = sum exp(z - m), u = sum exp(z - m) (z - m), zy the target's logit.
        m, s, u, zy = (hidden.new_empty(t.M, dtype=t.acc) for _ in range(4))
        for v0, v1, w_c in t.cols():
            for r0, r1 in t.rows():
                z, p, _ = t.buffers(r1 - r0, v1 - v0)
                raw = t.logits(r0, r1, w_c, z)  # (r, c)
                m_c = raw.amax(1).to(t.acc) * scale
                m_new = m_c if v0 == 0 else torch.maximum(m[r0:r1], m_c)
                z = torch.add(-m_new[:, None], raw, alpha=scale, out=z)  # z - m_new, (r, c)
                idx, inside = _in_chunk(targets[r0:r1], v0, v1 - v0)
                z_y = (z.gather(1, idx).squeeze(1) + m_new) * inside
                s_c = torch.exp(z, out=p).sum(1)
                u_c = p.mul_(z).sum(1)
                if v0 == 0:
                    m[r0:r1], s[r0:r1], u[r0:r1], zy[r0:r1] = m_new, s_c, u_c, z_y
                else:  # rescale the earlier chunks' sums from max m to m_new
                    d = m[r0:r1] - m_new
                    a = d.exp()
                    u[r0:r1] = a * (u[r0:r1] + d * s[r0:r1]) + u_c
                    s[r0:r1] = a * s[r0:r1] + s_c
                    m[r0:r1] = m_new
                    zy[r0:r1] += z_y
        log_s = s.log()
        lse = m + log_s
        lp = zy - lse
        ent = log_s - u / s if with_entropy else lse.new_empty(0)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.scale, ctx.rows, ctx.cols, ctx.with_entropy = scale, rows, cols, with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        use_ent = ctx.with_entropy and g_ent is not None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_lp is None and not use_ent) or not (need_h or need_w):
            return None, None, None, None, None, None, None
        if hidden.shape[0] == 0:  # every target ignored
            return (torch.zeros_like(hidden) if need_h else None, torch.zeros_like(weight) if need_w else None,
                    None, None, None, None, None)
        t = _Tiles(hidden, weight, ctx.rows, ctx.cols)
        sc = ctx.scale  # d/d(unscaled logits) = scale x d/d(scaled logits): folded into g and e
        g = lse.new_zeros(t.M) if g_lp is None else g_lp.to(t.acc) * sc
        if use_ent:  # G = g 1[v=y] - p (e log p + (g + e H)): the row constant once per token
            e = g_ent.to(t.acc) * sc
            neg_const = -(g + e * ent)
        grad_h = hidden.new_empty(hidden.shape, dtype=t.acc) if need_h else None  # (M, H)
        grad_w = weight.new_empty(weight.shape) if need_w else None  # (V, H)
        one_block = len(t.rows()) == 1
        direct_w = need_w and (weight.dtype == t.acc or (one_block and weight.dtype == t.mm_dtype
                                                          and not t.fp32_out))
        gw_acc = None if direct_w or not need_w else hidden.new_empty(min(t.C, t.V), hidden.shape[1], dtype=t.acc)
        for v0, v1, w_c in t.cols():
            dst_w = (grad_w[v0:v1] if direct_w else gw_acc[: v1 - v0]) if need_w else None
            for i, (r0, r1) in enumerate(t.rows()):
                z, p, low = t.buffers(r1 - r0, v1 - v0)
                raw = t.logits(r0, r1, w_c, z)
                logp = torch.add(-lse[r0:r1, None], raw, alpha=sc, out=z)  # (r, c)
                torch.exp(logp, out=p)
                if use_ent:  # -p (e log p + const), in z's buffer
                    G = torch.addcmul(neg_const[r0:r1, None], logp, e[r0:r1, None], value=-1, out=logp).mul_(p)
                else:  # -p g
                    G = p.mul_(-g[r0:r1, None])
                idx, inside = _in_chunk(targets[r0:r1], v0, v1 - v0)
                G.scatter_add_(1, idx, (g[r0:r1] * inside)[:, None])
                if low is not None:  # the matmuls' operand: G rounded to their dtype
                    G = low.copy_(G)
                if need_h:
                    _mm_into(grad_h[r0:r1], G, w_c, v0 == 0, t.fp32_out)
                if need_w:
                    _mm_into(dst_w, G.t(), t.h[r0:r1], i == 0, t.fp32_out)
            if need_w and not direct_w:
                grad_w[v0:v1].copy_(dst_w)
        grad_h = None if grad_h is None else grad_h.to(hidden.dtype)
        return grad_h, grad_w, None, None, None, None, None


def token_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    vocab_chunk_size: Optional[int] = None,
    with_entropy: bool = True,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per-token log-probs of `targets` and entropies under softmax(hidden @ weight.T / temperature).

    Runs over (R, C) tiles of tokens x vocabulary entries with the matmuls in the inputs' dtype and
    the softmax in float32; never holds more than a few (R, C) buffers; exact gradients for
    `hidden` and `weight` (module docstring, departure 2).

    Args:
        hidden: (N, T, H) final hidden states (any float dtype).
        weight: (V, H) the LM head's weight.
        targets: (N, T) token ids; `ignore_index` marks tokens to skip (log-prob and entropy 0).
        temperature: > 0; logits are divided by it.
        chunk_size: tokens per tile (R); None: `tile_shape`'s choice for the device.
        vocab_chunk_size: vocabulary entries per tile (C); None: `tile_shape`'s choice.
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
    for name, value in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1 or None, got {value}")
    R, C = tile_shape(rows.shape[0], weight.shape[0], hidden.device, chunk_size, vocab_chunk_size)
    lp, ent = _FusedHead.apply(rows.contiguous(), weight, flat_t, 1.0 / temperature, R, C, with_entropy)
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
