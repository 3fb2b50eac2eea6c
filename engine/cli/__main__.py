"""`python -m engine.cli ...` = `python launch.py ...`."""

from engine.cli import entry

entry()
