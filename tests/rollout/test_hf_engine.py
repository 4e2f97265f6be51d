"""tether.rollout: the HF engine's tokens, log-probs, stop handling and seeding, on CPU."""

from __future__ import annotations

import pytest
import torch

from tether.model.loading import init_model, load_model
from tether.rollout import (
    HFEngine,
    RolloutBatch,
    SamplingParams,
    engine_names,
    get_engine,
    sample_categorical,
    sample_tokens,
    top_p_filter,
)

PROMPTS = ["12+3=", "9,8,7=016:", "7*7="]  # different lengths: exercises left padding


@pytest.fixture(scope="module")
def model_and_tok(tmp_path_factory):
    path = init_model(tmp_path_factory.mktemp("m"), hidden_size=64, num_layers=2, num_heads=4, seed=0)
    return load_model(path)


@pytest.fixture(scope="module")
def stopping(tmp_path_factory):
    """A random model whose eos logit is raised by 4, so most samples stop within a few tokens."""
    path = init_model(tmp_path_factory.mktemp("s"), hidden_size=64, num_layers=2, num_heads=4, seed=1)
    model, tok = load_model(path)
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = 4.0
    model.lm_head = head
    return model, tok


def recomputed_logits(model, batch: RolloutBatch, i: int) -> torch.Tensor:
    """(L, V) logits predicting sample i's completion tokens, from one unpadded full forward."""
    length = int(batch.mask[i].sum())
    prompt = batch.prompt_ids[i]
    ids = torch.tensor([prompt + batch.completion_ids[i, :length].tolist()], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + length]


def test_registry(model_and_tok):
    model, tok = model_and_tok
    assert "hf" in engine_names()
    assert isinstance(get_engine("hf", model=model, tokenizer=tok), HFEngine)
    with pytest.raises(KeyError, match="hf"):
        get_engine("vllmm")


def test_batch_layout(stopping):
    model, tok = stopping
    batch = HFEngine(model, tok).generate(PROMPTS, n=4, params=SamplingParams(max_new_tokens=12), seed=0)
    n, t = batch.completion_ids.shape
    assert n == 12 and len(batch) == 12 and t <= 12
    assert int(batch.completion_lengths.max()) == t  # padded to the longest completion, no further
    assert batch.prompt_index == [0] * 4 + [1] * 4 + [2] * 4
    assert [tok.decode(p) for p in batch.prompt_ids] == [p for p in PROMPTS for _ in range(4)]
    assert batch.completion_ids.dtype == torch.long and batch.mask.dtype == torch.bool
    assert batch.sampler_logprobs.dtype == torch.float32
    assert (batch.completion_ids[~batch.mask] == tok.pad_token_id).all()
    assert (batch.sampler_logprobs[~batch.mask] == 0).all() and (batch.sampler_logprobs[batch.mask] < 0).all()
    # mask is a prefix: True then False
    assert torch.equal(batch.mask, torch.arange(t)[None, :] < batch.completion_lengths[:, None])


def test_seeded_reproducibility(model_and_tok):
    model, tok = model_and_tok
    engine = HFEngine(model, tok, batch_size=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=10)
    a = engine.generate(PROMPTS, n=3, params=params, seed=7)
    b = engine.generate(PROMPTS, n=3, params=params, seed=7)
    c = engine.generate(PROMPTS, n=3, params=params, seed=8)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.sampler_logprobs, b.sampler_logprobs)
    assert a.completions == b.completions
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # the samples of one prompt differ from each other (one generator stream, not one per row)
    assert not torch.equal(a.completion_ids[0], a.completion_ids[1])


def test_stop_token_is_in_the_mask(stopping):
    model, tok = stopping
    batch = HFEngine(model, tok).generate(PROMPTS, n=8, params=SamplingParams(max_new_tokens=24), seed=0)
    stopped = [i for i, r in enumerate(batch.finish_reasons) if r == "stop"]
    assert len(stopped) >= 12  # eos is likely: most of the 24 samples stop
    for i in stopped:
        length = int(batch.mask[i].sum())
        assert batch.completion_ids[i, length - 1] == tok.eos_token_id
        assert batch.mask[i, length - 1]  # the stop token counts
        assert (batch.completion_ids[i, : length - 1] != tok.eos_token_id).all()
        assert batch.completions[i] == tok.decode(batch.completion_ids[i, : length - 1], skip_special_tokens=True)
    for i, reason in enumerate(batch.finish_reasons):
        if reason == "length":
            assert batch.mask[i].all() and batch.completion_lengths[i] == 24


def test_max_new_tokens_honoured(model_and_tok):
    model, tok = model_and_tok
    batch = HFEngine(model, tok).generate(PROMPTS, n=2, params=SamplingParams(max_new_tokens=5), seed=0)
    assert batch.completion_ids.shape == (6, 5)
    assert all(r == "length" for r in batch.finish_reasons) and batch.mask.all()


def test_stop_token_ids_extra(stopping):
    model, tok = stopping
    digits = tuple(tok.convert_tokens_to_ids(list("0123456789")))
    batch = HFEngine(model, tok).generate(
        PROMPTS, n=4, params=SamplingParams(max_new_tokens=40, stop_token_ids=digits), seed=3
    )
    for i, reason in enumerate(batch.finish_reasons):
        length = int(batch.mask[i].sum())
        last = int(batch.completion_ids[i, length - 1])
        assert (reason == "stop") == (last in digits or last == tok.eos_token_id)
        assert not any(c.isdigit() for c in batch.completions[i])  # the stop digit is not in the text


@pytest.mark.parametrize("batch_size", [None, 5])
def test_sampler_logprobs_match_recomputed(stopping, batch_size):
    model, tok = stopping
    batch = HFEngine(model, tok, batch_size=batch_size).generate(
        PROMPTS, n=4, params=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=16), seed=0
    )
    assert len(set(batch.completion_lengths.tolist())) > 2  # padding really varies
    for i in range(len(batch)):
        length = int(batch.mask[i].sum())
        logits = recomputed_logits(model, batch, i)
        expected = logits.log_softmax(-1).gather(-1, batch.completion_ids[i, :length, None]).squeeze(-1)
        torch.testing.assert_close(batch.sampler_logprobs[i, :length], expected, atol=1e-4, rtol=0)


def test_prefill_runs_each_distinct_prompt_once(stopping):
    """The n samples of a prompt share its prefill: the first forward has one row per distinct
    prompt, and the sampler's log-probs are still the policy's (checked against a recompute)."""
    model, tok = stopping
    seen = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, a, out: seen.append(tuple(a[0].shape)))
    try:
        batch = HFEngine(model, tok).generate(PROMPTS, n=4, params=SamplingParams(max_new_tokens=6), seed=3)
    finally:
        handle.remove()
    assert seen[0] == (3, max(len(p) for p in PROMPTS)) and seen[1] == (12, 1)
    for i in range(len(batch)):
        length = int(batch.mask[i].sum())
        expected = recomputed_logits(model, batch, i).log_softmax(-1)
        expected = expected.gather(-1, batch.completion_ids[i, :length, None]).squeeze(-1)
        torch.testing.assert_close(batch.sampler_logprobs[i, :length], expected, atol=1e-4, rtol=0)


def test_finished_rows_leave_the_batch_and_the_rest_are_unaffected(stopping):
    """Once at most half the decoded rows are still running, finished ones are dropped from the
    batch and the KV cache: later decode steps run fewer rows, and every kept row's tokens,
    log-probs (against a full recompute), length and stop reason are still right."""
    model, tok = stopping
    seen = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, a, out: seen.append(a[0].shape[0]))
    try:
        batch = HFEngine(model, tok).generate(PROMPTS, n=8, params=SamplingParams(max_new_tokens=16), seed=5)
    finally:
        handle.remove()
    decode_rows = seen[1:]
    assert decode_rows[0] == 24 and min(decode_rows) < 12 and decode_rows == sorted(decode_rows, reverse=True)
    lengths = batch.mask.sum(1)
    assert len(set(lengths.tolist())) > 3 and int(lengths.max()) > 3
    for i in range(len(batch)):
        length = int(lengths[i])
        assert (batch.completion_ids[i, length:] == tok.pad_token_id).all()
        assert (batch.finish_reasons[i] == "stop") == (int(batch.completion_ids[i, length - 1]) == tok.eos_token_id)
        expected = recomputed_logits(model, batch, i).log_softmax(-1)
        expected = expected.gather(-1, batch.completion_ids[i, :length, None]).squeeze(-1)
        torch.testing.assert_close(batch.sampler_logprobs[i, :length], expected, atol=1e-4, rtol=0)


def test_temperature_logprobs_are_of_the_scaled_distribution(model_and_tok):
    model, tok = model_and_tok
    batch = HFEngine(model, tok).generate(
        PROMPTS, n=2, params=SamplingParams(temperature=0.5, max_new_tokens=8), seed=0
    )
    for i in range(len(batch)):
        logits = recomputed_logits(model, batch, i)
        expected = (logits / 0.5).log_softmax(-1).gather(-1, batch.completion_ids[i, :8, None]).squeeze(-1)
        torch.testing.assert_close(batch.sampler_logprobs[i], expected, atol=1e-4, rtol=0)


def test_greedy_is_argmax(stopping):
    model, tok = stopping
    engine = HFEngine(model, tok)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    batch = engine.generate(PROMPTS, n=2, params=params, seed=None)
    again = engine.generate(PROMPTS, n=2, params=params, seed=123)
    assert torch.equal(batch.completion_ids, again.completion_ids)  # greedy ignores the seed
    assert torch.equal(batch.completion_ids[0::2], batch.completion_ids[1::2])
    for i in range(len(batch)):
        length = int(batch.mask[i].sum())
        logits = recomputed_logits(model, batch, i)
        assert torch.equal(batch.completion_ids[i, :length], logits.argmax(-1))
        # greedy stores the unscaled model's log-prob of the chosen token
        torch.testing.assert_close(
            batch.sampler_logprobs[i, :length], logits.log_softmax(-1).max(-1).values, atol=1e-4, rtol=0
        )


def test_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    # probs about [0.644, 0.237, 0.087, 0.032]: mass before each token [0, 0.644, 0.881, 0.968]
    kept = torch.isfinite(top_p_filter(logits, 0.7))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(top_p_filter(logits, 0.5)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(top_p_filter(logits[:, [3, 1, 0, 2]], 0.9)).tolist() == [[False, True, True, True]]


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.9)])
def test_sampling_draws_from_the_tempered_nucleus_with_its_logprobs(temperature, top_p):
    """200,000 draws from one row: frequencies match softmax(logits / T) renormalised over the
    top-p nucleus (to 5 standard errors), excluded tokens never appear, and every recorded
    log-prob is that distribution's."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0, 0.5])
    n = 200_000
    tokens, logprobs = sample_tokens(logits.expand(n, -1), temperature, top_p, torch.Generator().manual_seed(0))
    target = top_p_filter((logits / temperature)[None], top_p).log_softmax(-1)[0]
    assert_draws_follow(tokens, target)
    torch.testing.assert_close(logprobs, target[tokens], atol=1e-6, rtol=0)


def assert_draws_follow(tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
    n = tokens.numel()
    freq = torch.bincount(tokens, minlength=logprobs.numel()).double() / n
    probs = logprobs.exp().double()
    assert (freq[probs == 0] == 0).all()
    assert torch.all((freq - probs).abs() <= 5 * (probs * (1 - probs) / n).sqrt() + 1e-12)


@pytest.mark.parametrize("block", [1, 2, 4, 5, 7])
def test_two_level_sampling_is_exact_for_any_block_size(block):
    """Blocks that do and do not divide V (the last one shorter), with an excluded token at a
    block edge: the draws still follow softmax(logits)."""
    logits = torch.tensor([0.3, -float("inf"), 1.2, -0.5, 2.0, 0.0, -2.0])
    n = 200_000
    tokens, logprobs = sample_categorical(logits.expand(n, -1), torch.Generator().manual_seed(2), block=block)
    target = logits.log_softmax(-1)
    assert_draws_follow(tokens, target)
    torch.testing.assert_close(logprobs, target[tokens], atol=1e-6, rtol=0)


def test_sampling_never_draws_an_excluded_token():
    """Zero-weight tokens (-inf logits) have empty intervals, first, last or between, and a
    near-certain token next to many tiny ones is still drawn with its exact probability."""
    inf = float("inf")
    gen = torch.Generator().manual_seed(1)
    logits = torch.tensor([[-inf, 0.0, -inf, 1.0, -inf]]).expand(50_000, -1)
    tokens, logprobs = sample_categorical(logits, gen)
    assert set(tokens.unique().tolist()) == {1, 3}
    torch.testing.assert_close(logprobs, logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1))
    wide = torch.full((4, 151_936), -30.0)
    wide[:, -1] = 0.0  # the last token holds all but ~1e-8 of the mass
    assert (sample_categorical(wide, gen)[0] == 151_935).all()
    tokens, _ = sample_categorical(torch.tensor([[-inf, -inf, 5.0]]).expand(1000, -1), gen)
    assert (tokens == 2).all()


def test_tiny_top_p_is_greedy_with_logprob_zero(stopping):
    model, tok = stopping
    engine = HFEngine(model, tok)
    nucleus = engine.generate(PROMPTS, n=1, params=SamplingParams(top_p=1e-6, max_new_tokens=10), seed=0)
    greedy = engine.generate(PROMPTS, n=1, params=SamplingParams(temperature=0, max_new_tokens=10), seed=0)
    assert torch.equal(nucleus.completion_ids, greedy.completion_ids)
    assert (nucleus.sampler_logprobs == 0).all()  # a one-token nucleus has probability 1


def test_stop_string(model_and_tok):
    model, tok = model_and_tok
    engine = HFEngine(model, tok)
    params = SamplingParams(max_new_tokens=20)
    free = engine.generate(PROMPTS, n=2, params=params, seed=5)
    text = free.completions[0]
    stop = text[6:8]  # a two-character string the model is known to produce with this seed
    assert len(stop) == 2 and stop not in text[:7]
    cut = engine.generate(PROMPTS, n=2, params=SamplingParams(max_new_tokens=20, stop_strings=(stop,)), seed=5)
    assert cut.finish_reasons[0] == "stop"
    assert cut.completions[0] == text[: text.index(stop)]
    length = int(cut.mask[0].sum())
    assert length == 8  # tokens through the one completing the stop string, which counts
    assert torch.equal(cut.completion_ids[0, :length], free.completion_ids[0, :length])
    for i, reason in enumerate(cut.finish_reasons):
        assert stop not in cut.completions[i]
        ids = cut.completion_ids[i, : int(cut.mask[i].sum())]
        if reason == "stop" and ids[-1] != tok.eos_token_id:
            assert tok.decode(ids, skip_special_tokens=True).endswith(
                stop
            )  # stopped on the token completing the string


def test_restores_training_mode_and_validates(model_and_tok):
    model, tok = model_and_tok
    model.train()
    HFEngine(model, tok).generate(["1+1="], n=1, params=SamplingParams(max_new_tokens=2), seed=0)
    assert model.training
    model.eval()
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="stop_strings"):
        SamplingParams(stop_strings="\n")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n >= 1"):
        HFEngine(model, tok).generate(["1+1="], n=0, params=SamplingParams())


@pytest.mark.gpu
def test_cuda_bfloat16(tmp_path):
    path = init_model(tmp_path / "g", hidden_size=64, num_layers=2, num_heads=4, seed=0)
    model, tok = load_model(path, dtype="auto", device="cuda")  # auto: bfloat16 on CUDA
    assert model.dtype == torch.bfloat16
    engine = HFEngine(model, tok)
    params = SamplingParams(max_new_tokens=16)
    a = engine.generate(PROMPTS, n=4, params=params, seed=0)
    b = engine.generate(PROMPTS, n=4, params=params, seed=0)
    assert a.completion_ids.is_cuda and torch.equal(a.completion_ids, b.completion_ids)
    for i in range(len(a)):
        length = int(a.mask[i].sum())
        expected = recomputed_logits(model, a, i).float().log_softmax(-1)
        expected = expected.gather(-1, a.completion_ids[i, :length, None]).squeeze(-1)
        torch.testing.assert_close(a.sampler_logprobs[i, :length], expected, atol=0.1, rtol=0)  # bf16 noise
