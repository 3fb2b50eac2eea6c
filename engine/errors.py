"""The one exception type that means "the user's input is wrong" (exit code 2), the one that
means processes lost each other (exit code 1), and the one way a background thread ends the
whole process."""

import os
import sys


class UsageError(ValueError):
    """Bad config, bad command line or bad input files: reported in one line, exit 2."""


class DistributedError(RuntimeError):
    """A process did not join, or did not reach a barrier, in time (exit code 1)."""


def exit_now(line: str, code: int) -> None:
    """From any thread: `line` to the process's real stderr, then the process ends at once with
    `code` (no clean-up runs; the OS releases its locks, as after a kill)."""
    stderr = sys.__stderr__ or sys.stderr
    stderr.write(line + "\n")
    stderr.flush()
    os._exit(code)
