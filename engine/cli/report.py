"""`launch.py report SWEEP_DIR_OR_WORKDIRS... [--metric split/name --mode min|max]`: rank runs by
a metric in a console table, report.csv, report.md and report.png."""

from __future__ import annotations

import argparse

from engine.cli.common import Command, Parser


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="launch.py report",
        description="Rank runs by a metric: a console table, report.csv, report.md and report.png (loss curves).",
    )
    p.add_argument("paths", nargs="+", help="a sweep directory, or run workdirs")
    p.add_argument("--metric", help="split/name to rank by (default: the sweep's, else eval/loss)")
    p.add_argument("--mode", choices=("min", "max"), help="best is min or max (default: the sweep's)")
    p.add_argument(
        "--out",
        help="where to write the report (default: the sweep directory, else the directory holding the workdirs)",
    )
    return p


def _no_jax(args) -> bool:
    return False


def run(args, argv: list[str]) -> int:
    from engine.observe.ranking import report

    report(args.paths, args.metric, args.mode, args.out)
    return 0


COMMAND = Command(parser, run, runs_jax=_no_jax)
