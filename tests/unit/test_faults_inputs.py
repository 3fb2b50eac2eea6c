"""Faults and abuse, hostile input: each test feeds the engine one thing real users and
machines produce (a sweep value that looks like a shell command, a damaged IDX file, a
malformed config or sweep field, labels out of range, NaN pixels) and checks that it is
refused by name with exit 2, never a traceback or a silent misreading."""

import json
import random
import re

import pytest
import yaml
from support.configs import ROOT

from engine.errors import UsageError
from engine.sweep import load_sweep


@pytest.mark.nocompile
@pytest.mark.parametrize("value", ["debug\ntouch /tmp/x", "gpu\r", "a\x00b"])
def test_control_characters_in_slurm_values_are_refused(tmp_path, value):
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(
        yaml.safe_dump(
            {"base": str(ROOT / "configs" / "mnist_mlp.yaml"), "grid": {"seed": [0, 1]}, "slurm": {"partition": value}}
        )
    )
    with pytest.raises(UsageError, match="slurm.partition=.* holds a control character"):
        load_sweep(sweep_file)


@pytest.mark.nocompile
def test_damaged_status_and_sweep_files_are_set_aside(tmp_path, capsys):
    """Before: a JSONDecodeError traceback in the sweep, the search and the report."""
    from engine.observe.ranking import report
    from engine.runtime.rundir import read_status, write_json

    sweep_dir = tmp_path / "sweep"
    for name, loss in (("a", 0.5), ("b", 0.25)):
        (sweep_dir / name).mkdir(parents=True)
        (sweep_dir / name / "metrics.jsonl").write_text(json.dumps({"step": 1, "split": "eval", "loss": loss}) + "\n")
        write_json(sweep_dir / name / "status.json", {"status": "finished"})
    (sweep_dir / "a" / "status.json").write_bytes(b'{"status": "fini\x00')
    (sweep_dir / "sweep.json").write_text('{"runs": ["a", "b"], "metric": "eval/lo')
    assert read_status(sweep_dir / "a") == {}
    rows = report([sweep_dir])
    assert [row["run"] for row in rows] == ["b", "a"]
    err = capsys.readouterr().err
    assert "sweep.json is damaged" in err and "a/status.json is damaged" in err, err
    assert (sweep_dir / "sweep.json.damaged").read_text().startswith('{"runs": ["a", "b"]')
    assert (sweep_dir / "a" / "status.json.damaged").exists()


@pytest.mark.nocompile
@pytest.mark.parametrize(
    "field, value, message",
    [
        ("base", ["a.yaml"], "needs 'base: <config file>'"),
        ("directory", 5, "directory=5 must be a path"),
        ("overrides", [3], "overrides must map dotted keys"),
        ("random", {"samples": 2, "params": {"seed": {"choice": []}}}, "random.params.seed must be one of"),
        (
            "random",
            {"samples": 2, "params": {"seed": {"int_uniform": [5, 1]}}},
            "int_uniform=[5, 1] must be [low, high]",
        ),
        ("random", {"samples": 2, "params": {"seed": {"int_uniform": [0.5, 3]}}}, "must be two whole numbers"),
        ("search", {"trials": 2, "params": {"seed": {"uniform": ["a", 1]}}}, "uniform=['a', 1] must be [low, high]"),
    ],
)
def test_malformed_sweep_fields_are_named(tmp_path, field, value, message):
    """Before: TypeError / numpy ValueError tracebacks."""
    spec = {"base": str(ROOT / "configs" / "mnist_mlp.yaml"), field: value}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(UsageError, match=re.escape(message)):
        load_sweep(tmp_path / "s.yaml")


@pytest.mark.nocompile
@pytest.mark.parametrize(
    "tf_config, message",
    [
        ({"cluster": [], "task": {"type": "worker", "index": 0}}, "cluster must map task types to lists"),
        (
            {"cluster": {"worker": "h:1"}, "task": {"type": "worker", "index": 0}},
            "cluster must map task types to lists",
        ),
        ({"cluster": {"worker": ["10.0.0.1"]}, "task": {"type": "worker", "index": 0}}, "'10.0.0.1' is not an address"),
        (
            {"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": -1}},
            "task must name a type and a whole",
        ),
    ],
)
def test_malformed_tf_config_is_named(tf_config, message):
    from engine.runtime.distributed import parse_tf_config

    with pytest.raises(UsageError, match=re.escape(message)):
        parse_tf_config(json.dumps(tf_config))


def _random_value(rng: random.Random, keys: list[str], depth: int = 0):
    """A value a hostile or careless YAML file might hold."""
    kind = rng.randrange(12 if depth < 2 else 6)
    pools = [
        [0, 1, -3, 7, 4097, 2**31, 2**33, 2**63, 2**70, -(2**40)],
        [0.0, 1e-3, -1.0, 3.5, 1e30, float("inf"), float("nan")],
        ["", "a", "mlp", "llama", "npz", "float32", "constant", "x" * 300, "\x00", "[1,2", "yes", "1_000"],
        [True, False, None],
        ["${foo}", "${train.steps}", "${", "???", "${oc.env:HOME}"],
        ["-.inf", ".nan", "0x10", "~", "!!python/none"],
    ]
    if kind < len(pools):
        return rng.choice(pools[kind])
    if kind < 9:
        return [_random_value(rng, keys, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(keys).rsplit(".", 1)[-1]: _random_value(rng, keys, depth + 1) for _ in range(rng.randrange(4))}


def _nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = value
    return out


@pytest.mark.nocompile
def test_random_config_and_sweep_files_load_or_exit_2_never_a_traceback(tmp_path):
    """A few hundred random YAML documents and overrides (wrong types, huge numbers, NaN, broken
    interpolations, sections given scalars, NUL bytes): each loads, or is refused with a
    UsageError (exit 2 at the command line); no other exception escapes. Seeded, so a failure
    reproduces. Before this issue's fixes: TypeError, AttributeError, ValueError and OmegaConf
    errors escaped (a scalar `model:`, `grid: 5`, `directory: 5`, `int_uniform: [5, 1]`, ...)."""
    from engine.config import load_config
    from engine.config.data_sections import DATA_CONFIGS
    from engine.config.load import _all_keys, _schema
    from engine.sweep.spec import SWEEP_KEYS

    schemas = [_schema(model, data) for model in ("mlp", "llama") for data in DATA_CONFIGS]
    keys = sorted({key for schema in schemas for key in _all_keys(schema)}) + ["bogus.key", "mesh.rules.embed"]
    rng = random.Random(17)
    outcomes = {"loaded": 0, "refused": 0}
    for i in range(300):
        doc = _nested({rng.choice(keys): _random_value(rng, keys) for _ in range(rng.randrange(5))})
        if rng.random() < 0.5:
            doc["extends"] = rng.choice([str(ROOT / "configs" / "mnist_mlp.yaml"), 5, ["a"], None, "nope.yaml"])
        text = yaml.safe_dump(doc) if rng.random() < 0.9 else rng.choice(["[1, 2]", "a: [", "- a", "a: &x [1]\nb: *x"])
        (tmp_path / "c.yaml").write_text(text)
        values = [yaml.safe_dump(_random_value(rng, keys), default_flow_style=True) for _ in range(rng.randrange(4))]
        overrides = [f"{rng.choice(keys)}={v.strip().removesuffix('...').strip()}" for v in values]
        if rng.random() < 0.2:
            overrides.append(rng.choice(["=", "a", "train..steps=1", "model.name", "train.steps=["]))
        sweep = {key: _random_value(rng, keys) for key in rng.sample(sorted(SWEEP_KEYS), rng.randrange(5))}
        if rng.random() < 0.7:
            sweep["base"] = str(ROOT / "configs" / "mnist_mlp.yaml")
        (tmp_path / "s.yaml").write_text(yaml.safe_dump(sweep))
        for what, load in (
            ("config", lambda: load_config(tmp_path / "c.yaml", overrides, str(tmp_path / "w"))),
            ("sweep", lambda: load_sweep(tmp_path / "s.yaml")),
        ):
            try:
                load()
                outcomes["loaded"] += 1
            except UsageError:
                outcomes["refused"] += 1
            except Exception as e:  # the failure this test exists to catch: show the input that caused it
                raise AssertionError(
                    f"document {i} ({what}) raised {e!r}\nconfig:\n{text}\noverrides: {overrides}\nsweep: {sweep}"
                ) from e
    assert outcomes["loaded"] > 20 and outcomes["refused"] > 300, outcomes  # both paths were exercised


@pytest.mark.nocompile
@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda raw: raw[: len(raw) // 2], "is not a complete gzip file"),  # a cut-off download
        (lambda raw: b"not gzip at all" + raw, "is not a complete gzip file"),
        (
            lambda raw: __import__("gzip").compress(bytes([0, 0, 8, 3]) + (2**31).to_bytes(4, "big") * 3),
            "header says (2147483648, 2147483648, 2147483648)",
        ),
        (lambda raw: __import__("gzip").compress(bytes([0, 0, 8, 3, 0, 0])), "bytes end inside its IDX header"),
    ],
    ids=["truncated-gz", "not-gzip", "huge-dims", "short-header"],
)
def test_damaged_idx_files_are_named(tmp_path, damage, message):
    """Before: gzip/EOFError/numpy tracebacks."""
    from support.data import make_mnist_dir

    from engine.config import DataConfig
    from engine.data.sources import load_dataset

    make_mnist_dir(tmp_path, gz=True)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(UsageError, match=re.escape(message)):
        load_dataset(DataConfig(name="idx", path=str(tmp_path)))


@pytest.mark.nocompile
@pytest.mark.parametrize(
    "labels, expected",
    [
        ([0, 1, 99], "20 of y outside [0, 10), the first at y[2] (value 99)"),
        ([0, -1, 3], "the first at y[1] (value -1)"),
        ([0, 2**33, 1], "(value 8589934592)"),
    ],
    ids=["too-large", "negative", "int64-would-wrap"],
)
def test_bad_labels_are_refused_at_load(tmp_path, capsys, labels, expected):
    """Before: 99 grew the model to 100 classes, -1 trained, 2**33 wrapped to 0. (The command line in
    this process; tests/e2e/test_faults_inputs_e2e.py refuses NaN inputs through launch.py.)"""
    import numpy as np

    from engine.cli import main

    y = np.array(labels * 20, np.int64)
    x = np.random.default_rng(0).random((len(y), 4, 4), np.float32)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    args = ["--config", "configs/mnist_mlp.yaml", "--workdir", str(tmp_path / "w"), "data.name=npz"]
    code = main([*args, f"data.path={tmp_path / 'd.npz'}"])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and str(tmp_path / "d.npz") in err, err
    assert not (tmp_path / "w").exists()  # refused before anything was written
