"""Raw table values → the tabular model's inputs, from the preprocessing a run recorded
(its `preprocessing.json`): the one transform both training and serving use.

This file imports only numpy and the standard library: `launch.py export` copies it beside
an exported tabular model as `preprocess.py`, so a server turns a dict of raw values
(strings included) into the exported function's inputs without this engine:

    import json, preprocess
    spec = json.load(open("EXPORT/preprocessing.json"))
    inputs = preprocess.rows([{"island": "Biscoe", "bill_length_mm": 45.1, ...}], spec)
    logits = forward.call(variables, inputs)  # {"numeric": float32 [n, k], "ids": int32 [n, s]}

What each feature kind does (spec["numeric"] and spec["ids"], in input order):
- numeric: float(value), a missing value (None, NaN, "") replaced by `fill`, then
  (value - shift) * scale (z-score: shift = mean, scale = 1/std; min-max: min, 1/(max-min));
- bucketized: the bucket of float(value) among `boundaries` (id i: boundaries[i-1] <= v < boundaries[i]);
- categorical: str(value) (integers without ".0") → its index in `vocabulary`, else an
  out-of-vocabulary id len(vocabulary) + hash(value) % oov_buckets; with `hash_buckets`,
  hash(value) % hash_buckets; a multi-valued cell split on `separator` fills `slots` ids
  (unused slots -1);
- crossed: hash of its features' ids joined by "x" (e.g. "2x0") % hash_buckets.
hash is the first 8 bytes of BLAKE2b of the UTF-8 text, little-endian: the same in every
process and every run.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Mapping, Sequence

import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)  # the model reads numbers as float32


class BadCell(ValueError):
    """A value the spec cannot take: `row` (0-based, in the rows given) and `column` name it."""

    def __init__(self, row: int, column: str, problem: str):
        super().__init__(f"row {row}, column {column!r}: {problem}")
        self.row, self.column, self.problem = row, column, problem


def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or value == ""


def as_text(value: Any) -> str:
    """A categorical cell as text: 2007 and 2007.0 are both "2007"."""
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return str(int(value))
    return str(value)


def numbers(values: Sequence[Any] | np.ndarray, column: str, fill: Any) -> np.ndarray:
    """float64 values of a numeric column, the missing ones `fill` (BadCell if there is none, or
    for a value beyond float32's range, which the model's inputs are)."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "biuf":  # a column read as numbers
        out = values.astype(np.float64)
        bad = np.flatnonzero(~np.isfinite(out))
        if bad.size and fill is None:
            what = "missing value (NaN or empty)" if np.isnan(out[bad[0]]) else f"value {out[bad[0]]}"
            raise BadCell(int(bad[0]), column, f"{what}; say how to fill it with missing:")
        out[bad] = fill if bad.size else 0.0
        return _within_float32(out, column)
    out = np.empty(len(values), np.float64)
    for row, value in enumerate(values):
        if is_missing(value):
            if fill is None:
                raise BadCell(row, column, "missing value (NaN or empty); say how to fill it with missing:")
            out[row] = fill
            continue
        try:
            out[row] = float(value)
        except (TypeError, ValueError):
            raise BadCell(row, column, f"non-numeric value {value!r} in a numeric feature") from None
        if not math.isfinite(out[row]):
            if fill is None:
                raise BadCell(row, column, f"value {value!r}; say how to fill it with missing:")
            out[row] = fill
    return _within_float32(out, column)


def _within_float32(out: np.ndarray, column: str) -> np.ndarray:
    huge = np.flatnonzero(np.abs(out) > FLOAT32_MAX)
    if huge.size:
        raise BadCell(int(huge[0]), column, f"value {out[huge[0]]:g} is beyond float32's range (±{FLOAT32_MAX:.3g})")
    return out


def category_ids(values: Sequence[Any] | np.ndarray, feature: Mapping) -> np.ndarray:
    """int32 [rows, slots] ids of a categorical feature (-1: an unused slot)."""
    slots, separator, fill = feature["slots"], feature.get("separator"), feature.get("fill")
    index = {value: i for i, value in enumerate(feature.get("vocabulary") or ())}
    out = np.full((len(values), slots), -1, np.int32)
    for row, value in enumerate(values):
        if is_missing(value):
            if fill is None:
                raise BadCell(row, feature["column"], "missing value; say how to fill it with missing:")
            value = fill
        texts = as_text(value).split(separator) if separator else [as_text(value)]
        if len(texts) > slots:
            raise BadCell(row, feature["column"], f"{len(texts)} values where the spec has room for {slots}")
        for slot, text in enumerate(texts):
            out[row, slot] = category_id(text, feature, index)
    return out


def category_id(text: str, feature: Mapping, index: Mapping[str, int]) -> int:
    if feature.get("hash_buckets"):
        return stable_hash(text) % feature["hash_buckets"]
    if text in index:
        return index[text]
    return len(index) + stable_hash(text) % feature["oov_buckets"]


def crossed_ids(parts: Sequence[np.ndarray], buckets: int) -> np.ndarray:
    """int32 [rows, 1]: each row's ids of the crossed features (one slot each), hashed together."""
    joined = np.stack([part[:, 0] for part in parts], axis=1)
    unique, inverse = np.unique(joined, axis=0, return_inverse=True)
    hashed = np.array([stable_hash("x".join(map(str, key))) % buckets for key in unique.tolist()], np.int32)
    return hashed[inverse.reshape(-1)][:, None]


def transform(columns: Mapping[str, Sequence[Any] | np.ndarray], spec: Mapping) -> dict[str, np.ndarray]:
    """Columns of raw values (name → one value per row) → {"numeric": float32 [rows, k],
    "ids": int32 [rows, slots]}; BadCell names the first value it cannot take."""
    rows = len(next(iter(columns.values()))) if columns else 0
    numeric = [
        (numbers(columns[f["column"]], f["column"], f.get("fill")) - f["shift"]) * f["scale"] for f in spec["numeric"]
    ]
    ids: dict[str, np.ndarray] = {}
    for feature in spec["ids"]:
        if feature["kind"] == "bucketized":
            values = numbers(columns[feature["column"]], feature["column"], feature.get("fill"))
            ids[feature["name"]] = np.searchsorted(feature["boundaries"], values, side="right").astype(np.int32)[
                :, None
            ]
        elif feature["kind"] == "crossed":
            ids[feature["name"]] = crossed_ids([ids[name] for name in feature["features"]], feature["hash_buckets"])
        else:
            ids[feature["name"]] = category_ids(columns[feature["column"]], feature)
    return {
        "numeric": np.stack(numeric, axis=1).astype(np.float32) if numeric else np.zeros((rows, 0), np.float32),
        "ids": np.concatenate([ids[f["name"]] for f in spec["ids"]], axis=1) if ids else np.zeros((rows, 0), np.int32),
    }


def rows(records: Sequence[Mapping[str, Any]], spec: Mapping) -> dict[str, np.ndarray]:
    """A list of dicts of raw values (column → value; a column left out is missing) → the
    exported function's inputs."""
    names = {f["column"] for f in spec["numeric"]} | {f["column"] for f in spec["ids"] if "column" in f}
    return transform({name: [record.get(name) for record in records] for name in names}, spec)


def labels(values: Sequence[Any] | np.ndarray, spec: Mapping) -> np.ndarray:
    """Raw labels → int32 class indices (classification) or float32 targets (regression)."""
    label = spec["label"]
    if not label.get("classes"):
        return numbers(values, label["column"], None).astype(np.float32)
    index = {name: i for i, name in enumerate(label["classes"])}
    out = np.empty(len(values), np.int32)
    for row, value in enumerate(values):
        text = None if is_missing(value) else as_text(value)
        if text not in index:
            raise BadCell(row, label["column"], f"label {value!r} is not one of the classes {label['classes']}")
        out[row] = index[text]
    return out
