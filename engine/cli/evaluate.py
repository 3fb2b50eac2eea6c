"""`launch.py eval --workdir DIR [--watch] [--config FILE] [key=value ...]`: the sidecar evaluator."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.cli.common import Command, Parser, overrides_argument


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="launch.py eval",
        description="Evaluate a training run's checkpoints (the sidecar evaluator, "
        "tf.distribute's evaluator task) with the run's own config.yaml; overrides go on top. With --watch, "
        "every new checkpoint until the run finishes or stops running.",
    )
    p.add_argument("--workdir", required=True, help="the training run's directory")
    p.add_argument("--config", help="config file, used only while the run has written no config.yaml")
    p.add_argument(
        "--watch",
        action="store_true",
        help="evaluate every new checkpoint until training finishes (else the newest once)",
    )
    p.add_argument(
        "--dead-after",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="with --watch: stop (exit 1) when no trainer holds the workdir and no checkpoint came for "
        "this long (default 60)",
    )
    overrides_argument(p)
    return p


def run(args, argv: list[str]) -> int:
    from engine.config import load_config
    from engine.errors import UsageError
    from engine.run.evaluator import run_evaluator

    written = Path(args.workdir) / "config.yaml"
    if not written.is_file() and not args.config:
        raise UsageError(f"{args.workdir} has no config.yaml yet; give --config (the training run's config file)")
    cfg = load_config(written if written.is_file() else args.config, args.overrides, args.workdir)
    return run_evaluator(cfg, watch=args.watch, dead_after=args.dead_after)


COMMAND = Command(parser, run)
