"""Tables: data.features turns raw rows into the tabular model's inputs (checked by hand on 5
rows), the shipped penguins config reaches a logistic regression's accuracy, resumes exactly
after SIGKILL and gives the one-device losses over 8 devices with its tables sharded, its
export serves raw rows (strings included) with the trainer's eval accuracy, and bad data is
one line naming the file, row and column, exit 2."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
from support.tabular import ROWS, SPEC, columns_of

from engine.data import features, preprocess


def blake(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


@pytest.mark.nocompile
def test_each_feature_kind_turns_five_rows_into_the_numbers_worked_by_hand():
    columns = columns_of(ROWS)
    spec = features.fit(features.entries(SPEC), columns, columns)
    inputs = preprocess.transform(columns, spec)
    age = (np.array([25, 35, 45, 55, 65]) - 45) / math.sqrt(200)  # mean 45, population std sqrt(200)
    income = (np.array([1000, 2000, 3000, 2750, 5000]) - 1000) / 4000  # the missing one: mean 2750
    np.testing.assert_allclose(inputs["numeric"], np.stack([age, income], 1), rtol=1e-6)
    ids = {f["name"]: inputs["ids"][:, f["offset"] : f["offset"] + f["slots"]] for f in spec["ids"]}
    assert ids["age_bucket"][:, 0].tolist() == [0, 1, 1, 2, 2]  # [35, 50): 1 (35 itself too), 50 and over: 2
    # vocabulary [paris, london], 2 out-of-vocabulary buckets after it
    city = [0, 1, 0, 2 + blake("tokyo") % 2, 2 + blake("berlin") % 2]
    assert ids["city"][:, 0].tolist() == city
    assert ids["city_hashed"][:, 0].tolist() == [blake(c) % 5 for c in ["paris", "london", "paris", "tokyo", "berlin"]]
    # computed vocabulary by count then text: a (3), b (3), c (1); the missing cell → OOV id 3
    assert ids["tags"].tolist() == [[0, 1, -1], [1, -1, -1], [3, -1, -1], [0, -1, -1], [2, 0, 1]]
    buckets = [0, 1, 1, 2, 2]
    assert ids["city_x_age"][:, 0].tolist() == [blake(f"{c}x{b}") % 7 for c, b in zip(city, buckets)]
    sizes = {f["name"]: f["size"] for f in spec["ids"]}
    assert sizes == {"age_bucket": 3, "city": 4, "city_hashed": 5, "tags": 4, "city_x_age": 7}
    assert [f["name"] for f in spec["wide"]] == ["city_onehot", "hashed_onehot", "city_x_age"]
    # serving: a dict per row, numbers as numbers or text, missing as None, gives the same inputs
    records = [dict(zip(columns, values)) for values in zip(*columns.values())]
    records[0]["age"] = 25
    again = preprocess.rows(records, json.loads(json.dumps(spec)))
    np.testing.assert_array_equal(again["ids"], inputs["ids"])
    np.testing.assert_allclose(again["numeric"], inputs["numeric"])
