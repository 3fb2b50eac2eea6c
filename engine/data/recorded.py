"""A table run's preprocessing as the run recorded it (its workdir's preprocessing.json):
what every later reader of the run (resume, export, the evaluator) checks the data against."""

from __future__ import annotations

import json
from pathlib import Path

from engine.data.features import first_difference
from engine.errors import UsageError

PREPROCESSING = "preprocessing.json"  # a table's vocabularies, boundaries and statistics (engine/data/table.py)


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
