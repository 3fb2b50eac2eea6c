"""Experiment trackers (log.trackers): W&B offline run files and an MLflow store, each read back
with the tool's own reader, across a resume and a sweep; a missing tracker is a usage error."""

import json
import struct

import pytest
import yaml
from support.cli import run_cli
from support.configs import ROOT
from support.fuzz_cli import run_in_one_process
from support.in_process import train_here

wandb = pytest.importorskip("wandb")


mlflow = pytest.importorskip("mlflow")


FAST = ["train.steps=20", "log.every_steps=5", "eval.every_steps=10", "checkpoint.every_steps=10"]


def wandb_records(path):
    """(kind, record) of a W&B transaction log (.wandb): a 7-byte header, then LevelDB-style log
    blocks of 32 KiB whose chunks (crc, length, type) carry wandb_internal_pb2.Record messages."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, pending = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # full, or last of several
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record.WhichOneof("record_type"), record


def wandb_history(directory):
    """step → {key: value} of every offline run file under directory/wandb, in order."""
    steps = {}
    for path in sorted((directory / "wandb").glob("offline-run-*/run-*.wandb")):
        for kind, record in wandb_records(path):
            if kind == "history":
                items = {
                    ".".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item
                }
                steps.setdefault(items["_step"], {}).update(items)
    return steps


def records(workdir, split):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["split"] == split}


def train_losses(workdir):
    return {step: r["loss"] for step, r in records(workdir, "train").items()}


def test_wandb_and_mlflow_follow_a_run_and_its_resume(tmp_path, monkeypatch, capsys):
    workdir = tmp_path / "run"
    args = ["--config", "mnist_mlp", "--workdir", str(workdir), "log.trackers=[wandb,mlflow]", *FAST[1:]]
    first = run_cli(*args, "train.steps=10")
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_cli(*args, "train.steps=20")  # resumes at step 10 into the same tracker runs
    assert again.returncode == 0, again.stderr[-2000:]
    # nothing to log: no tracker run is opened (the counts below); in this process (support/in_process.py)
    code, said = train_here(capsys, workdir, "mnist_mlp", *args[4:], "train.steps=20", devices=1, common=False)
    assert code == 0 and "already finished" in said, said[-3000:]
    losses = train_losses(workdir)
    assert sorted(losses) == [5, 10, 15, 20]

    # (not mlflow.set_tracking_uri: it also sets the variable for every process started later)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workdir / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["jax-engine"], output_format="list")
    client = mlflow.tracking.MlflowClient()
    assert len(runs) == 1 and runs[0].info.status == "FINISHED" and runs[0].info.run_name == "run"
    history = client.get_metric_history(runs[0].info.run_id, "train/loss")
    assert {m.step: m.value for m in history} == pytest.approx(losses, rel=1e-6)
    assert runs[0].data.params["optimizer.learning_rate"] == "0.001"
    assert "eval/accuracy" in runs[0].data.metrics and "summary/steps_per_sec" in runs[0].data.metrics

    dry = run_cli_module("wandb", "sync", "--dry-run", *map(str, (workdir / "wandb").glob("offline-run-*")))
    assert dry.returncode == 0 and dry.stderr.count(".wandb") == 2, dry.stderr  # wandb's reader finds both
    steps = wandb_history(workdir)
    assert {s: row["train/loss"] for s, row in steps.items() if "train/loss" in row} == pytest.approx(losses)
    assert steps[20]["eval/accuracy"] == pytest.approx(records(workdir, "eval")[20]["accuracy"])
    ids = json.loads((workdir / "trackers.json").read_text())
    assert all(p.name.endswith(ids["wandb"]) for p in (workdir / "wandb").glob("offline-run-*"))


def run_cli_module(module, *args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120)


def test_a_sweep_logs_one_tracker_run_per_trial_grouped_by_sweep(tmp_path):
    sweep = tmp_path / "lr.yaml"
    sweep.write_text(
        yaml.safe_dump(
            {
                "base": str(ROOT / "configs" / "mnist_mlp.yaml"),
                "overrides": {"train.steps": 10, "log.every_steps": 5, "log.trackers": ["mlflow", "wandb"]},
                "directory": str(tmp_path / "lr"),
                "grid": {"optimizer.learning_rate": [0.001, 0.003]},
                "metric": "eval/accuracy",
                "mode": "max",
            }
        )
    )
    proc = run_cli("sweep", str(sweep), "--parallel", "2", timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'lr' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("jax-engine").experiment_id
    runs = client.search_runs([experiment], filter_string="tags.group = 'lr'")
    assert sorted(r.info.run_name for r in runs) == ["learning_rate=0.001", "learning_rate=0.003"]
    for run in runs:
        jsonl = train_losses(tmp_path / "lr" / run.info.run_name)
        assert run.data.metrics["train/loss"] == pytest.approx(jsonl[10], rel=1e-6)
    wandb_runs = [  # W&B: one offline run per trial in the sweep's directory, its group the sweep's name
        record.run
        for path in (tmp_path / "lr" / "wandb").glob("offline-run-*/run-*.wandb")
        for kind, record in wandb_records(path)
        if kind == "run"
    ]
    assert sorted(r.display_name for r in wandb_runs) == ["learning_rate=0.001", "learning_rate=0.003"]
    assert {r.run_group for r in wandb_runs} == {"lr"}


def test_a_tracker_that_is_not_installed_is_a_usage_error(tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(  # wandb unimportable, as where it is not installed
        "import importlib.util, sys\n"
        "find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'wandb' else find(name, *a)\n"
    )
    workdir = tmp_path / "run"
    proc = run_cli(
        "--config", "mnist_mlp", "--workdir", str(workdir), "log.trackers=[wandb]", env={"PYTHONPATH": str(hide)}
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "log.trackers lists wandb, which is not installed: pip install 'wandb" in proc.stderr
    assert "Traceback" not in proc.stderr and not workdir.exists()


def _one_error_line(result):
    """The command stopped with exit 2 and one error line, no traceback (a result of
    tests/support/fuzz_cli.py)."""
    errors = [line for line in result["stderr"].splitlines() if line.startswith("error: ")]
    where = result["escaped"] or result["stderr"][-2000:]
    assert result["code"] == 2 and len(errors) == 1 and "Traceback" not in result["stderr"], where
    assert not result["escaped"], where
    return errors[0]


def test_a_misspelt_tracker_a_tracking_dir_that_cannot_be_a_directory_and_a_damaged_trackers_json_are_refused(
    tmp_path, make_config
):
    """Each refused at start, before anything is written or compiled: by the command line's
    check and by a run's own; the command lines run in one process (tests/support/fuzz_cli.py)."""
    from engine.errors import UsageError
    from engine.observe.trackers import check_installed, open_trackers

    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    for tracking_dir, says in ((afile, "it is a file"), (afile / "sub" / "dir", f"{afile} is a file")):
        cfg = make_config("mnist_mlp.yaml", "log.trackers=[wandb,mlflow]", f"log.tracking_dir={tracking_dir}")
        for check in (check_installed, open_trackers):  # the command line's check, and a run's own
            with pytest.raises(UsageError) as refused:
                check(cfg)
            assert f"log.tracking_dir={tracking_dir} cannot be a directory for log.trackers: {says}" in str(
                refused.value
            )
            assert "\n" not in str(refused.value) and not (tmp_path / "run").exists()
    typo, tracking, damaged = tmp_path / "typo", tmp_path / "tracking", tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "trackers.json").write_text('{"mlflow": ["x"]}')
    argv = lambda workdir, *args: ["--config", "mnist_mlp", "--workdir", str(workdir), *args]  # noqa: E731
    cases = [
        {"argv": argv(typo, "log.trackers=[wanb]")},
        {"argv": argv(tracking, "log.trackers=[mlflow]", f"log.tracking_dir={afile}/x")},
        {"argv": argv(damaged, "log.trackers=[mlflow]")},
    ]
    results = run_in_one_process(tmp_path, cases)
    assert "did you mean log.trackers=wandb?" in _one_error_line(results[0]) and not typo.exists()
    assert f"log.tracking_dir={afile}/x cannot be a directory" in _one_error_line(results[1])
    assert not tracking.exists()  # refused before anything was written or compiled
    assert f"{damaged / 'trackers.json'} is damaged (its mlflow run id is" in _one_error_line(results[2])
    assert [p.name for p in damaged.iterdir()] == ["trackers.json"]  # nothing else written
