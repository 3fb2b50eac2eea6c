"""The documents of a corpus to tokenize: plain text files (one document per file or per line),
JSON Lines records, Parquet rows and the rows of a Hugging Face `datasets` directory
(`save_to_disk`: Arrow files), from files or directories read recursively in sorted order."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Iterator

from engine.errors import UsageError

JSONL_SUFFIXES = (".jsonl", ".ndjson")


# The longest document tokenized whole, in characters (4 Mi): the encoder's memory grows with a
# document's length, so a longer one (a 1 GB file or line) is cut into pieces at line ends
# (where none: at the limit), each a document; a JSON Lines record may not be longer.
MAX_DOCUMENT_CHARS = 1 << 22
SNIFF_BYTES = 8192  # a NUL byte among a file's first 8 KiB makes it binary (git's rule)
ARROW_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # the end-of-stream marker a closed Arrow IPC stream ends with


def _binary(path: Path) -> bool:
    """A file that is neither Parquet nor text (a NUL byte in its first 8 KiB: .pyc, images, …)."""
    if path.suffix.lower() in (".parquet", ".arrow"):
        return False
    with open(path, "rb") as f:
        return b"\0" in f.read(SNIFF_BYTES)


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
    """Every non-empty document of the files, in order, streamed (none longer than
    MAX_DOCUMENT_CHARS: a longer one comes in pieces)."""
    for file in files:
        suffix = file.suffix.lower()
        if suffix in JSONL_SUFFIXES:
            yield from _jsonl(file, text_field)
        elif suffix == ".parquet":
            yield from (piece for text in _parquet(file, text_field) for piece in pieces(text) if piece.strip())
        elif suffix == ".arrow":
            yield from (piece for text in _arrow(file, text_field) for piece in pieces(text) if piece.strip())
        elif text_unit == "line":  # invalid UTF-8 and NUL bytes read as U+FFFD (counted by input_checks)
            with open(file, encoding="utf-8", errors="replace") as f:
                for line in iter(lambda: f.readline(MAX_DOCUMENT_CHARS), ""):  # (a longer line: in pieces)
                    if line.strip():
                        yield line.rstrip("\n").replace("\0", "\ufffd")
        else:
            with open(file, encoding="utf-8", errors="replace") as f:
                for text in _file_pieces(f):
                    if text.strip():
                        yield text.replace("\0", "\ufffd")


def pieces(text: str) -> Iterator[str]:
    """`text` cut into pieces of at most MAX_DOCUMENT_CHARS, each ending at a line end where
    there is one (all of it, when it is not longer)."""
    while len(text) > MAX_DOCUMENT_CHARS:
        cut = text.rfind("\n", 0, MAX_DOCUMENT_CHARS) + 1 or MAX_DOCUMENT_CHARS
        yield text[:cut]
        text = text[cut:]
    yield text


def _file_pieces(f) -> Iterator[str]:
    """A text file's documents (pieces), read MAX_DOCUMENT_CHARS at a time: no more than two
    pieces' worth of it is ever in memory."""
    buffer = ""
    while chunk := f.read(MAX_DOCUMENT_CHARS):
        buffer += chunk
        *whole, buffer = list(pieces(buffer)) if len(buffer) > MAX_DOCUMENT_CHARS else [buffer]
        yield from whole
    if buffer:
        yield buffer


def _jsonl(file: Path, text_field: str) -> Iterator[str]:
    with open(file, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(iter(lambda: f.readline(MAX_DOCUMENT_CHARS + 1), ""), 1):
            if len(line) > MAX_DOCUMENT_CHARS:
                raise UsageError(
                    f"{file}:{number}: a record longer than {MAX_DOCUMENT_CHARS:,} characters; split its text "
                    "into several records"
                )
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
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(file)
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet
        raise UsageError(f"{file} is not a readable Parquet file: {e}") from None
    if text_field not in table.schema_arrow.names:
        raise UsageError(
            f"{file}: no column {text_field!r} (columns: {table.schema_arrow.names}); pass --text-field NAME"
        )
    try:
        for batch in table.iter_batches(columns=[text_field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                if isinstance(text, str) and text.strip():
                    yield text
    except (pa.ArrowException, OSError) as e:  # a damaged page
        raise UsageError(f"{file} is a damaged Parquet file ({e}); write it again or restore it from a copy") from None


def hf_dataset_files(path: Path) -> list[Path] | None:
    """The Arrow files of a Hugging Face `datasets` directory written by save_to_disk, in row
    order (its state.json lists them); a DatasetDict's `train` split (DIR/SPLIT for another);
    None for any other directory."""
    if (path / "dataset_dict.json").is_file():
        splits = _json_file(path / "dataset_dict.json").get("splits", [])
        if not isinstance(splits, list) or not all(isinstance(split, str) for split in splits):
            raise _damaged_json(path / "dataset_dict.json", f"its splits are {json.dumps(splits)[:60]}")
        if "train" not in splits:
            raise UsageError(
                f"--input {path} is a Hugging Face DatasetDict without a train split (splits: {splits}); "
                f"give one split's directory, e.g. --input {path / (splits[0] if splits else 'SPLIT')}"
            )
        path = path / "train"
    if not (path / "state.json").is_file() or not (path / "dataset_info.json").is_file():
        return None
    _json_file(path / "dataset_info.json")
    entries = _json_file(path / "state.json").get("_data_files")
    names = _file_names(entries)
    if not names:
        raise _damaged_json(
            path / "state.json",
            f'its _data_files are {json.dumps(entries)[:60]}, not a list of {{"filename": "data-….arrow"}}',
        )
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        raise UsageError(f"--input {path}: the Hugging Face dataset's Arrow files {missing} are missing")
    return [path / n for n in names]


def _file_names(entries: object) -> list[str]:
    """The file names of state.json's `_data_files` ([] unless each is a name in the directory)."""
    if not isinstance(entries, list):
        return []
    names = [entry.get("filename") if isinstance(entry, dict) else None for entry in entries]
    good = [name for name in names if isinstance(name, str) and name and Path(name).name == name]
    return good if len(good) == len(entries) else []


def _damaged_json(path: Path, why: str) -> UsageError:
    return UsageError(
        f"{path} is damaged ({why}); save the dataset again (save_to_disk) or restore the directory from a copy"
    )


def _json_file(path: Path) -> dict:
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _damaged_json(path, f"not valid JSON: {e}") from None
    if not isinstance(found, dict):
        raise _damaged_json(path, f"it holds {type(found).__name__}, not the JSON object `datasets` writes")
    return found


def _damaged_arrow(file: Path, why: object) -> UsageError:
    return UsageError(
        f"{file} is a damaged Arrow file ({why}); write it again (a datasets directory: save_to_disk) or "
        "restore it from a copy"
    )


def _arrow_reader(file: Path):
    """(column names, record batches, each checked in full) of an Arrow file: the IPC stream format
    `datasets` writes, or the IPC file format; UsageError when it is damaged (Arrow keeps no
    checksum: a changed byte inside the text itself reads as other text)."""
    import pyarrow as pa

    with open(file, "rb") as f:
        head = f.read(6)
        f.seek(max(file.stat().st_size - len(ARROW_EOS), 0))
        tail = f.read()
    if head != b"ARROW1" and tail != ARROW_EOS:  # a stream cut at a batch's end reads as a shorter one
        raise _damaged_arrow(file, "cut short: no end-of-stream marker")
    errors = (pa.ArrowException, OSError, UnicodeDecodeError)  # what pyarrow raises for damaged bytes
    try:
        if head == b"ARROW1":
            reader = pa.ipc.open_file(pa.memory_map(str(file)))
            batches = map(reader.get_batch, range(reader.num_record_batches))
        else:
            reader = batches = pa.ipc.open_stream(pa.memory_map(str(file)))
        names = reader.schema.names
        _check_hf_metadata(file, reader.schema)
    except errors as e:
        raise _damaged_arrow(file, e) from None

    def checked():
        try:
            for batch in batches:
                if batch.schema.names != names:
                    raise _damaged_arrow(file, f"a batch has columns {batch.schema.names}, not {names}")
                batch.validate(full=True)  # offsets in bounds, UTF-8 text
                yield batch
        except errors as e:
            raise _damaged_arrow(file, e) from None

    return names, checked()


def _check_hf_metadata(file: Path, schema) -> None:
    """The columns that `datasets` wrote into the schema's metadata are the schema's own."""
    recorded = (schema.metadata or {}).get(b"huggingface")
    if recorded is None:
        return
    try:
        features = json.loads(recorded)["info"]["features"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise _damaged_arrow(file, f"its huggingface metadata does not read: {e!r}") from None
    if isinstance(features, dict) and sorted(features) != sorted(schema.names):
        raise _damaged_arrow(file, f"its columns {schema.names} are not the {list(features)} its metadata lists")


def check_arrow(file: Path) -> None:
    """UsageError when any part of an Arrow file is damaged."""
    for _ in _arrow_reader(file)[1]:
        pass


def _arrow(file: Path, text_field: str) -> Iterator[str]:
    """Rows of an Arrow file's `text_field` column."""
    names, batches = _arrow_reader(file)
    if text_field not in names:
        raise UsageError(f"{file}: no column {text_field!r} (columns: {names}); pass --text-field NAME")
    column = names.index(text_field)
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


def split_one_document(text: str, tokenizer, eod: int, fraction: float, writers: dict, text_bytes: dict) -> int:
    """A corpus of one document (one text file, one line): held-out documents would be none or all
    of it, so its last `fraction` of tokens (one at least) is held out instead, each part ending
    with `eod`, and `text_bytes` counts each part's own bytes; says so. → the tokens written."""
    encoding = tokenizer.encode(text, add_special_tokens=False)  # (with offsets: where the parts meet)
    ids = list(encoding.ids)
    held = min(max(math.ceil(len(ids) * fraction), 1), len(ids) - 1)
    if held < 1:  # (one token cannot be split: it trains, and nothing is held out)
        writers["train"].add([*ids, eod])
        text_bytes["train"] += len(text.encode("utf-8"))
        return len(ids) + 1
    cut = len(ids) - held
    char = encoding.offsets[cut][0]  # where the held-out tokens start in the text
    writers["train"].add([*ids[:cut], eod])
    writers["eval"].add([*ids[cut:], eod])
    text_bytes["train"] += len(text[:char].encode("utf-8"))
    text_bytes["eval"] += len(text[char:].encode("utf-8"))
    print(
        f"tokenize: the corpus is one document, so --eval-fraction {fraction} holds out its last {held:,} of "
        f"{len(ids):,} tokens (the end of its text, not a whole document) for evaluation",
        file=sys.stderr,
        flush=True,
    )
    return len(ids) + 2
