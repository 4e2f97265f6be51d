"""Benchmark (c): training throughput as model FLOP/s over the machine's measured matmul peak (MFU).

    python benchmarks/mfu.py                                   # 128x4, 256x4, 512x8 tiny Llamas, CPU fp32
    python benchmarks/mfu.py --device cuda --dtype bfloat16 --sizes 512x8 1024x16 2048x24 --vocab 151936

Peak: the best of a few square matmuls (2048 and 4096, and 8192 on CUDA) in the chosen dtype.
Training step: what tether.trainer.step.update does per micro-batch, on B sequences of L tokens
(P prompt + L - P completion): log-probs and entropy of the completion, a loss on both,
backward, gradient clipping and an AdamW step. Two columns: the model's full logits
(tether.model.causal_lm.token_logprobs with trainer.fused_logprobs=false) and the fused chunked head
(tether.model.causal_lm.causal_lm_token_logprobs, the trainer's default).

Model FLOPs per step (PaLM, arXiv 2204.02311, appendix B): 6 N B L + 12 n_layer d L^2 B, where N
counts every weight matrix including the output head but not the input embedding (a lookup), and
the second term is attention's QK^T and AV in forward and backward, without halving for the
causal mask. The same count is used for both paths, so a path that skips work (the fused head
on prompt positions) shows as higher MFU; the optimiser and elementwise work count as overhead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_args, dtype_of, emit, machine, median, setup, table, timed  # noqa: E402


PATHS = ("logits", "fused")


def matmul_peak(device: torch.device, dtype: torch.dtype, reps: int) -> tuple[float, int]:
    """Best FLOP/s over square matmuls; returns (FLOP/s, n that reached it)."""
    best, best_n = 0.0, 0
    for n in (2048, 4096, 8192) if device.type == "cuda" else (2048, 4096):
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        torch.mm(a, b)  # warm-up
        t = min(timed(lambda: torch.mm(a, b), device) for _ in range(reps))
        if 2 * n**3 / t > best:
            best, best_n = 2 * n**3 / t, n
    return best, best_n


def build(hidden: int, layers: int, vocab: int, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(2, hidden // 64),
        num_key_value_heads=max(2, hidden // 64),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype)


def model_flops(model, batch: int, length: int) -> float:
    c = model.config
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    return 6 * n * batch * length + 12 * c.num_hidden_layers * c.hidden_size * length**2 * batch


def train_step_fn(model, tokens, path: str, share: bool = True):
    from tether.model.causal_lm import LogProbSettings, causal_lm_token_logprobs, token_logprobs

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        if path == "logits":
            lp, ent = token_logprobs(model, tokens, LogProbSettings(fused=False), with_entropy=True)
        else:
            lp, ent, _ = causal_lm_token_logprobs(model, tokens, LogProbSettings(share_prompts=share))
        loss = -((lp + 0.01 * ent) * tokens.loss_mask).sum() / tokens.loss_mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def make_tokens(batch: int, length: int, prompt: int, vocab: int, device):
    from tether.model.causal_lm import Tokens

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (batch, length), generator=g)
    attention = torch.ones(batch, length, dtype=torch.long)
    position = torch.arange(length).expand(batch, length).contiguous()
    T = length - prompt
    return Tokens(
        ids.to(device),
        attention.to(device),
        position.to(device),
        ids[:, prompt:].to(device),
        torch.ones(batch, T, device=device),
        prompt,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["128x4", "256x4", "512x8"], help="HIDDENxLAYERS")
    p.add_argument("--vocab", type=int, default=100, help="100 is tether's character vocabulary")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=128, help="tokens per sequence (prompt + completion)")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens (not scored)")
    p.add_argument("--reps", type=int, default=5, help="timed steps per (size, path); the median is reported")
    add_common_args(p)
    args = p.parse_args()
    device = setup(args)
    dtype = dtype_of(args.dtype)
    peak, peak_n = matmul_peak(device, dtype, args.reps)
    tokens = make_tokens(args.batch, args.length, args.prompt, args.vocab, device)
    rows = []
    for size in args.sizes:
        hidden, layers = (int(x) for x in size.split("x"))
        model = build(hidden, layers, args.vocab, device, dtype).train()
        flops = model_flops(model, args.batch, args.length)
        row = [size, f"{sum(q.numel() for q in model.parameters()) / 1e6:.1f}M", f"{flops / 1e9:.0f}"]
        steps = {path: train_step_fn(model, tokens, path) for path in PATHS}
        for step in steps.values():
            step(), step()  # warm-up: optimiser state, allocator, the fused path's one-off logits check
        times = {path: [] for path in PATHS}
        for _ in range(args.reps):  # alternate, so drift in the machine's load hits both paths
            for path, step in steps.items():
                times[path].append(timed(step, device))
        for path in PATHS:
            t = median(times[path])
            row += [
                f"{t:.3f} s",
                f"{args.batch * args.length / t:,.0f}",
                f"{flops / t / 1e9:.1f}",
                f"{flops / t / peak:.1%}",
            ]
            print(f"{size} {path}: {[round(x, 3) for x in times[path]]}", file=sys.stderr)
        rows.append(row)
        del model
    text = "\n".join(
        [
            f"### Training throughput and MFU ({args.device}, {args.dtype})",
            "",
            f"Machine: {machine(device, args)}. Measured matmul peak: {peak / 1e9:.0f} GFLOP/s ({args.dtype}, {peak_n}^2, "
            f"best of {args.reps}). Step: B = {args.batch} sequences x L = {args.length} tokens "
            f"({args.prompt} prompt), vocabulary {args.vocab}, log-probs + entropy loss, backward, clip, AdamW; "
            f"median of {args.reps}, the two paths alternating, after two warm-up steps each. Model FLOPs = 6 N B L + 12 n_layer d L^2 B.",
            "",
            table(
                [
                    "model (d x layers)",
                    "params",
                    "GFLOP / step",
                    "logits: step",
                    "tok/s",
                    "GFLOP/s",
                    "MFU",
                    "fused: step",
                    "tok/s",
                    "GFLOP/s",
                    "MFU",
                ],
                rows,
            ),
        ]
    )
    emit(text, args.out)


if __name__ == "__main__":
    main()
