"""End to end through launch.py: the default job, its outputs, and failure exits."""

import json
import re
import struct

import numpy as np
import pytest
import yaml
from support.cli import run_cli


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


def test_default_job_reaches_95_percent_and_writes_its_outputs(tmp_path):
    workdir = tmp_path / "mnist"
    proc = run_cli("--config", "configs/mnist_mlp.yaml", "--workdir", str(workdir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(workdir / "metrics.jsonl")
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] == "eval"]
    assert evals[-1]["step"] == 1500 and evals[-1]["accuracy"] >= 0.95
    assert train[-1]["loss"] < 0.5 * train[0]["loss"]  # the loss falls
    assert all({"step", "loss", "accuracy", "steps_per_sec", "examples_per_sec"} <= r.keys() for r in train)
    assert [r["step"] for r in train] == list(range(100, 1501, 100))
    assert "step 1500 train: loss=" in proc.stdout  # not a terminal: plain lines, no progress bar
    assert "step/s" not in proc.stderr
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    assert config["model"]["name"] == "mlp" and config["workdir"] == str(workdir)
    scalars = read_tensorboard_scalars(workdir)
    assert [s for s, _ in scalars["train/loss"]] == list(range(100, 1501, 100))
    np.testing.assert_allclose([v for _, v in scalars["eval/accuracy"]], [r["accuracy"] for r in evals], rtol=1e-6)


@pytest.mark.slow
def test_written_config_alone_reproduces_the_run(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    args = ["train.steps=30", "log.every_steps=10", "log.progress=false"]
    assert run_cli("--config", "configs/mnist_mlp.yaml", "--workdir", str(first), *args).returncode == 0
    proc = run_cli("--config", str(first / "config.yaml"), "--workdir", str(second))
    assert proc.returncode == 0, proc.stderr
    losses = [
        [(r["step"], r["split"], r["loss"]) for r in read_jsonl(d / "metrics.jsonl") if "loss" in r]
        for d in (first, second)
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 4  # 3 train lines and the final eval


def test_summary_line_reports_time_goodput_and_mfu(tmp_path):
    proc = run_cli(
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(tmp_path / "s"),
        "train.steps=40",
        "log.every_steps=20",
    )  # log.progress on, but the output is not a terminal: plain lines, no progress-bar frames
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^step 20 train: loss=[0-9.]+ accuracy=", proc.stdout, re.M), proc.stdout
    assert re.search(r"^step 40 train: loss=", proc.stdout, re.M) and "\r" not in proc.stderr
    summary = read_jsonl(tmp_path / "s" / "metrics.jsonl")[-1]
    assert summary["split"] == "summary" and summary["step"] == 40
    assert 0 < summary["goodput"] < 1 and summary["mean_step_seconds"] > 0
    assert summary["time_to_first_step"] >= summary["compile_seconds"] > 0
    wall, steps = summary["wall_seconds"], 40
    # productive time = the loop's time less its waits for data (none redone in a fresh run)
    expected = (summary["mean_step_seconds"] * steps - summary["data_wait_seconds"]) / wall
    assert summary["goodput"] == pytest.approx(expected, rel=1e-6)
    assert summary["badput_data_wait"] == pytest.approx(summary["data_wait_seconds"] / wall, rel=1e-6)
    assert summary["badput_compile"] == pytest.approx(summary["compile_seconds"] / wall, rel=1e-6)
    assert summary["mean_step_seconds"] * steps + summary["compile_seconds"] < wall
    assert summary["redone_steps"] == 0
    assert 0 < summary["mfu"] < 1 and summary["peak_source"] == "measured float32 matmul on this CPU"
    assert summary["flops_per_device_step"] > 0
    train = [r for r in read_jsonl(tmp_path / "s" / "metrics.jsonl") if r["split"] == "train"]
    assert all(r["tflops_per_device"] > 0 and 0 < r["mfu"] < 1 for r in train)
    assert "goodput" in proc.stdout  # printed at the end
    assert re.search(r"goodput [0-9.]+%: [0-9.]+s of training steps in a [0-9.]+s process", proc.stdout)


def test_non_finite_loss_stops_with_the_step_named(tmp_path):
    proc = run_cli(
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(tmp_path / "nan"),
        "train.steps=40",
        "optimizer.name=sgd",
        "optimizer.learning_rate=1e30",
        "log.every_steps=20",
        "log.progress=false",
    )
    assert proc.returncode == 1
    assert "training stopped: loss is nan at step" in proc.stderr or "loss is inf at step" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_dry_run_prints_layout_without_training(tmp_path):
    proc = run_cli("--config", "configs/mnist_mlp.yaml", "--workdir", str(tmp_path / "dry"), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "hidden_0/kernel" in proc.stdout and "('embed', 'mlp')" in proc.stdout
    assert "model FLOPs per step" in proc.stdout and "compiled step memory" in proc.stdout
    assert not (tmp_path / "dry").exists()


def test_a_run_started_from_another_says_so_without_orbax_read_only_noise(tmp_path):
    common = ["--config", "configs/mnist_mlp.yaml", "log.progress=false", "log.tensorboard=false"]
    assert run_cli(*common, "--workdir", str(tmp_path / "a"), "train.steps=5").returncode == 0
    proc = run_cli(
        *common,
        "--workdir",
        str(tmp_path / "b"),
        "train.steps=8",
        f"checkpoint.restore_from={tmp_path / 'a'}/checkpoints",
    )
    assert proc.returncode == 0, proc.stderr
    assert f"starting from the parameters in {tmp_path / 'a'}/checkpoints at step 0" in proc.stdout, proc.stdout
    assert "read only" not in proc.stderr, proc.stderr
