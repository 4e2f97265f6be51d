"""Shared prompts (tether.model.causal_lm): running each distinct prompt once changes nothing but the cost.

What this proves: with the samples of a prompt sharing its forward pass (the prompt's KV cache
copied to every row), log-probs, entropies and the gradient of every parameter equal the
unshared computation in float64; the prompt really runs once per distinct prompt; and where
sharing cannot apply (no shared prompt, gradient checkpointing, a model whose cached forward
differs) the unshared path runs and says why.
"""

from __future__ import annotations

import pytest
import torch

from tether.model.causal_lm import (
    _SHARE_PROBED,
    LogProbSettings,
    Tokens,
    causal_lm_token_logprobs,
    shared_prompt_reason,
)

from conftest import param_grads
from conftest import tiny_float64_lm as tiny


pytestmark = pytest.mark.usefixtures("float64_rms_norm")  # conftest: exact float64 gradients


def grouped_tokens(
    prompt_lens=(5, 2, 4), group_sizes=(3, 1, 4), comp_lens=(6, 1, 3, 5, 2, 6, 4, 1), T=6, V=37, seed=0
) -> Tokens:
    """Left-padded prompts, each repeated for its group (one singleton), right-padded completions
    of different lengths: the layout tether.trainer.loop builds from a rollout."""
    g = torch.Generator().manual_seed(seed)
    P = max(prompt_lens)
    prompts = [torch.randint(1, V, (n,), generator=g) for n in prompt_lens]
    rows = [(prompts[i], prompt_lens[i]) for i, size in enumerate(group_sizes) for _ in range(size)]
    N = len(rows)
    ids = torch.zeros(N, P + T, dtype=torch.long)
    attention = torch.zeros(N, P + T, dtype=torch.long)
    for r, ((prompt, n), c) in enumerate(zip(rows, comp_lens)):
        ids[r, P - n : P] = prompt
        ids[r, P : P + c] = torch.randint(1, V, (c,), generator=g)
        attention[r, P - n : P + c] = 1
    position = (attention.cumsum(1) - 1).clamp(min=0)
    return Tokens(ids, attention, position, ids[:, P:], attention[:, P:].double(), P)


def run(model, tok, temperature=1.0, share=True):
    """causal_lm_token_logprobs on a Tokens batch: (log-probs, entropy, fused)."""
    return causal_lm_token_logprobs(
        model, tok, LogProbSettings(temperature=temperature, chunk_size=5, share_prompts=share)
    )


def decoder_calls(model, tok, **kw):
    """run(model, tok, **kw) after a first call (the one-off checks), and the (rows, columns)
    of every decoder call it made, recorded through the input embedding."""
    run(model, tok, **kw)
    seen = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    try:
        return run(model, tok, **kw), seen
    finally:
        handle.remove()


def assert_same(model, tok, shared, plain):
    (lp, ent, _), (ref_lp, ref_ent, _) = shared, plain
    torch.testing.assert_close(lp, ref_lp, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-11, atol=1e-11)
    got, want = param_grads(model, lp, ent, tok), param_grads(model, ref_lp, ref_ent, tok)
    assert len(got) == len(list(model.parameters()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prompts_give_the_unshared_values_and_gradients(arch, tie, temperature):
    model = tiny(arch, tie).train()
    tok = grouped_tokens()
    shared, seen = decoder_calls(model, tok, temperature=temperature)
    assert shared_prompt_reason(model) == ""
    # one pass per distinct prompt, then the 8 rows' completion columns: all but the last,
    # which predicts nothing
    assert seen == [(3, 5), (8, 5)]
    plain = run(model, tok, temperature, share=False)
    assert_same(model, tok, shared, plain)
    assert (shared[0] != 0).sum() == int(tok.loss_mask.sum())  # every real token scored, padding 0


def test_one_token_completions_run_only_the_prompts():
    model = tiny()
    shared, seen = decoder_calls(model, tok := grouped_tokens(comp_lens=(1,) * 8, T=1))
    assert seen == [(3, 5)]
    assert_same(model, tok, shared, run(model, tok, share=False))


def test_distinct_prompts_take_one_unshared_pass():
    model = tiny()
    shared, seen = decoder_calls(model, tok := grouped_tokens(group_sizes=(1, 1, 1), comp_lens=(6, 3, 1)))
    assert seen == [(3, 10)]
    assert_same(model, tok, shared, run(model, tok, share=False))


def test_gradient_checkpointing_turns_sharing_off():
    model = tiny()
    model.gradient_checkpointing_enable()
    model.train()
    shared, seen = decoder_calls(model, tok := grouped_tokens())
    assert "gradient checkpointing" in shared_prompt_reason(model)
    assert seen == [(8, 10)]
    assert_same(model, tok, shared, run(model, tok, share=False))


def test_a_model_whose_cached_forward_differs_falls_back():
    """A decoder that shifts its output whenever it is given a cache: the one-off check catches
    it, the reason is kept, and the results are the unshared ones."""
    model = tiny()
    body = model.get_decoder()

    def shift_when_cached(module, args, kwargs, out):
        cache = kwargs.get("past_key_values")
        if cache is not None and cache.get_seq_length() > 0:
            out.last_hidden_state = out.last_hidden_state + 0.5
        return out

    body.register_forward_hook(shift_when_cached, with_kwargs=True)
    tok = grouped_tokens()
    shared = run(model, tok)
    assert "differs from the full one" in shared_prompt_reason(model)
    assert_same(model, tok, shared, run(model, tok, share=False))
    _SHARE_PROBED.forget(model)


def test_rows_with_equal_ids_but_different_padding_do_not_share():
    """Prompt identity is ids and attention mask together: a real token equal to the pad id
    must not be mistaken for padding."""
    model = tiny()
    tok = grouped_tokens(prompt_lens=(3, 2), group_sizes=(2, 2), comp_lens=(4, 4, 4, 4), T=4)
    ids, attn = tok.input_ids.clone(), tok.attention_mask.clone()
    ids[2:, : tok.prompt_len] = ids[0, : tok.prompt_len]  # same ids as the first group ...
    ids[2:, 0] = 0
    ids[:2, 0] = 0  # ... with the first column a real token 0 there and padding (id 0) here
    attn[:2, 0] = 1
    attn[2:, 0] = 0
    position = (attn.cumsum(1) - 1).clamp(min=0)
    tok = Tokens(ids, attn, position, ids[:, tok.prompt_len :], attn[:, tok.prompt_len :].double(), tok.prompt_len)
    assert_same(model, tok, run(model, tok), run(model, tok, share=False))
