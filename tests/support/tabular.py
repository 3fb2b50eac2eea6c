"""Helpers of tests/**/test_tabular*.py that other test files (or its other tiers) share."""

from __future__ import annotations

import csv

ROWS = """age,city,tags,income,label
25,paris,a|b,1000,yes
35,london,b,2000,no
45,paris,,3000,yes
55,tokyo,a,,no
65,berlin,c|a|b,5000,yes
"""


SPEC = [
    {"name": "age", "kind": "numeric", "normalize": "zscore"},
    {"name": "income", "kind": "numeric", "normalize": "minmax", "missing": "mean"},
    {"name": "age_bucket", "kind": "bucketized", "column": "age", "boundaries": [35, 50]},
    {"name": "city", "kind": "categorical", "vocabulary": ["paris", "london"], "oov_buckets": 2},
    {"name": "city_hashed", "kind": "categorical", "column": "city", "hash_buckets": 5},
    {"name": "tags", "kind": "categorical", "separator": "|", "missing": "oov"},
    {"name": "city_x_age", "kind": "crossed", "features": ["city", "age_bucket"], "hash_buckets": 7},
    {"name": "city_onehot", "kind": "indicator", "source": "city"},
    {"name": "hashed_onehot", "kind": "indicator", "source": "city_hashed"},
    {"name": "tags_embedding", "kind": "embedding", "source": "tags", "dimension": 3, "combiner": "sqrtn"},
]


PENGUINS = "penguins_wide_deep.yaml"


def columns_of(text: str) -> dict:
    rows = list(csv.DictReader(text.splitlines()))
    return {name: [row[name] or None for row in rows] for name in rows[0]}
