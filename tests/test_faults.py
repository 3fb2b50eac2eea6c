"""Faults and abuse: each test reproduces one way real runs break (a hostile value, a second
process on the same workdir, a damaged checkpoint) and checks the engine's answer."""

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import ROOT, run_cli
from engine.errors import UsageError
from engine.sweep import load_sweep
from engine.sweep.slurm import sbatch_script

HOSTILE = ["it's", "$(touch {d}/dollar)", "`touch {d}/backtick`", "a\nb; touch {d}/newline", "semi; touch {d}/semi"]


def test_sbatch_script_runs_no_injected_command(tmp_path):
    """Sweep values, paths with spaces and quotes: nothing in them ever reaches a shell."""
    markers = tmp_path / "markers"
    markers.mkdir()
    base = tmp_path / "dir with 'quote' and space"
    base.mkdir()
    grid = {"data.path": [value.format(d=markers) for value in HOSTILE]}
    sweep_file = base / "sweep $(touch x).yaml"
    sweep_file.write_text(
        yaml.safe_dump(
            {
                "base": str(ROOT / "configs" / "mnist_mlp.yaml"),
                "grid": grid,
                "directory": str(base / "out dir"),
                "slurm": {"partition": "a'b"},
            }
        )
    )
    sweep = load_sweep(sweep_file)
    sweep.directory.mkdir(parents=True)
    tasks = sweep.directory / "sweep.tasks.json"
    tasks.write_text("[]")
    script = sweep.directory / "sweep.sbatch"
    script.write_text(sbatch_script(sweep, sweep.runs, tasks))
    # an array task index with no run: the task starts launch.py, which refuses it (exit 2)
    proc = subprocess.run(
        ["bash", str(script)],
        env=dict(os.environ, SLURM_ARRAY_TASK_ID="7"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and "array task 7 has no run" in proc.stderr, proc.stderr
    assert not list(markers.iterdir())  # no injected command ran
    assert not (tmp_path / "x").exists()


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


def _wait_until(ready, proc, seconds=120, poll=0.1):
    """Polls `ready()` while `proc` runs; fails with its output if it ends or time runs out first."""
    deadline = time.time() + seconds
    while not ready():
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(poll)


def _train(workdir, *extra):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "launch.py"),
            "--config",
            "configs/mnist_mlp.yaml",
            "--workdir",
            str(workdir),
            "log.progress=false",
            "log.tensorboard=false",
            *extra,
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_one_training_job_per_workdir_and_no_stale_lock_after_sigkill(tmp_path):
    workdir = tmp_path / "run"
    first = _train(workdir, "train.steps=1000000", "log.every_steps=10", "checkpoint.every_steps=50")
    _wait_until(lambda: (workdir / "metrics.jsonl").exists() and (workdir / "metrics.jsonl").read_text(), first)
    config_before = (workdir / "config.yaml").read_text()
    second = run_cli("--config", "configs/mnist_mlp.yaml", "--workdir", str(workdir), "train.steps=7")
    assert second.returncode == 2, second.stderr
    assert f"pid {first.pid}" in second.stderr and "in use by another training job" in second.stderr
    assert "Traceback" not in second.stderr
    assert (workdir / "config.yaml").read_text() == config_before  # the refused run wrote nothing
    first.kill()  # SIGKILL: no chance to clean up
    first.wait()
    third = run_cli(
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(workdir),
        "train.steps=100",
        "log.progress=false",
        "log.tensorboard=false",
        "checkpoint.every_steps=50",
        "log.every_steps=10",
    )
    assert third.returncode == 0, third.stderr  # the OS released the lock with the process


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_set_aside_and_saved_again(tmp_path):
    """Before: resumed from the step before, then failed on every re-run with orbax's
    StepAlreadyExistsError when training reached the damaged step again."""
    workdir = tmp_path / "run"
    args = [
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(workdir),
        "train.steps=20",
        "checkpoint.every_steps=10",
        "log.progress=false",
        "log.tensorboard=false",
        "log.every_steps=10",
    ]
    assert run_cli(*args).returncode == 0
    state = workdir / "checkpoints" / "20" / "state"
    biggest = max((p for p in state.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    os.truncate(biggest, 1000)
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "moved the unreadable checkpoint" in proc.stderr
    (aside,) = [p for p in (workdir / "checkpoints" / "damaged").iterdir() if p.is_dir()]
    assert aside.name.startswith("20-") and (aside.parent / f"{aside.name}.reason.txt").read_text().strip()
    assert (workdir / "checkpoints" / "20").is_dir()  # saved again
    again = run_cli(*args)
    assert again.returncode == 0 and "already finished" in again.stdout + again.stderr, again.stderr


@pytest.mark.parametrize(
    "labels, expected",
    [
        ([0, 1, 99], "20 of y outside [0, 10), the first at y[2] (value 99)"),
        ([0, -1, 3], "the first at y[1] (value -1)"),
        ([0, 2**33, 1], "(value 8589934592)"),
    ],
    ids=["too-large", "negative", "int64-would-wrap"],
)
def test_bad_labels_are_refused_at_load(tmp_path, labels, expected):
    """Before: 99 grew the model to 100 classes, -1 trained, 2**33 wrapped to 0."""
    import numpy as np

    y = np.array(labels * 20, np.int64)
    x = np.random.default_rng(0).random((len(y), 4, 4), np.float32)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    proc = run_cli(
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(tmp_path / "w"),
        "data.name=npz",
        f"data.path={tmp_path / 'd.npz'}",
    )
    assert proc.returncode == 2 and expected in proc.stderr and str(tmp_path / "d.npz") in proc.stderr, proc.stderr
    assert not (tmp_path / "w").exists()  # refused before anything was written


def test_nan_inputs_are_refused_at_load(tmp_path):
    import numpy as np

    x = np.random.default_rng(0).random((60, 4, 4), np.float32)
    x[17, 1, 2] = np.nan
    np.savez(tmp_path / "d.npz", x_train=x, y_train=np.arange(60) % 10, x_test=x[:10], y_test=np.arange(10))
    proc = run_cli(
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(tmp_path / "w"),
        "data.name=npz",
        f"data.path={tmp_path / 'd.npz'}",
    )
    assert proc.returncode == 2 and "of x_train hold NaN or infinite values, the first at x_train[17]" in proc.stderr, (
        proc.stderr
    )


def test_ctrl_c_saves_and_exits_130(tmp_path):
    """Before: a KeyboardInterrupt traceback, exit 130 and nothing saved."""
    import signal

    workdir = tmp_path / "run"
    proc = _train(workdir, "train.steps=1000000", "log.every_steps=10", "checkpoint.every_steps=100000")
    _wait_until(lambda: (workdir / "metrics.jsonl").exists() and (workdir / "metrics.jsonl").read_text(), proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert "stopped by SIGINT: saved a checkpoint at step" in err
    step = int(err.split("saved a checkpoint at step ")[1].split(";")[0])
    assert (workdir / "checkpoints" / str(step)).is_dir()


@pytest.mark.slow
def test_bfloat16_parameters_train_resume_from_float32_and_an_optimizer_change_is_named(make_config, tmp_path):
    """param_dtype=bfloat16 trains (its Adam state keeps its dtype; b2=0.999 is not rounded to
    1.0), one or several steps per call alike; a float32 run resumes in bfloat16; a changed
    optimizer is named as such, and no checkpoint is set aside."""
    from engine.errors import UsageError
    from engine.run.single import fit

    common = [
        "train.steps=20",
        "log.every_steps=10",
        "eval.every_steps=0",
        "checkpoint.every_steps=10",
        "mesh.num_devices=1",
    ]
    per_step = fit(make_config("mnist_mlp.yaml", *common, "train.param_dtype=bfloat16", workdir=tmp_path / "one"))
    per_call = fit(
        make_config(
            "mnist_mlp.yaml", *common, "train.param_dtype=bfloat16", "train.steps_per_call=10", workdir=tmp_path / "ten"
        )
    )
    assert per_call.losses == per_step.losses and all(np.isfinite(list(per_step.losses.values())))
    assert per_step.losses[20] < per_step.losses[1]
    fit(make_config("mnist_mlp.yaml", *common, workdir=tmp_path / "run"))  # float32
    resumed = fit(
        make_config(
            "mnist_mlp.yaml", *common[1:], "train.steps=30", "train.param_dtype=bfloat16", workdir=tmp_path / "run"
        )
    )
    assert sorted(resumed.losses) == list(range(21, 31)) and np.isfinite(resumed.losses[30])
    with pytest.raises(UsageError, match="another structure .* optimizer .* checkpoint.restore_mode=params"):
        fit(
            make_config("mnist_mlp.yaml", *common[1:], "train.steps=40", "optimizer.name=sgd", workdir=tmp_path / "run")
        )
    assert sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == [10, 20, 30]


def test_a_damaged_metrics_line_is_skipped_by_name_and_dropped_on_resume(make_config, tmp_path, capsys):
    """A line of metrics.jsonl damaged mid-file (a disk error, a hand edit): readers skip it
    and say which; the resumed run rewrites the file without it and trains on."""
    from engine.run.single import fit
    from engine.runtime.rundir import read_records

    workdir = tmp_path / "run"
    args = ["mesh.num_devices=1", "log.every_steps=2", "checkpoint.every_steps=2", "eval.every_steps=0"]
    fit(make_config("mnist_mlp.yaml", *args, "train.steps=4", workdir=workdir))
    path = workdir / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines.insert(1, '{"step": 2, "split": "tr\x00\x00')  # torn
    lines.insert(3, "[1, 2]")  # JSON, not a record
    path.write_text("\n".join(lines) + "\n")
    records = read_records(path)
    assert [r["step"] for r in records] == [
        json.loads(line)["step"] for line in lines if line.startswith('{"step": ') and line.endswith("}")
    ]
    assert "metrics.jsonl: 2 damaged line(s) skipped (line 2, 4)" in capsys.readouterr().err
    fit(make_config("mnist_mlp.yaml", *args, "train.steps=6", workdir=workdir))
    capsys.readouterr()
    assert [r["step"] for r in read_records(path) if r["split"] == "train"] == [2, 4, 6]
    assert "damaged" not in capsys.readouterr().err  # the resume rewrote the file without them
    kept = (workdir / "metrics.jsonl.damaged").read_text().splitlines()
    assert kept == ['{"step": 2, "split": "tr\x00\x00', "[1, 2]"]  # nothing lost: set aside


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


def test_random_config_and_sweep_files_load_or_exit_2_never_a_traceback(tmp_path):
    """A few hundred random YAML documents and overrides (wrong types, huge numbers, NaN, broken
    interpolations, sections given scalars, NUL bytes): each loads, or is refused with a
    UsageError (exit 2 at the command line); no other exception escapes. Seeded, so a failure
    reproduces. Before this issue's fixes: TypeError, AttributeError, ValueError and OmegaConf
    errors escaped (a scalar `model:`, `grid: 5`, `directory: 5`, `int_uniform: [5, 1]`, ...)."""
    from engine.config import load_config
    from engine.config.load import _all_keys, _schema
    from engine.sweep.spec import SWEEP_KEYS

    keys = sorted(set(_all_keys(_schema("mlp")) + _all_keys(_schema("llama")))) + ["bogus.key", "mesh.rules.embed"]
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
    from test_data import make_mnist_dir

    from engine.config import DataConfig
    from engine.data.sources import load_dataset

    make_mnist_dir(tmp_path, gz=True)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(UsageError, match=re.escape(message)):
        load_dataset(DataConfig(name="idx", path=str(tmp_path)))


def test_a_flipped_bit_in_a_checkpoint_is_caught_by_its_checksums(make_config, tmp_path, capsys):
    """Before: one flipped byte in a data file restored without a word (an optimizer moment
    changed). Each complete step now has a SHA256SUMS; a mismatch sets the step aside and the
    run resumes from the step before."""
    from engine.run.single import fit

    workdir = tmp_path / "run"
    args = ["mesh.num_devices=1", "log.every_steps=10", "checkpoint.every_steps=10", "eval.every_steps=0"]
    fit(make_config("mnist_mlp.yaml", *args, "train.steps=20", workdir=workdir))
    step20 = workdir / "checkpoints" / "20"
    sums = (step20 / "SHA256SUMS").read_text().splitlines()
    assert len(sums) == sum(1 for p in step20.rglob("*") if p.is_file()) - 1  # every file but itself
    subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=step20, check=True)  # the standard format
    data = max((p for p in (step20 / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    capsys.readouterr()
    resumed = fit(make_config("mnist_mlp.yaml", *args, "train.steps=30", workdir=workdir))
    err = capsys.readouterr().err
    assert "does not match its checksum in SHA256SUMS" in err and "moved the unreadable checkpoint" in err, err
    assert min(resumed.losses) == 11  # from step 10: the damaged step 20 was not used
    (aside,) = [p for p in (workdir / "checkpoints" / "damaged").iterdir() if p.is_dir()]
    assert aside.name.startswith("20-") and (aside / "SHA256SUMS").is_file()
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [10, 20, 30]


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs (root may mount one here; elsewhere the test is skipped), unmounted after."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def _fill(disk, leave: int) -> Path:
    filler = disk / "filler"
    filler.write_bytes(b"\0" * max(os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize - leave, 0))
    return filler


@pytest.mark.slow
def test_a_full_disk_is_one_error_and_the_run_resumes_exactly_once_space_is_freed(make_config, tmp_path, small_disk):
    """Before: 54 tracebacks, and a re-run while still full left a 0-byte metrics.tmp."""
    from engine.run.single import fit
    from engine.runtime.rundir import StorageError, read_records

    args = ["mesh.num_devices=1", "log.every_steps=10", "checkpoint.every_steps=10", "eval.every_steps=0"]
    workdir = small_disk / "run"
    fit(make_config("mnist_mlp.yaml", *args, "train.steps=20", workdir=workdir))
    filler = _fill(small_disk, leave=60_000)  # room for the records, not for the next checkpoint
    with pytest.raises(
        StorageError,
        match=r"cannot write to .*/run while saving a checkpoint: no space left; "
        r"[\d.]+ KiB free of 3.0 MiB; free some space",
    ):
        fit(make_config("mnist_mlp.yaml", *args, "train.steps=60", workdir=workdir))
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["10", "20"]  # no partial save left
    assert not [p for p in workdir.iterdir() if p.name.endswith(".tmp")]
    assert (workdir / "metrics.jsonl").read_text().endswith("\n")  # no half-written record
    filler.unlink()
    resumed = fit(make_config("mnist_mlp.yaml", *args, "train.steps=60", workdir=workdir))
    reference = fit(make_config("mnist_mlp.yaml", *args, "train.steps=60", workdir=tmp_path / "reference"))
    assert resumed.losses == {step: reference.losses[step] for step in range(21, 61)}

    def strip(records):
        return [{k: v for k, v in r.items() if k not in RATES} for r in records if r["split"] == "train"]

    assert strip(read_records(workdir / "metrics.jsonl")) == strip(
        read_records(tmp_path / "reference" / "metrics.jsonl")
    )


RATES = ("steps_per_sec", "examples_per_sec", "tflops_per_device", "mfu")


@pytest.mark.slow
def test_a_full_disk_stops_a_vectorised_group_with_one_error(make_config, small_disk):
    from engine.run.group import fit_group
    from engine.runtime.rundir import StorageError

    args = ["mesh.num_devices=1", "log.every_steps=10", "checkpoint.every_steps=10", "eval.every_steps=0"]

    def configs(steps):
        return [
            make_config(
                "mnist_mlp.yaml",
                *args,
                f"train.steps={steps}",
                f"optimizer.learning_rate={lr}",
                workdir=small_disk / f"run{i}",
            )
            for i, lr in enumerate((1e-3, 2e-3))
        ]

    fit_group(configs(20))
    _fill(small_disk, leave=60_000)
    with pytest.raises(StorageError, match=r"cannot write to .*/disk while .*: no space left; .* free some space"):
        fit_group(configs(60))
    for i in range(2):  # each run keeps its newest complete checkpoint, no partial save
        assert sorted(p.name for p in (small_disk / f"run{i}" / "checkpoints").iterdir()) == ["10", "20"]


def test_a_read_only_workdir_is_refused_before_compiling(small_disk):
    """Before: an OSError traceback from the lock file."""
    (small_disk / "run").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    for workdir in (small_disk / "run", small_disk / "new"):
        proc = run_cli("--config", "configs/mnist_mlp.yaml", "--workdir", str(workdir), "train.steps=5")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert f"cannot write to {workdir} while claiming the workdir: read-only file system" in proc.stderr
        assert "give a --workdir you can write to" in proc.stderr and "compile" not in proc.stdout + proc.stderr


def test_sigterm_while_compiling_exits_143_with_one_line_and_leaves_nothing(tmp_path):
    """Before: SIGTERM during start-up or restore ended the process by the signal (no 143)."""
    import signal

    workdir = tmp_path / "run"
    proc = _train(workdir)
    _wait_until(lambda: (workdir / ".lock").exists(), proc, poll=0.02)  # claimed: compiling now
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "Traceback" not in err, err
    assert "preempted by SIGTERM while loading data and compiling: nothing new to save" in err
    assert not workdir.exists()  # the workdir it had just made held nothing: removed


def test_a_stop_inside_a_log_window_resumes_with_the_metrics_of_an_unbroken_run(make_config, tmp_path, monkeypatch):
    """Before: SIGTERM in the middle of a log window saved and exited 143, but that window's
    steps were never logged, so metrics.jsonl differed from an uninterrupted run. The window's
    per-step metrics now travel in the checkpoint's meta and the resumed run logs them."""
    import signal

    from engine.run import loop
    from engine.run import single as trainer
    from engine.runtime.preemption import Preempted
    from engine.runtime.rundir import read_records

    args = [
        "mesh.num_devices=1",
        "train.steps=100",
        "log.every_steps=25",
        "eval.every_steps=50",
        "checkpoint.every_steps=0",
    ]
    real, calls = loop._dispatch, []

    def dispatch(*a):
        calls.append(1)
        if len(calls) == 37:  # SIGTERM arrives during step 37: the window of steps 26..50 is cut at 37
            signal.raise_signal(signal.SIGTERM)
        return real(*a)

    monkeypatch.setattr(loop, "_dispatch", dispatch)
    with pytest.raises(Preempted, match="saved a checkpoint at step 37") as stopped:
        trainer.fit(make_config("mnist_mlp.yaml", *args, workdir=tmp_path / "run"))
    assert stopped.value.exit_code == 143
    monkeypatch.setattr(loop, "_dispatch", real)
    resumed = trainer.fit(make_config("mnist_mlp.yaml", *args, workdir=tmp_path / "run"))
    reference = trainer.fit(make_config("mnist_mlp.yaml", *args, workdir=tmp_path / "reference"))
    assert resumed.losses == {step: loss for step, loss in reference.losses.items() if step > 37}

    def records(workdir):
        return [
            {k: v for k, v in r.items() if k not in RATES}
            for r in read_records(workdir / "metrics.jsonl")
            if r["split"] in ("train", "eval")
        ]

    assert records(tmp_path / "run") == records(tmp_path / "reference")


def test_a_hung_data_reader_is_named_with_every_threads_stack(tmp_path):
    """No silent wait: a reader blocked forever (here a FIFO no one writes; in life a dead
    network mount) ends the run after watchdog.compile seconds with the stacks on disk."""
    data = tmp_path / "data"
    data.mkdir()
    os.mkfifo(data / "x_train.npy")
    workdir = tmp_path / "run"
    started = time.time()
    proc = run_cli(
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(workdir),
        "data.name=npz",
        f"data.path={data}",
        "watchdog.compile=3",
        timeout=120,
    )
    assert proc.returncode == 1 and time.time() - started < 60, proc.stderr
    assert "error: no progress for 3s while loading data and compiling (watchdog.compile=3)" in proc.stderr
    (hang,) = workdir.glob("hang-*.txt")
    stacks = hang.read_text()
    assert "in load" in stacks and "engine/data/sources.py" in stacks and "in _watch" in stacks  # every thread


@pytest.mark.slow
def test_a_peer_that_never_starts_ends_the_job_with_one_line_not_sigabrt(tmp_path):
    """Before: process 0 waited the whole initialization timeout, then jaxlib aborted it
    (SIGABRT, exit 134) with a C++ stack."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.time()
    proc = run_cli(
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(tmp_path / "run"),
        "--coordinator-address",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
        "--process-id",
        "0",
        "distributed.initialization_timeout=6",
        timeout=120,
    )
    assert proc.returncode == 1 and time.time() - started < 60, proc.stderr
    assert "error: process 0 of 2: the job did not assemble within 6s" in proc.stderr
    assert "Check failure" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_record_that_meets_a_full_disk_is_not_left_half_written(small_disk):
    """A text-mode append flushes into the full disk before it can truncate: the file would
    end mid-line, and the next record, once space is freed, would be glued to it."""
    from engine.runtime.rundir import append_line, read_records

    path = small_disk / "metrics.jsonl"
    filler = _fill(small_disk, leave=4096)
    with pytest.raises(OSError):
        for step in range(1, 10):  # records of 3 kB until the disk is full
            append_line(path, json.dumps({"step": step, "split": "train", "pad": "x" * 3000}) + "\n")
    assert path.read_bytes().endswith(b"\n")  # whole records only
    filler.unlink()
    append_line(path, json.dumps({"step": 99, "split": "train", "loss": 0.5}) + "\n")
    steps = [r["step"] for r in read_records(path)]
    assert steps[-1] == 99 and steps == list(range(1, len(steps))) + [99]
