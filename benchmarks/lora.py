"""LoRA against full fine-tuning: peak memory and time of one optimiser step of tether's update.

    python benchmarks/lora.py                       # the 0.58B body (--preset qwen0.5b), 8 x (16 + 64) tokens
    python benchmarks/lora.py --device cuda --dtype bfloat16 --out benchmarks/results/performance/lora_gpu.md

Each mode runs in its own process (so one's allocations cannot hide the other's peak): load the
model, build one batch of random completions, then `--steps` updates through `tether.trainer.step.update`
(the trainer's own path: fused head, DAPO objective, AdamW) with `ppo_epochs = mini_batches = 1`.
Memory: the process's peak resident set (CPU) or `torch.cuda.max_memory_allocated` (GPU), and the
part of it above the memory after the model was loaded (weights, activations, gradients, AdamW state).
LoRA: r 16, alpha 32 on every attention and MLP projection (tether.config.sections.LoRAConfig's defaults), and
the reference, when an objective needs one, is the same weights with the adapters off (no second copy,
which full fine-tuning would hold: not counted here).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_args, add_preset_arg, apply_preset, emit, machine, median, setup, sync, table  # noqa: E402


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def child(args) -> dict:
    """One mode in this process; returns its measurements."""
    from tether import objectives
    from tether.config.sections import LoRAConfig
    from tether.config.loading import load_config
    from tether.model.loading import apply_lora, load_model
    from tether.model.causal_lm import LogProbSettings, Precision, Tokens
    from tether.trainer.update import Policy, UpdateBatch, update

    device = setup(args)
    model, _ = load_model(args.model_dir, dtype=args.dtype, device=str(device))
    if args.mode == "lora":
        model = apply_lora(model, LoRAConfig()).get_base_model()
    sync(device)
    after_load = (
        _peak_bytes(device) if device.type == "cuda" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    n, p, t = args.rows, args.prompt_len, args.completion_len
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (n, p + t), generator=g)
    attn = torch.ones(n, p + t, dtype=torch.long)
    tokens = Tokens(
        ids.to(device),
        attn.to(device),
        (attn.cumsum(1) - 1).to(device),
        ids[:, p:].to(device),
        torch.ones(n, t, device=device),
        p,
    )
    cfg = load_config(
        None,
        [
            "objective=dapo",
            "trainer.mini_batches=1",
            f"trainer.micro_batch_size={n}",
            "rollout.prompts_per_step=1",
            f"rollout.group_size={n}",
        ],
    )
    obj = objectives.build(cfg.objective)
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: 1.0)
    precision, settings = Precision.of(cfg.trainer.autocast, device), LogProbSettings.of(cfg.trainer, cfg.rollout)
    policy = Policy(model, None, optimizer, schedule, device, precision, settings)
    rewards = torch.arange(n, dtype=torch.float32).remainder(2).to(device)
    batch = UpdateBatch(
        tokens,
        obj.advantages(rewards.cpu(), torch.zeros(n, dtype=torch.long)).to(device),
        rewards,
        torch.zeros(n, dtype=torch.long, device=device),
        None,
    )
    times = []
    for i in range(args.warmup + args.steps):
        sync(device)
        tic = time.perf_counter()
        update(policy, obj, batch, cfg.trainer, torch.Generator().manual_seed(i))
        sync(device)
        times.append(time.perf_counter() - tic)
    return {
        "mode": args.mode,
        "step_s": median(times[args.warmup :]),
        "peak": _peak_bytes(device),
        "after_load": after_load,
        "trainable": sum(q.numel() for q in params),
        "total": sum(q.numel() for q in model.parameters()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=64, help="completion tokens per row")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--mode", choices=["full", "lora"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    add_preset_arg(p)
    add_common_args(p)
    p.set_defaults(preset="qwen0.5b")
    args = p.parse_args()
    apply_preset(args, p)
    if args.preset == "qwen0.5b" and args.max_new_tokens == 256:
        args.max_new_tokens = 64  # one update's batch, not a rollout budget
    args.completion_len = args.max_new_tokens
    if args.mode:  # a child: measure one mode, print JSON
        print(json.dumps(child(args)))
        return
    device = setup(args)
    from tether.model.loading import init_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_model(
            Path(tmp) / "model",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=args.heads,
            seed=0,
            vocab_size=args.vocab,
        )
        results = {}
        for mode in ("full", "lora"):
            cmd = [
                sys.executable,
                __file__,
                "--mode",
                mode,
                "--model-dir",
                str(model_dir),
                "--hidden",
                str(args.hidden),
                "--layers",
                str(args.layers),
                "--heads",
                str(args.heads),
                "--rows",
                str(args.rows),
                "--prompt-len",
                str(args.prompt_len),
                "--max-new-tokens",
                str(args.completion_len),
                "--steps",
                str(args.steps),
                "--warmup",
                str(args.warmup),
                "--device",
                args.device,
                "--dtype",
                args.dtype,
                "--threads",
                str(args.threads),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    f, lo = results["full"], results["lora"]
    gib = 2.0**30
    rows = [
        [
            "trainable parameters",
            f"{f['trainable'] / 1e6:.1f}M of {f['total'] / 1e6:.1f}M",
            f"{lo['trainable'] / 1e6:.2f}M of {lo['total'] / 1e6:.1f}M",
            f"{lo['trainable'] / f['trainable']:.4f}x",
        ],
        ["peak memory", f"{f['peak'] / gib:.2f} GiB", f"{lo['peak'] / gib:.2f} GiB", f"{lo['peak'] / f['peak']:.2f}x"],
        [
            "peak above the loaded model",
            f"{(f['peak'] - f['after_load']) / gib:.2f} GiB",
            f"{(lo['peak'] - lo['after_load']) / gib:.2f} GiB",
            f"{(lo['peak'] - lo['after_load']) / max(f['peak'] - f['after_load'], 1):.2f}x",
        ],
        [
            "one optimiser step (median)",
            f"{f['step_s']:.2f} s",
            f"{lo['step_s']:.2f} s",
            f"{lo['step_s'] / f['step_s']:.2f}x",
        ],
    ]
    emit(
        "\n".join(
            [
                f"### LoRA vs full fine-tuning, one optimiser step ({args.device}, {args.dtype})",
                "",
                f"Machine: {machine(device, args)}. Model: tiny Llama {args.hidden} x {args.layers} layers, vocabulary "
                f"{args.vocab or 'characters'} ({f['total'] / 1e6:.0f}M parameters). Batch: {args.rows} rows x "
                f"({args.prompt_len} prompt + {args.completion_len} completion) tokens; DAPO; median of {args.steps} steps "
                f"after {args.warmup} warm-up, each mode in its own process.",
                "",
                table(["", "full fine-tuning", "LoRA (r 16, alpha 32, all projections)", "LoRA / full"], rows),
            ]
        ),
        args.out,
    )


if __name__ == "__main__":
    main()
