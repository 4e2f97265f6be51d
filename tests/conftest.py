"""What the tests share: the test reward, the tiny model fixture, the small run's config, the
child-process runner of the kill/resume tests, a float64 causal LM, and the GPU skip.

Test modules import the plain helpers from here (`from conftest import ...`), never from one
another. Markers (pyproject.toml): `slow` trains a model for more than a few seconds, `soak` is the
long kill/resume cycle, `gpu` needs CUDA; the fast subset is `pytest -m "not slow and not soak"`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tether.rewards import REWARDS, RewardResult

DIGIT_REWARD = "test_starts_with_digit"

# Real benchmark data beside the checkout (../shared/data/math); tests that read it skip without it.
MATH_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "math"
needs_math_data = pytest.mark.skipif(not MATH_DATA.is_dir(), reason=f"{MATH_DATA} not present")

# The long real-model test (SmolLM2-135M-Instruct through scripts/get_model.sh: eval on benchmark files, vLLM,
# staleness, kill and resume, export, TRL; 10-20 minutes of 2-core CPU) runs only when asked for:
# TETHER_REAL_MODEL_TESTS=1. The short one (fetch, eval, 2 LoRA steps, log-probs against transformers) runs in
# the full suite, CI included (tests/model/test_real_model.py).
needs_real_model = pytest.mark.skipif(
    os.environ.get("TETHER_REAL_MODEL_TESTS") != "1",
    reason="real-model test: set TETHER_REAL_MODEL_TESTS=1 to fetch and run it",
)

# `python tests/cli_runner.py ARGS...` is `tether ARGS...` in a fresh process with DIGIT_REWARD registered.
CLI_RUNNER = Path(__file__).with_name("cli_runner.py")
KILL_RESUME_STEPS = 5


def _starts_with_digit(completion, example):
    """A reward an untrained model earns about half the time: variance in every group."""
    ok = completion[:1].isdigit()
    return RewardResult(float(ok), {"digit": float(ok)})


if DIGIT_REWARD not in REWARDS:
    REWARDS.register(DIGIT_REWARD)(_starts_with_digit)


@pytest.fixture(scope="session")
def default_warm_start_cache(tmp_path_factory):
    """One warm-start cache for the tests that train the default pipeline from its warm start (the learning
    test and the soak): its key (seed 0, the default task and model) is theirs alike, so the 1150 supervised
    steps run once per session (about 3 minutes of a 2-core CI run) instead of once per test. Never the user's."""
    return tmp_path_factory.mktemp("default-warm-start")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny Llama model with a character tokenizer, saved locally (the from_pretrained path)."""
    from tether.model.loading import init_model

    path = tmp_path_factory.mktemp("model") / "tiny"
    init_model(path, hidden_size=64, num_layers=2, num_heads=2, seed=0)
    return path


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    # A test module that sets torch's default dtype at import changes every test collected with it (a float64
    # default moved verl's dppo loss by 1e-8 in a test two files away): pass dtype= explicitly instead.
    if torch.get_default_dtype() != torch.float32:
        raise pytest.UsageError(
            f"a test module set torch's default dtype to {torch.get_default_dtype()} at import; "
            "give its tensors dtype= instead"
        )
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---------------------------------------------------------------- small training runs


def tiny_run(tiny_dir, *extra, out=None) -> list[str]:
    """The overrides every small run of the tiny model in the tests starts from (one list, not a copy per test file):
    no warm start, the test reward, 4 prompts x 4 samples of up to 6 tokens, 8 held-out problems, one thread; `out`
    the run directory (none: the caller's, as `tether compare` sets it); `extra` overrides come last, and win."""
    return [
        f"model.name_or_path={tiny_dir}",
        *([f"output_dir={out}"] if out is not None else []),
        "warm_start.enabled=false",
        f"reward.name={DIGIT_REWARD}",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=6",
        "data.eval_size=8",
        "trainer.threads=1",
        *extra,
    ]


def train_config(tiny_dir, out, *extra):
    """The small in-process run on the tiny model: 4 prompts x 4 samples, 2 mini-batches of 2 micro-batches,
    evaluation and a checkpoint every 2 steps, one thread; `extra` overrides come last."""
    from tether.config.loading import load_config

    return load_config(None, tiny_run(tiny_dir, *SMALL_UPDATE, "trainer.progress=false", *extra, out=out))


SMALL_UPDATE = ["trainer.mini_batches=2", "trainer.micro_batch_size=4", "trainer.lr=3e-3"]
SMALL_UPDATE += ["trainer.eval_every=2", "trainer.save_every=2"]
"""2 mini-batches of 2 micro-batches, lr 3e-3, an evaluation and a checkpoint every 2 steps."""


def metrics_rows(run):
    """A run's metrics.jsonl, one dict per line."""
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def untimed(row: dict) -> dict:
    """A metrics row without its wall-clock `time/*` keys: what two runs that should agree must agree on."""
    return {k: v for k, v in row.items() if not k.startswith("time/")}


def checkpoint_weights(run, step):
    """The model weights of a run's checkpoint at `step`."""
    from safetensors.torch import load_file

    return load_file(str(Path(run) / "checkpoints" / f"step_{step:06d}" / "model" / "model.safetensors"))


# ---------------------------------------------------------------- a run in a child process


def kill_resume_overrides(tiny_dir, out):
    """The kill/resume run: KILL_RESUME_STEPS steps of ATR-GRPO on the tiny model, a checkpoint every 2 steps.
    4 prompts x 4 samples, 2 mini-batches x 2 micro-batches: 4 backward passes per step."""
    extra = ["trainer.progress=false", "trainer.keep_last=2", "trainer.plots=false"]
    return tiny_run(
        tiny_dir, *SMALL_UPDATE, *extra, f"trainer.total_steps={KILL_RESUME_STEPS}", "objective=atr_grpo", out=out
    )


def tether_child(*args, kill_at=None, timeout=300):
    """`tether ARGS` in a child process (CLI_RUNNER); `kill_at` is tether.faults' TETHER_KILL_AT point."""
    env = {**os.environ, "TETHER_KILL_AT": kill_at or ""}
    return subprocess.run(
        [sys.executable, str(CLI_RUNNER), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


# ---------------------------------------------------------------- a scripted engine for episodes


class Scripted:
    """A rollout engine whose turns are scripted replies ending on eos, the same for every row (an untrained
    model seldom samples eos): call k returns replies[k % len(replies)]; log-prob -0.5 per token."""

    def __init__(self, tok, replies=("4", " x y", "7+5=12")):
        self.tok, self.replies, self.calls = tok, replies, 0

    def generate_ids(self, rows, params, seed=None):
        from tether.rollout import RolloutBatch

        text = self.replies[self.calls % len(self.replies)]
        self.calls += 1
        reply = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        ids = torch.tensor([reply] * len(rows))
        return RolloutBatch(
            prompt_ids=[list(r) for r in rows],
            completion_ids=ids,
            sampler_logprobs=torch.full(ids.shape, -0.5),
            mask=torch.ones(ids.shape, dtype=torch.bool),
            finish_reasons=["stop"] * len(rows),
            completions=[text] * len(rows),
            prompt_index=list(range(len(rows))),
        )


# ---------------------------------------------------------------- a float64 causal LM


def tiny_float64_lm(arch="llama", tie=False, seed=0):
    """A randomly initialised 2-layer Llama or Qwen2 (vocabulary 37), in float64."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    torch.manual_seed(seed)
    cfg = cls[0](
        vocab_size=37,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        pad_token_id=0,
    )
    return cls[1](cfg).double()


@pytest.fixture
def float64_rms_norm(monkeypatch):
    """Hugging Face's Llama/Qwen2 RMSNorm computes in float32 even in a float64 model. Sharing prompts sums the
    rows' gradients in a different order, and a float32 norm then rounds that 1e-16 difference to a float32 ulp now
    and then (gradients then agree to ~1e-7, not 1e-15). The norm in the model's own dtype makes float64
    comparisons exact."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    def forward(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for cls in (LlamaRMSNorm, Qwen2RMSNorm):
        monkeypatch.setattr(cls, "forward", forward)


def param_grads(model, lp, ent, tok, seed=0):
    """The gradient of every trainable parameter of a fixed random linear function of log-probs and entropies."""
    g = torch.Generator().manual_seed(seed)
    g_lp, g_ent = torch.randn(lp.shape, generator=g), torch.randn(lp.shape, generator=g)
    loss = ((lp * g_lp + ent * g_ent) * tok.loss_mask).sum()
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params)


# ---------------------------------------------------------------- an objective's batch with a sparse support


def with_support(obj, batch):
    """`batch` (a TokenBatch) with the support_* fields that an objective with a sparse support (TROLL,
    `sparse_support()`) reads, derived from its log-probs, else `batch` itself: each position's support is its
    sampled token (entry 0) and two others, with scores (log pi_theta(y), 0, -1) for pi_theta and
    (log pi_old(y), 0.5, -2) for pi_old, renormalised by the loss. Gradient reaches `batch.logprobs`; whatever the
    log-probs hold at padding reaches the support too."""
    import dataclasses

    if obj.config.sparse_support() is None:
        return batch
    lp, old = batch.logprobs, batch.old_logprobs
    rest = torch.tensor([0.0, -1.0], dtype=lp.dtype).expand(*lp.shape, 2)
    rest_old = torch.tensor([0.5, -2.0], dtype=lp.dtype).expand(*lp.shape, 2)
    return dataclasses.replace(
        batch,
        support_logprobs=torch.cat([lp[..., None], rest], -1),
        old_support_logprobs=torch.cat([old[..., None].to(lp.dtype), rest_old], -1),
        support_mask=torch.ones(*lp.shape, 3, dtype=torch.bool),
        support_token_index=torch.zeros(lp.shape, dtype=torch.long),
    )


# ---------------------------------------------------------------- markers


def slow_after_first(values):
    """Values for `pytest.mark.parametrize` with the first case in the fast subset and the others marked
    slow: the same end-to-end check once quickly, and for every case in the full suite."""
    values = list(values)
    return [*values[:1], *(pytest.param(v, marks=pytest.mark.slow) for v in values[1:])]


# ---------------------------------------------------------------- TRL's own loss, called


def trl_compute_loss(
    loss_type,
    lp,
    old,
    adv,
    mask,
    *,
    ref=None,
    beta=0.0,
    eps=(0.2, 0.2),
    level="token",
    max_len=None,
    is_ratio=None,
    tool_mask=None,
    **args,
):
    """TRL's own `GRPOTrainer._compute_loss` (the installed trl, 1.16) on these tensors: a trainer built without a
    model (`object.__new__`) holds only what the method reads, one process, one accumulation step,
    `steps_per_generation` 1, no entropy bonus; its log-prob forward returns a copy of `lp` (N, T). `adv` is (N,)
    or (N, T); `ref` (with `beta`) turns TRL's k3 term on; `is_ratio` is TRL's vLLM `importance_sampling_ratio`
    (vLLM correction on); `args` override GRPOConfig fields (`use_bias_correction_kl`, `vespo_*`, `sapo_*`,
    `delta`); `tool_mask` (N, T) is TRL's multi-turn mask (0 at tool output). Returns (loss, d loss / d lp, TRL's
    logged metrics for the step)."""
    from collections import defaultdict
    from types import SimpleNamespace

    from trl.trainer.grpo_trainer import GRPOTrainer

    leaf = lp.detach().clone().requires_grad_()
    same = lambda x, **_: x  # noqa: E731  (one process: gather and reduce are the identity)
    trainer = object.__new__(GRPOTrainer)
    trainer.__dict__.update(
        loss_type=loss_type,
        beta=beta,
        epsilon_low=eps[0],
        epsilon_high=eps[1],
        importance_sampling_level=level,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=True,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        max_completion_length=max_len if max_len is not None else lp.shape[1],
        current_gradient_accumulation_steps=1,
        model=SimpleNamespace(training=True),
        _metrics=defaultdict(lambda: defaultdict(list)),
        accelerator=SimpleNamespace(
            num_processes=1, sync_gradients=True, gather=same, reduce=same, gather_for_metrics=same
        ),
        args=SimpleNamespace(
            **{
                "use_bias_correction_kl": False,
                "delta": None,
                "steps_per_generation": 1,
                "sapo_temperature_pos": 1.0,
                "sapo_temperature_neg": 1.05,
                "vespo_k_pos": 2.0,
                "vespo_lambda_pos": 3.0,
                "vespo_k_neg": 3.0,
                "vespo_lambda_neg": 2.0,
                **args,
            }
        ),
        _get_per_token_logps_and_entropies=lambda *a, **k: (leaf, torch.zeros_like(leaf), None),
    )
    n, t = lp.shape
    inputs = {
        "prompt_ids": torch.ones(n, 1, dtype=torch.long),
        "prompt_mask": torch.ones(n, 1, dtype=torch.long),
        "completion_ids": torch.ones(n, t, dtype=torch.long),
        "completion_mask": mask.to(torch.long),
        "advantages": adv,
        "old_per_token_logps": old,
        "num_items_in_batch": (mask if tool_mask is None else mask * tool_mask).sum().to(lp.dtype),  # as TRL counts
    }
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    if tool_mask is not None:
        inputs["tool_mask"] = tool_mask.to(torch.long)
    loss = trainer._compute_loss(None, inputs)
    loss.backward()
    return loss.detach(), leaf.grad, trainer._metrics["train"]
