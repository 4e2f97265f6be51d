"""tether.rollout.static: the compiled decode on a static KV cache samples what the eager one does.

On CPU, in float32, the compiled path (inductor) and the eager path (dynamic cache) run the same
loop on logits equal to rounding, and every row draws its own uniform each step whichever rows
a decoder runs, so tokens, finish reasons and texts must be identical and log-probs equal to
1e-5. Compiling costs seconds per bucket shape; the tests share a handful of shapes (cache
length 64 with 12 rows and their power-of-two buckets; length 128 with 6 rows).
"""

from __future__ import annotations

import pytest
import torch

from tether.model.loading import init_model, load_model
from tether.rollout import HFEngine, SamplingParams
from tether.rollout.static import StaticDecoder, bucket_size, next_pow2, static_decode_reason

PROMPTS = ["12+3=", "9,8,7=016:", "7*7="]  # different lengths: left padding


def eos_biased(path, bias: float):
    """The model at `path` with eos's logit raised by `bias`: rows stop at spread-out lengths."""
    model, tok = load_model(path)
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = bias
    model.lm_head = head
    return model.eval(), tok


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = init_model(tmp_path_factory.mktemp("l"), hidden_size=64, num_layers=2, num_heads=4, seed=1)
    return eos_biased(path, bias=2.5)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = init_model(tmp_path_factory.mktemp("q"), arch="qwen2", hidden_size=64, num_layers=2, num_heads=4, seed=2)
    return eos_biased(path, bias=0.0)  # rows run long: one bucket, many steps


def assert_same_rollout(eager, compiled) -> None:
    assert torch.equal(eager.completion_ids, compiled.completion_ids)
    assert torch.equal(eager.mask, compiled.mask)
    assert eager.finish_reasons == compiled.finish_reasons and eager.completions == compiled.completions
    torch.testing.assert_close(compiled.sampler_logprobs, eager.sampler_logprobs, atol=1e-5, rtol=0)


def test_bucket_sizes():
    # shrink only when at most half the rows run, to the power of two holding them
    assert [next_pow2(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert bucket_size(12, 24) == 16 and bucket_size(5, 24) == 8 and bucket_size(13, 24) is None
    assert bucket_size(9, 16) is None and bucket_size(8, 16) == 8 and bucket_size(1, 16) == 1
    assert bucket_size(1, 1) is None and bucket_size(1, 3) == 1 and bucket_size(2, 5) == 2


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=16),
        SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=16),
        SamplingParams(temperature=1.0, max_new_tokens=16, stop_strings=("1", "+")),
    ],
    ids=["t1", "t0.7-p0.9", "stop-strings"],
)
def test_compiled_matches_eager_while_rows_leave_in_buckets(llama, params):
    """12 rows stopping at spread-out lengths: the compiled decode moves the running rows into
    buckets of 8, 4, ... rows, and every token, length, reason and text equals the eager path's."""
    model, tok = llama
    eager = HFEngine(model, tok, compile=False).generate(PROMPTS, n=4, params=params, seed=5)
    engine = HFEngine(model, tok, compile=True)
    compiled = engine.generate(PROMPTS, n=4, params=params, seed=5)
    assert_same_rollout(eager, compiled)
    lengths = eager.mask.sum(1)
    assert len(set(lengths.tolist())) > 3 and int(lengths.max()) > 8  # rows really finish at different steps
    buckets = set(engine._static._caches)
    assert 12 in buckets and {8, 4} & buckets  # it did shrink...
    assert all(b == 12 or b & (b - 1) == 0 for b in buckets)  # ...into powers of two
    if params.stop_strings:
        assert any(
            r == "stop" and not c.endswith(tok.eos_token) for r, c in zip(compiled.finish_reasons, compiled.completions)
        )
        for text in compiled.completions:
            assert not any(s in text for s in params.stop_strings)


def test_compiled_stop_token_max_tokens_and_logprobs(llama):
    """The stop token is in the mask, rows that never stop run exactly max_new_tokens, and the
    log-probs are the policy's (against one full forward per row)."""
    model, tok = llama
    batch = HFEngine(model, tok, compile=True).generate(PROMPTS, n=4, params=SamplingParams(max_new_tokens=16), seed=5)
    assert batch.completion_ids.shape[1] <= 16
    for i in range(len(batch)):
        length = int(batch.mask[i].sum())
        ids = batch.completion_ids[i, :length]
        if batch.finish_reasons[i] == "stop":
            assert ids[-1] == tok.eos_token_id and batch.mask[i, length - 1]
        else:
            assert length == 16
        full = torch.tensor([batch.prompt_ids[i] + ids.tolist()])
        with torch.no_grad():
            logits = model(input_ids=full).logits[0, len(batch.prompt_ids[i]) - 1 : -1]
        expected = logits.log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
        torch.testing.assert_close(batch.sampler_logprobs[i, :length], expected, atol=1e-5, rtol=0)


def test_compiled_seeds_and_reuse(llama):
    """The same seed gives the same rollout; another seed another; chunks (batch_size=8: 8 and 4
    rows) match the eager chunks; the bucket caches are allocated once and reused across calls
    and across engines on the same model."""
    model, tok = llama
    engine = HFEngine(model, tok, batch_size=8, compile=True)
    params = SamplingParams(max_new_tokens=12)
    a = engine.generate(PROMPTS, n=4, params=params, seed=11)
    caches = dict(engine._static._caches)
    b = engine.generate(PROMPTS, n=4, params=params, seed=11)
    c = engine.generate(PROMPTS, n=4, params=params, seed=12)
    assert_same_rollout(a, b)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    assert all(engine._static._caches[k] is v for k, v in caches.items())
    other = HFEngine(model, tok, batch_size=8, compile=True)  # another engine on the same model: the same decoder
    assert_same_rollout(other.generate(PROMPTS, n=4, params=params, seed=12), c)
    assert other._static is engine._static
    assert_same_rollout(
        HFEngine(model, tok, batch_size=8, compile=False).generate(PROMPTS, n=4, params=params, seed=11), a
    )


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_compiled_qwen2_and_a_longer_cache(qwen2, temperature):
    """Another architecture, and prompts + tokens beyond 64 columns: the cache grows to 128
    columns, stays there for a shorter call, and the tokens equal the eager path's over 70
    steps, sampled or greedy."""
    model, tok = qwen2
    engine = HFEngine(model, tok, compile=True)
    for steps, length in [(70, 128), (8, 128)]:
        params = SamplingParams(temperature=temperature, max_new_tokens=steps)
        eager = HFEngine(model, tok, compile=False).generate(PROMPTS, n=2, params=params, seed=3)
        compiled = engine.generate(PROMPTS, n=2, params=params, seed=3)
        assert engine._static._length == length
        assert_same_rollout(eager, compiled)


def test_compile_choice_and_errors(llama, monkeypatch):
    model, tok = llama
    cpu = torch.device("cpu")
    assert HFEngine(model, tok).decode_path(cpu).startswith("eager")  # auto: eager on CPU
    assert HFEngine(model, tok, compile=True).decode_path(cpu).startswith("compiled")
    assert static_decode_reason(model) is None
    with pytest.raises(ValueError, match="compile must be"):
        HFEngine(model, tok, compile="yes")
    monkeypatch.setattr(model, "_can_compile_fullgraph", False, raising=False)
    reason = static_decode_reason(model)
    assert reason is not None and "LlamaForCausalLM" in reason
    assert reason in HFEngine(model, tok).decode_path(torch.device("cuda"))  # auto falls back, saying why
    with pytest.raises(ValueError, match="compiled decode unavailable"):
        StaticDecoder(model)


@pytest.mark.gpu
def test_cuda_compiled_matches_eager_float32(tmp_path):
    """On CUDA, in float32, CUDA-graph decode and eager decode sample the same tokens."""
    path = init_model(tmp_path / "g", hidden_size=64, num_layers=2, num_heads=4, seed=1)
    model, tok = eos_biased(path, bias=2.5)
    model.cuda()
    params = SamplingParams(max_new_tokens=24)
    eager = HFEngine(model, tok, compile=False).generate(PROMPTS, n=16, params=params, seed=0)
    engine = HFEngine(model, tok)
    assert engine.decode_path(model.device).startswith("compiled")  # the default on CUDA
    first = engine.generate(PROMPTS, n=16, params=params, seed=0)
    again = engine.generate(PROMPTS, n=16, params=params, seed=0)  # replays the recorded graphs
    assert_same_rollout(eager, first)
    assert_same_rollout(first, again)


@pytest.mark.gpu
def test_cuda_compiled_bfloat16_logprobs(tmp_path):
    """The default CUDA path in bf16: seeds reproduce, stop tokens count, log-probs are the
    policy's to bf16 rounding."""
    path = init_model(tmp_path / "b", hidden_size=64, num_layers=2, num_heads=4, seed=1)
    model, tok = load_model(path, dtype="auto", device="cuda")
    engine = HFEngine(model, tok)
    params = SamplingParams(max_new_tokens=16)
    a = engine.generate(PROMPTS, n=8, params=params, seed=0)
    b = engine.generate(PROMPTS, n=8, params=params, seed=0)
    assert a.completion_ids.is_cuda and torch.equal(a.completion_ids, b.completion_ids)
    for i in range(len(a)):
        length = int(a.mask[i].sum())
        ids = a.completion_ids[i, :length]
        full = torch.tensor([a.prompt_ids[i] + ids.tolist()], device="cuda")
        with torch.no_grad():
            logits = model(input_ids=full).logits[0, len(a.prompt_ids[i]) - 1 : -1].float()
        expected = logits.log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
        torch.testing.assert_close(a.sampler_logprobs[i, :length], expected, atol=0.1, rtol=0)  # bf16 noise
