"""Helpers of tests/**/test_generation_eval*.py that other test files (or its other tiers) share."""

REWARDS = """
import math

def length(prompts, completions, completion_ids, **fields):
    return [float(len(c[0]["content"])) for c in completions]

def tokens(completions, completion_ids, **fields):
    return [len(ids) if i % 2 else None for i, ids in enumerate(completion_ids)]

def nan(completions, **fields):
    return [math.nan for _ in completions]

def short(completions, **fields):
    return [1.0]

def broken(completions, **fields):
    raise KeyError("answer")
"""
