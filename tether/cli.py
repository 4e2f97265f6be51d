"""The `tether` command line. Each subcommand is a thin wrapper over a library function.

Heavy packages (torch, transformers, vLLM) are imported by the commands that need them, after the
config has been read and checked: a config error is reported before any of them is imported
(docs/performance.md, "Time to an error"). Hence the imports inside the functions.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import warnings

from .evaluation.command import add_eval_parser

LIST_DELTAS = (0.01, 0.02, 0.0231, 0.0331, 0.05)


def cmd_list(args: argparse.Namespace) -> int:
    """Print the registered objectives, presets, and the trust-region table of every measure."""
    from . import objectives
    from .core.advantages import ADVANTAGES
    from .core.aggregation import AGGREGATIONS
    from .core.distill import DISTILL_SIGNALS
    from .core.kl import KL_ESTIMATORS
    from .core.multi_reward import REWARD_AGGREGATIONS
    from .divergences import BINARY_MEASURES, MEASURES, interval

    print("objectives:  " + ", ".join(objectives.names()))
    print("presets:")
    for name in objectives.preset_names():
        spec = objectives.load_preset(name)
        params = ", ".join(f"{k}={v}" for k, v in spec.items() if k != "name")
        print(f"  {name:<14} {spec['name']}: {params}")
    print("advantages:  " + ", ".join(ADVANTAGES.names()))
    print("reward aggregation: " + ", ".join(REWARD_AGGREGATIONS.names()))
    print("aggregation: " + ", ".join(AGGREGATIONS.names()))
    print("kl penalty:  " + ", ".join(KL_ESTIMATORS.names()))
    print("distill signals (objective.distill.signal, with a teacher; docs/algorithms/distillation.md):")
    for name in DISTILL_SIGNALS.names():
        signal = DISTILL_SIGNALS.get(name)
        print(f"  {name:<16} {signal.kind}: {signal.summary}")
    print(
        "binary measures (of two log-probs; dppo's measure, rollout_correction's rejection; binary_kl_max: KPop): "
        + ", ".join(BINARY_MEASURES.names())
    )
    print("\ntrust region [low, high] = {w : D(w) <= delta}")
    header = f"{'measure':<12}" + "".join(f"{'delta=' + format(d, 'g'):>20}" for d in LIST_DELTAS)
    print(header)
    for m in MEASURES.names():
        cells = "".join(f"{'[%.4f, %.4f]' % interval(m, d):>20}" for d in LIST_DELTAS)
        print(f"{m:<12}{cells}")
    return 0


def _split_config_args(items: list[str]) -> tuple[str | None, list[str]]:
    """[CONFIG] [key=value ...]: the first item without '=' is the config file."""
    path = None
    overrides = []
    for i, item in enumerate(items):
        if "=" in item:
            overrides.append(item)
        elif i == 0:
            path = item
        else:
            raise SystemExit(f"error: {item!r} is not key=value; only the first argument may be a config file")
    return path, overrides


def cmd_train(args: argparse.Namespace) -> int:
    from .config.loading import load_config

    if args.help_config:
        return _print_config_help()
    if args.resume:
        from pathlib import Path

        from .schema import ConfigError

        cfg_path = Path(args.resume) / "config.yaml"
        if not cfg_path.is_file():
            raise ConfigError(f"--resume {args.resume}: no config.yaml there; is it a tether run directory?")
        # The run's own config, with the overrides; train() refuses any that changes more than the
        # budget, logging or checkpointing (tether.config.sections.RESUMABLE_KEYS), and config.yaml stays as it was.
        cfg = load_config(str(cfg_path), [*args.args, f"output_dir={args.resume}"])
        from .trainer.loop import train  # torch and transformers: after the config is known to be good

        train(cfg, resume_dir=args.resume)
        return 0
    path, overrides = _split_config_args(args.args)
    cfg = load_config(path, overrides)
    from .trainer.loop import train

    train(cfg)
    return 0


def _print_config_help() -> int:
    from .config.help import describe_fields, describe_reward_params, describe_task_knobs

    for key, default, doc in describe_fields():
        print(f"{key:<40} {default:<16} {doc}")
    print("\nTask knobs: data.task_args.KNOB, for the task named by data.task (e.g. data.task_args.digits=3).")
    for key, scope, default, doc in describe_task_knobs():
        print(f"{key:<40} {'(' + scope + ')':<18} {default:<16} {doc}")
    print(
        "\nReward parameters: set per part of a weighted reward, reward.weights.NAME.PARAM=V, or in YAML\n"
        "  reward: {weights: {math: 1.0, overlong: {weight: 0.5, max_tokens: 512, cache: 128}}}\n"
        "(reward.weights.NAME.weight is the part's weight, default 1.0; a reward without parameters takes\n"
        "only a weight, reward.weights.NAME=W). A reward chosen by reward.name alone gets only the shared\n"
        "reward.timeout_s and reward.strict, so one with required parameters (overlong) needs reward.weights."
    )
    for key, scope, default, doc in describe_reward_params():
        print(f"{key:<40} {'(' + scope + ')':<18} {default:<16} {doc}")
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from .config.loading import load_config
    from .trainer.setup import build_task_and_reward, episodes_of
    from .trainer.warmstart import initial_model

    path, overrides = _split_config_args(args.args)
    cfg = load_config(path, [*overrides, "warm_start.enabled=true"])
    task, _, verifier = build_task_and_reward(cfg)
    print(initial_model(cfg, task, verifier, episodes_for=lambda tok: episodes_of(cfg, tok, task, print)))
    return 0


def cmd_init_model(args: argparse.Namespace) -> int:
    from .model.loading import init_model

    init_model(
        args.out_dir,
        arch=args.arch,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        num_heads=args.heads,
        seed=args.seed,
        vocab_size=args.vocab_size,
        max_positions=args.max_positions,
    )
    print(f"wrote a tiny {args.arch} model and its character tokenizer to {args.out_dir}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .trainer.compare import compare

    if args.plan is not None:
        from .reports.plan import plan_study
        from .schema import ConfigError

        if args.claims is None:
            raise ConfigError("tether compare --plan PILOT needs --claims FILE: the claims (and design) to plan for")
        print(plan_study(args.plan, args.claims, args.detect))
        return 0
    if args.objectives is None:
        from .schema import ConfigError

        raise ConfigError("tether compare needs --objectives (comma-separated presets), or --plan PILOT --claims C")
    path, overrides = _split_config_args(args.args)
    objectives_ = [o for o in args.objectives.split(",") if o]
    report = compare(
        path,
        objectives_,
        args.seeds,
        overrides,
        args.out,
        args.threshold,
        claims=args.claims,
        jobs=args.jobs,
        null_control=args.null_control,
    )
    print(f"report: {report}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .reports.report import discover, rewrite_from_summary, write_report
    from .schema import ConfigError

    if len(args.run_dirs) == 1 and Path(args.run_dirs[0]).name == "summary.json":  # the runs may be gone
        if args.threshold is not None:
            raise ConfigError("tether report SUMMARY.json: --threshold needs the runs (summary.json has no curves)")
        print(f"report: {rewrite_from_summary(args.run_dirs[0], args.claims, args.out)}")
        return 0
    # Several compare directories: one regime each, named by its directory; else one regime.
    left_out: list[str] = []  # runs of a comparison still in progress (or interrupted): reported when finished
    if len(args.run_dirs) > 1 and all(not (Path(d) / "metrics.jsonl").exists() for d in args.run_dirs):
        regimes = {Path(d).name: discover([d], left_out) for d in args.run_dirs}
    else:
        regimes = {Path(args.run_dirs[0]).name: discover(args.run_dirs, left_out)}
    for run in left_out:
        print(f"report: left out, not finished: {run}", file=sys.stderr)
    out = Path(args.out or args.run_dirs[0])
    print(f"report: {write_report(regimes, out, args.threshold, args.claims, tuple(left_out))}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .reports.export import ExportError, export

    try:
        export(args.run_dir, args.out, step=args.step, force=args.force, push_to_hub=args.push_to_hub)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tether", description="RLVR for language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="registered objectives, presets and trust-region intervals")
    p.set_defaults(func=cmd_list)
    add_train_parsers(sub)
    add_compare_parsers(sub)
    add_export_parser(sub)
    add_eval_parser(sub)  # tether.evaluation.command
    return parser


def add_train_parsers(sub) -> None:
    """`tether train`, `tether sft` and `tether init-model`."""
    p = sub.add_parser(
        "train",
        help="train a model with verifiable rewards",
        description="tether train [CONFIG] [key=value ...]  |  tether train --resume RUN_DIR",
    )
    p.add_argument("args", nargs="*", help="a YAML config file, then dotted overrides (trainer.total_steps=50)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    p.add_argument("--help-config", action="store_true", help="list every config key with its default and meaning")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("sft", help="supervised warm start only (cached); prints the model path")
    p.add_argument("args", nargs="*", help="a YAML config file, then dotted overrides")
    p.set_defaults(func=cmd_sft)
    p = sub.add_parser("init-model", help="build a tiny Llama/Qwen2 model with a character tokenizer")
    p.add_argument("out_dir")
    p.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="pad the character vocabulary with filler tokens to this size (e.g. 151936, Qwen2.5's), "
        "for a tiny model with a real LLM's head and sampling cost",
    )
    p.add_argument(
        "--max-positions",
        type=int,
        default=256,
        help="the model's context in tokens (characters), default 256; more for long prompts (tools' descriptions)",
    )
    p.set_defaults(func=cmd_init_model)


def add_compare_parsers(sub) -> None:
    """`tether compare` (and `tether report`, `add_report_parser`)."""
    p = sub.add_parser(
        "compare",
        help="train several objectives x seeds on one budget and write a report",
        description="tether compare [CONFIG] --objectives grpo,dapo,atr_grpo --seeds 3 [key=value ...]",
    )
    p.add_argument("args", nargs="*", help="a YAML config file, then dotted overrides applied to every run")
    p.add_argument("--objectives", default=None, help="comma-separated presets or objective names")
    p.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="seeds per method (default 3); with a claims file's design, its looks set them (docs/compare.md)",
    )
    p.add_argument("--out", default="runs/compare", help="directory for the runs and report.md")
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="accuracy for 'steps to reach' (default: mean initial accuracy + 0.1)",
    )
    p.add_argument(
        "--claims",
        default=None,
        help="a claims YAML to test in the report (see tether report); one with a design: runs the seeds in waves, "
        "one per look, and stops once every claim is decided",
    )
    p.add_argument(
        "--plan",
        default=None,
        metavar="PILOT",
        help="train nothing: from a pilot's runs (a compare directory or its summary.json), the seeds and looks "
        "each claim of --claims needs, at the level it is tested at, and the claims that cannot be tested",
    )
    p.add_argument(
        "--detect",
        type=float,
        default=None,
        help="with --plan: the difference to detect at 80%% power (default: the design's detect)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at a time, each in its own process with a log under OUT/logs/ (default 1: one "
        "after another, in this process). Several small runs share a GPU; on a 2-core CPU, 2",
    )
    p.add_argument(
        "--null-control",
        default=None,
        metavar="OBJECTIVE",
        help="also run OBJECTIVE (one of --objectives) a second time with only its mini-batch order changed, as "
        "OBJECTIVE_null, and test that A/A pair with the claims: the comparison's noise floor",
    )
    p.set_defaults(func=cmd_compare)
    add_report_parser(sub)


def add_report_parser(sub) -> None:
    """`tether report`."""
    p = sub.add_parser("report", help="rebuild report.md and plots from existing runs")
    p.add_argument(
        "run_dirs",
        nargs="+",
        help="run directories, or compare directories holding them; or a comparison's summary.json alone, to "
        "test its claims again from the per-seed values it holds (its report.md's claims are rewritten)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="where to write report.md (default: the first path); with a summary.json, a markdown file to hold "
        "only these claims' results, report.md and summary.json left alone",
    )
    p.add_argument("--threshold", type=float, default=None)
    p.add_argument(
        "--claims",
        default=None,
        help="a claims YAML (e.g. configs/claims.yaml, the papers' claims) to test: difference, t-test (95%% CI, "
        "p, Holm-corrected p), detectable difference, verdict",
    )
    p.set_defaults(func=cmd_report)


def add_export_parser(sub) -> None:
    """`tether export`."""
    p = sub.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face model directory (from_pretrained loads it)",
        description="tether export RUN_DIR [--step N|best|last] OUT [--push-to-hub REPO]",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a tether run directory")
    p.add_argument("out", metavar="OUT", help="the model directory to write (new, or empty)")
    p.add_argument(
        "--step",
        default="last",
        help="a checkpoint's step number, 'best' (best recorded held-out accuracy) or 'last' (default)",
    )
    p.add_argument(
        "--push-to-hub",
        metavar="REPO",
        default=None,
        help="then upload OUT to this Hugging Face model repo (needs HF_TOKEN or `hf auth login`)",
    )
    p.add_argument("--force", action="store_true", help="replace OUT when it exists and is not empty")
    p.set_defaults(func=cmd_export)


LIBRARY_NOTICES = (
    r".*`past_key_values`.*deprecated",
    r".*`is_gradient_checkpointing`.*deprecated",
    r".*torch\.distributed\.reduce_op.*deprecated",
)
"""Deprecation notices of the libraries tether calls that a user of tether cannot act on (they concern how
tether or vLLM calls transformers and torch), kept off a run's output; `python -W` settings still win."""


def quiet_library_notices() -> None:
    """Ignore LIBRARY_NOTICES (FutureWarning and DeprecationWarning) unless the user set -W or PYTHONWARNINGS."""
    if sys.warnoptions:
        return
    for message in LIBRARY_NOTICES:
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", message=message, category=category)


def main(argv: list[str] | None = None) -> int:
    if not sys.stdout.isatty() and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # `tether train > log`: each line lands as it is printed
    parser = build_parser()
    # key=value overrides may stand anywhere on the line, also after options (`tether compare CFG
    # --seeds 5 trainer.lr=1e-4`): argparse leaves those it could not place, and they join the rest.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "args") or any("=" not in e or e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.args = [*args.args, *extra]
    # tether draws its own progress bars: transformers' and the hub's are off (read when they are
    # imported, so no import of transformers here; a user's explicit setting wins).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    quiet_library_notices()
    from .schema import ConfigError, RunsFailed
    from .trainer.stopping import Interrupted
    from .tasks import DataError

    # SIGTERM (a scheduler's stop) outside the training loop, which handles it itself: stop like Ctrl-C.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        return args.func(args)
    except (ConfigError, DataError, FileExistsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunsFailed as e:  # tether compare --jobs N: each failed run's log is named
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:  # a clean stop: checkpoint, summary and plots are written
        print(str(e), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:  # before or after the loop, or a second Ctrl-C: nothing half-written
        signum = e.args[0] if e.args else signal.SIGINT
        print(f"interrupted ({signal.Signals(signum).name}); checkpoints already written are intact", file=sys.stderr)
        return 128 + signum
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _terminate(signum, frame):
    raise KeyboardInterrupt(signum)


if __name__ == "__main__":
    sys.exit(main())
