"""Two optimiser steps of the TRL adapter, for `tests/integrations/test_trl_adapter.py`'s many-process test.

    accelerate launch --multi_gpu --num_processes 2 tests/trl_two_processes.py MODEL_DIR OUT_DIR  # two processes
    python tests/trl_two_processes.py MODEL_DIR OUT_DIR                                             # one process
    accelerate launch --multi_gpu --num_machines 2 --num_processes 2 --machine_rank R \
        --main_process_ip 127.0.0.1 --main_process_port PORT tests/trl_two_processes.py ...        # "machine" R

(`--multi_gpu` is accelerate's data-parallel launcher, torchrun; with `use_cpu=True` the processes form a
gloo group on the CPU. `--cpu --num_processes 2` would start one process, and `--cpu --num_machines 2`
two unrelated single-process runs.) An optional third argument, comma-separated, picks OBJECTIVES.

Both runs train on the same global batch: 3 prompts x 4 completions (12 rows; with two processes, each
holds 6, so the middle group is split between them). In one process that is 2 accumulation steps of 6
rows; in two, 1 of 6 rows per process. Sampling is the one part replaced: TRL's public `rollout_func`
returns a fixed completion for each prompt and position in its group (from the row's index in the
gathered batch), so that both runs see the same completions. TRL's sampler, reward gathering, batching,
old and reference log-probs, DDP's gradient averaging and the optimiser (plain SGD, so that weights move
by lr x the gradient) are TRL's own; the adapter's overrides are what is under test.

Writes, for each objective NAME and process R: `NAME.rank{R}.json` (each loss evaluation's optimiser step,
loss and metrics, and on rank 0 TRL's log history) and `NAME.rank{R}.pt` (its weights after two steps).
"""

import json
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from trl import GRPOConfig

from tether.integrations.trl import make_trainer

PROMPTS = ["1+1=", "2+3=", "7*6="]
GROUP = 4
ROWS = len(PROMPTS) * GROUP
OBJECTIVES = {
    "ppo_clip": "ppo_clip",
    "etr": "etr",  # group statistics over the whole generation batch
    "reinforce_pp": "reinforce_pp",  # advantages whitened over the batch's tokens
    "rpg_ref": {"preset": "rpg_fkl", "anchor": "ref", "beta": 0.05},  # a reference model
}


def odd_chars(completions, **_):
    """Share of characters with an odd code point: a reward with variance in every group."""
    return [sum(ord(c) % 2 for c in t) / max(len(t), 1) for t in completions]


def completion(prompt: str, k: int) -> str:
    """The fixed completion of `prompt` at position k of its group: 1 to 7 characters, lengths differing."""
    i = PROMPTS.index(prompt)
    return "0123456789+-*="[(5 * i + 3 * k) % 7 :][: 1 + (3 * i + 2 * k) % 7]


def rollout(prompts: list, trainer) -> dict:
    """TRL's `rollout_func`: each row's completion from its prompt and its index in the gathered batch."""
    tok = trainer.processing_class
    first = trainer.accelerator.process_index * len(prompts)
    texts = [completion(p, (first + j) % GROUP) for j, p in enumerate(prompts)]
    return {
        "prompt_ids": [tok(p, add_special_tokens=False)["input_ids"] for p in prompts],
        # Even completion lengths end on the stop token, odd ones are cut off without it.
        "completion_ids": [
            tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] * (len(t) % 2 == 0) for t in texts
        ],
        "logprobs": None,
    }


def train(model_dir: str, out_dir: Path, name: str, objective, processes: int) -> None:
    records = []
    args = GRPOConfig(
        output_dir=str(out_dir / name),
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        max_completion_length=8,
        num_generations=GROUP,
        num_iterations=2,
        per_device_train_batch_size=ROWS // 2,
        gradient_accumulation_steps=2 // processes,
        seed=0,
    )
    trainer = make_trainer(
        model_dir,
        odd_chars,
        Dataset.from_dict({"prompt": PROMPTS}),
        objective=objective,
        args=args,
        rollout_func=rollout,
        on_objective=lambda inputs, batch, out: records.append(
            {
                "step": trainer.state.global_step,
                "loss": out.loss.item(),
                "metrics": {k: v.item() for k, v in out.metrics.items()},
                "rows": sorted(
                    zip(
                        inputs["tether_group_ids"].tolist(),
                        inputs["tether_rewards"].tolist(),
                        inputs["completion_mask"].sum(1).tolist(),
                        inputs["advantages"].tolist(),
                    )
                ),
            }
        ),
    )
    trainer.train()
    rank = trainer.accelerator.process_index
    history = trainer.state.log_history if rank == 0 else []
    state = trainer.accelerator.state
    run = {"processes": state.num_processes, "distributed": str(state.distributed_type), "backend": state.backend}
    (out_dir / f"{name}.rank{rank}.json").write_text(json.dumps({"records": records, "history": history, **run}))
    model = trainer.accelerator.unwrap_model(trainer.model)
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, out_dir / f"{name}.rank{rank}.pt")
    trainer.accelerator.wait_for_everyone()


def main() -> None:
    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    processes = int(os.environ.get("WORLD_SIZE", "1"))  # set by the launcher
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else list(OBJECTIVES)
    for name in names:
        train(model_dir, out_dir, name, OBJECTIVES[name], processes)


if __name__ == "__main__":
    main()
