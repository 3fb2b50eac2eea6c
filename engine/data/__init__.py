"""Input: dataset sources (sources.py) and the deterministic batching pipeline (pipeline.py)."""

from engine.data.pipeline import Prefetcher, TrainBatches, eval_batches, example_spec, process_rows
from engine.data.sources import SOURCES, DataInfo, Dataset, load_dataset

__all__ = [
    "Prefetcher",
    "TrainBatches",
    "eval_batches",
    "example_spec",
    "process_rows",
    "SOURCES",
    "DataInfo",
    "Dataset",
    "load_dataset",
]
