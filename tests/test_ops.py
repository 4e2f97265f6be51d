"""tether.ops: the chunked head against the naive log-softmax, in float64.

What is proved: (1) hand-computed values; (3) gradients of hidden and weight, through log-probs
and entropy, equal the naive ones for chunk sizes that do and do not divide the token count, and
pass gradcheck; (4) ignored targets and bfloat16 inputs; and, on tiny Llama and Qwen2 models, the
model-level helper equals the model-logits computation (float32 and float64) in values and
parameter gradients, with tied embeddings, falls back to the model's logits when its head is
not plain, and is what `tether.train.token_logprobs` computes (0 at padding).
"""

import math

import pytest
import torch

from tether.ops import IGNORE_INDEX, causal_lm_token_logprobs, fused_head_reason, token_logprobs_and_entropy
from tether.train import Tokens, token_logprobs


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
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_naive(chunk, temperature):
    hidden, weight, targets, g_lp, g_ent = inputs()  # 14 tokens: chunks 3 and 4 leave a remainder
    lp, ent = token_logprobs_and_entropy(hidden, weight, targets, temperature=temperature, chunk_size=chunk)
    ref_lp, ref_ent = naive(hidden, weight, targets, temperature)
    assert lp.dtype == ent.dtype == torch.float64
    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-12)
    got = grads((lp * g_lp).sum() + (ent * g_ent).sum(), hidden, weight)
    want = grads((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum(), hidden, weight)
    for a, b in zip(got, want):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("which", ["logprobs", "entropy"])
def test_each_output_alone_has_the_naive_gradient(which):
    hidden, weight, targets, g_lp, g_ent = inputs(seed=1)
    lp, ent = token_logprobs_and_entropy(hidden, weight, targets, temperature=1.3, chunk_size=5)
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
        return token_logprobs_and_entropy(h, w, targets, temperature=0.9, chunk_size=2)

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


def test_bfloat16_inputs_accumulate_in_float32_and_return_input_dtypes():
    hidden, weight, targets, g_lp, g_ent = inputs(N=2, T=6, H=16, V=50, dtype=torch.float32, seed=7)
    hb, wb = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    lp, ent = token_logprobs_and_entropy(hb, wb, targets, chunk_size=5)
    assert lp.dtype == ent.dtype == torch.float32
    # The reference: the same bfloat16 values, computed exactly in float64.
    h64, w64 = hb.detach().double().requires_grad_(), wb.detach().double().requires_grad_()
    ref_lp, ref_ent = naive(h64, w64, targets)
    torch.testing.assert_close(lp, ref_lp.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent.float(), rtol=1e-5, atol=1e-5)
    gh, gw = grads((lp * g_lp).sum() + (ent * g_ent).sum(), hb, wb)
    assert gh.dtype == gw.dtype == torch.bfloat16
    rh, rw = grads((ref_lp * g_lp.double()).sum() + (ref_ent * g_ent.double()).sum(), h64, w64)
    torch.testing.assert_close(gh.double(), rh, rtol=2e-2, atol=2e-2)  # bfloat16 rounding of the result
    torch.testing.assert_close(gw.double(), rw, rtol=2e-2, atol=2e-2)


def test_bad_arguments_raise():
    hidden, weight, targets, _, _ = inputs()
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(hidden, weight, targets, temperature=0.0)
    with pytest.raises(ValueError, match="expected hidden"):
        token_logprobs_and_entropy(hidden, weight.t(), targets)


# ---------------------------------------------------------------- on tiny models


def tiny(arch="llama", tie=False, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    torch.manual_seed(seed)
    cfg = cls[0](vocab_size=37, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie, pad_token_id=0)
    return cls[1](cfg).double()


def rollout_tokens(N=4, P=5, T=6, V=37, seed=0):
    """Left-padded prompts of different lengths, right-padded completions, as tether.train builds them."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, comp_lens = [5, 3, 4, 2][:N], [6, 2, 4, 1][:N]
    ids = torch.randint(1, V, (N, P + T), generator=g)
    attention = torch.zeros(N, P + T, dtype=torch.long)
    for i in range(N):
        attention[i, P - prompt_lens[i]: P + comp_lens[i]] = 1
    ids = ids.masked_fill(attention == 0, 0)
    position = (attention.cumsum(1) - 1).clamp(min=0)
    mask = attention[:, P:].double()
    return Tokens(ids, attention, position, ids[:, P:], mask, P)


def helper(model, tok, temperature, **kw):
    return causal_lm_token_logprobs(model, tok.input_ids, tok.attention_mask, tok.position_ids, tok.prompt_len,
                                    tok.completion_ids, temperature=temperature, **kw)


def param_grads(model, lp, ent, tok, seed=0):
    g = torch.Generator().manual_seed(seed)
    g_lp, g_ent = torch.randn(lp.shape, generator=g), torch.randn(lp.shape, generator=g)
    loss = ((lp * g_lp + ent * g_ent) * tok.mask).sum()
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params)


def model_naive(model, tok, temperature):
    """train.token_logprobs without its float32 cast: the full model's logits, in float64."""
    T = tok.completion_ids.shape[1]
    logits = model(input_ids=tok.input_ids, attention_mask=tok.attention_mask, position_ids=tok.position_ids,
                   use_cache=False).logits[:, tok.prompt_len - 1: tok.prompt_len - 1 + T]
    return naive_logits(logits / (temperature if temperature > 0 else 1.0), tok.completion_ids)


def logits_float32(model, tok, temperature):
    """The model-logits path in float32 (trainer.fused_logprobs=false, without zeroing padding)."""
    T = tok.completion_ids.shape[1]
    logits = model(input_ids=tok.input_ids, attention_mask=tok.attention_mask, position_ids=tok.position_ids,
                   use_cache=False).logits[:, tok.prompt_len - 1: tok.prompt_len - 1 + T].float()
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
    lp, ent = token_logprobs(model, tok, 0.7, with_entropy=True, fused=fused)
    ref_lp, ref_ent = model_naive(model, tok, 0.7)
    tol = 1e-12 if fused else 1e-6  # the model-logits path computes the softmax in float32
    torch.testing.assert_close(lp, (ref_lp * tok.mask).to(lp.dtype), rtol=tol, atol=tol)
    torch.testing.assert_close(ent, (ref_ent * tok.mask).to(ent.dtype), rtol=tol, atol=tol)


def test_tied_embeddings_get_both_gradients():
    model = tiny("llama", tie=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    tok = rollout_tokens(seed=3)
    lp, ent, _ = helper(model, tok, 1.0)
    (ours,) = torch.autograd.grad((lp * tok.mask).sum(), model.get_input_embeddings().weight)
    ref_lp, _ = model_naive(model, tok, 1.0)
    (ref,) = torch.autograd.grad((ref_lp * tok.mask).sum(), model.get_input_embeddings().weight)
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-12)
    # The head's share alone would miss the embedding lookup's: check the sum has both parts.
    rows = torch.zeros(37, dtype=torch.bool)
    rows[tok.input_ids[tok.attention_mask.bool()]] = True
    assert ours[rows].abs().sum() > 0 and ours[~rows].abs().sum() > 0


def test_model_helper_with_mask_and_no_entropy():
    model = tiny("llama")
    tok = rollout_tokens(seed=1)
    lp, ent, fused = helper(model, tok, 1.0, mask=tok.mask, with_entropy=False)
    assert fused and ent is None
    assert (lp[tok.mask == 0] == 0).all()
    ref_lp, _ = model_naive(model, tok, 1.0)
    torch.testing.assert_close(lp, ref_lp * tok.mask, rtol=1e-12, atol=1e-12)
    (a,) = torch.autograd.grad(lp.sum(), model.model.layers[0].mlp.up_proj.weight)
    (b,) = torch.autograd.grad((ref_lp * tok.mask).sum(), model.model.layers[0].mlp.up_proj.weight)
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_model_helper_float32_tight_tolerance(tiny_dir):
    from tether.models import load_model

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
    assert not fused
    ref_lp, ref_ent = logits_float32(model, tok, 0.7)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-6, atol=1e-6)


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
    torch.testing.assert_close(lp, ref_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-6, atol=1e-6)


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
        causal_lm_token_logprobs(model, tok.input_ids, tok.attention_mask, tok.position_ids, 0, tok.completion_ids)


@pytest.mark.gpu
def test_cuda_bfloat16_matches_float64_reference():
    hidden, weight, targets, g_lp, g_ent = inputs(N=2, T=300, H=64, V=1000, dtype=torch.float32, seed=8)
    hb = hidden.detach().bfloat16().cuda().requires_grad_()
    wb = weight.detach().bfloat16().cuda().requires_grad_()
    lp, ent = token_logprobs_and_entropy(hb, wb, targets.cuda(), temperature=0.8, chunk_size=128)
    gh, gw = grads((lp * g_lp.cuda()).sum() + (ent * g_ent.cuda()).sum(), hb, wb)
    h64, w64 = hb.detach().cpu().double().requires_grad_(), wb.detach().cpu().double().requires_grad_()
    ref_lp, ref_ent = naive(h64, w64, targets, 0.8)
    rh, rw = grads((ref_lp * g_lp.double()).sum() + (ref_ent * g_ent.double()).sum(), h64, w64)
    torch.testing.assert_close(lp.cpu().double(), ref_lp, rtol=1e-4, atol=1e-4)  # TF32 would loosen this
    torch.testing.assert_close(ent.cpu().double(), ref_ent, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gh.cpu().double(), rh, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gw.cpu().double(), rw, rtol=2e-2, atol=2e-2)
