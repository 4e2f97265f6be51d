"""Benchmark (a): per-token log-probs + entropy, naive log_softmax vs tether.model.ops' chunked head.

    python benchmarks/logprobs.py                              # V 151,936, H 1024, T 1024/4096/8192, CPU fp32
    python benchmarks/logprobs.py --dtype bfloat16 --tokens 1024  # the CPU bf16 row (issue 14)
    python benchmarks/logprobs.py --device cuda --dtype bfloat16 --tokens 4096 8192 \
        --out benchmarks/results/performance/logprobs_gpu.md

One forward + backward through log-probs and entropy of N = 1 sequence of T tokens, both outputs
in the loss (with random weights, so both gradients flow) and gradients for the hidden states and
the head weight. "naive" is the trainer's model-logits path (trainer.fused_logprobs=false): the (T, V) logits in float32,
log_softmax, gather, entropy from exp(logp); in bfloat16 its matmuls are bf16 and the logits are
upcast after the head, as a bf16 model's lm_head does. "chunked" is tether.model.ops.token_logprobs_and_entropy
with its default tiles for the device (or --chunk-size / --vocab-chunk-size). --methods runs only
some of the two (a naive bf16 step on a CPU without bf16 GEMMs takes many minutes).
--naive-matmul float32 gives naive float32 matmuls on upcast bf16 inputs instead (a float32 copy
of the weight per step): the fastest naive computation on such a CPU.

Each (method, T) runs in its own process, so peak memory is that process's own: on CPU the peak
resident set (ru_maxrss) minus the resident set just before the first step (the weight, hidden
states and Python are in both); on CUDA the allocator's peak minus what was allocated before.
Time is the median over --reps steps. A naive run that would not fit in the memory available
now (extrapolated from the smaller T, or 6 float32 (T, V) copies) is skipped, not attempted.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_args, dtype_of, emit, machine, median, setup, table, timed  # noqa: E402

GB = 1e9


def naive(hidden, weight, targets, temperature, upcast: bool = False):
    """The model-logits path on hidden states: full logits, log_softmax, gather, entropy. With
    `upcast`, bf16 inputs are cast to float32 before the matmul (a float32 copy of the weight)."""
    if upcast:
        hidden, weight = hidden.float(), weight.float()
    logits = (hidden @ weight.t()).float()  # (N, T, V)
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1)


def rss_now() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def mem_available() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return float("inf")


def child(args) -> None:
    """One method at one T: print {"times": [...], "extra": bytes, "peak": bytes} as JSON."""
    from tether.model.ops import token_logprobs_and_entropy

    device = setup(args)
    dtype = dtype_of(args.dtype)
    V, H, T = args.vocab, args.hidden, args.tokens[0]
    torch.manual_seed(0)
    # Filled in place: a temporary here would raise the peak before the baseline is taken.
    weight = torch.empty(V, H, device=device, dtype=dtype).normal_(std=H**-0.5).requires_grad_()
    hidden = torch.empty(1, T, H, device=device, dtype=dtype).normal_().requires_grad_()
    targets = torch.randint(0, V, (1, T), device=device)
    g_lp, g_ent = torch.randn(1, T, device=device), torch.randn(1, T, device=device)

    def step():
        hidden.grad = weight.grad = None
        if args.child == "naive":
            lp, ent = naive(hidden, weight, targets, args.temperature, args.naive_matmul == "float32")
        else:
            lp, ent = token_logprobs_and_entropy(
                hidden,
                weight,
                targets,
                temperature=args.temperature,
                chunk_size=args.chunk_size,
                vocab_chunk_size=args.vocab_chunk_size,
            )
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        base = rss_now()
    times = [timed(step, device) for _ in range(args.reps)]
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"times": times, "extra": peak - base, "peak": peak}))


def run_child(args, method: str, T: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        method,
        "--tokens",
        str(T),
        "--vocab",
        str(args.vocab),
        "--hidden",
        str(args.hidden),
        "--reps",
        str(args.reps),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
        "--temperature",
        str(args.temperature),
        "--naive-matmul",
        args.naive_matmul,
    ]
    if args.chunk_size:
        cmd += ["--chunk-size", str(args.chunk_size)]
    if args.vocab_chunk_size:
        cmd += ["--vocab-chunk-size", str(args.vocab_chunk_size)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": f"failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def needs(method: str, T: int, args, measured: dict) -> float:
    """Bytes the run is expected to need beyond its baseline."""
    smaller = [(t, r["extra"]) for (m, t), r in measured.items() if m == method and "extra" in r and t < T]
    if smaller:
        t, extra = max(smaller)
        return extra * T / t * 1.1
    copies = 6 if method == "naive" else 0
    return copies * T * args.vocab * 4 + args.vocab * args.hidden * 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192], help="T values (N = 1)")
    p.add_argument("--reps", type=int, default=3, help="timed steps per (method, T); the median is reported")
    p.add_argument(
        "--chunk-size", type=int, default=None, help="tokens per tile (default: tether.model.ops.tile_shape)"
    )
    p.add_argument(
        "--vocab-chunk-size",
        type=int,
        default=None,
        help="vocabulary entries per tile (default: tether.model.ops.tile_shape)",
    )
    p.add_argument("--methods", nargs="+", choices=["naive", "chunked"], default=["naive", "chunked"])
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--naive-matmul",
        choices=["input", "float32"],
        default="input",
        help="naive's head matmul: in the inputs' dtype (a bf16 lm_head), or float32 on upcast inputs "
        "(the fastest naive on a CPU without bf16 GEMMs)",
    )
    p.add_argument("--headroom-gb", type=float, default=1.5, help="memory to leave free when deciding to skip")
    p.add_argument("--child", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    add_common_args(p)
    args = p.parse_args()
    if args.child:
        return child(args)
    device = setup(args)
    from tether.model.ops import native_low_precision_matmul, tile_shape

    R, C = tile_shape(max(args.tokens), args.vocab, device, args.chunk_size, args.vocab_chunk_size, args.hidden)
    low = dtype_of(args.dtype) != torch.float32
    mm = (
        (
            "bf16 GEMMs"
            if native_low_precision_matmul(device, dtype_of(args.dtype))
            else "float32 GEMMs on upcast tiles (no bf16 GEMMs on this CPU)"
        )
        if low
        else "float32 GEMMs"
    )
    measured: dict = {}
    rows = []
    for T in args.tokens:
        for method in ("naive", "chunked"):
            if method not in args.methods:
                measured[(method, T)] = {"skip": "not run (--methods)"}
                continue
            need = needs(method, T, args, measured)
            free = mem_available() if device.type == "cpu" else torch.cuda.mem_get_info(device)[0]
            if need > free - args.headroom_gb * GB:
                measured[(method, T)] = {"skip": f"skipped: needs ~{need / GB:.1f} GB, {free / GB:.1f} GB free"}
            else:
                measured[(method, T)] = run_child(args, method, T)
            print(f"T={T} {method}: {measured[(method, T)]}", file=sys.stderr)
        rows.append(row(T, args.vocab, measured[("naive", T)], measured[("chunked", T)]))
    text = "\n".join(
        [
            f"### Log-probs + entropy, forward + backward (V = {args.vocab:,}, H = {args.hidden}, N = 1, "
            f"{args.dtype}, {args.device})",
            "",
            f"Machine: {machine(device, args)}. Tiles: {R} tokens x {C:,} vocabulary entries (for the largest T; one "
            f"float32 tile = {R * C * 4 / GB:.3f} GB); chunked matmuls: {mm}; naive matmul: "
            f"{'float32 on upcast inputs' if args.naive_matmul == 'float32' else 'in the inputs dtype'}. Peak memory: above the process's footprint before the "
            f"first step ({'allocator peak' if device.type == 'cuda' else 'max RSS'}); time: median (min-max) of {args.reps}.",
            "",
            table(
                [
                    "T",
                    "(T, V) fp32 logits",
                    "naive peak",
                    "chunked peak",
                    "chunked / naive memory",
                    "naive time",
                    "chunked time",
                    "chunked / naive time",
                ],
                rows,
            ),
        ]
    )
    emit(text, args.out)


def row(T: int, V: int, naive_r: dict, chunked_r: dict) -> list:
    def mem(r):
        return f"{r['extra'] / GB:.2f} GB" if "extra" in r else r.get("skip") or r.get("error")

    def sec(r):
        return f"{median(r['times']):.2f} s ({min(r['times']):.1f}-{max(r['times']):.1f})" if "times" in r else "-"

    both = "extra" in naive_r and "extra" in chunked_r
    mem_ratio = f"{chunked_r['extra'] / naive_r['extra']:.3f}" if both else "-"
    time_ratio = f"{median(chunked_r['times']) / median(naive_r['times']):.2f}" if both else "-"
    return [
        T,
        f"{T * V * 4 / GB:.2f} GB",
        mem(naive_r),
        mem(chunked_r),
        mem_ratio,
        sec(naive_r),
        sec(chunked_r),
        time_ratio,
    ]


if __name__ == "__main__":
    main()
