"""Command line of the engine (engine/cli/): `python launch.py [COMMAND] ...`; the installed
`jax-engine` console script runs the same. `python launch.py --help` lists the commands."""

from engine.cli import entry

if __name__ == "__main__":
    entry()
