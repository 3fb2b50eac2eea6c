"""Command line of the engine.

  python launch.py --config FILE [--workdir DIR] [--dry-run] [dotted.key=value ...]   train
  python launch.py eval --workdir DIR [--watch] [--config FILE]                      evaluate checkpoints
  python launch.py export --workdir DIR --out PATH [--format hf]                     export for inference
  python launch.py import-hf HF_DIR --workdir DIR                                    Hugging Face weights in
  python launch.py sample --workdir DIR --prompt TEXT                                generate text
  python launch.py tokenize --input PATH... --out DIR --tokenizer bpe:N|tokenizer.json  token shards, once

Exit codes: 0 done; 2 bad config or usage; 143 preempted by SIGTERM after saving (re-run to
resume); 1 a failed run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

STARTED = time.time()  # goodput and time to first step count from here

COMMANDS = ("train", "eval", "export", "sweep", "report", "import-hf", "sample", "tokenize")


class _Parser(argparse.ArgumentParser):
    def __init__(self, **kwargs):  # no abbreviated flags: --local-processes is stripped for children by name
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message):  # one line, exit 2, no usage dump
        sys.stderr.write(f"error: {message} (see python launch.py --help)\n")
        sys.exit(2)


def _parser(command: str) -> argparse.ArgumentParser:
    from engine.config import shipped_configs

    if command == "sweep":
        parser = _Parser(prog="launch.py sweep", description="Run every config of a sweep file (grid, zip, random "
                                                             "search); re-running resumes what is unfinished.")
        parser.add_argument("sweep_file", help="the sweep YAML (see engine/sweep.py and README)")
        parser.add_argument("--parallel", type=int, default=1, metavar="K", help="runs at a time (local backend)")
        parser.add_argument("--backend", choices=("local", "slurm"), default="local",
                            help="local processes, or one SLURM job array (sbatch)")
        parser.add_argument("--retry-failed", action="store_true", help="run failed runs again")
        parser.add_argument("--run-task", type=int, help=argparse.SUPPRESS)  # inside a SLURM array task
        parser.add_argument("--task-runs", help=argparse.SUPPRESS)
        parser.add_argument("--run-group", help=argparse.SUPPRESS)  # a vectorised group, in the sweep's child
        return parser
    if command == "report":
        parser = _Parser(prog="launch.py report", description="Rank runs by a metric: a console table, report.csv, "
                                                              "report.md and report.png (loss curves).")
        parser.add_argument("paths", nargs="+", help="a sweep directory, or run workdirs")
        parser.add_argument("--metric", help="split/name to rank by (default: the sweep's, else eval/loss)")
        parser.add_argument("--mode", choices=("min", "max"), help="best is min or max (default: the sweep's)")
        parser.add_argument("--out", help="where to write the report (default: the sweep directory, else .)")
        return parser
    if command == "export":
        parser = _Parser(prog="launch.py export", description="Export a trained run's variables and forward "
                                                              "function (jax.export StableHLO) for inference.")
        parser.add_argument("--workdir", required=True, help="the training run's directory")
        parser.add_argument("--out", required=True, help="a new directory to write the export into")
        parser.add_argument("--format", choices=("jax", "hf"), default="jax",
                            help="jax: variables + jax.export StableHLO (default); hf: a Hugging Face model "
                                 "directory (config.json + safetensors) for model families that have one")
        return parser
    if command == "import-hf":
        parser = _Parser(prog="launch.py import-hf", description="Import a Hugging Face model directory "
                         "(config.json + *.safetensors) as a run at step 0: re-run on the workdir to fine-tune, "
                         "or start other runs from it with checkpoint.restore_from=WORKDIR/checkpoints.")
        parser.add_argument("hf_dir", help="a local Hugging Face model directory (no download)")
        parser.add_argument("--workdir", required=True, help="a new run directory to write")
        parser.add_argument("--config", help="config file for everything but the model (default configs/base.yaml)")
        parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (data, mesh, ...)")
        return parser
    if command == "sample":
        parser = _Parser(prog="launch.py sample", description="Generate text from a run's newest checkpoint "
                                                              "(key/value cache; greedy at temperature 0).")
        parser.add_argument("--workdir", required=True, help="the training run's directory")
        parser.add_argument("--prompt", required=True, help="the text to continue")
        parser.add_argument("--max-tokens", type=int, default=200, help="tokens to generate (default 200)")
        parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
        parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
        parser.add_argument("--seed", type=int, default=0, help="same seed, same text (default 0)")
        return parser
    if command == "tokenize":
        parser = _Parser(prog="launch.py tokenize", description="Tokenize text corpora once into token shards for "
                         "data.name=tokens (train with data.path=OUT). Streams the input; an interrupted run re-run "
                         "with the same arguments continues where it stopped.")
        parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                            help="text files (a file is a document; see --text-unit), .jsonl records, .parquet "
                                 "rows, or directories of them")
        parser.add_argument("--out", required=True, help="the corpus directory to write")
        parser.add_argument("--tokenizer", required=True, metavar="T",
                            help="a Hugging Face tokenizer.json (or a directory with one), or bpe:N to train a "
                                 "byte-level BPE of N tokens on the input itself")
        parser.add_argument("--vocab-size", type=int, metavar="N",
                            help="the vocabulary the corpus declares (at least the tokenizer's; e.g. rounded up to "
                                 "a multiple of 128), or N for --tokenizer bpe")
        parser.add_argument("--eval-fraction", type=float, default=0.01, metavar="F",
                            help="share of documents held out for evaluation (default 0.01)")
        parser.add_argument("--text-field", default="text", help="the JSON Lines field / Parquet column of the text")
        parser.add_argument("--text-unit", choices=("file", "line"), default="file",
                            help="plain text files: one document per file (default) or per line")
        parser.add_argument("--shard-tokens", type=int, default=1 << 27, metavar="N",
                            help="tokens per shard file (default 134,217,728)")
        parser.add_argument("--eod-token", help="the end-of-document token (default: the tokenizer's own, e.g. "
                                                "<|endoftext|> or </s>)")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar")
        return parser
    if command == "eval":
        parser = _Parser(prog="launch.py eval", description="Evaluate a training run's checkpoints (the sidecar "
                         "evaluator, tf.distribute's evaluator task) with the run's own config.yaml; overrides go on "
                         "top. With --watch, every new checkpoint until the run finishes or stops running.")
        parser.add_argument("--workdir", required=True, help="the training run's directory")
        parser.add_argument("--config", help="config file, used only while the run has written no config.yaml")
        parser.add_argument("--watch", action="store_true",
                            help="evaluate every new checkpoint until training finishes (else the newest once)")
        parser.add_argument("--dead-after", type=float, default=60.0, metavar="SECONDS",
                            help="with --watch: stop (exit 1) when no trainer holds the workdir and no checkpoint "
                                 "came for this long (default 60)")
        parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
        return parser
    parser = _Parser(
        prog="launch.py",
        description="Train a model from a config file (subcommands: eval, export, sweep, report, import-hf, "
                    "sample, tokenize). Overrides are dotted.key=value pairs, e.g. train.steps=500 "
                    "optimizer.learning_rate=3e-4 mesh.fsdp=8 model.hidden_sizes=[256,128]; values are parsed as "
                    "YAML. Re-running on a workdir with checkpoints resumes from the newest one.",
        epilog="shipped configs (in configs/, by path or bare name): " + ", ".join(shipped_configs()),
    )
    parser.add_argument("--config", required=True, help="a YAML config file (or the name of one in configs/)")
    parser.add_argument("--workdir", help="output directory (default: the config's workdir, or runs/<config name>)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the mesh, parameter layout, memory and FLOPs per step; do not train")
    parser.add_argument("--profile", action="store_true",
                        help="trace steps 5..15 of this run with jax.profiler into WORKDIR/profile "
                             "(= log.profile_steps=[5,15]; view with TensorBoard's profile plugin or XProf)")
    group = parser.add_argument_group("multi-process (see README: multi-host)")
    group.add_argument("--local-processes", type=int, metavar="N",
                       help="run N processes on this host (CPU devices, coordinator on 127.0.0.1)")
    group.add_argument("--devices-per-process", type=int, default=1, metavar="M",
                       help="simulated CPU devices per local process (default 1)")
    group.add_argument("--coordinator-address", help="= distributed.coordinator_address (host:port)")
    group.add_argument("--num-processes", type=int, help="= distributed.num_processes")
    group.add_argument("--process-id", type=int, help="= distributed.process_id")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser


def _distributed_overrides(args) -> list[str]:
    flags = {"coordinator_address": args.coordinator_address, "num_processes": args.num_processes,
             "process_id": args.process_id}
    return [f"distributed.{key}={value}" for key, value in flags.items() if value is not None]


def main(argv: list[str]) -> int:
    command = argv[0] if argv and argv[0] in COMMANDS else "train"
    from engine.preemption import Preempted, note_signals

    trains = command == "train" or (command == "sweep" and "--run-group" in argv)  # a vectorised group trains
    if trains and not any(arg.split("=")[0] == "--local-processes" for arg in argv):
        note_signals()  # from here a SIGTERM/SIGINT ends with one line and 143/130 (see engine/preemption.py)
    args = _parser(command).parse_intermixed_args(argv[1:] if argv and argv[0] in COMMANDS else argv)
    from engine.errors import UsageError

    if command == "train" and args.local_processes:
        if args.local_processes < 1 or args.devices_per_process < 1:
            sys.stderr.write("error: --local-processes and --devices-per-process must be at least 1\n")
            return 2
        from engine.launcher import run_local_job

        return run_local_job(_without_local_flags(argv), args.local_processes, args.devices_per_process)
    from engine import process
    from engine.errors import DistributedError

    # a sweep's own process (its runs are children) and a report never load jax
    if command not in ("sweep", "report") or getattr(args, "run_group", None):
        process.install(reader=command in ("eval", "export", "sample"))  # once (see engine/process.py)
    try:
        if command == "sweep":
            from engine.sweep import main as sweep_main

            if args.parallel < 1:
                raise UsageError(f"--parallel {args.parallel} must be at least 1")
            return sweep_main(args.sweep_file, args.parallel, args.backend, args.retry_failed, args.run_task,
                              args.task_runs, args.run_group)
        if command == "report":
            from engine.report import report

            report(args.paths, args.metric, args.mode, args.out)
            return 0
        if command == "export":
            if args.format == "hf":
                from engine.hf import export_hf as export_run
            else:
                from engine.export import export_run

            print(f"exported to {export_run(args.workdir, args.out)}")
            return 0
        if command == "import-hf":
            from engine.hf import import_hf

            print(f"imported {args.hf_dir} into {import_hf(args.hf_dir, args.workdir, args.config, args.overrides)}")
            return 0
        if command == "tokenize":
            from engine.data.tokenize import main as tokenize_main

            return tokenize_main(args)
        if command == "sample":
            from engine.generate import sample

            print(sample(args.workdir, args.prompt, args.max_tokens, args.temperature, args.top_p, args.seed))
            return 0
        import jax

        from engine.config import load_config
        from engine.distributed import initialize, parse_tf_config

        if command == "eval":
            from engine.evaluator import run_evaluator

            return run_evaluator(_eval_config(args), watch=args.watch, dead_after=args.dead_after)
        profile = ["log.profile_steps=[5,15]"] if args.profile else []
        cfg = load_config(args.config, profile + args.overrides + _distributed_overrides(args), args.workdir)
        tf_config = os.environ.get("TF_CONFIG")
        if tf_config and parse_tf_config(tf_config).kind == "evaluator":
            from engine.evaluator import run_evaluator
            from engine.preemption import release_signals

            release_signals()  # the evaluator ends on SIGTERM as a reader does

            return run_evaluator(cfg, watch=True)
        initialize(cfg.distributed)
        # saves from a background thread need them (without them host staging lets orbax copy first)
        if jax.process_count() > 1 and (cfg.checkpoint.staging == "device" or process.has_distributed_client_barriers()):
            process.use_distributed_client_barriers()
        if args.dry_run:
            from engine.dryrun import dry_run

            dry_run(cfg)
            return 0
        from engine.trainer import NonFiniteLoss, fit

        try:
            result = fit(cfg, started=STARTED)
        except NonFiniteLoss as e:
            sys.stderr.write(f"error: training stopped: {e}\n")
            return 1
    except Preempted as e:  # SIGTERM/SIGINT: saved (or nothing new to save during start-up)
        sys.stderr.write(f"{e}\n")
        return e.exit_code
    except UsageError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    except DistributedError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    if result.eval_metrics:
        summary = " ".join(f"{k}={v:.4f}" for k, v in result.eval_metrics.items())
        print(f"done: {cfg.train.steps} steps; eval {summary}; outputs in {cfg.workdir}")
    return 0


def _eval_config(args):
    """The watched run's own resolved config.yaml (overrides on top); --config only before it exists."""
    from pathlib import Path

    from engine.config import load_config
    from engine.errors import UsageError

    written = Path(args.workdir) / "config.yaml"
    if not written.is_file() and not args.config:
        raise UsageError(f"{args.workdir} has no config.yaml yet; give --config (the training run's config file)")
    return load_config(written if written.is_file() else args.config, args.overrides, args.workdir)


def _without_local_flags(argv: list[str]) -> list[str]:
    """argv less --local-processes/--devices-per-process (and their values)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        name = item.split("=", 1)[0]
        if name in ("--local-processes", "--devices-per-process"):
            skip = "=" not in item
            continue
        out.append(item)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
