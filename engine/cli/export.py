"""`launch.py export --workdir DIR --out PATH [--format hf] [--step best|N]`: a trained run for inference."""

from __future__ import annotations

import argparse

from engine.cli.common import Command, Parser


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="launch.py export",
        description="Export a trained run's variables and forward function (jax.export StableHLO) for inference.",
    )
    p.add_argument("--workdir", required=True, help="the training run's directory")
    p.add_argument("--out", required=True, help="a new directory to write the export into")
    p.add_argument(
        "--step",
        metavar="best|N",
        help="the checkpoint to export: best (the one checkpoint.keep_best kept) or a step number; default: the newest",
    )
    p.add_argument(
        "--format",
        choices=("jax", "hf"),
        default="jax",
        help="jax: variables + jax.export StableHLO (default); hf: a Hugging Face model directory "
        "(config.json + safetensors) for model families that have one",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="--format hf of a LoRA run: fold the adapters into the base (a plain checkpoint); without it, "
        "a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)",
    )
    p.add_argument(
        "--base-model",
        metavar="NAME_OR_PATH",
        help="--format hf of a LoRA run without --merge: the adapter directory's base_model_name_or_path (a hub "
        "name or a directory; default: the Hugging Face directory the base was imported from)",
    )
    return p


def run(args, argv: list[str]) -> int:
    if args.format == "hf" and args.step is not None:
        from engine.errors import UsageError

        raise UsageError("--step goes with --format jax for now; --format hf exports the newest checkpoint")
    if args.format == "hf":
        from engine.hub.hf import export_hf

        print(f"exported to {export_hf(args.workdir, args.out, merge=args.merge, base_model=args.base_model)}")
        return 0
    if args.merge or args.base_model is not None:
        from engine.errors import UsageError

        flag = "--merge" if args.merge else "--base-model"
        raise UsageError(f"{flag} goes with --format hf (the default export keeps the adapters as parameters)")
    from engine.hub.inference import export_run

    print(f"exported to {export_run(args.workdir, args.out, args.step)}")
    return 0


COMMAND = Command(parser, run)
