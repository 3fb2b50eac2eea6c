"""Helpers of tests/**/test_diloco*.py that other test files (or its other tiers) share."""

DILOCO = ["train.sync=diloco", "diloco.replica_axis=data"]


QUIET = ["log.every_steps=1", "eval.every_steps=0", "log.progress=false"]
