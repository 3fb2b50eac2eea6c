"""Helpers of tests/**/test_loss_chunk*.py that other test files (or its other tiers) share."""

VOCAB = 32768
