"""A roofline for the RL step of a finished run: each phase's model FLOPs over its measured time,
against this machine's measured float32 GEMM throughput at the shapes that phase multiplies.

    python benchmarks/real_model/roofline.py RUN_DIR [--threads N] [--skip 1] [--out FILE.md]

RUN_DIR is a `tether train` run directory (configs/real_model.yaml's, say). Its metrics give each
step's phase times (`time/sample_s`, `time/old_logprobs_s`, `time/ref_logprobs_s`, `time/update_s`)
and completion lengths; its samples give the prompt lengths (tokenized with the run's model); its
config gives the batch, LoRA, prompt sharing and gradient checkpointing. FLOPs are model FLOPs, the
MFU convention: 2 per weight per token for every matrix product (the output layer included, the
embedding lookup not), plus attention's 4 x layers x attention width x context per token.

- sampling: one prefill per prompt (the engine shares a prompt's prefill among its samples), then
  one decode step per generated token of every sample, at the mean context;
- old / reference log-probs: one forward over the batch, each prompt once when
  `trainer.share_prompts` is on (it is, unless gradient checkpointing turns it off);
- update: forward + backward. The backward of a frozen weight computes only its input's gradient
  (one more forward's worth); a trained weight's gradient costs another: LoRA 2x, full fine-tuning
  3x the forward, plus one forward more under gradient checkpointing.

The GEMM peak is measured here, now, in float32 at the phase's own shapes: the decode multiplies
(samples x hidden) by each weight, the other phases (tokens x hidden), tokens = what one micro-batch
holds. A phase's "of peak" is its achieved FLOP/s over that measured rate: what the GEMMs of that
shape allow on this CPU, the bound the issue asks each phase to come within 2x of.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import emit, table  # noqa: E402


def model_dims(config) -> dict:
    h = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = getattr(config, "num_key_value_heads", heads) or heads
    return {
        "layers": config.num_hidden_layers,
        "hidden": h,
        "inter": config.intermediate_size,
        "vocab": config.vocab_size,
        "q": heads * head_dim,
        "kv": kv * head_dim,
    }


def weight_shapes(d: dict) -> list[tuple[int, int]]:
    """(in, out) of every matrix product of one token's forward: per layer q, k, v, o, gate, up, down; the head."""
    h, i = d["hidden"], d["inter"]
    layer = [(h, d["q"]), (h, d["kv"]), (h, d["kv"]), (d["q"], h), (h, i), (h, i), (i, h)]
    return layer * d["layers"] + [(h, d["vocab"])]


def forward_flops_per_token(d: dict, context: float, lora_r: int = 0, lora_targets: int = 7) -> float:
    matmul = sum(2 * a * b for a, b in weight_shapes(d))
    attention = 4 * d["layers"] * d["q"] * context
    lora = 0.0
    if lora_r:
        per_layer = weight_shapes(d)[:7][:lora_targets]
        lora = d["layers"] * sum(2 * lora_r * (a + b) for a, b in per_layer)
    return matmul + attention + lora


def gemm_rate(shapes: list[tuple[int, int]], rows: int, reps: int = 3) -> float:
    """Measured float32 FLOP/s of (rows x a) @ (a x b) over the distinct shapes, weighted by their FLOPs."""
    distinct = sorted(set(shapes))
    flops = seconds = 0.0
    for a, b in distinct:
        x, w = torch.randn(rows, a), torch.randn(a, b)
        x @ w  # warm-up
        best = float("inf")
        for _ in range(reps):
            tic = time.perf_counter()
            x @ w
            best = min(best, time.perf_counter() - tic)
        n = shapes.count((a, b))
        flops += n * 2 * rows * a * b
        seconds += n * best
    return flops / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads for the GEMM measurement (0: the run's trainer.threads, -1 or 0 there: every core)",
    )
    p.add_argument("--skip", type=int, default=1, help="first steps left out (the first step warms up)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import os

    import yaml
    from transformers import AutoConfig

    from tether.model.loading import load_tokenizer, local_source

    run = Path(args.run_dir)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "time/update_s" in r and r["step"] > args.skip]
    if not steps:
        raise SystemExit(f"{run}: no finished step after the first {args.skip}")
    model_path = local_source(cfg["model"]["name_or_path"], log=lambda _: None)
    d = model_dims(AutoConfig.from_pretrained(model_path))
    tokenizer = load_tokenizer(model_path)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines() if line.strip()]
    prompt_len = statistics.mean(len(tokenizer(s["prompt"], add_special_tokens=False).input_ids) for s in samples)

    ro, tr = cfg["rollout"], cfg["trainer"]
    prompts, group = ro["prompts_per_step"], ro["group_size"]
    batch = prompts * group
    lora = cfg["model"].get("lora") or {}
    r = lora.get("r", 0) if lora else 0
    checkpointing = bool(cfg["model"].get("gradient_checkpointing"))
    share = tr.get("share_prompts", True) and not checkpointing
    uses_ref = any(r.get("time/ref_logprobs_s", 0) > 0 for r in steps)
    threads = args.threads or tr.get("threads", 0)
    if threads > 0:
        torch.set_num_threads(threads)
    completion = statistics.mean(s["rollout/len_mean"] for s in steps)
    seq = prompt_len + completion

    def f(ctx):
        return forward_flops_per_token(d, ctx, r)

    forward_tokens = (prompts * prompt_len + batch * completion) if share else batch * seq
    forward = forward_tokens * f(seq / 2)
    backward_factor = (1 if r else 2) + (1 if checkpointing else 0)
    phases = {
        "sampling (prefill + decode)": (
            prompts * prompt_len * f(prompt_len / 2) + batch * completion * f(prompt_len + completion / 2),
            "time/sample_s",
            "decode",
        ),
        "old log-probs (forward)": (forward, "time/old_logprobs_s", "batch"),
        "update (forward + backward, all mini-batches)": (
            forward * (1 + backward_factor) * tr.get("ppo_epochs", 1),
            "time/update_s",
            "batch",
        ),
    }
    if uses_ref:
        phases["reference log-probs (forward)"] = (forward, "time/ref_logprobs_s", "batch")
    micro_rows = max(
        1, int(tr.get("micro_batch_size", batch) * (completion + (prompt_len if not share else prompt_len / group)))
    )
    shapes = weight_shapes(d)
    peak = {"decode": gemm_rate(shapes, batch), "batch": gemm_rate(shapes, micro_rows)}
    rows_out = []
    total_flops = total_time = 0.0
    for name, (flops, key, kind) in phases.items():
        seconds = statistics.median(s[key] for s in steps)
        rate = flops / seconds if seconds > 0 else float("nan")
        total_flops += flops
        total_time += seconds
        rows_out.append(
            [
                name,
                f"{flops / 1e9:.1f}",
                f"{seconds:.2f}",
                f"{rate / 1e9:.1f}",
                f"{peak[kind] / 1e9:.1f} ({'%d x hidden' % batch if kind == 'decode' else '%d x hidden' % micro_rows})",
                f"{rate / peak[kind]:.2f}",
                f"{peak[kind] * seconds / flops:.1f}x",
            ]
        )
    step_s = statistics.median(s["time/step_s"] for s in steps)
    load = os.getloadavg()
    text = "\n".join(
        [
            f"### Roofline of the RL step: {run.name} (float32, {torch.get_num_threads()} threads)",
            "",
            f"Run: `{run}`, {len(steps)} steps (after the first {args.skip}), medians. Model: {model_path} "
            f"({d['layers']} layers, hidden {d['hidden']}, vocabulary {d['vocab']:,}{f', LoRA r {r}' if r else ''}). "
            f"Batch: {prompts} prompts x {group} samples, prompt {prompt_len:.0f} tokens (chat template included), "
            f"completion {completion:.1f} tokens (mean); prompt sharing {'on' if share else 'off'}. GEMM rates measured "
            f"now on {os.cpu_count()} logical cores, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
            f"(1 / 5 / 15 min); the run's own times carry the load it ran under.",
            "",
            table(
                [
                    "phase",
                    "model GFLOP",
                    "time (s)",
                    "achieved GFLOP/s",
                    "GEMM rate at its shape, GFLOP/s",
                    "of that rate",
                    "time / GEMM-bound time",
                ],
                rows_out,
            ),
            "",
            f"Whole step: {total_flops / 1e9:.1f} GFLOP in {step_s:.1f} s (median `time/step_s`; the phases above sum to "
            f"{total_time:.1f} s), {total_flops / step_s / 1e9:.1f} GFLOP/s.",
        ]
    )
    emit(text, args.out)


if __name__ == "__main__":
    main()
