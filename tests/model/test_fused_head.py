"""tether.model.ops: the tiled head against the naive log-softmax, in float64, and in bfloat16 within a
bound derived from bfloat16 rounding.

What is proved: (1) hand-computed values; (3) gradients of hidden and weight, through log-probs
and entropy, equal the naive ones for token and vocabulary tile sizes that do and do not divide
the token count and the vocabulary (the online softmax across vocabulary tiles included), and pass
gradcheck; (4) ignored targets; bfloat16 inputs, on each matmul path (float32 upcast, bf16 GEMMs
with bf16 output, bf16 GEMMs with float32 output), stay within a first-order rounding bound
computed from the data, and a softmax or an accumulation in bfloat16 breaks that bound; the tile
heuristic; and, on tiny Llama and Qwen2 models, the model-level helper equals the model-logits
computation (float32 and float64) in values and parameter gradients, with tied embeddings, falls
back to the model's logits when its head is not plain, and is what `tether.model.causal_lm.token_logprobs`
computes (0 at padding).
"""

import dataclasses
import math

import pytest
import torch

import tether.model.ops as ops
from tether.model.causal_lm import LogProbSettings, Tokens, causal_lm_token_logprobs, fused_head_reason, token_logprobs
from tether.model.ops import IGNORE_INDEX, tile_shape, token_logprobs_and_entropy

from conftest import param_grads
from conftest import tiny_float64_lm as tiny


def naive(hidden, weight, targets, temperature=1.0):
    logp = torch.log_softmax(hidden @ weight.t() / temperature, -1)  # (N, T, V)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1)


def inputs(N=2, T=7, H=5, V=11, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, T, H, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g, dtype=dtype).requires_grad_()
    targets = torch.randint(0, V, (N, T), generator=g)
    g_lp, g_ent = torch.randn(N, T, generator=g, dtype=dtype), torch.randn(N, T, generator=g, dtype=dtype)
    return hidden, weight, targets, g_lp, g_ent


def grads(loss, *xs):
    return torch.autograd.grad(loss, xs)


def assert_matches_naive(lp, ent, ref_lp, ref_ent, g_lp, g_ent, hidden, weight, grad_dtype=None):
    """Log-probs and entropies equal the naive ones to 1e-12, and so do the gradients of a random linear
    functional of both with respect to the hidden states and the head weight (to 1e-10), of `grad_dtype` if given."""
    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-12)
    got = grads((lp * g_lp).sum() + (ent * g_ent).sum(), hidden, weight)
    want = grads((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), hidden, weight)
    for a, b in zip(got, want):
        assert grad_dtype is None or a.dtype == grad_dtype
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_uniform_logits_hand_computed():
    # A zero weight gives zero logits: p = 1/V for every token, so log p(y) = -log V and
    # H = -sum_v (1/V) log(1/V) = log V; with V = 11: -2.3979 and 2.3979.
    hidden = torch.randn(2, 3, 4, dtype=torch.float64)
    weight = torch.zeros(11, 4, dtype=torch.float64)
    lp, ent = token_logprobs_and_entropy(hidden, weight, torch.zeros(2, 3, dtype=torch.long), chunk_size=2)
    torch.testing.assert_close(lp, torch.full((2, 3), -math.log(11), dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, torch.full((2, 3), math.log(11), dtype=torch.float64), rtol=0, atol=1e-12)


def test_two_token_hand_computed():
    # Logits (2, 0) at temperature 2 -> (1, 0): p = (e/(e+1), 1/(e+1)) = (0.731059, 0.268941);
    # log p(y=1) = -log(e+1) = -1.313262; H = -(0.731059 ln 0.731059 + 0.268941 ln 0.268941) = 0.582203.
    hidden = torch.tensor([[[1.0]]], dtype=torch.float64)
    weight = torch.tensor([[2.0], [0.0]], dtype=torch.float64)
    lp, ent = token_logprobs_and_entropy(hidden, weight, torch.tensor([[1]]), temperature=2.0)
    assert lp.item() == pytest.approx(-1.313262, abs=1e-6)
    assert ent.item() == pytest.approx(0.582203, abs=1e-6)


@pytest.mark.parametrize("chunk", [1, 3, 4, 7, 14, 100, None])
@pytest.mark.parametrize("vocab_chunk", [None, 3, 4, 11])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_naive(chunk, vocab_chunk, temperature):
    # 14 tokens and 11 vocabulary entries: tiles of 3 and 4 leave a remainder in both directions.
    hidden, weight, targets, g_lp, g_ent = inputs()
    lp, ent = token_logprobs_and_entropy(
        hidden, weight, targets, temperature=temperature, chunk_size=chunk, vocab_chunk_size=vocab_chunk
    )
    ref_lp, ref_ent = naive(hidden, weight, targets, temperature)
    assert lp.dtype == ent.dtype == torch.float64
    assert_matches_naive(lp, ent, ref_lp, ref_ent, g_lp, g_ent, hidden, weight, grad_dtype=torch.float64)


@pytest.mark.parametrize("which", ["logprobs", "entropy"])
def test_each_output_alone_has_the_naive_gradient(which):
    hidden, weight, targets, g_lp, g_ent = inputs(seed=1)
    lp, ent = token_logprobs_and_entropy(hidden, weight, targets, temperature=1.3, chunk_size=5, vocab_chunk_size=4)
    ref_lp, ref_ent = naive(hidden, weight, targets, 1.3)
    ours, ref = (lp, ref_lp) if which == "logprobs" else (ent, ref_ent)
    for a, b in zip(grads((ours * g_lp).sum(), hidden, weight), grads((ref * g_lp).sum(), hidden, weight)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_without_entropy():
    hidden, weight, targets, g_lp, _ = inputs(seed=2)
    lp, ent = token_logprobs_and_entropy(hidden, weight, targets, chunk_size=4, with_entropy=False)
    assert ent is None
    ref_lp, _ = naive(hidden, weight, targets)
    for a, b in zip(grads((lp * g_lp).sum(), hidden, weight), grads((ref_lp * g_lp).sum(), hidden, weight)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_gradcheck():
    hidden, weight, targets, _, _ = inputs(N=1, T=5, H=3, V=6, seed=3)

    def f(h, w):
        return token_logprobs_and_entropy(h, w, targets, temperature=0.9, chunk_size=2, vocab_chunk_size=4)

    assert torch.autograd.gradcheck(f, (hidden, weight))


def test_ignored_targets_skip_the_head():
    hidden, weight, targets, g_lp, g_ent = inputs(seed=4)
    ignored = torch.zeros_like(targets, dtype=torch.bool)
    ignored[0, 4:] = True
    ignored[1, 0] = True
    lp, ent = token_logprobs_and_entropy(hidden, weight, targets.masked_fill(ignored, IGNORE_INDEX), chunk_size=3)
    assert (lp[ignored] == 0).all() and (ent[ignored] == 0).all()
    ref_lp, ref_ent = naive(hidden, weight, targets)
    keep = (~ignored).double()
    torch.testing.assert_close(lp, ref_lp * keep, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent * keep, rtol=1e-12, atol=1e-12)
    got = grads((lp * g_lp).sum() + (ent * g_ent).sum(), hidden, weight)
    want = grads((ref_lp * g_lp * keep).sum() + (ref_ent * g_ent * keep).sum(), hidden, weight)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert (got[0][ignored] == 0).all()


@pytest.mark.parametrize("chunk, vocab_chunk", [(3, 4), (5, None), (100, 11)])
def test_several_targets_per_position_match_the_naive_gather(chunk, vocab_chunk):
    # TROLL's support: S = 6 ids per position (repeats included), the log-probs (N, T, S) and the entropy, values
    # and gradients against the gather of the naive log-softmax; a skipped position skips all its S ids.
    hidden, weight, _, _, g_ent = inputs(seed=11)
    gen = torch.Generator().manual_seed(12)
    targets = torch.randint(0, 11, (2, 7, 6), generator=gen)
    g_lp = torch.randn(2, 7, 6, generator=gen, dtype=torch.float64)
    skipped = torch.zeros(2, 7, dtype=torch.bool)
    skipped[0, 5:] = True
    skipped[1, 1] = True
    lp, ent = token_logprobs_and_entropy(
        hidden,
        weight,
        targets.masked_fill(skipped[..., None], IGNORE_INDEX),
        temperature=0.8,
        chunk_size=chunk,
        vocab_chunk_size=vocab_chunk,
    )
    logp = torch.log_softmax(hidden @ weight.t() / 0.8, -1)
    keep = (~skipped).double()
    ref_lp, ref_ent = logp.gather(-1, targets) * keep[..., None], -(logp.exp() * logp).sum(-1) * keep
    assert lp.shape == (2, 7, 6) and ent.shape == (2, 7)
    assert_matches_naive(lp, ent, ref_lp, ref_ent, g_lp, g_ent, hidden, weight)
    half = targets.clone()
    half[0, 0, 3:] = IGNORE_INDEX
    with pytest.raises(ValueError, match="all -100 \\(skipped\\) or none"):
        token_logprobs_and_entropy(hidden, weight, half)


def test_all_targets_ignored_gives_zeros_and_zero_gradients():
    hidden, weight, targets, _, _ = inputs(seed=5)
    lp, ent = token_logprobs_and_entropy(hidden, weight, torch.full_like(targets, IGNORE_INDEX))
    assert (lp == 0).all() and (ent == 0).all()
    gh, gw = grads(lp.sum() + ent.sum(), hidden, weight)
    assert (gh == 0).all() and (gw == 0).all()


def test_only_one_input_needs_grad():
    hidden, weight, targets, g_lp, g_ent = inputs(seed=6)
    frozen = weight.detach()
    lp, ent = token_logprobs_and_entropy(hidden, frozen, targets, chunk_size=4)
    ref_lp, ref_ent = naive(hidden, frozen, targets)
    (a,) = grads((lp * g_lp + ent * g_ent).sum(), hidden)
    (b,) = grads((ref_lp * g_lp + ref_ent * g_ent).sum(), hidden)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    frozen_h = hidden.detach()
    lp, ent = token_logprobs_and_entropy(frozen_h, weight, targets, chunk_size=4)
    ref_lp, ref_ent = naive(frozen_h, weight, targets)
    (a,) = grads((lp * g_lp + ent * g_ent).sum(), weight)
    (b,) = grads((ref_lp * g_lp + ref_ent * g_ent).sum(), weight)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- bfloat16 against a rounding bound

U_BF16 = 2.0**-8  # unit roundoff of bfloat16: 8 significand bits, round to nearest
EPS32 = 2.0**-24  # unit roundoff of float32


def gamma(n):
    """Higham's gamma_n = n eps / (1 - n eps): the relative error bound of an n-term float32 sum."""
    return n * EPS32 / (1 - n * EPS32)


def bf16_reference_and_bound(h, w, targets, tau, g_lp, g_ent):
    """Exact values (float64, from the same bfloat16 inputs) of log p, entropy, dL/dh and dL/dW, and
    a first-order bound on the error of the tiled head with bf16 matmuls, computed from the data.

    With s = 1/tau, z = s h W^T and the loss sum_t g_t log p_t(y_t) + e_t H_t:
    - logits: the matmul accumulates the H exact bf16 x bf16 products in float32 (<= gamma_H s
      sum_i |h_i w_vi|) and may round its result to bf16 (<= u |z_v|, CPU):
      eta_v = u |z_v| + gamma_H s sum_i |h_i w_vi|.
    - the float32 softmax (shift, exp, V-term sums, log) adds at most
      sigma = gamma_(V+4) (1 + 2 max_v |z_v|) + 2 eps |lse| to lse and log p.
    - log p(y) = z_y - lse: d log p(y) = dz_y - sum_v p_v dz_v, so |err| <= eta_y + sum_v p_v eta_v + sigma.
    - H: dH/dz_v = -p_v (log p_v + H), so |err| <= sum_v p_v |log p_v + H| eta_v + sigma (1 + 2 range(z)),
      the last term from dividing sum_v p_v (z_v - max z) by sum_v p_v in float32.
    - G_v = s [g (1[v=y] - p_v) - e p_v (log p_v + H)] (the gradient wrt the unscaled logits): its
      error from the above is <= s p_v (eta_v + eta_bar + sigma)(|g| + |e| (|log p_v + H| + 1))
      + s |e| p_v err(H), plus u |G_v| when G is rounded to bf16 for the matmul: D_v.
    - dL/dh = G W, dL/dW = G^T h: sum_v D_v |w_vi| (resp. sum_t D_tv |h_ti|), plus the rounding of
      partial products to bf16 and their float32 sum, (u + gamma_n) sum |G w| (resp. sum |G h|),
      plus the final rounding of the result to bf16, u |result|.
    Second-order terms (u^2 relative, 1.5e-5) are dropped: the comparison allows 1.25 x the bound.
    """
    h, w = h.double(), w.double()
    s = 1.0 / tau
    M, H = h.shape
    V = w.shape[0]
    z = h @ w.t() * s  # (M, V)
    logp = torch.log_softmax(z, -1)
    p, lse = logp.exp(), torch.logsumexp(z, -1)
    ent = -(p * logp).sum(-1)
    lp = logp.gather(1, targets[:, None]).squeeze(1)
    eta = U_BF16 * z.abs() + gamma(H) * (h.abs() @ w.abs().t()) * s  # (M, V)
    eta_bar = (p * eta).sum(-1)
    sigma = gamma(V + 4) * (1 + 2 * z.abs().amax(-1)) + 2 * EPS32 * lse.abs()
    b_lp = eta.gather(1, targets[:, None]).squeeze(1) + eta_bar + sigma
    lp_h = (logp + ent[:, None]).abs()
    b_ent = (p * lp_h * eta).sum(-1) + sigma * (1 + 2 * (z.amax(-1) - z.amin(-1)))
    g, e = g_lp.double() * s, g_ent.double() * s
    onehot = torch.zeros_like(z).scatter_(1, targets[:, None], 1.0)
    G = g[:, None] * (onehot - p) - e[:, None] * p * (logp + ent[:, None])  # (M, V)
    D = (
        p * (eta + (eta_bar + sigma)[:, None]) * (g.abs()[:, None] + e.abs()[:, None] * (lp_h + 1))
        + (e.abs() * b_ent)[:, None] * p
        + (U_BF16 + 8 * EPS32) * G.abs()
    )
    gh, gw = G @ w, G.t() @ h
    b_gh = D @ w.abs() + (U_BF16 + gamma(V)) * (G.abs() @ w.abs()) + U_BF16 * gh.abs()
    b_gw = D.t() @ h.abs() + (U_BF16 + gamma(M)) * (G.abs().t() @ h.abs()) + U_BF16 * gw.abs()
    return (lp, ent, gh, gw), (b_lp, b_ent, b_gh, b_gw)


def bf16_case(seed=0, M=256, H=64, V=4096):
    """bf16 hidden states and weight with logits of O(1) and a few frequent targets (16 distinct)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, H, generator=g).bfloat16()
    w = (torch.randn(V, H, generator=g) * H**-0.5).bfloat16()
    targets = torch.randint(0, 16, (M,), generator=g)
    return h, w, targets, torch.randn(M, generator=g), torch.randn(M, generator=g)


def bf16_head(h, w, targets, tau, g_lp, g_ent, device="cpu", out_dtype=torch.float32, **kw):
    """(log p, entropy, dL/dh, dL/dW) of the fused head on bf16 leaves."""
    h, w = h.to(device).requires_grad_(), w.to(device).requires_grad_()
    lp, ent = token_logprobs_and_entropy(h[None], w, targets.to(device)[None], temperature=tau, **kw)
    assert lp.dtype == ent.dtype == out_dtype
    gh, gw = grads((lp[0] * g_lp.to(device)).sum() + (ent[0] * g_ent.to(device)).sum(), h, w)
    assert gh.dtype == gw.dtype == torch.bfloat16
    return [x.detach().cpu().double() for x in (lp[0], ent[0], gh, gw)]


def bound_ratios(out, ref, bound):
    """max |ours - exact| / bound for log p, entropy, dL/dh, dL/dW (<= 1 within the bound)."""
    return [((o - r).abs() / b).max().item() for o, r, b in zip(out, ref, bound)]


@pytest.fixture(params=["float32 upcast", "bf16 GEMM", "bf16 GEMM, float32 out"])
def matmul_path(request, monkeypatch):
    """Each matmul path of the head, on this CPU: the float32 upcast (a CPU without bf16 GEMMs),
    bf16 GEMMs rounding their result to bf16 (a CPU with them), and bf16 GEMMs with a float32
    result (CUDA's out_dtype; here emulated by a float32 matmul of the bf16 values, which is the
    same arithmetic: exact products, float32 sums)."""
    # Each case forces its path, so that every CPU tests all three whatever its vector extensions (left alone,
    # the upcast case took bf16 GEMMs on a CPU with AVX512-BF16 and upcast only on an AVX2 one).
    native = request.param != "float32 upcast"
    monkeypatch.setattr(ops, "native_low_precision_matmul", lambda device, dtype: native)
    if request.param == "bf16 GEMM, float32 out":
        monkeypatch.setitem(ops._FP32_OUT, ("cpu", torch.bfloat16), True)
        monkeypatch.setattr(ops, "_mm_out", lambda a, b, dtype: a.to(dtype) @ b.to(dtype))
    return request.param


@pytest.mark.parametrize(
    "tiles", [{}, {"chunk_size": 8, "vocab_chunk_size": 64}, {"chunk_size": 100, "vocab_chunk_size": 1000}]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_bfloat16_is_within_the_rounding_bound(matmul_path, tiles, seed):
    h, w, targets, g_lp, g_ent = bf16_case(seed)
    ref, bound = bf16_reference_and_bound(h, w, targets, 0.8, g_lp, g_ent)
    ratios = bound_ratios(bf16_head(h, w, targets, 0.8, g_lp, g_ent, **tiles), ref, bound)
    assert max(ratios) <= 1.25, dict(zip(["logp", "entropy", "grad_h", "grad_w"], ratios))


def test_the_bound_catches_a_bfloat16_softmax(monkeypatch):
    # The same head with its softmax, sums and accumulators in bf16 (the matmul dtype): log p,
    # entropy and dL/dh leave the bound (by about 8x, 2x and 2.5x on this data). dL/dW does not:
    # its bound sums |G_tv h_ti| over the 256 tokens, and these errors, of random sign, grow like
    # the square root of that sum.
    monkeypatch.setattr(ops, "native_low_precision_matmul", lambda device, dtype: True)
    monkeypatch.setattr(ops, "_softmax_dtype", lambda mm_dtype: mm_dtype)
    for seed in (0, 1):
        h, w, targets, g_lp, g_ent = bf16_case(seed)
        ref, bound = bf16_reference_and_bound(h, w, targets, 0.8, g_lp, g_ent)
        out = bf16_head(h, w, targets, 0.8, g_lp, g_ent, out_dtype=torch.bfloat16, chunk_size=8, vocab_chunk_size=64)
        r_lp, r_ent, r_gh, _ = bound_ratios(out, ref, bound)
        assert r_lp > 2 and r_ent > 1.25 and r_gh > 1.25, (r_lp, r_ent, r_gh)


def test_the_bound_catches_bfloat16_accumulation(monkeypatch):
    # The head with the gradient's running sums over tiles kept in bf16 instead of float32: dL/dh,
    # summed over 64 vocabulary tiles, leaves the bound (about 2.5x).
    monkeypatch.setattr(ops, "native_low_precision_matmul", lambda device, dtype: True)
    real = ops._mm_into

    def bf16_running_sum(out, a, b, first, fp32_out):
        real(out, a, b, first, fp32_out)
        out.copy_(out.to(torch.bfloat16))

    monkeypatch.setattr(ops, "_mm_into", bf16_running_sum)
    for seed in (0, 1):
        h, w, targets, g_lp, g_ent = bf16_case(seed)
        ref, bound = bf16_reference_and_bound(h, w, targets, 0.8, g_lp, g_ent)
        out = bf16_head(h, w, targets, 0.8, g_lp, g_ent, chunk_size=8, vocab_chunk_size=64)
        assert bound_ratios(out, ref, bound)[2] > 1.25


def test_mixed_dtypes_compute_in_the_wider_one():
    # A float32 hidden state on a bf16 head (and the reverse) is computed in float32: exact to
    # float32 rounding against float64 on the same values.
    hidden, weight, targets, g_lp, g_ent = inputs(N=2, T=6, H=16, V=50, dtype=torch.float32, seed=7)
    for h, w in (
        (hidden, weight.detach().bfloat16().requires_grad_()),
        (hidden.detach().bfloat16().requires_grad_(), weight),
    ):
        lp, ent = token_logprobs_and_entropy(h, w, targets, chunk_size=5, vocab_chunk_size=16)
        ref_lp, ref_ent = naive(h.detach().double(), w.detach().double(), targets)
        torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
        gh, gw = grads((lp * g_lp).sum() + (ent * g_ent).sum(), h, w)
        assert gh.dtype == h.dtype and gw.dtype == w.dtype


def test_tile_shape_follows_the_device_and_the_overrides():
    V = 151_936
    # CPU: up to 1024 tokens x (64 MiB / (4 x 1024)) = 16,384 entries; CUDA: 4096 x (128 MiB / 16 KiB) = 8192.
    assert tile_shape(5000, V, torch.device("cpu")) == (1024, 16384)
    assert tile_shape(5000, V, torch.device("cuda")) == (4096, 8192)
    assert tile_shape(300, V, torch.device("cpu")) == (300, 55808)  # 64 MiB / 1200 B = 55,924 -> 436 x 128
    assert tile_shape(300, 1000, torch.device("cpu")) == (300, 1000)  # all of a small vocabulary
    assert tile_shape(5000, V, torch.device("cpu"), chunk_size=10**6) == (5000, 3328)  # a user's chunk_size
    assert tile_shape(5000, V, torch.device("cpu"), chunk_size=64, vocab_chunk_size=500) == (64, 500)
    # a few tokens: the (C, H) float32 weight tile bounds C, not the (R, C) logits tile alone
    # (otherwise C = all of V, and a bf16 head upcast on a CPU would copy the whole weight)
    assert tile_shape(64, V, torch.device("cpu")) == (64, V)
    assert tile_shape(64, V, torch.device("cpu"), hidden=1024) == (64, 16384)
    assert tile_shape(5000, V, torch.device("cpu"), hidden=1024) == (1024, 16384)  # R already bounds it


def test_bad_arguments_raise():
    hidden, weight, targets, _, _ = inputs()
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="expected hidden"):
        token_logprobs_and_entropy(hidden, weight.t(), targets)
    with pytest.raises(ValueError, match="vocab_chunk_size"):
        token_logprobs_and_entropy(hidden, weight, targets, vocab_chunk_size=0)


# ---------------------------------------------------------------- on tiny models


def rollout_tokens(N=4, P=5, T=6, V=37, seed=0):
    """Left-padded prompts of different lengths, right-padded completions, as tether.trainer.loop builds them."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, comp_lens = [5, 3, 4, 2][:N], [6, 2, 4, 1][:N]
    ids = torch.randint(1, V, (N, P + T), generator=g)
    attention = torch.zeros(N, P + T, dtype=torch.long)
    for i in range(N):
        attention[i, P - prompt_lens[i] : P + comp_lens[i]] = 1
    ids = ids.masked_fill(attention == 0, 0)
    position = (attention.cumsum(1) - 1).clamp(min=0)
    mask = attention[:, P:].double()
    return Tokens(ids, attention, position, ids[:, P:], mask, P)


def helper(model, tok, temperature, mask=None, with_entropy=True, **kw):
    """causal_lm_token_logprobs on `tok`, every column scored unless `mask` is given."""
    tok = dataclasses.replace(tok, loss_mask=torch.ones_like(tok.loss_mask) if mask is None else mask)
    return causal_lm_token_logprobs(model, tok, LogProbSettings(temperature=temperature, **kw), with_entropy)


def model_naive(model, tok, temperature):
    """train.token_logprobs without its float32 cast: the full model's logits, in float64."""
    T = tok.completion_ids.shape[1]
    logits = model(
        input_ids=tok.input_ids, attention_mask=tok.attention_mask, position_ids=tok.position_ids, use_cache=False
    ).logits[:, tok.prompt_len - 1 : tok.prompt_len - 1 + T]
    return naive_logits(logits / (temperature if temperature > 0 else 1.0), tok.completion_ids)


def logits_float32(model, tok, temperature):
    """The model-logits path in float32 (trainer.fused_logprobs=false, without zeroing padding)."""
    T = tok.completion_ids.shape[1]
    logits = (
        model(
            input_ids=tok.input_ids, attention_mask=tok.attention_mask, position_ids=tok.position_ids, use_cache=False
        )
        .logits[:, tok.prompt_len - 1 : tok.prompt_len - 1 + T]
        .float()
    )
    return naive_logits(logits / (temperature if temperature > 0 else 1.0), tok.completion_ids)


def naive_logits(logits, targets):
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("tie", [False, True])
def test_model_helper_matches_train_token_logprobs(arch, temperature, tie):
    model = tiny(arch, tie)
    assert fused_head_reason(model) == ""
    tok = rollout_tokens()
    lp, ent, fused = helper(model, tok, temperature, chunk_size=5)
    assert fused
    # The model-logits path (float32 logits) to float32 precision ...
    ref_lp, ref_ent = logits_float32(model, tok, temperature)
    torch.testing.assert_close(lp.float(), ref_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent.float(), ref_ent, rtol=1e-6, atol=1e-6)
    # ... and the same computation in float64 exactly, gradients of every parameter included.
    ref_lp, ref_ent = model_naive(model, tok, temperature)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-12)
    got, want = param_grads(model, lp, ent, tok), param_grads(model, ref_lp, ref_ent, tok)
    assert len(got) == len(want) == len(list(model.parameters()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("fused", [True, False])
def test_the_trainer_uses_the_helper_with_padding_masked(fused):
    model = tiny("llama")
    tok = rollout_tokens(seed=4)
    lp, ent = token_logprobs(model, tok, LogProbSettings(temperature=0.7, fused=fused), with_entropy=True)
    ref_lp, ref_ent = model_naive(model, tok, 0.7)
    tol = 1e-12 if fused else 1e-6  # the model-logits path computes the softmax in float32
    torch.testing.assert_close(lp, (ref_lp * tok.loss_mask).to(lp.dtype), rtol=tol, atol=tol)
    torch.testing.assert_close(ent, (ref_ent * tok.loss_mask).to(ent.dtype), rtol=tol, atol=tol)


def test_tied_embeddings_get_both_gradients():
    model = tiny("llama", tie=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    tok = rollout_tokens(seed=3)
    lp, ent, _ = helper(model, tok, 1.0)
    (ours,) = torch.autograd.grad((lp * tok.loss_mask).sum(), model.get_input_embeddings().weight)
    ref_lp, _ = model_naive(model, tok, 1.0)
    (ref,) = torch.autograd.grad((ref_lp * tok.loss_mask).sum(), model.get_input_embeddings().weight)
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-12)
    # The head's share alone would miss the embedding lookup's: check the sum has both parts.
    rows = torch.zeros(37, dtype=torch.bool)
    rows[tok.input_ids[tok.attention_mask.bool()]] = True
    assert ours[rows].abs().sum() > 0 and ours[~rows].abs().sum() > 0


def test_model_helper_with_mask_and_no_entropy():
    model = tiny("llama")
    tok = rollout_tokens(seed=1)
    lp, ent, fused = helper(model, tok, 1.0, mask=tok.loss_mask, with_entropy=False)
    assert fused and ent is None
    assert (lp[tok.loss_mask == 0] == 0).all()
    ref_lp, _ = model_naive(model, tok, 1.0)
    torch.testing.assert_close(lp, ref_lp * tok.loss_mask, rtol=1e-12, atol=1e-12)
    (a,) = torch.autograd.grad(lp.sum(), model.model.layers[0].mlp.up_proj.weight)
    (b,) = torch.autograd.grad((ref_lp * tok.loss_mask).sum(), model.model.layers[0].mlp.up_proj.weight)
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_model_helper_float32_tight_tolerance(tiny_dir):
    from tether.model.loading import load_model

    model, _ = load_model(tiny_dir, dtype="float32")
    tok = rollout_tokens(V=len(_), seed=2)
    lp, ent, fused = helper(model, tok, 0.8)
    ref_lp, ref_ent = logits_float32(model, tok, 0.8)
    assert fused
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=2e-5)


def test_falls_back_on_logit_scaling_in_config():
    model = tiny("llama")
    model.config.logit_scale = 0.5  # as Cohere's config names it; Llama ignores it, so values must not change
    assert "logit_scale" in fused_head_reason(model)
    tok = rollout_tokens()
    lp, ent, fused = helper(model, tok, 0.7)
    assert not fused and lp.dtype == ent.dtype == torch.float64  # the logits path keeps a float64 model's precision
    ref_lp, ref_ent = logits_float32(model, tok, 0.7)
    torch.testing.assert_close(lp.float(), ref_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent.float(), ref_ent, rtol=1e-6, atol=1e-6)


def test_falls_back_when_the_model_transforms_its_logits():
    from transformers import LlamaForCausalLM

    class Scaled(LlamaForCausalLM):  # a head the static checks cannot see: logits x 3 after lm_head
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 3.0
            return out

    base = tiny("llama")
    model = Scaled(base.config).double()
    model.load_state_dict(base.state_dict())
    tok = rollout_tokens()
    lp, ent, fused = helper(model, tok, 1.0)
    assert not fused and "differ" in fused_head_reason(model)
    ref_lp, ref_ent = logits_float32(model, tok, 1.0)
    torch.testing.assert_close(lp.float(), ref_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent.float(), ref_ent, rtol=1e-6, atol=1e-6)


def test_head_with_bias_is_not_fused():
    model = tiny("llama")
    model.lm_head = torch.nn.Linear(32, 37, bias=True).double()
    assert "bias" in fused_head_reason(model)
    tok = rollout_tokens()
    assert not helper(model, tok, 1.0)[2]


def test_start_must_be_positive():
    model = tiny("llama")
    tok = rollout_tokens()
    with pytest.raises(ValueError, match="start"):
        causal_lm_token_logprobs(model, dataclasses.replace(tok, prompt_len=0))


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [{}, {"chunk_size": 8, "vocab_chunk_size": 64}])
def test_cuda_bfloat16_is_within_the_rounding_bound(tiles):
    # CUDA runs bf16 GEMMs (tensor cores) with a float32 result where torch offers it: the same bound
    # holds (its u |z| term is then not used). TF32 does not enter: no float32 GEMM runs here.
    assert ops.native_low_precision_matmul(torch.device("cuda"), torch.bfloat16)
    for seed in (0, 1):
        h, w, targets, g_lp, g_ent = bf16_case(seed)
        ref, bound = bf16_reference_and_bound(h, w, targets, 0.8, g_lp, g_ent)
        ratios = bound_ratios(bf16_head(h, w, targets, 0.8, g_lp, g_ent, device="cuda", **tiles), ref, bound)
        assert max(ratios) <= 1.25, ratios


@pytest.mark.gpu
def test_cuda_float64_matches_naive():
    hidden, weight, targets, g_lp, g_ent = (x.cuda() for x in inputs(N=2, T=300, H=16, V=1000, seed=8))
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    lp, ent = token_logprobs_and_entropy(hidden, weight, targets, temperature=0.8, chunk_size=128, vocab_chunk_size=300)
    ref_lp, ref_ent = naive(hidden, weight, targets, 0.8)
    assert_matches_naive(lp, ent, ref_lp, ref_ent, g_lp, g_ent, hidden, weight)
