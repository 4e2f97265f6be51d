"""Where the time of a multi-turn RL step goes: phase by phase, and the sampling turn by turn.

    python benchmarks/multi_turn/step_time.py configs/tool_use.yaml --steps 4 --out FILE.md [key=value ...]

Builds the run of CONFIG (its warm start from the cache, when it has one), then times `--steps` RL steps in this
process (no evaluation, no checkpoints): each step's sampling, old and reference log-prob passes and update
(the trainer's own `time/*` metrics), the tokens of each side of the episodes, and every call the episode runner
makes to the engine (one per turn): how many rows, how long their context is (what the prefill re-encodes: the
prompt, with the tools' description, and every earlier turn), how many tokens it sampled, and its seconds. The
prompt table compares the prompt with the tools' description against the task's prompt alone. `--vs KEY=VALUE ...`
builds a second run with those settings too; the two take turns step by step (so a change in the machine's load hits
both alike) and a last table gives each phase's median in both and their ratio. The last line is the process's peak
memory (max RSS; Linux reports it in KiB).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import emit, machine, setup, table  # noqa: E402

from tether.config.loading import load_config  # noqa: E402
from tether.rollout import encode_prompts  # noqa: E402
from tether.rollout.hf import HFEngine  # noqa: E402


def instrument(calls: list[dict]) -> None:
    """Record every `generate_ids` call of the hf engine (the episode runner's turns)."""
    original = HFEngine.generate_ids

    def timed(self, rows, params, seed=None):
        tic = time.perf_counter()
        out = original(self, rows, params, seed)
        lengths = [len(r) for r in rows]
        calls.append(
            {
                "rows": len(rows),
                "distinct": len({tuple(r) for r in rows}),
                "context": statistics.fmean(lengths),
                "context_max": max(lengths),
                "new": int(out.mask.sum()),
                "width": int(out.completion_ids.shape[1]),
                "seconds": time.perf_counter() - tic,
            }
        )
        return out

    HFEngine.generate_ids = timed


def prompt_lengths(run, cfg) -> tuple[float, float]:
    """Mean prompt tokens of the task's training examples with the tools' description and without it."""
    from tether.envs import ChatTurns, resolve_tools

    examples = run.parts.source.stream.task.examples("train", 32, seed=0)
    tokenizer = run.records.tokenizer
    tools = resolve_tools(cfg.env) if cfg.env.tools else []
    with_tools = ChatTurns(tokenizer, tools)
    alone = [len(x) for x in encode_prompts(tokenizer, [ex.prompt for ex in examples])]
    described = [len(x) for x in encode_prompts(tokenizer, [with_tools.prompt(ex, None) for ex in examples])]
    return statistics.fmean(described), statistics.fmean(alone)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vs", nargs="+", default=None, metavar="KEY=VALUE", help="also time the run with these")
    args = ap.parse_args()
    device = setup(args)
    from tether.trainer.step import rl_step

    cfg, run = build(args, args.overrides)
    other = build(args, [*args.overrides, *args.vs])[1] if args.vs else None
    calls: list[dict] = []
    instrument(calls)
    steps, vs_steps, turns = [], [], defaultdict(list)
    for step in range(1, args.steps + 1):  # with --vs the two runs take turns, step by step
        before = len(calls)
        _, m = rl_step(run.parts, run.progress.counters, step)
        for k, call in enumerate(calls[before:], 1):
            turns[k].append(call)
        steps.append(m)
        if other is not None:
            vs_steps.append(rl_step(other.parts, other.progress.counters, step)[1])
    described, alone = prompt_lengths(run, cfg)
    text = [
        f"### One RL step of `{args.config}` {' '.join(args.overrides)}, phase by phase ({machine(device, args)})",
        "",
        f"{args.steps} steps of {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size} episodes, "
        f"{cfg.trainer.threads} torch thread(s); seconds are the trainer's own `time/*` metrics.",
        "",
    ]
    rows = []
    for i, m in enumerate(steps, 1):
        logp = m["time/old_logprobs_s"] + m["time/ref_logprobs_s"]
        rows.append(
            [
                i,
                f"{m['time/step_s']:.1f}",
                f"{m['time/sample_s']:.1f} ({m['time/sample_s'] / m['time/step_s']:.0%})",
                f"{logp:.1f} ({logp / m['time/step_s']:.0%})",
                f"{m['time/update_s']:.1f} ({m['time/update_s'] / m['time/step_s']:.0%})",
                f"{m.get('env/turns', float('nan')):.2f}",
                f"{m.get('env/model_tokens', float('nan')):.0f}",
                f"{m.get('env/env_tokens', float('nan')):.0f}",
                f"{m.get('tokens/pad_frac', float('nan')):.0%}",
            ]
        )
    header = ["step", "step s", "sample s", "log-probs s", "update s", "turns", "model tokens", "env tokens"]
    header += ["padding (passes)"]
    text += [table(header, rows), "", "The sampling, turn by turn (one engine call per turn, every step):", ""]
    rows = []
    for k, cs in sorted(turns.items()):
        rows.append(
            [
                k,
                len(cs),
                f"{statistics.fmean(c['rows'] for c in cs):.0f}",
                f"{statistics.fmean(c['distinct'] for c in cs):.0f}",
                f"{statistics.fmean(c['context'] for c in cs):.0f} (max {max(c['context_max'] for c in cs)})",
                f"{statistics.fmean(c['new'] / c['rows'] for c in cs):.1f} (of {cfg.env.turn_tokens(cfg.rollout)})",
                f"{statistics.fmean(c['seconds'] for c in cs):.1f}",
            ]
        )
    header = ["turn", "calls", "rows", "distinct rows", "context tokens re-encoded", "new tokens per row", "seconds"]
    text += [table(header, rows), ""]
    text += [
        f"Prompt: {described:.0f} tokens with the tools' description, {alone:.0f} without it "
        f"({described - alone:.0f} tokens, {described / alone:.1f}x).",
        f"Peak memory of this process (max RSS, every run it built): "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB.",
    ]
    if vs_steps:
        text += ["", side_by_side(steps, vs_steps, " ".join(args.vs))]
    emit("\n".join(text), args.out)


def build(args, overrides: list[str]):
    """(config, run) of the benchmark's config with `overrides`, timed steps only (no evaluation, no files kept)."""
    from tether.trainer.setup import start_run

    out_dir = tempfile.mkdtemp(prefix="tether-step-time-")
    extra = [f"output_dir={out_dir}", "trainer.progress=false", "trainer.plots=false", "trainer.tensorboard=false"]
    extra += [f"trainer.threads={args.threads}", f"trainer.total_steps={args.steps}", "trainer.eval_every=1000000"]
    cfg = load_config(args.config, [*overrides, *extra])
    return cfg, start_run(cfg, log=lambda *_: None)


PHASES = (
    ("step", "time/step_s"),
    ("sample", "time/sample_s"),
    ("old log-probs", "time/old_logprobs_s"),
    ("reference log-probs", "time/ref_logprobs_s"),
    ("update", "time/update_s"),
)


def side_by_side(steps: list[dict], vs_steps: list[dict], vs: str) -> str:
    """Median seconds per phase of the two runs, which took turns step by step, and their ratio."""
    rows = []
    for name, key in PHASES:
        a, b = statistics.median(m[key] for m in steps), statistics.median(m[key] for m in vs_steps)
        rows.append([name, f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}x" if a > 0 else "-"])
    header = ["phase (median s)", "as configured", vs, "ratio"]
    return f"Side by side with `{vs}`, steps alternating:\n\n" + table(header, rows)


if __name__ == "__main__":
    main()
