"""The documents of a corpus to tokenize: plain text files (one document per file or per line),
JSON Lines records, Parquet rows and the rows of a Hugging Face `datasets` directory
(`save_to_disk`: Arrow files), from files or directories read recursively in sorted order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from engine.errors import UsageError

JSONL_SUFFIXES = (".jsonl", ".ndjson")


def _binary(path: Path) -> bool:
    """A file that is neither Parquet nor text (a NUL byte in its first 8 KiB: .pyc, images, …)."""
    if path.suffix.lower() in (".parquet", ".arrow"):
        return False
    with open(path, "rb") as f:
        return b"\0" in f.read(8192)


def input_files(paths: list[str]) -> list[Path]:
    """Files to read, in a fixed order: each path as given; a directory's files (recursive,
    sorted, hidden and binary ones left out). A file reached twice (through a symlink, or named
    twice) is read once, where it is first reached."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir() and (hf := hf_dataset_files(path)) is not None:
            files += hf
        elif path.is_dir():
            found = sorted(
                p
                for p in path.rglob("*")
                if p.is_file()
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
                and not _binary(p)
            )
            if not found:
                raise UsageError(f"--input {raw} is an empty directory; give files of text, JSON Lines or Parquet")
            files += found
        else:
            raise UsageError(f"--input {raw} does not exist; give text, JSON Lines or Parquet files or directories")
    seen: set[Path] = set()
    unique = []
    for file in files:
        real = file.resolve()
        if real not in seen:
            seen.add(real)
            unique.append(file)
    return unique


def documents(files: list[Path], text_field: str = "text", text_unit: str = "file") -> Iterator[str]:
    """Every non-empty document of the files, in order, streamed."""
    for file in files:
        suffix = file.suffix.lower()
        if suffix in JSONL_SUFFIXES:
            yield from _jsonl(file, text_field)
        elif suffix == ".parquet":
            yield from _parquet(file, text_field)
        elif suffix == ".arrow":
            yield from _arrow(file, text_field)
        elif text_unit == "line":
            with open(file, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.strip():
                        yield line.rstrip("\n")
        else:
            text = file.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                yield text


def _jsonl(file: Path, text_field: str) -> Iterator[str]:
    with open(file, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(
                    f"{file}:{number}: not a JSON record ({e.msg}); JSON Lines hold one object per line"
                ) from None
            if not isinstance(record, dict) or text_field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise UsageError(
                    f"{file}:{number}: no {text_field!r} field (the record has {keys}); pass "
                    "--text-field NAME for the field that holds the text"
                )
            text = record[text_field]
            if not isinstance(text, str):
                raise UsageError(f"{file}:{number}: field {text_field!r} is {type(text).__name__}, not text")
            if text.strip():
                yield text


def _parquet(file: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(file)
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet
        raise UsageError(f"{file} is not a readable Parquet file: {e}") from None
    if text_field not in table.schema_arrow.names:
        raise UsageError(
            f"{file}: no column {text_field!r} (columns: {table.schema_arrow.names}); pass --text-field NAME"
        )
    for batch in table.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if isinstance(text, str) and text.strip():
                yield text


def hf_dataset_files(path: Path) -> list[Path] | None:
    """The Arrow files of a Hugging Face `datasets` directory written by save_to_disk, in row
    order (its state.json lists them); a DatasetDict's `train` split (DIR/SPLIT for another);
    None for any other directory."""
    if (path / "dataset_dict.json").is_file():
        splits = _json_file(path / "dataset_dict.json").get("splits", [])
        if "train" not in splits:
            raise UsageError(
                f"--input {path} is a Hugging Face DatasetDict without a train split (splits: {splits}); "
                f"give one split's directory, e.g. --input {path / (splits[0] if splits else 'SPLIT')}"
            )
        path = path / "train"
    if not (path / "state.json").is_file() or not (path / "dataset_info.json").is_file():
        return None
    files = [path / entry["filename"] for entry in _json_file(path / "state.json").get("_data_files", [])]
    missing = [f.name for f in files if not f.is_file()]
    if not files or missing:
        raise UsageError(f"--input {path}: the Hugging Face dataset's Arrow files {missing or '(none)'} are missing")
    return files


def _json_file(path: Path) -> dict:
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"{path} is not valid JSON ({e}); is the dataset directory complete?") from None
    if not isinstance(found, dict):
        raise UsageError(f"{path} holds {type(found).__name__}, not the JSON object `datasets` writes")
    return found


def _arrow(file: Path, text_field: str) -> Iterator[str]:
    """Rows of an Arrow file: the IPC stream format `datasets` writes, or the IPC file format."""
    import pyarrow as pa

    try:
        reader = pa.ipc.open_stream(pa.memory_map(str(file)))
    except pa.ArrowInvalid:
        try:
            reader = pa.ipc.open_file(pa.memory_map(str(file)))
        except pa.ArrowInvalid as e:
            raise UsageError(f"{file} is not a readable Arrow file: {e}") from None
    if text_field not in reader.schema.names:
        raise UsageError(f"{file}: no column {text_field!r} (columns: {reader.schema.names}); pass --text-field NAME")
    column = reader.schema.get_field_index(text_field)
    batches = (
        reader
        if isinstance(reader, pa.ipc.RecordBatchStreamReader)
        else map(reader.get_batch, range(reader.num_record_batches))
    )
    for batch in batches:
        for text in batch.column(column).to_pylist():
            if isinstance(text, str) and text.strip():
                yield text


def with_last(items: Iterator) -> Iterator[tuple]:
    """(item, whether it is the last one)."""
    previous, started = None, False
    for item in items:
        if started:
            yield previous, False
        previous, started = item, True
    if started:
        yield previous, True


def batches(texts: Iterator[str], batch_bytes: int) -> Iterator[list[str]]:
    """Lists of texts of about `batch_bytes` characters."""
    batch, size = [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def first_bytes(texts: Iterator[str], limit: int) -> Iterator[str]:
    """The texts until `limit` characters have been given (0: all)."""
    size = 0
    for text in texts:
        yield text
        size += len(text)
        if limit and size >= limit:
            return
