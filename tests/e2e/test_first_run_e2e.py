"""What a new user meets first: the default job and its outputs, the evaluator's config, and the
README's own commands."""

import json
import re
import shutil
import struct

import numpy as np
import pytest
import yaml

from engine.run.single import fit
from engine.runtime.rundir import read_records


@pytest.mark.slow
def test_the_evaluator_reads_the_runs_own_config_and_stops_when_it_is_finished(make_config, tmp_path):
    """Before: without repeating training's train.steps=20 the watcher waited silently for the
    config file's step 1000."""
    import time

    from support.cli import run_cli

    workdir = tmp_path / "run"
    fit(
        make_config(
            "mnist_mlp.yaml", "mesh.num_devices=1", "train.steps=20", "checkpoint.every_steps=10", workdir=workdir
        )
    )
    began = time.time()
    proc = run_cli("eval", "--config", "configs/mnist_mlp.yaml", "--workdir", str(workdir), "--watch", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert time.time() - began < 90
    evaluated = [r["step"] for r in read_records(workdir / "metrics.jsonl") if r.get("source") == "evaluator"]
    assert evaluated == [10, 20]


@pytest.mark.slow
def test_the_evaluator_stops_when_the_run_it_watches_is_dead(make_config, tmp_path):
    from support.cli import run_cli

    workdir = tmp_path / "run"
    fit(
        make_config(
            "mnist_mlp.yaml", "mesh.num_devices=1", "train.steps=30", "checkpoint.every_steps=10", workdir=workdir
        )
    )
    shutil.rmtree(workdir / "checkpoints" / "30")  # as if the trainer died after step 20's save
    proc = run_cli("eval", "--workdir", str(workdir), "--watch", "--dead-after", "3", timeout=120)
    assert proc.returncode == 1
    assert "waiting for a checkpoint after step 20 (training runs to step 30)" in proc.stdout
    assert "is not running" in proc.stderr and "newest checkpoint is step 20 of 30" in proc.stderr


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_tensorboard_scalars(workdir):
    """Parses TensorBoard event files (TFRecord frames of Event protos) into {tag: [(step, value)]}."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    files = sorted(workdir.glob("events.out.tfevents.*"))
    assert files, "no TensorBoard event file"
    for file in files:
        data, offset = file.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


@pytest.mark.slow
def test_the_default_job_reaches_95_percent_writes_its_outputs_and_summary_and_the_readme_serving_snippet_runs(
    tmp_path,
):
    """One run of the default job, as the README starts it (no --workdir, in a fresh directory):
    it reaches 95%, writes its metrics, config, TensorBoard events and a summary line of time,
    goodput and MFU; then the export + serving commands of docs/checkpoints.md run on it as a
    user would paste them."""
    import subprocess
    import sys

    from support.cli import run_cli
    from support.configs import ROOT

    # log.progress on, but the output is not a terminal: plain lines, no progress-bar frames
    proc = run_cli("--config", str(ROOT / "configs" / "mnist_mlp.yaml"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    workdir = tmp_path / "runs" / "mnist_mlp"
    records = read_jsonl(workdir / "metrics.jsonl")
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval"]
    assert evals[-1]["step"] == 1500 and evals[-1]["accuracy"] >= 0.95
    assert train[-1]["loss"] < 0.5 * train[0]["loss"]  # the loss falls
    assert all({"step", "loss", "accuracy", "steps_per_sec", "examples_per_sec"} <= r.keys() for r in train)
    assert [r["step"] for r in train] == list(range(100, 1501, 100))
    assert "step 1500 train: loss=" in proc.stdout  # not a terminal: plain lines, no progress bar
    assert re.search(r"^step 100 train: loss=[0-9.]+ accuracy=", proc.stdout, re.M), proc.stdout
    assert "step/s" not in proc.stderr and "\r" not in proc.stderr
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    assert config["model"]["name"] == "mlp" and config["workdir"] == "runs/mnist_mlp", config["workdir"]
    scalars = read_tensorboard_scalars(workdir)
    assert [s for s, _ in scalars["train/loss"]] == list(range(100, 1501, 100))
    np.testing.assert_allclose([v for _, v in scalars["eval/accuracy"]], [r["accuracy"] for r in evals], rtol=1e-6)

    summary, steps = records[-1], 1500
    assert summary["split"] == "summary" and summary["step"] == steps
    assert 0 < summary["goodput"] < 1 and summary["mean_step_seconds"] > 0
    assert summary["time_to_first_step"] >= summary["compile_seconds"] > 0
    wall = summary["wall_seconds"]
    # productive time = the loop's time less its waits for data (none redone in a fresh run)
    expected = (summary["mean_step_seconds"] * steps - summary["data_wait_seconds"]) / wall
    assert summary["goodput"] == pytest.approx(expected, rel=1e-6)
    assert summary["badput_data_wait"] == pytest.approx(summary["data_wait_seconds"] / wall, rel=1e-6)
    assert summary["badput_compile"] == pytest.approx(summary["compile_seconds"] / wall, rel=1e-6)
    assert summary["mean_step_seconds"] * steps + summary["compile_seconds"] < wall
    assert summary["redone_steps"] == 0
    assert 0 < summary["mfu"] < 1 and summary["peak_source"] == "measured float32 matmul on this CPU"
    assert summary["flops_per_device_step"] > 0
    assert all(r["tflops_per_device"] > 0 and 0 < r["mfu"] < 1 for r in train)
    assert "goodput" in proc.stdout  # printed at the end
    assert re.search(r"goodput [0-9.]+%: [0-9.]+s of training steps in a [0-9.]+s process", proc.stdout)

    readme = (ROOT / "docs" / "checkpoints.md").read_text()
    snippet = readme.split("<!-- serving snippet: tests/e2e/test_first_run_e2e.py runs it as written -->", 1)[1]
    code = re.search(r"```python\n(.*?)```", snippet, re.S).group(1)
    code = "\n".join(line[2:] if line.startswith("  ") else line for line in code.splitlines())  # list indent
    assert (
        run_cli("export", "--workdir", "runs/mnist_mlp", "--out", "runs/mnist_mlp_export", cwd=tmp_path).returncode == 0
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "load_digits().images / 16.0" in proc.stdout
    predicted, true = re.search(r"predicted \[(.*?)\] true \[(.*?)\]", proc.stdout, re.S).groups()
    assert sum(a == b for a, b in zip(predicted.split(), true.split())) >= 6  # a trained model, fed right
