"""The LM head at a few tokens per position (`CompletionHead.top` and `.logprobs`, through `causal_lm.head_pass` and
`batched_topk`), which distillation to a teacher's top-k distribution reads, on a float64 tiny Llama:

1. exactness: the chunked top-k log-probs and ids, and the student's log-probs at given ids, equal the model's own
   full log-softmax to 1e-12, with chunks of one and of three positions, shared prompts on and off, at temperature
   0.7; the unfused path (the model's logits, which tether casts to float32) to float32's rounding;
2. gradients: the parameters' gradient through the fused head's tiles equals the one through the full logits;
3. invariants: positions outside the loss mask get 0 and id 0, and nothing that needs no top-k changes.
"""

import dataclasses

import pytest
import torch
from conftest import tiny_float64_lm

from tether.model.causal_lm import LogProbSettings, Tokens, batched_logprobs, batched_topk, head_pass

V, K, TAU = 37, 5, 0.7
pytestmark = pytest.mark.usefixtures("float64_rms_norm")  # conftest: exact float64 gradients with shared prompts


def _tokens(seed=0, N=4, P=5, T=6):
    """Left-padded prompts, right-padded completions; row 3's second completion token an environment's (mask 0)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, comp_lens = [5, 5, 4, 2], [6, 2, 4, 5]
    ids = torch.randint(1, V, (N, P + T), generator=g)
    ids[1, :P] = ids[0, :P]  # rows 0 and 1 share a prompt
    attention = torch.zeros(N, P + T, dtype=torch.long)
    for i in range(N):
        attention[i, P - prompt_lens[i] : P + comp_lens[i]] = 1
    ids = ids.masked_fill(attention == 0, 0)
    mask = attention[:, P:].double()
    mask[3, 1] = 0
    return Tokens(ids, attention, (attention.cumsum(1) - 1).clamp(min=0), ids[:, P:], mask, P)


def _full_logsoftmax(model, tok):
    T = tok.completion_ids.shape[1]
    logits = model(
        input_ids=tok.input_ids, attention_mask=tok.attention_mask, position_ids=tok.position_ids, use_cache=False
    ).logits[:, tok.prompt_len - 1 : tok.prompt_len - 1 + T]
    return torch.log_softmax(logits / TAU, -1)


@pytest.mark.parametrize(
    "fused, chunk, share", [(True, 1, True), (True, 3, False), (True, 1, False), (True, 3, True), (False, None, True)]
)
def test_topk_and_gathered_log_probs_equal_the_full_softmax(fused, chunk, share):
    model = tiny_float64_lm()
    tok = _tokens()
    settings = LogProbSettings(temperature=TAU, fused=fused, chunk_size=chunk, share_prompts=share)
    full = _full_logsoftmax(model, tok)  # (N, T, V)
    keep = tok.loss_mask.bool()
    top = full.topk(K, -1)
    out = head_pass(model, tok, settings, with_entropy=False, topk=K, gather_ids=top.indices)
    assert out.fused == fused
    tol = dict(rtol=1e-12, atol=1e-12) if fused else dict(rtol=1e-5, atol=1e-5, check_dtype=False)
    values, ids = out.topk
    torch.testing.assert_close(values[keep], top.values[keep], **tol)
    assert torch.equal(ids[keep], top.indices[keep])
    assert not values[~keep].any() and not ids[~keep].any()
    torch.testing.assert_close(out.gathered[keep], top.values[keep], **tol)
    assert not out.gathered[~keep].any()
    # 2. the gradient of a fixed linear function of the gathered log-probs, through the chunks and through the logits
    w = torch.randn(out.gathered.shape, generator=torch.Generator().manual_seed(1), dtype=out.gathered.dtype)
    params = list(model.parameters())
    ours = torch.autograd.grad((out.gathered * w).sum(), params, allow_unused=True)
    theirs = torch.autograd.grad((torch.where(keep[..., None], top.values, 0) * w).sum(), params, allow_unused=True)
    tol = dict(rtol=1e-10, atol=1e-12) if fused else dict(rtol=1e-4, atol=1e-6)
    for a, b in zip(ours, theirs):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, **tol)


def test_batched_topk_runs_micro_batches_and_agrees_with_batched_logprobs():
    model = tiny_float64_lm()
    tok = _tokens(seed=2)
    settings = LogProbSettings(temperature=TAU, micro_batch_size=3)  # rows 0-2, then row 3
    lp, (values, ids) = batched_topk(model, tok, settings, K)
    torch.testing.assert_close(lp, batched_logprobs(model, tok, settings), rtol=0, atol=0)
    keep = tok.loss_mask.bool()
    top = _full_logsoftmax(model, tok).topk(K, -1)
    torch.testing.assert_close(values[keep], top.values[keep], rtol=1e-12, atol=1e-12)
    assert torch.equal(ids[keep], top.indices[keep]) and values.shape == (4, 6, K)
    assert batched_topk(model, tok, settings, 0)[1] is None
    empty = dataclasses.replace(tok, loss_mask=torch.zeros_like(tok.loss_mask))
    lp0, (v0, i0) = batched_topk(model, empty, settings, K)
    assert not lp0.any() and not v0.any() and not i0.any()
