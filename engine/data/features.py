"""`data.features`: the feature columns of a table (TensorFlow's feature_column, as data).

Each entry has a `name` and a `kind`:
- numeric: `column` (default: the name), `normalize` (none, zscore, minmax), `missing`
  (mean, median or a number);
- bucketized: `column`, `boundaries` (ascending) or `quantiles: N` (N buckets of the train
  split), `missing`;
- categorical: `column`, one of `vocabulary` (a list), `vocabulary_file` (one value per
  line), `min_count` (computed from the train split; default 1) or `hash_buckets: N`;
  `oov_buckets` (default 1), `separator` (multi-valued cells), `missing` (oov or a value);
- crossed: `features` (categorical or bucketized names, one value per cell), `hash_buckets`;
- indicator: `source` (a categorical, bucketized or crossed name): one-hot, read by the
  model's wide (linear) part; a crossed feature is read by it directly;
- embedding: `source`, `dimension`, `combiner` (mean, sum, sqrtn): read by the deep part.

`fit` computes what the train split decides (statistics, vocabularies, quantiles) in one
pass → the resolved spec engine/data/preprocess.py applies (and `preprocessing.json` holds).
"""

from __future__ import annotations

import collections
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from engine.data.preprocess import as_text, is_missing, numbers
from engine.errors import UsageError

KEYS = {
    "numeric": {"column", "normalize", "missing"},
    "bucketized": {"column", "boundaries", "quantiles", "missing"},
    "categorical": {
        "column",
        "vocabulary",
        "vocabulary_file",
        "min_count",
        "hash_buckets",
        "oov_buckets",
        "separator",
        "missing",
    },
    "crossed": {"features", "hash_buckets"},
    "indicator": {"source"},
    "embedding": {"source", "dimension", "combiner"},
}
IDS = ("bucketized", "categorical", "crossed")  # kinds that make ids
MISSING_TEXT = "<missing>"  # categorical `missing: oov`: a value no vocabulary computed here holds
MAX_ID = 2**31 - 1
MAX_QUANTILES = 65536  # a bucketized feature's buckets from quantiles (more cannot differ on real data)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def entries(features: Sequence[Any]) -> list[dict]:
    """data.features checked: UsageError naming the entry and the key, before any data is read."""
    out: list[dict] = []
    for i, entry in enumerate(features):
        where = f"data.features[{i}]"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str) or not entry.get("name"):
            raise UsageError(
                f"{where}={entry!r}: each feature is a mapping with a name and a kind, e.g. "
                "{name: age, kind: numeric}"
            )
        entry, where = dict(entry), f"{where} ({entry['name']})"
        kind = entry.get("kind")
        if kind not in KEYS:
            raise UsageError(f"{where}: kind={kind!r} must be one of {', '.join(KEYS)}")
        unknown = set(entry) - KEYS[kind] - {"name", "kind"}
        if unknown:
            raise UsageError(
                f"{where}: {sorted(unknown)} are not keys of a {kind} feature; it takes {sorted(KEYS[kind])}"
            )
        if any(e["name"] == entry["name"] for e in out):
            raise UsageError(f"{where}: the name {entry['name']!r} is used twice; give each feature its own")
        _check_entry(entry, where, {e["name"]: e for e in out})
        out.append(entry)
    _check_used(out)
    return out


def _check_entry(entry: dict, where: str, before: Mapping[str, dict]) -> None:
    kind = entry["kind"]
    if kind == "numeric" and entry.get("normalize", "none") not in ("none", "zscore", "minmax"):
        raise UsageError(f"{where}: normalize={entry['normalize']!r} must be none, zscore or minmax")
    if kind == "bucketized":
        bounds, quantiles = entry.get("boundaries"), entry.get("quantiles")
        if (bounds is None) == (quantiles is None):
            raise UsageError(f"{where}: give boundaries: [..] or quantiles: N (not both)")
        numbers_only = isinstance(bounds, list) and all(_is_number(b) for b in bounds)
        if bounds is not None and (not numbers_only or not bounds or list(bounds) != sorted(set(bounds))):
            raise UsageError(f"{where}: boundaries={bounds} must be a non-empty ascending list of numbers")
        if quantiles is not None and (not isinstance(quantiles, int) or not 2 <= quantiles <= MAX_QUANTILES):
            raise UsageError(
                f"{where}: quantiles={quantiles!r} must be an integer from 2 to {MAX_QUANTILES} (the buckets made)"
            )
    if kind == "categorical":
        given = [k for k in ("vocabulary", "vocabulary_file", "min_count", "hash_buckets") if k in entry]
        if len(given) > 1:
            raise UsageError(f"{where}: {' and '.join(given)} each say where the ids come from; give one")
        for key in ("min_count", "hash_buckets", "oov_buckets"):
            if key in entry and (not isinstance(entry[key], int) or not 1 <= entry[key] <= MAX_ID // 2):
                raise UsageError(f"{where}: {key}={entry[key]!r} must be a positive integer")
    if kind == "crossed":
        names, buckets = entry.get("features"), entry.get("hash_buckets")
        if not isinstance(names, list) or len(names) < 2 or not isinstance(buckets, int) or isinstance(buckets, bool):
            raise UsageError(f"{where}: a crossed feature needs features: [a, b, ...] (2 or more) and hash_buckets: N")
        if not 1 <= buckets <= MAX_ID // 2:
            raise UsageError(f"{where}: hash_buckets={buckets} must be from 1 to {MAX_ID // 2} (ids are int32)")
        for name in names:
            if before.get(name, {}).get("kind") not in ("categorical", "bucketized"):
                raise UsageError(f"{where}: {name!r} must name a categorical or bucketized feature listed before it")
            if before[name].get("separator"):
                raise UsageError(f"{where}: {name!r} is multi-valued (separator); crosses take one value per cell")
    if kind in ("indicator", "embedding") and before.get(str(entry.get("source")), {}).get("kind") not in IDS:
        raise UsageError(
            f"{where}: source={entry.get('source')!r} must name a categorical, bucketized or crossed feature "
            "listed before it"
        )
    if kind == "embedding" and (not isinstance(entry.get("dimension"), int) or entry["dimension"] < 1):
        raise UsageError(f"{where}: dimension={entry.get('dimension')!r} must be a positive integer")
    if kind == "embedding" and entry.get("combiner", "mean") not in ("mean", "sum", "sqrtn"):
        raise UsageError(f"{where}: combiner={entry['combiner']!r} must be mean, sum or sqrtn")


def _check_used(features: list[dict]) -> None:
    """Every categorical or bucketized feature reaches the model (TensorFlow's rule: wrap it)."""
    read = {f.get("source") for f in features} | {n for f in features for n in f.get("features", ())}
    for f in features:
        if f["kind"] in ("categorical", "bucketized") and f["name"] not in read:
            raise UsageError(
                f"data.features ({f['name']}): a {f['kind']} feature reaches the model only through an "
                f"indicator, an embedding or a crossed feature; add e.g. {{name: {f['name']}_onehot, "
                f"kind: indicator, source: {f['name']}}}"
            )
    if not any(f["kind"] in ("numeric", "indicator", "embedding", "crossed") for f in features):
        raise UsageError("data.features: no feature reaches the model; add a numeric, indicator or embedding one")


def columns_read(features: list[dict]) -> list[str]:
    """The table columns the features read, in order, each once."""
    names = [f.get("column", f["name"]) for f in features if f["kind"] in ("numeric", "bucketized", "categorical")]
    return list(dict.fromkeys(names))


def fit(features: list[dict], train: Mapping[str, Sequence], every: Mapping[str, Sequence]) -> dict:
    """The resolved spec (preprocess.transform's): statistics, quantiles and computed vocabularies
    from the `train` columns, the slots of multi-valued cells from `every` row."""
    numeric, ids, wide, deep = [], [], [], []
    for f in features:
        kind, column = f["kind"], f.get("column", f["name"])
        if kind == "numeric":
            numeric.append({"name": f["name"], "column": column, **_numeric_stats(f, train[column])})
        elif kind == "bucketized":
            values, fill = _present(f, train[column])
            bounds = f.get("boundaries") or _quantiles(values, f["quantiles"])
            ids.append({"name": f["name"], "kind": kind, "column": column, "fill": fill, "boundaries": bounds})
            ids[-1]["size"], ids[-1]["slots"] = len(bounds) + 1, 1
        elif kind == "categorical":
            ids.append(_categorical(f, column, train[column], every[column]))
        elif kind == "crossed":
            ids.append({"name": f["name"], "kind": kind, "features": list(f["features"])})
            ids[-1].update(hash_buckets=f["hash_buckets"], size=f["hash_buckets"], slots=1)
        elif kind == "indicator":
            wide.append({"name": f["name"], "ids": f["source"]})
        else:
            deep.append({"name": f["name"], "ids": f["source"], "dimension": f["dimension"]})
            deep[-1]["combiner"] = f.get("combiner", "mean")
    wide += [{"name": f["name"], "ids": f["name"]} for f in features if f["kind"] == "crossed"]
    offset = 0
    for entry in ids:  # where each feature's ids sit in the model's `ids` input
        entry["offset"], offset = offset, offset + entry["slots"]
    return {"numeric": numeric, "ids": ids, "wide": wide, "deep": deep}


def _present(f: Mapping, values: Sequence) -> tuple[np.ndarray, Any]:
    """(the train split's present values of a numeric column, the fill for missing ones)."""
    column = f.get("column", f["name"])
    parsed = numbers(values, column, math.nan)
    present = parsed[np.isfinite(parsed)]
    missing = f.get("missing")
    if isinstance(missing, (int, float)) and not isinstance(missing, bool):
        return present, float(missing)
    if missing in ("mean", "median"):
        if not present.size:
            raise UsageError(f"data.features ({f['name']}): column {column!r} has no values to take the {missing} of")
        return present, float(np.mean(present) if missing == "mean" else np.median(present))
    if missing is not None:
        raise UsageError(f"data.features ({f['name']}): missing={missing!r} must be mean, median or a number")
    return present, None


def _numeric_stats(f: Mapping, values: Sequence) -> dict:
    present, fill = _present(f, values)
    how = f.get("normalize", "none")
    shift, scale = 0.0, 1.0
    if how != "none" and present.size:
        low, high = (np.mean(present), np.std(present)) if how == "zscore" else (np.min(present), np.ptp(present))
        shift, scale = float(low), float(1.0 / high) if high > 0 else 1.0
    if not (math.isfinite(shift) and math.isfinite(scale) and scale > 0):
        raise UsageError(
            f"data.features ({f['name']}): the {how} statistics of column {f.get('column', f['name'])!r} are not "
            f"finite (shift {shift}, scale {scale}); its values span too wide a range: remove the outliers"
        )
    return {"fill": fill, "shift": shift, "scale": scale, "normalize": how}


def _quantiles(values: np.ndarray, buckets: int) -> list[float]:
    if not values.size:
        raise UsageError("data.features: a bucketized feature's column has no values to take quantiles of")
    if buckets > values.size:
        raise UsageError(
            f"data.features: quantiles={buckets} exceeds the train split's {values.size} values of the column; "
            "use fewer buckets"
        )
    cuts = np.quantile(values, np.linspace(0, 1, buckets + 1)[1:-1])
    return [float(c) for c in np.unique(cuts)]


def _categorical(f: Mapping, column: str, train: Sequence, every: Sequence) -> dict:
    separator, missing = f.get("separator"), f.get("missing")
    fill = None if missing is None else MISSING_TEXT if missing == "oov" else as_text(missing)
    out: dict[str, Any] = {"name": f["name"], "kind": "categorical", "column": column, "fill": fill}
    out.update(separator=separator, oov_buckets=f.get("oov_buckets", 1), hash_buckets=f.get("hash_buckets", 0))

    def split(value) -> list[str]:
        if is_missing(value):
            return []
        return as_text(value).split(separator) if separator else [as_text(value)]

    if "vocabulary" in f:
        out["vocabulary"] = [as_text(v) for v in f["vocabulary"]]
    elif "vocabulary_file" in f:
        out["vocabulary"] = _vocabulary_file(Path(f["vocabulary_file"]), f["name"])
    elif not out["hash_buckets"]:
        counts = collections.Counter(text for value in train for text in split(value))
        kept = [(-n, text) for text, n in counts.items() if n >= f.get("min_count", 1)]
        out["vocabulary"] = [text for _, text in sorted(kept)]
    vocabulary = out.get("vocabulary") or []
    if len(set(vocabulary)) != len(vocabulary):
        raise UsageError(f"data.features ({f['name']}): the vocabulary holds a value twice")
    out["size"] = out["hash_buckets"] or len(vocabulary) + out["oov_buckets"]
    out["slots"] = max([len(split(v)) for v in every] + [1])
    return out


def _vocabulary_file(path: Path, name: str) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"data.features ({name}): vocabulary_file {path} cannot be read ({e})") from None
    words = [line.strip() for line in lines if line.strip()]
    if not words:
        raise UsageError(f"data.features ({name}): vocabulary_file {path} holds no values (one per line)")
    return words


def first_difference(recorded: Any, now: Any, where: str = "") -> str:
    """Where two resolved specs (parsed preprocessing.json) first differ, with both values:
    'numeric[0].shift: 0.455 recorded, 1.791 now' ("" when equal)."""
    if isinstance(recorded, dict) and isinstance(now, dict):
        for key in sorted(recorded.keys() | now.keys(), key=str):
            named = f"{where}.{key}" if where else str(key)
            if key not in recorded or key not in now:
                was, now_is = ("present", "absent") if key in recorded else ("absent", "present")
                return f"{named}: {was} recorded, {now_is} now"
            found = first_difference(recorded[key], now[key], named)
            if found:
                return found
        return ""
    if isinstance(recorded, list) and isinstance(now, list) and len(recorded) == len(now):
        for i, (a, b) in enumerate(zip(recorded, now)):
            name = f" ({a['name']})" if isinstance(a, dict) and "name" in a else ""
            found = first_difference(a, b, f"{where}[{i}]{name}")
            if found:
                return found
        return ""
    if recorded == now:
        return ""
    return f"{where}: {_short(recorded)} recorded, {_short(now)} now"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
