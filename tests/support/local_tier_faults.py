"""Helpers of tests/**/test_local_tier_faults*.py that other test files (or its other tiers) share."""

from engine.checkpoint.local_tier import LocalTier


def _tier(tmp_path, fresh=False, verify=False):
    return LocalTier(str(tmp_path / "shm"), tmp_path / "run" / "checkpoints", 3, 1, verify, fresh)
