"""Packed against padded forwards on one real batch: the log-prob pass and the update's forward + backward.

    python benchmarks/packing.py configs/real_model.yaml --out FILE.md [--widths 0,256,512] [--repeats 3] [key=value ...]

Builds the run of CONFIG, samples one batch with its sampler (the trainer's own `collect` and tokens), then times,
alternating setting by setting so that a change in the machine's load hits all alike, with the config's
micro-batches: the old log-prob pass (no gradient) and one pass of the update's forward and backward (the fused
head's log-probs and entropy, summed, backward), for the padded forwards with shared prompts (the default), padded
without sharing, and packed at each `--widths` (trainer.pack_width; 0: the longest row). Each row gives the padding
share of the positions computed (`tokens/pad_frac`'s measure), the packed rows' attention pairs (width^2 per row,
which sdpa computes masked or not), and the median seconds with the ratio to the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, machine, setup, table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--widths", default="0,256,512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = setup(args)
    import tempfile

    from tether.config.loading import load_config
    from tether.model.causal_lm import batched_logprobs, head_pass
    from tether.model.packing import forward_rows, padding_share, plan
    from tether.trainer import seeds
    from tether.trainer.setup import start_run
    from tether.trainer.step import collect, tokens_for_update

    out = tempfile.mkdtemp(prefix="tether-packing-")
    cfg = load_config(args.config, [*args.overrides, f"output_dir={out}/run", "trainer.progress=false"])
    run = start_run(cfg, log=lambda *_: None)
    parts, policy = run.parts, run.parts.policy
    policy.model.eval()
    with policy.precision():
        scored, _ = collect(parts.source, parts.rollout, seeds.rollout(seeds.sampling_root(cfg.trainer), 1))
    tokens, _ = tokens_for_update(scored, parts)
    base = policy.logprob_settings
    settings = {"padded, shared prompts (default)": dataclasses.replace(base, pack=False, share_prompts=True)}
    settings["padded, unshared"] = dataclasses.replace(base, pack=False, share_prompts=False)
    for w in [int(x) for x in args.widths.split(",")]:
        settings[f"packed, pack_width {w}"] = dataclasses.replace(base, pack=True, share_prompts=True, pack_width=w)

    def timed(fn) -> float:
        tic = time.perf_counter()
        fn()
        return time.perf_counter() - tic

    def update_pass(s):
        policy.model.train()
        for idx in forward_rows(tokens, s):
            with policy.precision():
                p = head_pass(policy.model, tokens.select(idx), s, True)
            (p.logprobs.sum() + p.entropy.sum()).backward()
        policy.optimizer.zero_grad(set_to_none=True)
        policy.model.eval()

    times = {k: {"logprobs": [], "update": []} for k in settings}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, s in settings.items():
            with policy.precision():
                times[name]["logprobs"].append(timed(lambda: batched_logprobs(policy.model, tokens, s)))
            times[name]["update"].append(timed(lambda: update_pass(s)))
    rows, ref = [], None
    for name, s in settings.items():
        lp, up = (statistics.median(times[name][k][1:]) for k in ("logprobs", "update"))
        ref = ref or (lp, up)
        pairs = "-"
        if s.pack:
            plans = [
                plan(tokens.input_ids[i], tokens.attention_mask[i], tokens.prompt_len, True, s.pack_width)
                for i in forward_rows(tokens, s)
            ]
            pairs = f"{sum(p.bins * p.width**2 for p in plans):,} ({sum(p.bins for p in plans)} rows)"
        pad = padding_share(tokens, forward_rows(tokens, s), s.share_prompts, s.pack, s.pack_width)
        rows.append(
            [name, f"{pad:.0%}", pairs, f"{lp:.2f} s", f"{ref[0] / lp:.2f}x", f"{up:.2f} s", f"{ref[1] / up:.2f}x"]
        )
    n, width = tokens.input_ids.shape
    lengths = tokens.attention_mask.sum(1).float()
    text = "\n".join(
        [
            f"### Packed against padded forwards: `{args.config}` {' '.join(args.overrides)}",
            "",
            f"Machine: {machine(device, args)}. One sampled batch of {n} rows ({tokens.prompt_len} prompt columns, "
            f"{width - tokens.prompt_len} completion columns; real tokens per row {lengths.min():.0f}-"
            f"{lengths.max():.0f}, mean {lengths.mean():.0f}), in forwards of trainer.micro_batch_size "
            f"{base.micro_batch_size} rows; median of {args.repeats} after a warm-up, settings alternating.",
            "",
            table(
                [
                    "forwards",
                    "padding share",
                    "attention pairs (packed rows)",
                    "log-prob pass",
                    "speed-up",
                    "update forward + backward",
                    "speed-up",
                ],
                rows,
            ),
        ]
    )
    emit(text, args.out)


if __name__ == "__main__":
    main()
