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
151,936-token vocabulary that is 0.6 MB per token per copy in float32. Here the M = N T tokens and
the V vocabulary entries are cut into (R, C) tiles. The forward keeps, per token, a running max m,
s = sum exp(z - m) and u = sum exp(z - m)(z - m) across vocabulary tiles (an online softmax: when
the max rises from m to m', s <- s e^(m - m') and u <- e^(m - m')(u + (m - m') s)), so that
lse = m + log s and H = log s - u / s; it keeps lse_t and H_t (8 bytes a token). The backward
recomputes each tile's logits and forms G on it; dL/dW's rows for a vocabulary tile are complete
once its token tiles are done, so no (V, H) float32 buffer is needed.

Where this departs from the naive `log_softmax` path:
1. The backward recomputes the logits: four (tokens x V x H) matmuls instead of three, so the
   head costs about a third more FLOPs in exchange for O(R C) instead of O(N T V) memory.
2. Dtypes. The matmuls run in the inputs' (promoted) dtype: bf16 inputs give bf16 GEMMs (tensor
   cores on a GPU). Everything after the matmul is float32 (float64 for float64 inputs): the
   softmax statistics, G, and the accumulation of the gradients across tiles (dL/dh in an (M, H)
   float32 buffer, dL/dW in a (C, H) one when there is more than one token tile); G is rounded to
   the matmul dtype as the GEMMs' operand, and gradients come back in the inputs' dtypes. Where
   torch offers a bf16 GEMM with a float32 result (`torch.mm(..., out_dtype=torch.float32)`,
   CUDA), the logits and partial gradients are never rounded to bf16; elsewhere (CPU) the GEMM
   rounds its result to bf16, as a bf16 `lm_head` does, before the float32 softmax. A CPU
   without native bf16 GEMMs (no AVX512-BF16 / AMX, which oneDNN reports) gets float32 GEMMs on
   tiles upcast one at a time instead: torch emulates bf16 GEMMs there at a few GFLOP/s. The
   error against exact arithmetic is bounded by bf16 rounding (`tests/model/test_fused_head.py` derives the
   bound); float64 inputs stay exact to float64 rounding.
   Tile sizes (`tile_shape`): at most 1024 tokens x a 64 MiB float32 tile on CPU and 4096 tokens x
   128 MiB elsewhere (CUDA), with the (C, H) float32 weight tile (upcast weight, gradient
   accumulator) held to the same bytes, so a short sequence does not take all of V in one tile
   (bf16, T = 64 on the 2-core CPU: 1.66 GB -> 0.53 GB above the baseline, 2.5 s -> 2.1 s);
   `chunk_size` (tokens, the trainer's `logprob_chunk_size`) and `vocab_chunk_size` override them. The loops run over
   shapes only: no host sync per tile.
3. The temperature scales the logits in float32 as they are shifted by the max (one pass that
   does both), and is folded into g and e in the backward: no bf16 rounding of h / tau.
4. Targets equal to `ignore_index` skip the head altogether and give log-prob 0 and entropy 0
   (and no gradient), where the naive path computes values that a loss mask then discards.
5. Only a plain linear head is fused: no bias, no logit scaling or soft-capping.
   `tether.model.causal_lm.causal_lm_token_logprobs` checks the model and otherwise falls back to the
   model's own logits.
"""

from __future__ import annotations

from typing import Optional

import torch

IGNORE_INDEX = -100
# The tile heuristic (departure 2, `tile_shape`): tokens per tile, and bytes of one (R, C) float32
# logits tile, by device type. CPU: 1024 x 16,384 at most (timed on the 2-core CPU: 4 MiB tiles, whose
# passes stay in cache, were 1.35x slower, as the narrower GEMMs lose more than the cache gains);
# elsewhere (CUDA): 4096 tokens x 8192 entries, so every kernel launch has millions of elements.
TILE_ROWS = {"cpu": 1024, "other": 4096}
TILE_BYTES = {"cpu": 64 * 2**20, "other": 128 * 2**20}
_COL_ALIGN = 128  # vocabulary entries per tile: a multiple of this (and at least this), or all of V


def tile_shape(
    rows: int,
    vocab: int,
    device: torch.device,
    chunk_size: Optional[int] = None,
    vocab_chunk_size: Optional[int] = None,
    hidden: Optional[int] = None,
) -> tuple[int, int]:
    """(R, C): tokens and vocabulary entries per (R, C) tile of the fused head (departure 2).

    R is `chunk_size`, else at most TILE_ROWS[device] tokens; C is `vocab_chunk_size`, else
    TILE_BYTES[device] / (4 max(R, H)) rounded down to a multiple of 128 (at least 128), at most V:
    both the (R, C) float32 logits tile and a (C, H) float32 weight tile (the upcast weight on a
    CPU without bf16 GEMMs, the weight-gradient accumulator) stay within TILE_BYTES. `hidden` is H
    (None: not bounded by it).
    """
    kind = "cpu" if torch.device(device).type == "cpu" else "other"
    R = min(max(rows, 1), chunk_size or TILE_ROWS[kind])
    if vocab_chunk_size is not None:
        C = vocab_chunk_size
    else:
        C = max(_COL_ALIGN, TILE_BYTES[kind] // (4 * max(R, hidden or 0)) // _COL_ALIGN * _COL_ALIGN)
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
    """(column of each target (r, S) within the chunk [v0, v0 + c), clamped; whether it is inside), both (r, S)."""
    idx = targets - v0
    inside = (idx >= 0) & (idx < c)
    return idx.clamp(0, c - 1), inside


class _FusedHead(torch.autograd.Function):
    """(hidden (M, H), weight (V, H), targets (M, S)) -> (logprobs (M, S), entropy (M,) or empty): the log-probs
    of S tokens per row (S = 1: the sampled token; TROLL's support: many), G_t summing their 1[v = y] terms."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, scale: float, rows: int, cols: int, with_entropy: bool):
        t = _Tiles(hidden, weight, rows, cols)
        # Online softmax over vocabulary chunks (departure 2), per token: m the running max of the
        # scaled logits, s = sum exp(z - m), u = sum exp(z - m) (z - m), zy the target's logit.
        m, s, u = (hidden.new_empty(t.M, dtype=t.acc) for _ in range(3))
        zy = hidden.new_empty(targets.shape, dtype=t.acc)  # (M, S)
        for v0, v1, w_c in t.cols():
            for r0, r1 in t.rows():
                z, p, _ = t.buffers(r1 - r0, v1 - v0)
                raw = t.logits(r0, r1, w_c, z)  # (r, c)
                m_c = raw.amax(1).to(t.acc) * scale
                m_new = m_c if v0 == 0 else torch.maximum(m[r0:r1], m_c)
                z = torch.add(-m_new[:, None], raw, alpha=scale, out=z)  # z - m_new, (r, c)
                idx, inside = _in_chunk(targets[r0:r1], v0, v1 - v0)
                z_y = (z.gather(1, idx) + m_new[:, None]) * inside
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
        lp = zy - lse[:, None]
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
            return (
                torch.zeros_like(hidden) if need_h else None,
                torch.zeros_like(weight) if need_w else None,
                None,
                None,
                None,
                None,
                None,
            )
        t = _Tiles(hidden, weight, ctx.rows, ctx.cols)
        sc = ctx.scale  # d/d(unscaled logits) = scale x d/d(scaled logits): folded into g and e
        g = lse.new_zeros(targets.shape) if g_lp is None else g_lp.to(t.acc) * sc  # (M, S)
        g_row = g.sum(1)  # G = sum_s g_s 1[v=y_s] - p (e log p + (sum_s g_s + e H))
        if use_ent:  # the row constant once per token
            e = g_ent.to(t.acc) * sc
            neg_const = -(g_row + e * ent)
        grad_h = hidden.new_empty(hidden.shape, dtype=t.acc) if need_h else None  # (M, H)
        grad_w = weight.new_empty(weight.shape) if need_w else None  # (V, H)
        one_block = len(t.rows()) == 1
        direct_w = need_w and (weight.dtype == t.acc or (one_block and weight.dtype == t.mm_dtype and not t.fp32_out))
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
                    G = p.mul_(-g_row[r0:r1, None])
                idx, inside = _in_chunk(targets[r0:r1], v0, v1 - v0)
                G.scatter_add_(1, idx, g[r0:r1] * inside)
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
        targets: (N, T) token ids, or (N, T, S): S token ids per position (a support); `ignore_index` marks
            positions to skip (log-prob and entropy 0), in every entry of a skipped position's S.
        temperature: > 0; logits are divided by it.
        chunk_size: tokens per tile (R); None: `tile_shape`'s choice for the device.
        vocab_chunk_size: vocabulary entries per tile (C); None: `tile_shape`'s choice.
        with_entropy: also return the entropy (its gradient flows too).

    Returns:
        logprobs (N, T) (or (N, T, S)) and entropy (N, T) (or None without `with_entropy`), float32, or float64
        when an input is float64.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if (
        hidden.dim() != 3
        or targets.shape[:2] != hidden.shape[:2]
        or targets.dim() not in (2, 3)
        or weight.dim() != 2
        or weight.shape[1] != hidden.shape[2]
    ):
        raise ValueError(
            f"expected hidden (N, T, H), weight (V, H), targets (N, T) or (N, T, S); got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    for name, value in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1 or None, got {value}")
    N, T, H = hidden.shape
    flat_t = targets.reshape(N * T, -1)  # (M, S)
    rows, flat_t, idx = _kept_rows(hidden.reshape(N * T, H), flat_t, ignore_index)
    R, C = tile_shape(rows.shape[0], weight.shape[0], hidden.device, chunk_size, vocab_chunk_size, weight.shape[1])
    lp, ent = _FusedHead.apply(rows.contiguous(), weight, flat_t, 1.0 / temperature, R, C, with_entropy)
    if idx is not None:  # scatter the kept tokens back; skipped ones are 0
        lp = lp.new_zeros(N * T, lp.shape[1]).index_copy(0, idx, lp)
        ent = ent.new_zeros(N * T).index_copy(0, idx, ent) if with_entropy else ent
    return lp.view(targets.shape), (ent.view(N, T) if with_entropy else None)


def _kept_rows(rows: torch.Tensor, targets: torch.Tensor, ignore_index: int):
    """(rows (M', H), targets (M', S), their indices or None when every row is kept): the rows whose targets are
    not `ignore_index`; a row with some targets ignored and some not is an error."""
    ignored = targets == ignore_index
    skip = ignored[:, 0]
    if targets.shape[1] > 1 and bool((ignored != skip[:, None]).any()):
        raise ValueError(f"a position's targets must be all {ignore_index} (skipped) or none")
    if not bool(skip.any()):
        return rows, targets, None
    idx = (~skip).nonzero().squeeze(1)
    return rows.index_select(0, idx), targets.index_select(0, idx), idx


@torch.no_grad()
def top_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    *,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    vocab_chunk_size: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most probable tokens of softmax(hidden @ weight.T / temperature) at each of M rows, without gradient
    and without the (M, V) logits: per (R, C) tile, a running top-k of the scaled logits merged with the tile's
    own and the online log-sum-exp of the forward (module docstring).

    Args: hidden (M, H), weight (V, H), k >= 1 (at most V are returned); tiles as `token_logprobs_and_entropy`.
    Returns: (ids (M, k) long, logprobs (M, k) float32, or float64 for float64 inputs), most probable first.
    """
    t = _Tiles(
        hidden,
        weight,
        *tile_shape(hidden.shape[0], weight.shape[0], hidden.device, chunk_size, vocab_chunk_size, weight.shape[1]),
    )
    k = min(k, t.V)
    m = hidden.new_full((t.M,), float("-inf"), dtype=t.acc)  # running max and sum exp(z - m) of the scaled logits
    s = hidden.new_zeros(t.M, dtype=t.acc)
    top = hidden.new_full((t.M, k), float("-inf"), dtype=t.acc)  # running top-k scaled logits and their ids
    ids = torch.zeros(t.M, k, dtype=torch.long, device=hidden.device)
    scale = 1.0 / temperature
    for v0, v1, w_c in t.cols():
        for r0, r1 in t.rows():
            z, p, _ = t.buffers(r1 - r0, v1 - v0)
            raw = t.logits(r0, r1, w_c, z)
            z = torch.mul(raw, scale, out=z) if raw.dtype == t.acc else z.copy_(raw).mul_(scale)  # (r, c)
            m_new = torch.maximum(m[r0:r1], z.amax(1))
            s[r0:r1] = s[r0:r1] * (m[r0:r1] - m_new).exp() + torch.sub(z, m_new[:, None], out=p).exp_().sum(1)
            m[r0:r1] = m_new
            c_top, c_ids = z.topk(min(k, v1 - v0), dim=1)
            merged, at = torch.cat([top[r0:r1], c_top], 1).topk(k, dim=1)
            ids[r0:r1] = torch.cat([ids[r0:r1], c_ids + v0], 1).gather(1, at)
            top[r0:r1] = merged
    return ids, top - (m + s.log())[:, None]
