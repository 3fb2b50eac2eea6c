"""Helpers of tests/**/test_pipeline*.py that other test files (or its other tiers) share."""

from engine.runtime.rundir import read_records
from support.context_experts import LLAMA

DEEP = [*LLAMA, "model.num_layers=4"]  # GQA (2 key/value heads for 4 query heads), no dropout


def losses_of(workdir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(workdir / "metrics.jsonl") if r["split"] == "train"}
