"""End to end through launch.py: a run's written config, a run started from another, failure exits and
--dry-run (the default job itself: tests/e2e/test_first_run_e2e.py)."""

import json

import pytest
from support.cli import run_cli


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_written_config_alone_reproduces_the_run_and_a_run_started_from_it_says_so_without_orbax_noise(tmp_path):
    first, second, third = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    args = ["train.steps=30", "log.every_steps=10", "log.progress=false"]
    assert run_cli("--config", "configs/mnist_mlp.yaml", "--workdir", str(first), *args).returncode == 0
    proc = run_cli("--config", str(first / "config.yaml"), "--workdir", str(second))
    assert proc.returncode == 0, proc.stderr
    losses = [
        [(r["step"], r["split"], r["loss"]) for r in read_jsonl(d / "metrics.jsonl") if "loss" in r]
        for d in (first, second)
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 4  # 3 train lines and the final eval
    # a run started from another's parameters (checkpoint.restore_from) says so, without orbax's read-only noise
    proc = run_cli(
        *["--config", "configs/mnist_mlp.yaml", "log.progress=false", "log.tensorboard=false"],
        *["--workdir", str(third), "train.steps=8", f"checkpoint.restore_from={first}/checkpoints"],
    )
    assert proc.returncode == 0, proc.stderr
    assert f"starting from the parameters in {first}/checkpoints at step 0" in proc.stdout, proc.stdout
    assert "read only" not in proc.stderr, proc.stderr


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
