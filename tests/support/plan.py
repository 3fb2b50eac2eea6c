"""Helpers of tests/**/test_plan*.py that other test files (or its other tiers) share."""

TINY = ["train.steps_per_call=1", "data.steps_per_transfer=1"]


def tiny(make_config, *overrides, **kwargs):
    return make_config("llama_tiny.yaml", *TINY, *overrides, **kwargs)
