"""What a run recorded of its data for its later readers: a table's preprocessing (its workdir's
preprocessing.json, which resume, export and the evaluator check the data against) and the
data's shape (data.json: DataInfo and each split's fields, which sample and export build the
model from without reading, tokenizing or caching any data)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import numpy as np

from engine.data.base import DataInfo, Dataset
from engine.data.features import first_difference
from engine.errors import UsageError
from engine.runtime.rundir import write_atomic

PREPROCESSING = "preprocessing.json"  # a table's vocabularies, boundaries and statistics (engine/data/table.py)
DATA_SHAPE = "data.json"  # the run's DataInfo and its splits' fields (record_shape)


def check_preprocessing(
    recorded: Path, info, fix: str = "train on the data it started with, or give a new --workdir"
) -> None:
    """UsageError when the workdir's run was trained on inputs preprocessed otherwise (a table
    whose vocabularies or statistics changed since): its weights would read other ids."""
    if not recorded.is_file() or recorded.read_bytes() == info.preprocessing_data.encode():
        return
    try:
        difference = first_difference(json.loads(recorded.read_bytes()), json.loads(info.preprocessing_data or "{}"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        difference = "the recorded file is not JSON"
    raise UsageError(
        f"{recorded} (the vocabularies, boundaries and statistics this run was trained with) differs "
        f"from what the data gives now ({difference or 'formatting'}; the data or data.features changed); {fix}"
    )


def recorded_preprocessing(workdir: Path, info, purpose: str = "export") -> bytes:
    """The preprocessing the run in `workdir` trained with (its preprocessing.json, as recorded),
    UsageError when the data now gives another one (the model would be served other inputs)
    or the record is missing; b"" for a source without preprocessing."""
    if not info.preprocessing_data:
        return b""
    recorded = workdir / PREPROCESSING
    if not recorded.is_file():
        raise UsageError(
            f"{recorded} is missing: the run's record of its table preprocessing; restore it from a copy "
            "of the workdir (it cannot be fitted again from data that may have changed)"
        )
    check_preprocessing(recorded, info, f"restore the data the run trained on to {purpose} it")
    return recorded.read_bytes()


def shape_record(info: DataInfo, train: dict, eval_: dict) -> str:
    """data.json's text: `info` and the fields of the train and eval splits (name → one example's
    shape and dtype; `train` and `eval_` as engine/data/pipeline.py example_spec gives them)."""

    def fields(spec: dict) -> dict:
        return {name: [list(array.shape[1:]), str(array.dtype)] for name, array in spec.items()}

    return json.dumps({"info": dataclasses.asdict(info), "train": fields(train), "eval": fields(eval_)}, indent=1)


def record_shape(workdir: Path, info: DataInfo, train: dict, eval_: dict) -> None:
    """workdir/data.json (shape_record), written whole."""
    write_atomic(workdir / DATA_SHAPE, shape_record(info, train, eval_) + "\n")


def recorded_shape(cfg) -> Optional[Dataset]:
    """A Dataset of zeros of the fields cfg.workdir's data.json records (a batch of rows in each
    split) and its DataInfo: what a reader of the run (sample, export) builds its model and state
    from; None where the run recorded none (a run from before data.json) or the record does not read."""
    workdir, rows = Path(cfg.workdir), max(cfg.train.global_batch_size, cfg.eval.batch_size, 1)
    try:
        record = json.loads((workdir / DATA_SHAPE).read_text(encoding="utf-8"))
        values = record["info"]
        for field in dataclasses.fields(DataInfo):  # (JSON gives lists where DataInfo keeps tuples)
            if isinstance(values.get(field.name), list):
                values[field.name] = tuple(values[field.name])
        info = DataInfo(**values)
        splits = [
            {name: np.zeros((rows, *shape), np.dtype(dtype)) for name, (shape, dtype) in record[split].items()}
            for split in ("train", "eval")
        ]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None  # (the readers then build the data, as before data.json)
    return Dataset(splits[0], splits[1], info)
