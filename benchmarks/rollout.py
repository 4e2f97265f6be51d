"""Benchmark (d): rollout tokens/s of the `hf` engine, eager and compiled, and of the `vllm` engine,
against HF `generate`.

    python benchmarks/rollout.py                                # tiny Llamas on CPU, no compile
    python benchmarks/rollout.py --vocab 151936 --sizes 256x4   # with Qwen2.5's vocabulary size
    python benchmarks/rollout.py --compile --sizes 128x4        # + the compiled rows (slow to compile on CPU)
    python benchmarks/rollout.py --vllm --sizes 128x4           # + the vLLM engine (its start and weight push too)
    # issue 14's workload: the 0.58B body (896 x 24, 14 heads, vocabulary 151,936), 128 rows x 256 tokens
    python benchmarks/rollout.py --preset qwen0.5b --device cuda --dtype bfloat16 --compile \
        --out benchmarks/results/performance/rollout_gpu_qwen0.5b.md

Rows: with --vllm, tether's `vllm` engine (an in-process vLLM engine, tether/rollout/vllm_engine.py;
its warm-up column adds vLLM's import, the engine's start and one push of the model's weights);
tether's `hf` engine eager (dynamic KV cache, `HFEngine(compile=False)`) and, with
--compile, compiled (static KV cache + torch.compile, CUDA graphs on a GPU: `compile=True`,
the default on CUDA; tether/rollout/static.py); Hugging Face `generate` with the dynamic cache
(the like-for-like reference), with `cache_implementation="static"`, and with --compile static +
torch.compile of the decode step. All sample at temperature 1, top-p 1, no top-k, and stop rows
on eos. Tokens/s counts completion tokens up to and including eos, over the wall time of the
whole call (prefill included); the median of --reps calls after one warm-up call (the compile
happens in the warm-up, timed apart). With --vocab the character vocabulary is padded with
filler tokens to that size, so the head and the sampling over the vocabulary cost what they do
for a real LLM (tether's engine samples by a two-level inverse CDF, `generate` by softmax +
torch.multinomial). With --eos-bias rows stop at spread-out lengths: tether's engine drops
finished rows from the batch once at most half are still running, where `generate` keeps
decoding them to the longest.

The last row is the physical limit of decode: every step reads the weights (all but the input
embedding, of which it gathers one row per token) and the KV cache of every row, so
tokens/s <= rows x bandwidth / (weight bytes + KV bytes), with KV bytes at the mean context
(prompt + half the new tokens: every row running to the limit, a dynamic cache). The
bandwidth is measured here (a sum over a 1 GiB tensor) unless --bandwidth gives it in GB/s.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    add_common_args,
    add_preset_arg,
    apply_preset,
    emit,
    machine,
    median,
    setup,
    table,
    timed,
)


def hf_generate(model, tokenizer, prompts, args, cache: str | None, compile_: bool):
    """A closure calling model.generate; returns the completion token count of each call."""
    from transformers import CompileConfig

    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    ids = enc.input_ids.repeat_interleave(args.group, 0)
    mask = enc.attention_mask.repeat_interleave(args.group, 0)
    kwargs = dict(
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=args.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if cache:
        kwargs["cache_implementation"] = cache
    if compile_:
        config = CompileConfig(fullgraph=False, mode="reduce-overhead" if model.device.type == "cuda" else "default")
        config._compile_all_devices = True  # transformers compiles only on accelerators unless told
        kwargs["compile_config"] = config
    else:
        kwargs["disable_compile"] = True

    def run() -> int:
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)[:, ids.shape[1] :]
        is_eos = out == tokenizer.eos_token_id
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, out.shape[1])
        return int(first.sum())

    return run


def add_eos_bias(model, eos_id: int, bias: float) -> None:
    """Give the output head a bias that raises eos's logit, so completions stop at spread-out
    lengths (an untrained model otherwise runs nearly every row to the limit)."""
    old = model.get_output_embeddings()
    head = torch.nn.Linear(
        old.in_features, old.out_features, bias=True, device=old.weight.device, dtype=old.weight.dtype
    )
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[eos_id] = bias
    model.set_output_embeddings(head)


def engine_generate(model, tokenizer, prompts, args, compile_: bool, name: str = "hf"):
    from tether.rollout import SamplingParams, get_engine

    engine = get_engine(name, model=model, tokenizer=tokenizer, compile=compile_)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens)
    seed = [0]

    def run() -> int:
        seed[0] += 1
        return int(engine.generate(prompts, n=args.group, params=params, seed=seed[0]).mask.sum())

    run.engine = engine
    return run


def vllm_extras(model, tokenizer, prompts, args) -> tuple[object, str]:
    """The vLLM engine's generate closure, and its one-time costs for the table: engine start
    (after vLLM's import, timed apart) and one weight push of the whole model."""
    import time

    tic = time.perf_counter()
    from tether.rollout.vllm_compat import import_vllm

    import_vllm()

    imported = time.perf_counter() - tic
    run = engine_generate(model, tokenizer, prompts, args, "auto", "vllm")
    engine = run.engine
    engine.sync_weights(force=True)
    return run, f"import {imported:.1f} s, start {engine.start_seconds:.1f} s, weight push {engine.sync_seconds:.2f} s"


def read_bandwidth(device: torch.device, gib: float = 1.0) -> float:
    """Bytes/s of a sum over a `gib` GiB float32 tensor (median of 5): what decode's reads can reach."""
    x = torch.ones(int(gib * 2**30) // 4, device=device)
    x.sum()
    times = [timed(lambda: x.sum(), device) for _ in range(5)]
    return x.numel() * 4 / median(times)


def decode_bound(model, rows: int, prompt_len: float, new_tokens: int, bandwidth: float) -> tuple[float, float, float]:
    """(tokens/s bound, weight bytes, KV bytes) per decode step: weights but the input embedding,
    plus the KV cache of `rows` rows at the mean context prompt_len + new_tokens / 2."""
    c = model.config
    size = next(model.parameters()).element_size()
    weights = (sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()) * size
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = rows * (prompt_len + new_tokens / 2) * c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * size
    return rows * bandwidth / (weights + kv), weights, kv


def measure(run, device, reps: int) -> tuple[float, float]:
    """(median tokens/s over reps, warm-up seconds)."""
    counts = []
    warm = timed(run, device)
    rates = []
    for _ in range(reps):
        box = {}
        t = timed(lambda: box.setdefault("n", run()), device)
        counts.append(box["n"])
        rates.append(box["n"] / t)
    return median(rates), warm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["128x4", "256x4"], help="HIDDENxLAYERS tiny Llamas")
    p.add_argument(
        "--hidden", type=int, default=None, help="one model of this width (with --layers), instead of --sizes"
    )
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None, help="attention heads (default: hidden / 64)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--eos-bias",
        type=float,
        default=0.0,
        help="add this to eos's logit, so rows stop at spread-out lengths (e.g. 2.5)",
    )
    p.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="pad the character vocabulary with filler tokens to this size (151936: Qwen2.5's)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also the compiled rows: tether's compiled decode and HF static + torch.compile",
    )
    p.add_argument(
        "--vllm",
        action="store_true",
        help="also the vLLM engine (rollout.engine=vllm; one model size per process: vLLM starts once)",
    )
    p.add_argument("--bandwidth", type=float, default=None, help="memory bandwidth in GB/s (default: measured)")
    p.add_argument(
        "--skip-hf", action="store_true", help="only tether's rows (HF generate is slow at a large vocabulary on CPU)"
    )
    add_common_args(p)
    add_preset_arg(p)
    args = p.parse_args()
    apply_preset(args, p)
    if args.hidden is not None:
        args.sizes = [f"{args.hidden}x{args.layers}"]
    device = setup(args)
    bandwidth = args.bandwidth * 1e9 if args.bandwidth else read_bandwidth(device)
    from tether.trainer.data import PromptStream
    from tether.model.loading import init_model, load_model
    from tether.tasks import get_task
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    prompts = [e.prompt for e in PromptStream(get_task("arithmetic"), seed=0).take(args.prompts)]
    rows = []
    for size in args.sizes:
        hidden, layers = (int(x) for x in size.split("x"))
        with tempfile.TemporaryDirectory() as tmp:
            path = init_model(
                Path(tmp) / "m",
                hidden_size=hidden,
                num_layers=layers,
                num_heads=args.heads or max(2, hidden // 64),
                max_positions=max(256, 2 * args.max_new_tokens),
                vocab_size=args.vocab,
            )
            model, tokenizer = load_model(path, dtype=args.dtype, device=str(device))
        if args.eos_bias:
            add_eos_bias(model, tokenizer.eos_token_id, args.eos_bias)
        model.eval()
        params = sum(p.numel() for p in model.parameters())
        label = f"{size} ({params / 1e6:,.1f}M)"
        variants = [
            ("tether hf engine, eager (dynamic cache)", engine_generate(model, tokenizer, prompts, args, False))
        ]
        notes = {}
        if args.vllm:
            run, notes["vLLM, in-process engine"] = vllm_extras(model, tokenizer, prompts, args)
            variants.append(("vLLM, in-process engine", run))
        if args.compile:
            variants.append(
                (
                    "tether hf engine, compiled (static cache + torch.compile)",
                    engine_generate(model, tokenizer, prompts, args, True),
                )
            )
        if not args.skip_hf:
            variants += [
                ("HF generate, dynamic cache", hf_generate(model, tokenizer, prompts, args, None, False)),
                ("HF generate, static cache", hf_generate(model, tokenizer, prompts, args, "static", False)),
            ]
            if args.compile:
                variants.append(
                    (
                        "HF generate, static cache + torch.compile",
                        hf_generate(model, tokenizer, prompts, args, "static", True),
                    )
                )
        base = None
        for name, run in variants:
            rate, warm = measure(run, device, args.reps)
            base = base or rate
            warm_text = f"{warm:.1f} s" + (f" ({notes[name]})" if name in notes else "")
            rows.append([label, name, f"{rate:,.0f}", f"{rate / base:.2f}", warm_text])
            print(f"{size} {name}: {rate:.0f} tok/s (warm-up {warm:.1f} s)", file=sys.stderr)
        prompt_len = sum(len(tokenizer(q, add_special_tokens=False).input_ids) for q in prompts) / len(prompts)
        bound, weights, kv = decode_bound(model, args.prompts * args.group, prompt_len, args.max_new_tokens, bandwidth)
        rows.append(
            [
                label,
                f"physical limit: {weights / 1e6:,.1f} MB weights + {kv / 1e6:,.1f} MB KV per step "
                f"at {bandwidth / 1e9:,.0f} GB/s",
                f"{bound:,.0f}",
                f"{bound / base:.2f}",
                "-",
            ]
        )
        del model, variants
        torch._dynamo.reset()
    text = "\n".join(
        [
            f"### Rollout throughput ({args.device}, {args.dtype})",
            "",
            f"Machine: {machine(device, args)}. {args.prompts} prompts x {args.group} samples = "
            f"{args.prompts * args.group} rows, up to {args.max_new_tokens} new tokens, sampling at temperature 1; "
            f"{'character vocabulary' if args.vocab is None else f'vocabulary {args.vocab:,} (characters + filler tokens)'}; "
            f"{f'eos logit raised by {args.eos_bias:g}, so rows stop at spread-out lengths; ' if args.eos_bias else ''}"
            f"completion tokens per second of wall time, median of {args.reps} calls after one warm-up call. "
            f"Bandwidth {bandwidth / 1e9:,.0f} GB/s ({'given' if args.bandwidth else 'measured: a sum over 1 GiB'}).",
            "",
            table(["model (d x layers)", "generator", "tokens/s", "vs tether engine", "warm-up call"], rows),
        ]
    )
    emit(text, args.out)


if __name__ == "__main__":
    main()
