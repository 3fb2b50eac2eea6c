"""Tables: data.features turns raw rows into the tabular model's inputs (checked by hand on 5
rows), the shipped penguins config reaches a logistic regression's accuracy, resumes exactly
after SIGKILL and gives the one-device losses over 8 devices with its tables sharded, its
export serves raw rows (strings included) with the trainer's eval accuracy, and bad data is
one line naming the file, row and column, exit 2."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.cli import run_cli, start_cli, wait_until
from support.configs import QUIET, ROOT
from support.fuzz_cli import refused_in_one_line, run_in_one_process
from support.in_process import train_here
from support.tabular import PENGUINS, ROWS, SPEC, columns_of

from engine.data import features, preprocess


@pytest.mark.nocompile
def test_hashed_ids_are_the_same_in_another_process():
    columns = columns_of(ROWS)
    spec = features.fit(features.entries(SPEC), columns, columns)
    code = (
        "import json, sys; from engine.data import preprocess; a = json.load(sys.stdin); "
        "print(json.dumps(preprocess.transform(a['columns'], a['spec'])['ids'].tolist()))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # Python's own str hash would differ
    proc = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps({"columns": columns, "spec": spec}),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=True,
    )
    assert json.loads(proc.stdout) == preprocess.transform(columns, spec)["ids"].tolist()


def _penguins_dataset(make_config):
    from engine.data import load_dataset

    return load_dataset(make_config(PENGUINS).data)


def _records(workdir: Path):
    lines = (workdir / "metrics.jsonl").read_text().splitlines() if (workdir / "metrics.jsonl").exists() else []
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r["split"] == "train"]


def test_sigkill_then_rerun_continues_the_same_table_run(tmp_path, capsys):
    """The run never stopped is this test's own (support/in_process.py); the killed one and its re-run are launched."""
    args = [
        "train.steps=60",
        "checkpoint.every_steps=10",
        "log.every_steps=1",
        "eval.every_steps=0",
        "data.placement=host",
        "data.steps_per_transfer=1",
    ]

    def start(workdir):
        return start_cli("--config", f"configs/{PENGUINS}", "--workdir", str(workdir), *QUIET, *args)

    reference, killed = tmp_path / "reference", tmp_path / "killed"
    code, said = train_here(capsys, reference, f"configs/{PENGUINS}", *QUIET, *args, devices=1, common=False)
    assert code == 0, said[-3000:]
    proc = start(killed)
    wait_until(lambda: _records(killed) and _records(killed)[-1][0] >= 25, proc, 240, poll=0.02)
    proc.kill()
    proc.wait()
    assert _records(killed)[-1][0] < 60
    proc = start(killed)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert _records(killed) == _records(reference) and len(_records(reference)) == 60
    assert (killed / "preprocessing.json").read_text() == (reference / "preprocessing.json").read_text()


def test_the_shipped_config_reaches_a_logistic_regressions_accuracy_and_its_export_serves_raw_rows_with_it(
    tmp_path, make_config
):
    """One run of the shipped penguins config: its final eval accuracy is at least scikit-learn's
    LogisticRegression's on the same held-out rows, reading the same inputs (the ids one-hot);
    the export's preprocess.py on the held-out rows as raw text (the CSV's cells, "NA" as None)
    gives the eval accuracy the trainer logged; docs/data.md's serving snippet runs as written."""
    from sklearn.linear_model import LogisticRegression

    from engine.data.base import SPLIT_SEED
    from engine.data.table import table_files

    data = _penguins_dataset(make_config)
    sizes = [f["size"] for f in json.loads(data.info.preprocessing_data)["ids"]]

    def dense(split):
        hot = [np.eye(size)[split["ids"][:, i]] for i, size in enumerate(sizes)]
        return np.concatenate([split["numeric"], *hot], axis=1)

    baseline = LogisticRegression(max_iter=2000).fit(dense(data.train), data.train["label"])
    wanted = baseline.score(dense(data.eval), data.eval["label"])
    assert run_cli("--config", str(ROOT / "configs" / PENGUINS), "log.progress=false", cwd=tmp_path).returncode == 0
    records = [
        json.loads(line) for line in (tmp_path / "runs/penguins_wide_deep/metrics.jsonl").read_text().splitlines()
    ]
    final = [r for r in records if r["split"] == "eval"][-1]
    assert data.info.num_eval == 86 and wanted > 0.95 and final["step"] == 300
    assert final["accuracy"] >= wanted - 1e-9, (final, wanted)
    proc = run_cli("export", "--workdir", "runs/penguins_wide_deep", "--out", "runs/penguins_export", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    export = tmp_path / "runs" / "penguins_export"
    assert json.loads((export / "export.json").read_text())["inputs"]["ids"] == {
        "shape": ["batch", 5],
        "dtype": "int32",
    }
    readme = (
        (ROOT / "docs" / "data.md")
        .read_text()
        .split("<!-- table serving snippet: tests/e2e/test_tabular.py runs it as written -->")[1]
    )
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['Gentoo', 'Chinstrap', 'Adelie']"

    rows = list(csv.DictReader(table_files("palmerpenguins:data/penguins.csv")[0].read_text().splitlines()))
    held_out = np.random.default_rng(SPLIT_SEED).permutation(len(rows))[:86]
    records = [{k: (None if v == "NA" else v) for k, v in rows[i].items()} for i in held_out]
    serve = (
        "import json, sys; import numpy as np, jax, orbax.checkpoint as ocp; from pathlib import Path; "
        "e = Path(sys.argv[1]); sys.path.insert(0, str(e)); import preprocess; "
        "spec = json.loads((e / 'preprocessing.json').read_text()); records = json.load(sys.stdin); "
        "f = jax.export.deserialize(bytearray((e / 'forward.stablehlo').read_bytes())); "
        "v = ocp.StandardCheckpointer().restore(e / 'variables'); "
        "p = np.argmax(f.call(v, preprocess.rows(records, spec)), -1); "
        "print(json.dumps([spec['label']['classes'][i] for i in p]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", serve, str(export)],
        input=json.dumps(records),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    served = np.mean([p == r["species"] for p, r in zip(json.loads(proc.stdout), records)])
    logged = [
        json.loads(line) for line in (tmp_path / "runs/penguins_wide_deep/metrics.jsonl").read_text().splitlines()
    ]
    assert served == pytest.approx([r for r in logged if r["split"] == "eval"][-1]["accuracy"], abs=1e-9)


BAD = {
    "an unseen column": (ROWS, ["data.features=[{name: height, kind: numeric}]"], "has no column 'height'"),
    "a non-numeric cell": (
        ROWS.replace("35,london", "3S,london"),
        [],
        "line 3, column 'age': non-numeric value '3S' in a numeric feature",
    ),
    "a label outside the classes": (
        ROWS.replace("55,tokyo,a,,no", "55,tokyo,a,,maybe"),
        ["data.classes=['yes','no']"],
        "line 5, column 'label': label 'maybe' is not one of the classes ['yes', 'no']",
    ),
    "an empty file": ("", [], "is empty; a table needs a header row and data rows"),
    "a NaN with no missing: rule": (
        ROWS,
        ["data.features=[{name: income, kind: numeric}]"],
        "line 5, column 'income': missing value (NaN or empty); say how to fill it with missing:",
    ),
}


def test_bad_data_is_one_line_naming_the_file_row_and_column_and_exit_2(tmp_path):
    """The first case through launch.py in a process of its own (what a user sees), the others
    through the CLI's main in one process (tests/support/fuzz_cli.py)."""
    cases = []
    for i, (case, (text, overrides, message)) in enumerate(BAD.items()):
        table = tmp_path / f"t{i}" / "people.csv"
        table.parent.mkdir()
        table.write_text(text)
        args = ["data.path=" + str(table), "data.label=label", "data.eval_fraction=0.2"]
        features = "data.features=[{name: age, kind: numeric}, {name: income, kind: numeric, missing: 0}]"
        workdir = table.parent / "run"
        argv = ["--config", f"configs/{PENGUINS}", "--workdir", str(workdir), *args, features, *overrides]
        named = [message] if case == "an unseen column" else [message, str(table)]
        cases.append({"argv": argv, "named": named, "workdir": str(workdir)})
    first, *rest = cases
    proc = run_cli(*first["argv"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line
    assert all(word in proc.stderr for word in first["named"]), proc.stderr
    results = run_in_one_process(tmp_path, rest)
    assert len(results) == len(rest) == 4
    for result in results:
        refused_in_one_line(result, *result["named"])
    assert not any(Path(case["workdir"]).exists() for case in cases)  # nothing left behind


def city_table(tmp_path):
    """(a CSV of ROWS' rows four times, its rows without the header, the overrides of a run on it
    with a z-scored number and an embedded category)."""
    table = tmp_path / "people.csv"
    body = ROWS.split("\n", 1)[1]
    table.write_text(ROWS + body * 3)
    args = [
        "data.path=" + str(table),
        "data.label=label",
        "data.features=[{name: age, kind: numeric, normalize: zscore}, {name: city, kind: categorical}, "
        "{name: city_embedding, kind: embedding, source: city, dimension: 2}]",
        "train.global_batch_size=8",
        "log.progress=false",
    ]
    return table, body, args


HOSTILE = {  # (the table's bytes, data.features, what the one line says)
    "a cell that is not UTF-8": (
        ROWS.encode().replace(b"london", b"lond\xffn"),
        "[{name: age, kind: numeric}, {name: city, kind: categorical}, {name: c, kind: indicator, source: city}]",
        "line 3, column 'city': b'lond\\xffn' is not UTF-8 text",
    ),
    "a column named twice": (
        ROWS.replace("age,city,tags,income", "age,city,tags,age").encode(),
        "[{name: age, kind: numeric}]",
        "column(s) named 'age' more than once",
    ),
    "a number beyond float32": (
        ROWS.replace("35,london", "1e308,london").encode(),
        "[{name: age, kind: numeric, normalize: zscore}]",
        "line 3, column 'age': value 1e+308 is beyond float32's range",
    ),
    "boundaries that are text": (
        ROWS.encode(),
        "[{name: b, kind: bucketized, column: age, boundaries: [a, b]}, {name: i, kind: indicator, source: b}]",
        "boundaries=['a', 'b'] must be a non-empty ascending list of numbers",
    ),
    "quantiles beyond the rows": (
        ROWS.encode(),
        "[{name: b, kind: bucketized, column: age, quantiles: 1000}, {name: i, kind: indicator, source: b}]",
        "quantiles=1000 exceeds the train split's 4 values",
    ),
    "a billion quantiles": (
        ROWS.encode(),
        "[{name: b, kind: bucketized, column: age, quantiles: 1000000000}, {name: i, kind: indicator, source: b}]",
        "quantiles=1000000000 must be an integer from 2 to 65536",
    ),
    "crossed buckets beyond int32": (
        ROWS.encode(),
        "[{name: c, kind: categorical, column: city}, {name: t, kind: categorical, column: tags}, "
        "{name: x, kind: crossed, features: [c, t], hash_buckets: 1000000000000}]",
        "hash_buckets=1000000000000 must be from 1 to",
    ),
    "crossed buckets of 0": (
        ROWS.encode(),
        "[{name: c, kind: categorical, column: city}, {name: t, kind: categorical, column: tags}, "
        "{name: x, kind: crossed, features: [c, t], hash_buckets: 0}]",
        "hash_buckets=0 must be from 1 to",
    ),
    "an embedding no device holds": (
        ROWS.encode(),
        "[{name: c, kind: categorical, column: city}, {name: e, kind: embedding, source: c, dimension: 1000000000}]",
        "the train state needs",
    ),
}


def test_hostile_tables_and_features_are_one_line_exit_2_and_leave_nothing(tmp_path):
    """Each case in one process (tests/support/fuzz_cli.py run_in_one_process): exit 2, one line naming the problem, no
    traceback, no workdir left behind; sizes that cannot fit are refused before allocation."""
    cases = []
    for i, (name, (data, spec, message)) in enumerate(HOSTILE.items()):
        table = tmp_path / f"t{i}" / "people.csv"
        table.parent.mkdir()
        table.write_bytes(data)
        args = [f"data.path={table}", "data.label=label", "data.eval_fraction=0.2", f"data.features={spec}"]
        argv = ["--config", str(ROOT / "configs" / PENGUINS), "--workdir", str(table.parent / "run"), *args]
        cases.append({"name": name, "message": message, "workdir": str(table.parent / "run"), "argv": argv})
    for result in run_in_one_process(tmp_path, cases, env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}):
        where = f"{result['name']}: {result['stderr']} {result['escaped']}"
        assert result["code"] == 2 and not result["escaped"], where
        assert result["message"] in result["stderr"], where
        assert len(result["stderr"].strip().splitlines()) == 1, where
        assert not Path(result["workdir"]).exists(), where


def test_an_edited_feature_cache_is_fitted_again_and_changed_data_stops_a_resume_and_an_export(tmp_path):
    """A feature cache whose spec was edited is not trusted (one line, fitted again); after the
    data changed, a resume is refused (exit 2 naming preprocessing.json) and an export exits 2
    naming the difference, and after it is restored the export ships the workdir's
    preprocessing.json byte for byte."""
    table, body, args = city_table(tmp_path)
    args.append("train.steps=2")
    first, second = tmp_path / "first", tmp_path / "second"
    assert run_cli("--config", f"configs/{PENGUINS}", "--workdir", str(first), *args).returncode == 0
    (cache,) = tmp_path.glob(".people.csv.features-*.json")
    kept = json.loads(cache.read_text())
    kept["spec"]["numeric"][0]["shift"] = 1e6  # a hand edit
    cache.write_text(json.dumps(kept))
    proc = run_cli("--config", f"configs/{PENGUINS}", "--workdir", str(second), *args)
    assert proc.returncode == 0, proc.stderr
    assert f"the feature cache {cache} is damaged or edited; fitting the features again" in proc.stderr
    assert (second / "preprocessing.json").read_bytes() == (first / "preprocessing.json").read_bytes()

    table.write_text(ROWS + body * 3 + "30,rome,a,10,no\n")  # a new city, new statistics
    steps = [arg for arg in args if not arg.startswith("train.steps=")]
    proc = run_cli("--config", f"configs/{PENGUINS}", "--workdir", str(first), *steps, "train.steps=4")
    assert proc.returncode == 2 and "preprocessing.json" in proc.stderr and "differs" in proc.stderr, proc.stderr
    proc = run_cli("export", "--workdir", str(first), "--out", str(tmp_path / "export"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "(ids[0] (city).size: 5 recorded, 6 now;" in proc.stderr, proc.stderr
    assert not (tmp_path / "export").exists()
    table.write_text(ROWS + body * 3)
    proc = run_cli("export", "--workdir", str(first), "--out", str(tmp_path / "export"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "export" / "preprocessing.json").read_bytes() == (first / "preprocessing.json").read_bytes()


def test_a_regression_head_predicts_body_mass_better_than_the_mean_and_reports_rmse(tmp_path):
    """data.target=regression: one output, squared error; the eval record carries rmse (grams
    here), which must beat the spread of the label itself (predicting the mean: ~800 g)."""
    features = (
        "data.features=[{name: flipper_length_mm, kind: numeric, normalize: zscore, missing: mean}, "
        "{name: bill_depth_mm, kind: numeric, normalize: zscore, missing: mean}, "
        "{name: species, kind: categorical}, {name: species_onehot, kind: indicator, source: species}, "
        "{name: sex, kind: categorical, missing: oov}, "
        "{name: sex_embedding, kind: embedding, source: sex, dimension: 2}]"
    )
    workdir = tmp_path / "run"
    args = ["data.label=body_mass_g", "data.target=regression", features, "optimizer.learning_rate=0.05"]
    proc = run_cli("--config", f"configs/{PENGUINS}", "--workdir", str(workdir), *args, "train.steps=600")
    assert proc.returncode == 2 and "body_mass_g" in proc.stderr and "missing value" in proc.stderr, proc.stderr
    table = tmp_path / "penguins.csv"  # the two birds without measurements left out
    rows = [line for line in PENGUINS_CSV().splitlines() if ",NA,NA,NA,NA," not in line]
    table.write_text("\n".join(rows) + "\n")
    proc = run_cli(
        "--config", f"configs/{PENGUINS}", "--workdir", str(workdir), *args, "train.steps=600", f"data.path={table}"
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if r["split"] == "eval"][-1]
    assert final["rmse"] == pytest.approx(math.sqrt(final["loss"]))
    assert final["rmse"] < 400, final  # the label's own standard deviation is ~800 g


def PENGUINS_CSV() -> str:
    from engine.data.table import table_files

    return table_files("palmerpenguins:data/penguins.csv")[0].read_text()
