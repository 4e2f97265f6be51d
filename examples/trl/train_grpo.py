"""Train with a tether objective inside TRL's GRPOTrainer, on a tether task with its verifier.

    # CPU smoke run: a tiny randomly initialised model, 4 optimiser steps (about a minute)
    python examples/trl/train_grpo.py --tiny --max-steps 4
    # Each generation batch is used for --num-iterations 2 passes (the default), so from the second
    # pass on the ratio to the sampling policy moves and the trust region acts: policy/clipfrac_* > 0
    # in the logs (tests/integrations/test_trl_adapter.py checks it). With --num-iterations 1 and
    # --steps-per-generation equal to --grad-accum every update is on-policy and nothing is clipped.
    # all GPUs of one node (one process per GPU); add --bf16 and, for vLLM generation, --use-vllm
    accelerate launch examples/trl/train_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct \\
        --objective atr_grpo --num-generations 8 --per-device-batch 8 --grad-accum 2 --num-iterations 2
    # an objective mapping instead of a preset name
    python examples/trl/train_grpo.py --tiny --objective '{"preset": "rpg_urkl", "anchor": "ref"}'
    # a real model on a math file, prompts in its chat template (scripts/get_model.sh smollm2-135m)
    python examples/trl/train_grpo.py --model ~/.cache/tether/models/smollm2-135m --task math \
        --task-args '{"train": "tether:word1_train.jsonl", "template": "{problem}\\nAnswer with the number only."}' \
        --num-generations 4 --per-device-batch 8 --max-completion-length 48 --max-steps 20

See docs/trl.md for the config mapping and what tether changes in TRL's loss.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="hub id or local directory of a causal LM")
    p.add_argument("--tiny", action="store_true", help="create a tiny random model under --output-dir instead")
    p.add_argument("--objective", default="rpg_fkl", help="preset or objective name, or a JSON mapping")
    p.add_argument("--task", default="arithmetic", help="a tether task (arithmetic, countdown, math)")
    p.add_argument(
        "--task-args",
        default="{}",
        help="the task's arguments as JSON, as data.task_args (math: train, test, template)",
    )
    p.add_argument("--n-train", type=int, default=2000, help="training prompts drawn from the task")
    p.add_argument("--output-dir", default="runs/trl")
    p.add_argument("--max-steps", type=int, default=200, help="optimiser steps")
    p.add_argument("--num-generations", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--per-device-batch", type=int, default=16, help="rows per micro-batch per process")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimiser step")
    p.add_argument(
        "--steps-per-generation",
        type=int,
        default=None,
        help="micro-batches per generation batch (default: --grad-accum)",
    )
    p.add_argument(
        "--num-iterations",
        type=int,
        default=2,
        help="passes over each generation batch (default 2: the second is off-policy, so the trust "
        "region acts; 1 with the default --steps-per-generation leaves it inactive)",
    )
    p.add_argument("--max-completion-length", type=int, default=16)
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="learning rate (default 1e-5; 1e-3 with --tiny, a step that moves the ratio in a few steps)",
    )
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--use-vllm", action="store_true", help="generate with vLLM (colocated)")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    import torch
    from trl import GRPOConfig

    from tether.integrations.trl import make_trainer, reward_func, to_dataset
    from tether.model.loading import init_model, load_tokenizer, local_source
    from tether.rewards import task_reward
    from tether.tasks import get_task, takes_tokenizer

    if a.tiny == (a.model is not None):
        raise SystemExit("pass exactly one of --model and --tiny")
    model = str(init_model(Path(a.output_dir) / "tiny-model")) if a.tiny else local_source(a.model)
    knobs = json.loads(a.task_args)
    if takes_tokenizer(a.task):  # math renders its prompts in the model's chat template, as tether train does
        knobs["tokenizer"] = load_tokenizer(model)
    task = get_task(a.task, **knobs)
    train = to_dataset(task.examples("train", a.n_train, unique=False))
    objective = json.loads(a.objective) if a.objective.lstrip().startswith("{") else a.objective
    config = GRPOConfig(
        output_dir=a.output_dir,
        max_steps=a.max_steps,
        learning_rate=a.lr if a.lr is not None else (1e-3 if a.tiny else 1e-5),
        num_generations=a.num_generations,
        per_device_train_batch_size=a.per_device_batch,
        gradient_accumulation_steps=a.grad_accum,
        steps_per_generation=a.steps_per_generation,
        num_iterations=a.num_iterations,
        max_completion_length=a.max_completion_length,
        bf16=a.bf16,
        use_cpu=a.tiny or not torch.cuda.is_available(),
        use_vllm=a.use_vllm,
        vllm_mode="colocate",
        # tether's objective is the only importance weighting; see docs/trl.md
        vllm_importance_sampling_correction=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
    )
    # task_reward: the task's verifier as tether's trainer builds it (strict \boxed{} extraction when the
    # template asks for a box).
    trainer = make_trainer(
        model, reward_func(task_reward(task), name=task.reward), train, objective=objective, args=config
    )
    trainer.train()
    trainer.save_model()
    return trainer


if __name__ == "__main__":
    main()
