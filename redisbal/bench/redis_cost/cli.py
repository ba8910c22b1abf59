"""``python scripts/redis_cost.py MODE [options]``: one argument parser, a subcommand per
mode (each mode's module has its options and what it runs)."""

from __future__ import annotations

import argparse
import importlib
import sys

MODES = {
    "core": "route() and snapshot adoption per call, server time per report, latency",
    "batch": "Redis CPU per engine-step: one report per round trip against report_many",
    "ab": "route() and report server time of two checkouts, interleaved, as ratios",
    "callgrind": "instructions per report or publish under valgrind (deterministic)",
    "lua": "where a report_many call's and a publish's server time goes, by stage",
}
MODULES = {"lua": "stages"}  # the module of a mode, where its name differs


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="redis_cost.py", description="What a report and a route cost in Redis and Python."
    )
    sub = ap.add_subparsers(dest="mode", required=True, metavar="MODE")
    for mode, summary in MODES.items():
        module = importlib.import_module(f"redisbal.bench.redis_cost.{MODULES.get(mode, mode)}")
        p = sub.add_parser(
            mode,
            help=summary,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
