"""Command line of the engine.

  python launch.py --config FILE [--workdir DIR] [--dry-run] [dotted.key=value ...]   train
  python launch.py eval --config FILE --workdir DIR [--watch]                        evaluate checkpoints
  python launch.py export --workdir DIR --out PATH                                   export for inference

Exit codes: 0 done; 2 bad config or usage; 143 preempted by SIGTERM after saving (re-run to
resume); 1 a failed run.
"""
from __future__ import annotations

import argparse
import sys

COMMANDS = ("train", "eval", "export")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump
        sys.stderr.write(f"error: {message} (see python launch.py --help)\n")
        sys.exit(2)


def _parser(command: str) -> argparse.ArgumentParser:
    from engine.config import shipped_configs

    if command == "export":
        parser = _Parser(prog="launch.py export", description="Export a trained run's variables and forward "
                                                              "function (jax.export StableHLO) for inference.")
        parser.add_argument("--workdir", required=True, help="the training run's directory")
        parser.add_argument("--out", required=True, help="a new directory to write the export into")
        return parser
    parser = _Parser(
        prog="launch.py" if command == "train" else f"launch.py {command}",
        description="Train a model from a config file (subcommands: eval, export). Overrides are "
                    "dotted.key=value pairs, e.g. train.steps=500 optimizer.learning_rate=3e-4 mesh.fsdp=8 "
                    "model.hidden_sizes=[256,128]; values are parsed as YAML. Re-running on a workdir with "
                    "checkpoints resumes from the newest one.",
        epilog="shipped configs (in configs/): " + ", ".join(shipped_configs()),
    )
    parser.add_argument("--config", required=True, help="a YAML config file (or the name of one in configs/)")
    parser.add_argument("--workdir", required=command == "eval",
                        help="output directory (default: the config's workdir, or runs/<config name>)")
    if command == "train":
        parser.add_argument("--dry-run", action="store_true",
                            help="print the mesh, parameter layout, memory and FLOPs per step; do not train")
    else:
        parser.add_argument("--watch", action="store_true",
                            help="evaluate every new checkpoint until training finishes (else the newest once)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser


def main(argv: list[str]) -> int:
    command = argv[0] if argv and argv[0] in COMMANDS else "train"
    args = _parser(command).parse_args(argv[1:] if argv and argv[0] in COMMANDS else argv)
    from engine.errors import UsageError

    try:
        if command == "export":
            from engine.export import export_run

            print(f"exported to {export_run(args.workdir, args.out)}")
            return 0
        from engine.config import load_config

        cfg = load_config(args.config, args.overrides, args.workdir)
        if command == "eval":
            from engine.evaluator import run_evaluator

            return run_evaluator(cfg, watch=args.watch)
        if args.dry_run:
            from engine.dryrun import dry_run

            dry_run(cfg)
            return 0
        from engine.trainer import NonFiniteLoss, Preempted, fit

        try:
            result = fit(cfg)
        except NonFiniteLoss as e:
            sys.stderr.write(f"error: training stopped: {e}\n")
            return 1
        except Preempted as e:
            sys.stderr.write(f"{e}\n")
            return 143
    except UsageError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    if result.eval_metrics:
        summary = " ".join(f"{k}={v:.4f}" for k, v in result.eval_metrics.items())
        print(f"done: {cfg.train.steps} steps; eval {summary}; outputs in {cfg.workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
