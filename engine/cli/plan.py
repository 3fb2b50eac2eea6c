"""`launch.py plan --config FILE --target TOPOLOGY [--slices N] [--search] [key=value ...]`: the run
compiled for a TPU pod by the TPU compiler on this host; exit 0 when it fits, 1 when not."""

from __future__ import annotations

import argparse

from engine.cli.common import Command, Parser, overrides_argument


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="launch.py plan",
        description="Compile a run for a TPU pod with the TPU compiler (libtpu) on "
        "this host: memory per chip against its HBM, the collectives over ICI and DCN, step time at a few MFUs. "
        "No chip is used and no state is allocated. Exit 0 when it fits, 1 when it does not.",
    )
    p.add_argument("--config", required=True, help="a YAML config file (or the name of one in configs/)")
    p.add_argument(
        "--target",
        required=True,
        metavar="TOPOLOGY",
        help="a TPU slice as users name it: v5p-128, v5e-256, v6e-64, v4-32, or a shape like v5p:4x4x8",
    )
    p.add_argument(
        "--slices",
        type=int,
        default=1,
        metavar="N",
        help="slices of that shape (multi-slice: the mesh's dcn_* keys place axes across them)",
    )
    p.add_argument(
        "--search", action="store_true", help="rank candidate layouts (mesh, remat, attention, loss chunk, micro-batch)"
    )
    p.add_argument(
        "--compiles", type=int, default=4, metavar="K", help="with --search: how many candidates to compile (default 4)"
    )
    p.add_argument("--json", metavar="FILE", help="also write the plan's figures as JSON")
    overrides_argument(p)
    return p


def run(args, argv: list[str]) -> int:
    from engine.config import load_config
    from engine.errors import UsageError
    from engine.plan.command import plan_command

    if args.compiles < 1:
        raise UsageError(f"--compiles {args.compiles} must be at least 1")
    cfg = load_config(args.config, args.overrides, "/tmp/unused-plan-workdir")
    return plan_command(cfg, args.target, args.slices, args.search, args.compiles, args.json)


COMMAND = Command(parser, run)
