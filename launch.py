"""Command line of the engine (engine/cli/): `python launch.py [COMMAND] ...`; the installed
`jax-engine` console script runs the same. `python launch.py --help` lists the commands."""

import sys

from engine.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
