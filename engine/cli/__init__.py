"""The command line: `python launch.py COMMAND ...` or the installed `jax-engine COMMAND ...`.
One module per command (train, eval, export, import-hf, sample, tokenize, sweep, report, plan);
each gives its parser and its `run`. This module picks the command, installs the process-wide
settings of the commands that run jax, and turns errors into exit codes:

0 done; 2 bad config or usage (one line, no traceback); 143/130 stopped by SIGTERM/SIGINT
after saving (re-run to resume); 1 a failed run (said plainly).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import traceback

STARTED = time.time()  # goodput and time to first step count from here
COORDINATOR_GRACE_SECONDS = 2.0  # how long a failing process 0 of a job waits before it exits (`entry`)

# command → module; `train` is also what a command line without one runs
COMMANDS = {
    "train": "train",
    "eval": "evaluate",
    "export": "export",
    "import-hf": "import_hf",
    "sample": "sample",
    "tokenize": "tokenize",
    "sweep": "sweep",
    "report": "report",
    "plan": "plan",
}


def command(name: str):
    """The Command of `name` (engine/cli/common.py), its module imported only now."""
    return importlib.import_module(f"engine.cli.{COMMANDS[name]}").COMMAND


def main(argv: list[str]) -> int:
    """Runs one command line; returns its exit code."""
    named = bool(argv) and argv[0] in COMMANDS
    name, rest = (argv[0], argv[1:]) if named else ("train", argv)
    module = command(name)
    if not module.trains(rest):
        return _run(module, name, rest)
    from engine.runtime.preemption import note_signals, stop_noting

    note_signals()  # from here a SIGTERM/SIGINT ends with one line and 143/130 (engine/runtime/preemption.py)
    try:
        return _run(module, name, rest)
    finally:
        stop_noting()  # no thread of this command outlives it (one left in JAX's C++ at exit aborts the process)


def _run(module, name: str, rest: list[str]) -> int:
    args = module.parser().parse_intermixed_args(rest)
    from engine.errors import DistributedError, UsageError
    from engine.runtime.preemption import Preempted

    if module.runs_jax(args):
        from engine.runtime import settings as process

        process.install(reader=name in ("eval", "export", "sample"))  # once (see engine/runtime/settings.py)
    try:
        return module.run(args, rest)
    except Preempted as e:  # SIGTERM/SIGINT: saved (or nothing new to save during start-up)
        sys.stderr.write(f"{e}\n")
        return e.exit_code
    except UsageError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    except DistributedError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1


def entry() -> None:
    """The `jax-engine` console script."""
    try:
        code = main(sys.argv[1:])
    except Exception:
        if not _in_job():
            raise
        traceback.print_exc()
        code = 1
    if code in (1, 2) and _in_job():
        # a process of a jax.distributed job that fails: at exit JAX waits for every process at its
        # shutdown barrier (300 s), while the others wait for this one in a collective; it ends now
        # instead, so that its launcher sees the failure within moments and stops the others
        sys.stdout.flush()
        sys.stderr.flush()
        if _process_index() == 0:
            # process 0 hosts the job's coordination service: leaving first would abort peers that
            # are failing the same way (a NaN, a usage error) with SIGABRT, and the launcher would
            # blame process 0 for a loss; it gives them a moment to leave on their own first
            time.sleep(COORDINATOR_GRACE_SECONDS)
        os._exit(code)
    sys.exit(code)


def _process_index() -> int:
    import jax

    return jax.process_index()


def _in_job() -> bool:
    """Whether this process is one of a jax.distributed job's (its coordination client started)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import distributed

    return distributed.global_state.client is not None
