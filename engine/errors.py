"""The one exception type that means "the user's input is wrong" (exit code 2), and the one
way a background thread ends the whole process."""
import os
import sys


class UsageError(ValueError):
    """Bad config, bad command line or bad input files: reported in one line, exit 2."""


def exit_now(line: str, code: int) -> None:
    """From any thread: `line` to the process's real stderr, then the process ends at once with
    `code` (no clean-up runs; the OS releases its locks, as after a kill)."""
    sys.__stderr__.write(line + "\n")
    sys.__stderr__.flush()
    os._exit(code)
