"""Benchmark: one training micro-step with and without shared prompts (trainer.share_prompts).

    python benchmarks/shared_prompts.py                      # tiny Llama 256 x 4, character vocabulary
    python benchmarks/shared_prompts.py --device cuda --dtype bfloat16 --size 1024x16 --vocab 151936

GRPO's G samples of a prompt share it; with `share_prompts` the decoder runs each distinct prompt
once and the completions on its copied KV cache (tether.model.causal_lm, module docstring). A micro-step is
what `tether.trainer.step.update` does per micro-batch: log-probs and entropy of the completion through
the fused head, a loss, backward, gradient clipping and AdamW. The batch is --prompts distinct
prompts x --group samples, every prompt --prompt-len tokens and every completion the length in
the table. The two settings alternate; median of --reps after a warm-up. "positions" is the
decoder's work in token positions: N (P + T - 1) unshared, U P + N (T - 1) shared (the last
column predicts nothing and is not run in either).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_args, emit, machine, median, setup, table, timed  # noqa: E402
from mfu import build, train_step_fn  # noqa: E402


def grouped_tokens(prompts: int, group: int, prompt_len: int, completion_len: int, vocab: int, device):
    from tether.model.causal_lm import Tokens

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, vocab, (prompts, prompt_len), generator=g).repeat_interleave(group, 0)
    completion = torch.randint(1, vocab, (prompts * group, completion_len), generator=g)
    ids = torch.cat([prompt, completion], 1)
    n, length = ids.shape
    attention = torch.ones(n, length, dtype=torch.long)
    position = torch.arange(length).expand(n, length).contiguous()
    return Tokens(
        ids.to(device),
        attention.to(device),
        position.to(device),
        completion.to(device),
        torch.ones(n, completion_len, device=device),
        prompt_len,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="256x4", help="HIDDENxLAYERS")
    p.add_argument("--vocab", type=int, default=100, help="100 is tether's character vocabulary")
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts per micro-batch")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument(
        "--shapes", nargs="+", default=["6x16", "64x16", "64x128", "256x64"], help="PROMPTxCOMPLETION lengths"
    )
    p.add_argument("--reps", type=int, default=5)
    add_common_args(p)
    args = p.parse_args()
    device = setup(args)
    from tether.model.causal_lm import shared_prompt_reason

    from common import dtype_of

    hidden, layers = (int(x) for x in args.size.split("x"))
    model = build(hidden, layers, args.vocab, device, dtype_of(args.dtype)).train()
    rows, n, u = [], args.prompts * args.group, args.prompts
    for shape in args.shapes:
        P, T = (int(x) for x in shape.split("x"))
        tokens = grouped_tokens(args.prompts, args.group, P, T, args.vocab, device)
        steps = {share: train_step_fn(model, tokens, "fused", share) for share in (False, True)}
        for fn in steps.values():
            fn()  # warm-up (and the one-off checks)
        times = {False: [], True: []}
        for _ in range(args.reps):
            for share, fn in steps.items():
                times[share].append(timed(fn, device))
        plain, shared = median(times[False]), median(times[True])
        work = (n * (P + T - 1), u * P + n * (T - 1))
        rows.append(
            [
                f"{P} + {T}",
                f"{work[0]:,} -> {work[1]:,} ({work[0] / work[1]:.2f}x)",
                f"{plain:.3f} s",
                f"{shared:.3f} s",
                f"{plain / shared:.2f}x",
            ]
        )
        print(f"P={P} T={T}: {plain:.3f} s -> {shared:.3f} s", file=sys.stderr)
    assert not shared_prompt_reason(model), shared_prompt_reason(model)
    text = "\n".join(
        [
            f"### Shared prompts: one training micro-step ({args.device}, {args.dtype})",
            "",
            f"Machine: {machine(device, args)}. Tiny Llama {args.size}, vocabulary {args.vocab:,}; "
            f"{u} prompts x {args.group} samples = {n} rows per micro-batch; forward + backward through the fused head, "
            f"clip, AdamW; median of {args.reps}, the two settings alternating.",
            "",
            table(
                [
                    "prompt + completion tokens",
                    "decoder positions (unshared -> shared)",
                    "unshared",
                    "shared",
                    "speed-up",
                ],
                rows,
            ),
        ]
    )
    emit(text, args.out)


if __name__ == "__main__":
    main()
