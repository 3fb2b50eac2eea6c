"""Helpers of tests/**/test_models*.py that other test files (or its other tiers) share."""

from engine.data import DataInfo

TOKENS = DataInfo("tokens", 8, 8, vocab_size=32, seq_len=12)
