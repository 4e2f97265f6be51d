"""Two generation batches of TRL's `GRPOTrainer` with `use_vllm=True, vllm_mode="colocate"`, in its own process.

    python tests/trl_vllm_colocate.py MODEL_DIR TRAINER OUT_DIR

TRAINER: "trl" (TRL's own trainer) or "tether" (the adapter).

For `tests/integrations/test_trl_adapter.py` and `tests/rollout/test_vllm_engine.py` (vLLM's parallel state is
process-wide, so each run gets a fresh interpreter). Prints one JSON line:
- `packed`: the layers of TRL's live engine whose weight vLLM's CPU GEMM dispatch replaced by an empty parameter
  (`vllm_compat.packed_layers`, read right after the trainer started the engine): where this is not empty, a
  per-tensor `load_weights` has no `weight_loader` to call;
- `error` and `raised_at` (file:line (function)) where training stopped, or `steps` and, per loss evaluation,
  the largest |vLLM's sampler log-prob - the policy's log-prob at sampling time| over the counted tokens
  (`sampler_gap`): about 1e-6 where the engine samples from the current weights, far larger where a sync left it
  on old ones (learning rate 1e-2);
- `after` (the adapter only): the same gap for fresh samples once training has ended, read from the engine as
  the last generation batch left it (`stale`: two optimiser steps behind the policy, the control) and again after
  one more weight sync (`synced`).
"""

import json
import os
import sys
import traceback

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from tether.rollout import vllm_compat  # noqa: E402

PROMPTS = ["1+1=", "2+3=", "7*6=", "9-4="]


def odd_chars(completions, **_):
    return [sum(ord(c) % 2 for c in t) / max(len(t), 1) for t in completions]


def run(model_dir, which: str, out_dir, timeout: float = 900) -> dict:
    """This script in a fresh interpreter; its JSON result (an AssertionError with its stderr when it printed none)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, __file__, str(model_dir), which, str(out_dir)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1])


def main(model_dir: str, which: str, out_dir: str) -> dict:
    args = GRPOConfig(
        output_dir=out_dir,
        report_to="none",
        use_cpu=True,
        bf16=False,
        max_steps=4,  # two generation batches of two optimiser steps each
        steps_per_generation=2,
        gradient_accumulation_steps=1,
        per_device_train_batch_size=4,
        num_generations=4,
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-2,
        max_completion_length=6,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="dapo",
        seed=0,
        shuffle_dataset=False,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=64,
        vllm_importance_sampling_correction=False,  # the adapter refuses it (its departure 5)
        disable_tqdm=True,
    )
    data = Dataset.from_dict({"prompt": PROMPTS * 2})
    gaps: list[float] = []
    if which == "tether":
        from tether.integrations.trl import make_trainer

        def record(inputs, batch, out):
            mask = batch.loss_mask.bool()
            gap = (inputs["sampling_per_token_logps"] - inputs["old_per_token_logps"]).abs()[mask]
            gaps.append(float(gap.max()))

        trainer = make_trainer(model_dir, odd_chars, data, objective="dapo", args=args, on_objective=record)
    else:
        trainer = GRPOTrainer(model=model_dir, reward_funcs=odd_chars, args=args, train_dataset=data)
    result: dict = {"packed": vllm_compat.packed_layers(trainer.vllm_generation.llm)}
    try:
        trainer.train()
    except Exception as exc:  # the result says what stopped it and where
        last = traceback.extract_tb(exc.__traceback__)[-1]
        result["error"] = f"{type(exc).__name__}: {exc}"[:300]
        result["raised_at"] = f"{last.filename.split('site-packages/')[-1]}:{last.lineno} ({last.name})"
        return result
    result["steps"] = trainer.state.global_step
    result["sampler_gap"] = gaps
    if which == "tether":
        stale = engine_gap(trainer)
        trainer.vllm_generation.sync_weights()
        result["after"] = {"stale": stale, "synced": engine_gap(trainer)}
    return result


@torch.no_grad()
def engine_gap(trainer) -> float:
    """Largest |engine's sampler log-prob - the policy's| over 4 samples of each prompt from the engine as it is."""
    from vllm import SamplingParams

    tokenizer, model = trainer.processing_class, trainer.model
    prompts = [tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS]
    params = SamplingParams(n=4, max_tokens=6, temperature=1.0, logprobs=0, seed=0)
    outs = trainer.vllm_generation.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    gap = 0.0
    for ids, out in zip(prompts, outs):
        for sample in out.outputs:
            tokens = list(sample.token_ids)
            sampled = torch.tensor([step[t].logprob for t, step in zip(tokens, sample.logprobs)])
            logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1].float()
            policy = logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
            gap = max(gap, float((policy - sampled).abs().max()))
    return gap


if __name__ == "__main__":
    torch.manual_seed(0)
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3])))
