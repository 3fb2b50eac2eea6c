"""What a data source gives the pipeline: a Dataset of arrays indexed by example, and what
the model needs to know of it (DataInfo)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import UsageError

SPLIT_SEED = 20240521  # the held-out split is fixed, whatever the run's seed


@dataclass(frozen=True)
class DataInfo:
    kind: str  # "image" (image, label), "tokens" (tokens) or "table" (numeric, ids, label[, weight])
    num_train: int
    num_eval: int
    input_shape: tuple[int, ...] = ()  # image: [height, width, channels]
    num_classes: int = 0
    vocab_size: int = 0
    seq_len: int = 0  # tokens the model sees per example
    text_codec: str = ""  # how token ids map to text: "bytes" (ids are UTF-8 bytes), "tokenizer"; "" = not text
    tokenizer: str = ""  # text_codec "tokenizer": the tokenizer.json file
    bytes_per_token: float = 0.0  # UTF-8 bytes of text per token of the eval split (bits per byte); 0 = unknown
    sources: tuple[str, ...] = ()  # a mixture's source names; batches carry `source` (their index)
    preprocessing: str = ""  # what was done to the stored inputs before the model saw them (export.json says it)
    # the preprocessing as data (JSON: a table's vocabularies, boundaries, statistics), kept as
    # the workdir's and the export's preprocessing.json; "" = none
    preprocessing_data: str = ""
    serving_files: tuple[str, ...] = ()  # files an export carries to apply that preprocessing (preprocess.py)
    notes: tuple[str, ...] = ()  # lines the source says of the data at a run's start (chat: what was cut or left out)
    # chat, preferences: the local time (%Y-%m-%dT%H:%M:%S) a chat template's strftime_now() gave
    # (the run's first start, WORKDIR/template_time.json: engine/run/data_record.py)
    template_time: str = ""


@dataclass(frozen=True)
class Dataset:
    # name → array [examples, ...] in memory (or memory-mapped), or Examples read by index
    # (engine/data/tokens.py: tokenized corpora through Grain)
    train: Any
    eval: Any
    info: DataInfo
    # data.name=prompts: the (train, eval) records (engine/data/prompts.py PromptRecord) by the
    # batches' record_index, for the reward functions; None for other sources
    records: Any = None


def existing_dir(path: str, what: str) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise UsageError(f"data.path={path} is not a directory; expected a directory of {what}")
    return directory
