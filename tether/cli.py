"""The `tether` command line. Each subcommand is a thin wrapper over a library function."""

from __future__ import annotations

import argparse
import sys

from . import objectives
from .divergences import MEASURES, interval

LIST_DELTAS = (0.01, 0.02, 0.0231, 0.0331, 0.05)


def cmd_list(args: argparse.Namespace) -> int:
    """Print the registered objectives, presets, and the trust-region table of every measure."""
    from .core.advantages import ADVANTAGES
    from .core.aggregation import AGGREGATIONS
    from .core.kl import KL_ESTIMATORS

    print("objectives:  " + ", ".join(objectives.names()))
    print("presets:")
    for name in objectives.preset_names():
        spec = objectives.load_preset(name)
        params = ", ".join(f"{k}={v}" for k, v in spec.items() if k != "name")
        print(f"  {name:<14} {spec['name']}: {params}")
    print("advantages:  " + ", ".join(ADVANTAGES.names()))
    print("aggregation: " + ", ".join(AGGREGATIONS.names()))
    print("kl penalty:  " + ", ".join(KL_ESTIMATORS.names()))
    print("\ntrust region [low, high] = {w : D(w) <= delta}")
    header = f"{'measure':<12}" + "".join(f"{'delta=' + format(d, 'g'):>20}" for d in LIST_DELTAS)
    print(header)
    for m in MEASURES.names():
        cells = "".join(f"{'[%.4f, %.4f]' % interval(m, d):>20}" for d in LIST_DELTAS)
        print(f"{m:<12}{cells}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tether", description="RLVR for language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="registered objectives, presets and trust-region intervals")
    p.set_defaults(func=cmd_list)
    for register in _EXTRA_COMMANDS:
        register(sub)
    return parser


_EXTRA_COMMANDS: list = []


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
