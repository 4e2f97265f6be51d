"""Benchmark (b): one RL step of tether vs TRL's GRPOTrainer, same model, prompts and settings.

    python benchmarks/rl_step.py                     # tiny Llama 256 x 4 (4.2M), 16 prompts x 8, 16 new tokens
    python benchmarks/rl_step.py --vocab 151936      # the same body with Qwen2.5's vocabulary size (82M)
    python benchmarks/rl_step.py --device cuda --dtype bfloat16 --out benchmarks/results/performance/rl_step_gpu.md
    python benchmarks/rl_step.py --preset qwen0.5b --device cuda --dtype bfloat16 --steps 5 --out benchmarks/results/performance/rl_step_gpu_qwen0.5b.md
    python benchmarks/rl_step.py --real-model --out benchmarks/results/real_model_cpu/rl_step.md   # SmolLM2-135M, LoRA

--model DIR trains a saved model (a directory, hub id or .gguf file) instead of the tiny one;
--real-model is --model ~/.cache/tether/models/smollm2-135m (scripts/get_model.sh) with
configs/real_model.yaml's workload: word1 prompts in the model's chat template, LoRA r 16, 8 prompts
x 4 samples of up to 32 tokens. --data FILE takes the prompts from a math JSONL file, rendered
as tether's math task renders them (--template, then the tokenizer's chat template): TRL gets the
same rendered strings, so both sample from identical token sequences.

An RL step is: sample prompts_per_step x group_size completions, score them, recompute the old
log-probs, and take `mini_batches` optimiser steps over the batch. Both trainers get the same:

- model (one saved checkpoint, loaded twice), dtype, device and torch threads; with --vocab the
  character vocabulary is padded with filler tokens (`init_model(vocab_size=...)`), which gives
  the tiny body a real LLM's output head and sampling cost;
- prompts (the arithmetic task's training stream), group size, max new tokens, temperature 1,
  top-p 1 (plain sampling), stop on eos;
- reward (1 when the completion has an even number of characters: groups have variance, scoring is free);
- objective: tether's `dapo` preset (clip 0.2 / 0.28, token-mean, group-std advantages, no KL)
  and TRL's loss_type="dapo", epsilon=0.2, epsilon_high=0.28, scale_rewards="group", beta=0;
- optimiser steps per generation batch: tether trainer.mini_batches = M, micro-batch = batch / M;
  TRL steps_per_generation = M, per_device_train_batch_size = batch / M, gradient accumulation 1
  (so TRL computes old log-probs, as tether does); AdamW, the same constant lr, grad clip 1.0;
- no gradient checkpointing; fp32 unless --dtype bfloat16 (TRL then also gets bf16=True).

Tether runs the trainer's own step (`tether.trainer.step.rl_step` on the parts `start_run` builds from a
config of this workload), its phases read from the step's `time/*` metrics; TRL runs `trainer.train()` with its model's `generate` timed and a
callback that stamps the end of each generation batch's last optimiser step and then runs one
tether step (outside TRL's timing): the two alternate step by step, so a change in the machine's
load hits both alike. The first --warmup steps of each are dropped.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_args, add_preset_arg, apply_preset, emit, machine, median, setup, sync, table  # noqa: E402


def parity_reward(completion, example):
    """1 when the completion has an even number of characters: free to score, and groups have
    variance whatever the (untrained) model samples, from a character or a filler vocabulary."""
    from tether.rewards import RewardResult

    ok = len(completion) % 2 == 0
    return RewardResult(float(ok), {"even": float(ok)})


def tether_runner(
    model_dir: Path,
    args,
    device: torch.device,
    old_logprobs: str = "recompute",
    engine_name: str = "hf",
    extra: tuple[str, ...] = (),
):
    """A closure that runs one RL step of tether's trainer and returns its timings; and the parameter count.

    The run is the trainer's own: `start_run` builds it from a config that states this benchmark's workload
    (the model, the prompts, the parity reward as a plug-in, the objective, the batch, LoRA, the engine), and
    each call is `tether.trainer.step.rl_step` on its parts, the function `tether train` runs, with the
    non-finite sampler-token filter, the sampler log-probs and the reference refresh included. Phases come from
    the step's own `time/*` metrics. old_logprobs="sampler" is trainer.old_logprobs=sampler (the old log-prob
    pass skipped); engine_name="vllm" is rollout.engine=vllm, whose weight push before each rollout is timed as
    "sync" (within generation); `extra` overrides come last (--packed: trainer.packing=true)."""
    import atexit
    import shutil

    from tether.config.loading import load_config
    from tether.trainer.setup import start_run
    from tether.trainer.step import rl_step

    batch = args.prompts * args.group
    out = tempfile.mkdtemp(prefix="tether-rl-step-")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    data = getattr(args, "data", None)  # callers that build their own arguments (tests) may leave it out
    cfg = load_config(
        overrides=[
            f"model.name_or_path={model_dir}",
            f"model.dtype={args.dtype}",
            f"output_dir={out}/run",
            "warm_start.enabled=false",
            "reward.name=rl_step:parity_reward",
            f"objective={args.objective}",
            f"rollout.prompts_per_step={args.prompts}",
            f"rollout.group_size={args.group}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            f"rollout.engine={engine_name}",
            f"trainer.mini_batches={args.mini_batches}",
            f"trainer.micro_batch_size={batch // args.mini_batches}",
            f"trainer.lr={args.lr}",
            "trainer.warmup_steps=0",
            f"trainer.old_logprobs={old_logprobs}",
            f"trainer.device={device}",
            f"trainer.threads={args.threads if args.threads > 0 else -1}",
            "trainer.progress=false",
            "trainer.tensorboard=false",
            "trainer.plots=false",
            "data.eval_size=1",
            *([f"model.lora.r={args.lora}", f"model.lora.alpha={2.0 * args.lora}"] if getattr(args, "lora", 0) else []),
            *(
                [
                    "data.task=math",
                    f"data.task_args.train={data}",
                    f"data.task_args.test={getattr(args, 'test', None) or data}",
                ]
                + [f"data.task_args.template={getattr(args, 'template', 'plain')}"]
                if data
                else []
            ),
            *extra,
        ]
    )
    run = start_run(cfg, log=lambda *_: None)
    policy, engine = run.parts.policy, run.evaluation.engine
    args.uses_reference = run.parts.objective.uses_reference()
    step = 0

    def one_step() -> dict:
        nonlocal step
        step += 1
        _, m = rl_step(run.parts, run.progress.counters, step)
        return {
            "total": m["time/step_s"],
            "generation": m["time/sample_s"] + m["time/score_s"],
            "logprobs": m["time/old_logprobs_s"] + m["time/ref_logprobs_s"],
            "update": m["time/update_s"],
            "tokens": m["rollout/len_mean"] * batch,
            "pad": m["tokens/pad_frac"],
            "sync": getattr(engine, "sync_seconds", 0.0),
            "start": getattr(engine, "start_seconds", 0.0),
        }

    args.n_trainable = sum(t.numel() for t in policy.model.parameters() if t.requires_grad)
    return one_step, sum(t.numel() for t in policy.model.parameters())


def prompt_task(args, tokenizer):
    """The prompts' task: tether's math task over --data (rendered with --template and the tokenizer's
    chat template, exactly as `tether train` renders them), else the arithmetic task."""
    from tether.tasks import get_task

    if getattr(args, "data", None):  # callers that build their own arguments (tests) may leave it out
        return get_task("math", train=args.data, template=getattr(args, "template", "plain"), tokenizer=tokenizer)
    return get_task("arithmetic")


def timed(fn, times: list[float], device: torch.device):
    """`fn`, adding each call's wall time (device synchronised before and after) to times[-1]."""

    def wrapper(*a, **k):
        sync(device)
        tic = time.perf_counter()
        out = fn(*a, **k)
        sync(device)
        times[-1] += time.perf_counter() - tic
        return out

    return wrapper


def trl_steps(model_dir: Path, args, device: torch.device, cycles: int, between, use_vllm: bool = False) -> list[dict]:
    """Run TRL's GRPOTrainer for `cycles` generation batches; per batch: total and generate time.

    `between()` runs after each batch (outside TRL's timing): tether's steps interleave with
    TRL's, so a change in the machine's load hits both alike. use_vllm: TRL's own vLLM mode
    (`use_vllm=True, vllm_mode="colocate"`, an in-process vLLM engine), with its weight sync
    (`sync_weights`, once per generation batch) timed as "sync" and the trainer's construction
    (which starts the engine) as "start".
    """
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tether.trainer.data import PromptStream
    from tether.model.loading import load_tokenizer, resolve_dtype

    dtype = resolve_dtype(args.dtype, device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    tokenizer = load_tokenizer(model_dir)  # tether's loader: the same special-token fixes as tether's side
    prompts = [e.prompt for e in PromptStream(prompt_task(args, tokenizer), seed=0).take(args.prompts * cycles)]
    peft_config = None
    if getattr(args, "lora", 0):
        from peft import LoraConfig

        from tether.config.sections import LoRAConfig

        ours = LoRAConfig(r=args.lora, alpha=2.0 * args.lora)
        peft_config = LoraConfig(
            r=ours.r,
            lora_alpha=ours.alpha,
            lora_dropout=ours.dropout,
            target_modules=list(ours.target_modules),
            task_type="CAUSAL_LM",
        )
    m = args.mini_batches
    gen_times = [0.0]  # per generation batch

    model.generate = timed(model.generate, gen_times, device)
    sync_times = [0.0]

    class Stamps(TrainerCallback):
        def __init__(self):
            self.starts: list[float] = []
            self.totals: list[float] = []

        def on_train_begin(self, *a, **k):
            self.starts.append(time.perf_counter())

        def on_step_end(self, args_, state, control, **k):
            sync(device)
            if state.global_step % m == 0:  # a generation batch and its m optimiser steps are done
                self.totals.append(time.perf_counter() - self.starts[-1])
                gen_times.append(0.0)
                sync_times.append(0.0)
                between()
                self.starts.append(time.perf_counter())

    def reward(prompts, completions, **kwargs):
        return [float(len(c) % 2 == 0) for c in completions]

    batch = args.prompts * args.group
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(
            output_dir=out,
            report_to="none",
            save_strategy="no",
            logging_steps=10**6,
            disable_tqdm=True,
            use_cpu=device.type == "cpu",
            bf16=args.dtype == "bfloat16",
            gradient_checkpointing=False,
            per_device_train_batch_size=batch // m,
            steps_per_generation=m,
            gradient_accumulation_steps=1,
            num_generations=args.group,
            max_completion_length=args.max_new_tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            beta=0.0,
            loss_type="dapo",
            epsilon=0.2,
            epsilon_high=0.28,
            scale_rewards="group",
            max_steps=cycles * m,
            seed=0,
            dataloader_num_workers=0,
            shuffle_dataset=False,
            **(
                {
                    "use_vllm": True,
                    "vllm_mode": "colocate",  # the engine's context: the model's, capped as tether caps it
                    "vllm_max_model_length": min(model.config.max_position_embeddings, 4096),
                }
                if use_vllm
                else {}
            ),
        )
        stamps = Stamps()
        tic = time.perf_counter()
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            callbacks=[stamps],
            peft_config=peft_config,
        )
        start = time.perf_counter() - tic
        if use_vllm:  # TRL samples with vLLM, not model.generate: time its generate and its weight sync
            vg = trainer.vllm_generation

            vg.sync_weights = timed(vg.sync_weights, sync_times, device)
            vg.generate = timed(vg.generate, gen_times, device)
        trainer.train()
    logged = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    args.trl_mean_length = float(logged[-1]) if logged else float("nan")
    return [
        {"total": t, "generation": g + w, "sync": w, "start": start}
        for t, g, w in zip(stamps.totals, gen_times, sync_times)
    ]


def _trl_vllm_child(model_dir: str, args, queue) -> None:
    import os
    import traceback

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    device = setup(args)
    try:
        rows = trl_steps(Path(model_dir), args, device, args.warmup + args.steps, lambda: None, use_vllm=True)
        queue.put({"rows": rows, "mean_length": args.trl_mean_length})
    except Exception as exc:  # the column reports what stopped it, and where
        frames = traceback.extract_tb(exc.__traceback__)
        trl_frames = [f for f in frames if "/trl/" in f.filename]

        def where(f):
            return f"{f.filename.split('site-packages/')[-1]}:{f.lineno} ({f.name})"

        queue.put(
            {
                "error": " ".join(f"{type(exc).__name__}: {exc}".split())[:300],
                "raised_at": where(frames[-1]),
                "trl_call": where(trl_frames[-1]) if trl_frames else "",
            }
        )


def trl_vllm_steps(model_dir: Path, args) -> dict:
    """TRL's GRPOTrainer with use_vllm=True, vllm_mode="colocate", in a child process (vLLM's
    parallel state is process-wide, and tether's vLLM engine already holds this one's): its
    timings ({"rows": [...]}) or, where it does not run, the error and where it was raised."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_trl_vllm_child, args=(str(model_dir), args, queue))
    child.start()
    try:
        result = queue.get(timeout=args.trl_vllm_timeout)
    except Exception:  # noqa: BLE001 - the queue's Empty: a hang or a crash without a report
        result = {
            "error": f"no result within {args.trl_vllm_timeout} s (exit code {child.exitcode})",
            "raised_at": "",
            "trl_call": "",
        }
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--mini-batches", type=int, default=2, help="optimiser steps per generation batch")
    p.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="pad the character vocabulary with filler tokens to this size (151936: Qwen2.5's)",
    )
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--objective", default="dapo", help="tether objective preset (TRL is set up as DAPO)")
    p.add_argument("--steps", type=int, default=10, help="measured RL steps per trainer")
    p.add_argument("--warmup", type=int, default=1, help="RL steps dropped before measuring")
    p.add_argument("--vllm", action="store_true", help="also tether with rollout.engine=vllm (a fourth column)")
    p.add_argument("--packed", action="store_true", help="also tether with trainer.packing=true (a column beside it)")
    p.add_argument(
        "--trl-vllm",
        action="store_true",
        help="also TRL with use_vllm=True, vllm_mode='colocate' (after the others, in its own process, "
        "not interleaved); where it does not run, its column gives the error",
    )
    p.add_argument("--trl-vllm-timeout", type=float, default=900, help="seconds before the TRL + vLLM run is given up")
    p.add_argument(
        "--model",
        default=None,
        help="a saved model (directory, hub id or .gguf file) instead of the tiny one built from --hidden ...",
    )
    p.add_argument("--data", default=None, help="prompts from this math JSONL file (default: the arithmetic task)")
    p.add_argument("--template", default="plain", help="math prompt template, as data.task_args.template")
    p.add_argument(
        "--lora",
        type=int,
        default=0,
        help="LoRA rank on both trainers (alpha 2r, tether's seven projections; 0: full fine-tuning)",
    )
    p.add_argument(
        "--real-model",
        action="store_true",
        help="SmolLM2-135M-Instruct with configs/real_model.yaml's workload (explicit flags win)",
    )
    add_preset_arg(p)
    add_common_args(p)
    args = p.parse_args()
    apply_preset(args, p)
    if args.real_model:
        from tether.model.files import cache_root

        real = {
            "model": str(cache_root() / "models" / "smollm2-135m"),
            "data": "tether:word1_train.jsonl",
            "template": "{problem}\nAnswer with the number only.",
            "lora": 16,
            "prompts": 8,
            "group": 4,
            "max_new_tokens": 32,
            "steps": 3,
        }
        for key, value in real.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    device = setup(args)
    from tether.model.loading import init_model, local_source
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if args.prompts % args.mini_batches:
        raise SystemExit("--prompts must be divisible by --mini-batches")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model_dir = Path(local_source(args.model))
        else:
            model_dir = init_model(
                Path(tmp) / "model",
                hidden_size=args.hidden,
                num_layers=args.layers,
                num_heads=args.heads,
                seed=0,
                vocab_size=args.vocab,
            )
        run, args.n_params = tether_runner(model_dir, args, device)
        run_sampler, _ = tether_runner(model_dir, args, device, old_logprobs="sampler")
        run_vllm = tether_runner(model_dir, args, device, engine_name="vllm")[0] if args.vllm else None
        run_packed = tether_runner(model_dir, args, device, extra=("trainer.packing=true",))[0] if args.packed else None
        run(), run_sampler()  # tether's own warm-up, before TRL starts
        ours: list[dict] = []
        fast: list[dict] = []
        with_vllm: list[dict] = []
        args.packed_rows = []
        if run_vllm:
            run_vllm()
        if run_packed:
            run_packed()

        def between():
            ours.append(run())
            fast.append(run_sampler())
            if run_vllm:
                with_vllm.append(run_vllm())
            if run_packed:
                args.packed_rows.append(run_packed())

        theirs = trl_steps(model_dir, args, device, args.warmup + args.steps, between)
        trl_vllm = trl_vllm_steps(model_dir, args) if args.trl_vllm else None
    ours, fast, theirs, with_vllm = (
        ours[args.warmup :],
        fast[args.warmup :],
        theirs[args.warmup :],
        with_vllm[args.warmup :],
    )
    args.packed_rows = args.packed_rows[args.warmup :]
    if trl_vllm and "rows" in trl_vllm:
        trl_vllm["rows"] = trl_vllm["rows"][args.warmup :]
    print(
        f"tether: {[round(r['total'], 3) for r in ours]}\ntether (sampler): "
        f"{[round(r['total'], 3) for r in fast]}\ntrl: {[round(r['total'], 3) for r in theirs]}",
        file=sys.stderr,
    )
    if trl_vllm:
        print(f"trl + vllm: {trl_vllm}", file=sys.stderr)
    emit(report(args, device, ours, fast, theirs, with_vllm, trl_vllm), args.out)


def _packed_column(rows: list, header: list, packed: list[dict], ours: list[dict], med) -> tuple[list, list]:
    """The table with a column for tether with trainer.packing=true, after the padded one."""
    p = packed
    col = [
        f"{med(p, 'total'):.3f} s",
        f"{med(p, 'generation'):.3f} s",
        f"{med(p, 'logprobs'):.3f} s",
        f"{med(p, 'update'):.3f} s",
        f"{max(med(p, 'total') - med(p, 'generation') - med(p, 'logprobs') - med(p, 'update'), 0.0):.3f} s",
        f"{med(p, 'pad'):.1%}",
    ]
    col += ["-"] * (len(rows) - len(col))
    return [[*r[:2], c, *r[2:]] for r, c in zip(rows, col)], [*header[:2], "tether (trainer.packing=true)", *header[2:]]


def model_line(args) -> str:
    r = getattr(args, "lora", 0)
    lora = f", LoRA r {r} ({args.n_trainable / 1e6:.1f}M trainable)" if r else ", full fine-tuning"
    if getattr(args, "model", None):
        return f"{args.model} ({args.n_params / 1e6:.1f}M parameters{lora})"
    vocab = "character vocabulary" if args.vocab is None else f"vocabulary {args.vocab:,} (characters + filler tokens)"
    return f"tiny Llama {args.hidden} x {args.layers} layers ({args.n_params / 1e6:.1f}M parameters, {vocab}{lora})"


def report(
    args,
    device,
    ours: list[dict],
    fast: list[dict],
    theirs: list[dict],
    with_vllm: list[dict] = (),
    trl_vllm: dict | None = None,
) -> str:
    def med(rows, key):
        return median([r[key] for r in rows])

    def cells(rows, key):
        return f"{med(rows, key):.3f} s"

    t_total, f_total, r_total = med(ours, "total"), med(fast, "total"), med(theirs, "total")
    rest = [
        max(med(rs, "total") - med(rs, "generation") - med(rs, "logprobs") - med(rs, "update"), 0.0)
        for rs in (ours, fast)
    ]
    rows = [
        [
            "RL step (median)",
            f"{t_total:.3f} s",
            f"{f_total:.3f} s",
            f"{r_total:.3f} s",
            f"{r_total / t_total:.2f}x",
            f"{r_total / f_total:.2f}x",
        ],
        [
            "generation + scoring",
            cells(ours, "generation"),
            cells(fast, "generation"),
            f"{med(theirs, 'generation'):.3f} s (generate)",
            "",
            "",
        ],
        [
            "old log-probs pass" + (" + reference pass" if args.uses_reference else ""),
            cells(ours, "logprobs"),
            cells(fast, "logprobs") + " (none)",
            "-",
            "",
            "",
        ],
        [
            f"updates ({args.mini_batches} optimiser steps)",
            cells(ours, "update"),
            cells(fast, "update"),
            f"{r_total - med(theirs, 'generation'):.3f} s (old log-probs + updates)",
            "",
            "",
        ],
        ["rest (advantages, tensors)", f"{rest[0]:.3f} s", f"{rest[1]:.3f} s", "-", "", ""],
        ["padding share of the passes", f"{med(ours, 'pad'):.1%}", f"{med(fast, 'pad'):.1%}", "-", "", ""],
    ]
    header = [
        "",
        "tether (recompute)",
        "tether (old_logprobs=sampler)",
        "TRL GRPOTrainer",
        "TRL / tether",
        "TRL / tether (sampler)",
    ]
    if with_vllm:
        v = with_vllm
        extra = [
            f"{med(v, 'total'):.3f} s",
            cells(v, "generation") + f" (weight push {med(v, 'sync'):.3f} s)",
            cells(v, "logprobs"),
            cells(v, "update"),
            f"{max(med(v, 'total') - med(v, 'generation') - med(v, 'logprobs') - med(v, 'update'), 0.0):.3f} s",
            f"{med(v, 'pad'):.1%}",
        ]
        rows = [[*r[:3], e, *r[3:]] for r, e in zip(rows, extra, strict=True)]
        header = [*header[:3], "tether (rollout.engine=vllm)", *header[3:]]
        rows.append(["vLLM engine start (once per run)", "-", "-", f"{v[0]['start']:.1f} s", "-", "", ""])
    notes = []
    packed = getattr(args, "packed_rows", [])
    if packed:
        rows, header = _packed_column(rows, header, packed, ours, med)
        notes.append(
            f"trainer.packing=true (packed rows, each prompt once) against the default padded forwards: the step "
            f"{med(ours, 'total') / med(packed, 'total'):.2f}x as fast, the log-prob passes "
            f"{med(ours, 'logprobs') / max(med(packed, 'logprobs'), 1e-9):.2f}x, the update "
            f"{med(ours, 'update') / med(packed, 'update'):.2f}x (padded / packed, side by side)."
        )
    if trl_vllm is not None:
        width = len(header)
        if "rows" in trl_vllm and trl_vllm["rows"]:
            t = trl_vllm["rows"]
            col = [
                f"{med(t, 'total'):.3f} s",
                f"{med(t, 'generation'):.3f} s (weight sync {med(t, 'sync'):.3f} s)",
                "-",
                f"{med(t, 'total') - med(t, 'generation'):.3f} s (old log-probs + updates)",
                "-",
            ]
            if len(rows) > len(col):
                col.append(f"{t[0]['start']:.1f} s (the trainer's construction)")
            notes.append(
                f"TRL + vLLM ran in its own process after the others (not interleaved), median over {len(t)} "
                f"steps; mean completion length {trl_vllm.get('mean_length', float('nan')):.1f} tokens."
            )
        else:
            col = ["does not run"] + ["-"] * (len(rows) - 1)
            notes.append(
                f'TRL + vLLM (`use_vllm=True, vllm_mode="colocate"`) does not run here: '
                f"`{trl_vllm['error']}`, raised at `{trl_vllm['raised_at']}`"
                + (f", called from `{trl_vllm['trl_call']}`" if trl_vllm.get("trl_call") else "")
                + "."
            )
        rows = [[*r[: width - 2], c, *r[width - 2 :]] for r, c in zip(rows, col)]
        header = [*header[: width - 2], "TRL GRPOTrainer + vLLM (colocate)", *header[width - 2 :]]
    return "\n".join(
        [
            f"### One RL step: tether vs TRL GRPOTrainer ({args.device}, {args.dtype})",
            "",
            f"Machine: {machine(device, args)}. Model: {model_line(args)}. Prompts: "
            f"{f'{Path(args.data).name} ({args.template!r}, chat template)' if getattr(args, 'data', None) else 'the arithmetic task'}; "
            "reward: even completion length. "
            f"{args.prompts} prompts x {args.group} samples, {args.max_new_tokens} new tokens max, "
            f"{args.mini_batches} optimiser steps per batch; median over {len(ours)} (tether) and {len(theirs)} (TRL) "
            f"steps after {args.warmup} warm-up; the {'four' if with_vllm else 'three'} alternate step by step (TRL + vLLM, "
            "if run, after them). Mean completion length: tether "
            f"{sum(r['tokens'] for r in ours) / len(ours) / (args.prompts * args.group):.1f}, TRL "
            f"{args.trl_mean_length:.1f} tokens (of {args.max_new_tokens}).",
            "",
            table(header, rows),
            *(["", *notes] if notes else []),
        ]
    )


if __name__ == "__main__":
    main()
