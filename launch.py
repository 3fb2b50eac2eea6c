"""Command line of the engine: train (default), with --dry-run to inspect a layout.

  python launch.py --config configs/mnist_mlp.yaml [--workdir DIR] [dotted.key=value ...]
"""
from __future__ import annotations

import argparse
import sys


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump
        sys.stderr.write(f"error: {message} (see python launch.py --help)\n")
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    from engine.config import shipped_configs

    parser = _Parser(
        description="Train a model from a config file. Overrides are dotted.key=value pairs, e.g. "
                    "train.steps=500 optimizer.learning_rate=3e-4 mesh.fsdp=8 model.hidden_sizes=[256,128]; "
                    "values are parsed as YAML.",
        epilog="shipped configs (in configs/): " + ", ".join(shipped_configs()),
    )
    parser.add_argument("--config", required=True, help="a YAML config file (or the name of one in configs/)")
    parser.add_argument("--workdir", help="output directory (default: the config's workdir, or runs/<config name>)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the mesh, parameter layout, memory and FLOPs per step; do not train")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from engine.errors import UsageError

    try:
        from engine.config import load_config

        cfg = load_config(args.config, args.overrides, args.workdir)
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
