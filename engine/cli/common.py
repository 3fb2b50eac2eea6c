"""What the command modules share: a parser whose errors are one line and exit 2."""
from __future__ import annotations

import argparse
import sys


class Parser(argparse.ArgumentParser):
    def __init__(self, **kwargs):  # no abbreviated flags: --local-processes is stripped for children by name
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message):  # one line, exit 2, no usage dump
        sys.stderr.write(f"error: {message} (see python launch.py --help)\n")
        sys.exit(2)


def overrides_argument(parser: argparse.ArgumentParser, what: str = "config overrides") -> None:
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=what)
