"""`data.name=table`: rows of a CSV or Parquet file (or a glob of them) with a label column,
turned into a tabular model's inputs by the feature columns of `data.features`
(engine/data/features.py).

- `data.path`: a file, a glob, or `PACKAGE:PATH` (a file shipped inside an installed Python
  package, e.g. `palmerpenguins:data/penguins.csv`).
- `data.label` (the label column), `data.target` (classification: the label's values are
  the classes, in `data.classes` order if given, else sorted; regression: a number),
  `data.weight` (an optional per-row weight column).
- The held-out rows are those of `data.eval_path` (files as data.path takes them), else a fixed
  share of data.path's rows (`data.eval_fraction`, drawn by SPLIT_SEED whatever the run's seed).

What the train split decides (statistics, quantiles, vocabularies) is computed once and
cached beside the data (`.NAME.features-KEY.json`; KEY: a SHA-256 of the files' bytes and of
the spec), or under ~/.cache/jax-engine/tables where that directory is not writable or
belongs to the Python installation. The run records it as `preprocessing.json` in its
workdir (a resume refuses data whose preprocessing changed) and export copies it.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from engine.data import features as feature_columns
from engine.data import preprocess
from engine.data.base import SPLIT_SEED, DataInfo, Dataset
from engine.errors import UsageError
from engine.runtime.caches import DEFAULT_ROOT, cache_path
from engine.runtime.rundir import write_atomic

CACHE = f"{DEFAULT_ROOT}/tables"


def table(cfg) -> Dataset:
    """The rows of data.path as {numeric, ids, label[, weight]} arrays (engine/data/preprocess.py)."""
    features = feature_columns.entries(cfg.features)
    files = table_files(cfg.path)
    held_out = table_files(cfg.eval_path, "data.eval_path") if cfg.eval_path else []
    both = {f.resolve() for f in files} & {f.resolve() for f in held_out}
    if both:
        raise UsageError(
            f"data.eval_path and data.path both name {sorted(both)[0]}: the held-out rows would be trained on; "
            "give data.eval_path files of their own"
        )
    columns, origin = _read(
        files + held_out, [*feature_columns.columns_read(features), cfg.label, *([cfg.weight] * bool(cfg.weight))]
    )
    splits = _splits(cfg, files, origin)
    train = {name: values[splits["train"]] for name, values in columns.items()}
    files = files + held_out  # (the feature cache's key covers both; BadCells name either)
    spec = _cached_fit(cfg, files, features, (train, splits["train"]), columns, origin)
    arrays = {}
    for split, index in splits.items():
        part = {name: values[index] for name, values in columns.items()}
        arrays[split] = _named(functools.partial(_inputs, cfg, part, spec), files, origin, index)
    info = DataInfo(
        "table",
        len(splits["train"]),
        len(splits["eval"]),
        (len(spec["numeric"]), sum(f["slots"] for f in spec["ids"])),
        num_classes=len(spec["label"].get("classes") or ()),
        preprocessing="the feature columns of data.features (preprocessing.json, applied by preprocess.py)",
        preprocessing_data=json.dumps(spec, indent=1),
        serving_files=(preprocess.__file__,),
    )
    return Dataset(arrays["train"], arrays["eval"], info)


def _splits(cfg, files: list[Path], origin: np.ndarray) -> dict[str, np.ndarray]:
    """Row indices of each split: every row of data.path trains and data.eval_path's are held
    out; else a fixed share of data.path's rows (data.eval_fraction), drawn by SPLIT_SEED."""
    if cfg.eval_path:
        from_eval = origin[:, 0] >= len(files)
        return {"train": np.flatnonzero(~from_eval), "eval": np.flatnonzero(from_eval)}
    rows = len(origin)
    order = np.random.default_rng(SPLIT_SEED).permutation(rows)
    n_eval = max(1, int(round(rows * cfg.eval_fraction)))
    if rows - n_eval < 1:
        raise UsageError(f"{files[0]}: {rows} row(s) leave none to train on after holding out {n_eval}; add rows")
    return {"train": order[n_eval:], "eval": order[:n_eval]}


def _inputs(cfg, part: dict, spec: dict) -> dict[str, np.ndarray]:
    arrays = preprocess.transform(part, spec)
    arrays["label"] = preprocess.labels(part[cfg.label], spec)
    if cfg.weight:
        arrays["weight"] = preprocess.numbers(part[cfg.weight], cfg.weight, None).astype(np.float32)
    return arrays


def table_files(path: str | None, key: str = "data.path") -> list[Path]:
    """data.path (or `key`) → the CSV or Parquet files it names, sorted."""
    if not path:
        raise UsageError(f"data.name=table reads a CSV or Parquet file: set {key}=FILE (or a glob)")
    package, _, inside = path.partition(":")
    if inside and not Path(path).exists() and package.isidentifier():
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise UsageError(f"{key}={path}: no installed package {package!r}; pip install {package}")
        path = str(Path(next(iter(spec.submodule_search_locations))) / inside)
    files = sorted(Path(p) for p in glob.glob(os.path.expanduser(path))) if glob.has_magic(path) else [Path(path)]
    files = [f for f in files if f.is_file()]
    if not files:
        raise UsageError(f"{key}={path} names no file; give a CSV or Parquet file, or a glob of them")
    for file in files:
        if file.suffix.lower() not in (".csv", ".parquet", ".pq"):
            raise UsageError(f"{file}: a table is a .csv or .parquet file")
    return files


def _read(files: list[Path], wanted: list[str]) -> tuple[dict[str, Any], np.ndarray]:
    """The wanted columns of every file, concatenated (numbers as float64 arrays, NaN where
    missing; text as object arrays, None where missing), and each row's (file, row) origin."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    wanted = list(dict.fromkeys(wanted))  # a column read twice (a feature that is also the label) once
    parts: dict[str, list] = {name: [] for name in wanted}
    origin = []
    for i, file in enumerate(files):
        if file.stat().st_size == 0:
            raise UsageError(f"{file} is empty; a table needs a header row and data rows")
        try:
            data = pq.read_table(file) if file.suffix.lower() != ".csv" else pacsv.read_csv(file)
        except (pa.ArrowInvalid, OSError) as e:
            raise UsageError(f"{file} is not a readable {file.suffix[1:]} table: {e}") from None
        twice = sorted({name for name in wanted if data.column_names.count(name) > 1})
        if twice:
            raise UsageError(f"{file} has {len(twice)} column(s) named {twice[0]!r} more than once; rename them")
        missing = [name for name in wanted if name not in data.column_names]
        if missing:
            raise UsageError(
                f"{file} has no column {missing[0]!r} (named in data.features, data.label or data.weight); "
                f"its columns: {', '.join(data.column_names)}"
            )
        if data.num_rows == 0:
            raise UsageError(f"{file} has a header but no rows")
        for name in wanted:
            column = data.column(name)
            numeric = pa.types.is_integer(column.type) or pa.types.is_floating(column.type)
            values = column.to_numpy().astype(np.float64) if numeric else np.array(column.to_pylist(), object)
            if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
                _refuse_bytes(file, name, values)  # (pyarrow reads a text column with a non-UTF-8 cell as bytes)
            parts[name].append(values)
        origin.append(np.stack([np.full(data.num_rows, i), np.arange(data.num_rows)], axis=1))
    columns = {name: _join(chunks) for name, chunks in parts.items()}
    return columns, np.concatenate(origin)


def _refuse_bytes(file: Path, name: str, values: np.ndarray) -> None:
    """UsageError naming the first cell of a bytes column that is not UTF-8 text (a table's
    categories are text: bytes would each become their own unseen category when served)."""
    for row, value in enumerate(values):
        if value is None:
            continue
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            raise UsageError(
                f"{file}: {_place(file, row)}, column {name!r}: {bytes(value[:40])!r} is not UTF-8 text; "
                "save the table as UTF-8"
            ) from None
    raise UsageError(f"{file}: column {name!r} holds binary values, not text or numbers; a feature reads one of those")


def _place(file: Path, row: int) -> str:
    return f"line {row + 2}" if file.suffix.lower() == ".csv" else f"row {row}"  # a CSV's header is line 1


def _join(chunks: list[np.ndarray]) -> np.ndarray:
    if all(c.dtype == np.float64 for c in chunks):
        return np.concatenate(chunks)
    return np.concatenate([c.astype(object) for c in chunks])  # text in one file, numbers in another


def _named(make, files: list[Path], origin: np.ndarray, index: np.ndarray):
    """make() with a BadCell (row r of these rows) named by its file, line and column."""
    try:
        return make()
    except preprocess.BadCell as e:
        file_index, row = origin[index[e.row]]
        file = files[file_index]
        raise UsageError(f"{file}: {_place(file, row)}, column {e.column!r}: {e.problem}") from None


def _cached_fit(cfg, files, features, train: tuple[dict, np.ndarray], columns, origin) -> dict:
    """feature_columns.fit over the train rows (their columns, their indices), kept in a file
    keyed by the data and the spec."""
    digest = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    held_out = cfg.eval_path or ""  # (which files train: data.path's, or a share of all)
    settings = [features, cfg.label, cfg.target, list(cfg.classes), cfg.eval_fraction, cfg.weight, held_out]
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    key = digest.hexdigest()
    cache = _cache_file(files[0], key)
    kept = _cached_spec(cache, key)
    if kept is not None:
        return kept
    spec = _named(lambda: feature_columns.fit(features, train[0], columns), files, origin, train[1])
    spec["label"] = _label_spec(cfg, columns[cfg.label], files, origin, np.arange(len(origin)))
    cache.parent.mkdir(parents=True, exist_ok=True)
    record = {"key": key, "files": [str(f) for f in files], "spec": spec, "spec_sha256": _spec_digest(spec)}
    write_atomic(cache, json.dumps(record, indent=1))
    return spec


def _spec_digest(spec) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def _cached_spec(cache: Path, key: str) -> dict | None:
    """The spec a cache file holds when it is the one fitted for `key` and matches its checksum;
    None (fit again) otherwise, with one line saying why when the file is damaged or was edited."""
    if not cache.is_file():
        return None
    try:
        kept = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        kept, problem = None, f"unreadable ({type(e).__name__})"
    else:
        intact = isinstance(kept, dict) and kept.get("key") == key and isinstance(kept.get("spec"), dict)
        problem = "" if intact and kept.get("spec_sha256") == _spec_digest(kept["spec"]) else "damaged or edited"
    if problem:
        print(f"warning: the feature cache {cache} is {problem}; fitting the features again", file=sys.stderr)
        return None
    return kept["spec"]


def _label_spec(cfg, values: np.ndarray, files, origin, index) -> dict:
    if cfg.target == "regression":
        _named(lambda: preprocess.numbers(values, cfg.label, None), files, origin, index)
        return {"column": cfg.label, "classes": []}
    present = [preprocess.as_text(v) for v in values if not preprocess.is_missing(v)]
    classes = [preprocess.as_text(c) for c in cfg.classes] or sorted(set(present))
    if len(classes) < 2:
        raise UsageError(f"data.label={cfg.label}: {len(classes)} class(es); a classifier needs 2 or more")
    spec = {"column": cfg.label, "classes": classes}
    _named(lambda: preprocess.labels(values, {"label": spec}), files, origin, index)
    return spec


def _cache_file(first: Path, key: str) -> Path:
    directory = first.resolve().parent
    installed = any(directory.is_relative_to(Path(p).resolve()) for p in {sys.prefix, sys.base_prefix})
    if installed or not os.access(directory, os.W_OK):
        return cache_path(CACHE) / f"{first.stem}.features-{key[:16]}.json"
    return directory / f".{first.name}.features-{key[:16]}.json"
