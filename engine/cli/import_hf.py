"""`launch.py import-hf HF_DIR --workdir DIR [--config FILE] [key=value ...]`: Hugging Face
weights in, as a run at step 0."""

from __future__ import annotations

import argparse

from engine.cli.common import Command, Parser, overrides_argument


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="launch.py import-hf",
        description="Import a Hugging Face model directory (config.json + "
        "*.safetensors) as a run at step 0: re-run on the workdir to fine-tune, or start other runs from it "
        "with checkpoint.restore_from=WORKDIR/checkpoints.",
    )
    p.add_argument("hf_dir", help="a local Hugging Face model directory (no download)")
    p.add_argument("--workdir", required=True, help="a new run directory to write")
    p.add_argument("--config", help="config file for everything but the model (default configs/base.yaml)")
    overrides_argument(p, "config overrides (data, mesh, ...)")
    return p


def run(args, argv: list[str]) -> int:
    from engine.hub.hf import import_hf

    print(f"imported {args.hf_dir} into {import_hf(args.hf_dir, args.workdir, args.config, args.overrides)}")
    return 0


COMMAND = Command(parser, run)
