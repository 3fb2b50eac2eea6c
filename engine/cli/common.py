"""What the command modules share: a parser whose errors are one line and exit 2."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable


class Parser(argparse.ArgumentParser):
    def __init__(self, **kwargs):  # no abbreviated flags: --local-processes is stripped for children by name
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message):  # one line, exit 2, no usage dump
        sys.stderr.write(f"error: {message} (see python launch.py --help)\n")
        sys.exit(2)


def overrides_argument(parser: argparse.ArgumentParser, what: str = "config overrides") -> None:
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=what)


def _never(argv: list[str]) -> bool:
    return False


def _always(args: argparse.Namespace) -> bool:
    return True


@dataclass(frozen=True)
class Command:
    """A command: its parser and what it runs, and two things engine.cli.main asks first."""

    parser: Callable[[], argparse.ArgumentParser]
    run: Callable[[argparse.Namespace, list[str]], int]  # (parsed args, the command's argv) → exit code
    trains: Callable[[list[str]], bool] = _never  # trains in this process: signals are noted from start-up
    runs_jax: Callable[[argparse.Namespace], bool] = _always  # needs the process-wide jax settings
