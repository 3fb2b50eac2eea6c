"""Helpers of tests/**/test_local_tier*.py that other test files (or its other tiers) share."""

from engine.checkpoint.local_tier import run_directory


def local_steps(local_dir, workdir, process=0, owner=0):
    folder = run_directory(str(local_dir), workdir / "checkpoints") / f"process_{process}" / f"owner_{owner}"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []
