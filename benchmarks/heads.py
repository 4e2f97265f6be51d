"""Benchmark: tether's fused head vs TRL's, on the same hidden states (log-probs + entropy, fwd + bwd).

    python benchmarks/heads.py                 # V 151,936, H 256 and 1024, N 1024 and 4096 tokens, CPU

TRL's GRPOTrainer (trl >= 1.14) also never materialises the logits: it patches the model with a
fused LM head (`trl.trainer.utils.add_fused_lm_head`, `trl.kernels.chunked_logprob.
ChunkedLogProbFunction`) that tiles tokens x 32,768-token vocabulary chunks, folds each tile into
an online log-sum-exp, and recomputes the tiles in the backward. This script times that function
against `tether.model.ops.token_logprobs_and_entropy` on the same (N, H) hidden states, (V, H) weight
and targets, with both outputs in the loss and gradients for the hidden states and the weight;
the two alternate, median of --reps after a warm-up. It is the per-token cost of the head only:
in a GRPO step TRL additionally scores every position of the sequence on devices without Triton
(its `compact` path, which keeps only completion positions, is Triton-only), where tether runs
the head on the completion tokens alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_args, dtype_of, emit, machine, median, setup, table, timed  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--hiddens", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--reps", type=int, default=3)
    add_common_args(p)
    args = p.parse_args()
    device = setup(args)
    dtype = dtype_of(args.dtype)
    import trl
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    from tether.model.ops import token_logprobs_and_entropy

    rows = []
    for H in args.hiddens:
        for N in args.tokens:
            g = torch.Generator().manual_seed(0)
            weight = (torch.randn(args.vocab, H, generator=g) * H**-0.5).to(device, dtype).requires_grad_()
            hidden = torch.randn(N, H, generator=g).to(device, dtype).requires_grad_()
            targets = torch.randint(0, args.vocab, (N,), generator=g).to(device)
            g_lp, g_ent = torch.randn(N, generator=g).to(device), torch.randn(N, generator=g).to(device)

            def ours():
                lp, ent = token_logprobs_and_entropy(hidden[None], weight, targets[None])
                ((lp[0] * g_lp).sum() + (ent[0] * g_ent).sum()).backward()

            def theirs():
                lp, ent, *_ = ChunkedLogProbFunction.apply(
                    hidden, weight, None, targets, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("log_probs", "entropy")
                )
                ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()

            fns = {"tether": ours, "trl": theirs}
            results = {}
            for name, fn in fns.items():  # warm-up, and the two agree
                hidden.grad = weight.grad = None
                fn()
                results[name] = (hidden.grad.clone(), weight.grad.clone())
            err = max(
                (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
                for a, b in zip(results["tether"], results["trl"])
            )
            times = {name: [] for name in fns}
            for _ in range(args.reps):
                for name, fn in fns.items():
                    hidden.grad = weight.grad = None
                    times[name].append(timed(fn, device))
            ours_t, theirs_t = median(times["tether"]), median(times["trl"])
            rows.append(
                [f"{H:,}", f"{N:,}", f"{ours_t:.3f} s", f"{theirs_t:.3f} s", f"{theirs_t / ours_t:.2f}x", f"{err:.1e}"]
            )
            print(f"H={H} N={N}: tether {ours_t:.3f} s, trl {theirs_t:.3f} s", file=sys.stderr)
    text = "\n".join(
        [
            f"### Fused LM heads: tether vs TRL ({args.device}, {args.dtype})",
            "",
            f"Machine: {machine(device, args)}. trl {trl.__version__}. V = {args.vocab:,}; N tokens of hidden size H; "
            f"log-probs and entropy, forward + backward (hidden and weight gradients); median of {args.reps}, "
            'alternating. "gradient difference" is the largest difference of the two heads\' gradients relative '
            "to the largest gradient.",
            "",
            table(["H", "N tokens", "tether", "TRL", "TRL / tether", "gradient difference"], rows),
        ]
    )
    emit(text, args.out)


if __name__ == "__main__":
    main()
