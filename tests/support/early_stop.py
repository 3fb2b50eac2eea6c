"""Helpers of tests/**/test_early_stop*.py that other test files (or its other tiers) share."""

import json


def saved_steps(workdir):
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def meta(workdir, step):
    return json.loads((workdir / "checkpoints" / str(step) / "meta" / "metadata").read_text())
