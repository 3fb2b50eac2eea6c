"""Faults and abuse, hostile input: each test feeds the engine one thing real users and
machines produce (a sweep value that looks like a shell command, a damaged IDX file, a
malformed config or sweep field, labels out of range, NaN pixels) and checks that it is
refused by name with exit 2, never a traceback or a silent misreading."""

import os
import subprocess

import yaml
from support.cli import run_cli
from support.configs import ROOT

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


def train_on_npz(tmp_path):
    """The shipped MLP on tmp_path/d.npz, in workdir tmp_path/w."""
    return run_cli(
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(tmp_path / "w"),
        "data.name=npz",
        f"data.path={tmp_path / 'd.npz'}",
    )


def test_nan_inputs_are_refused_at_load(tmp_path):
    """(Labels out of range, refused the same way: tests/unit/test_faults_inputs.py, in this process.)"""
    import numpy as np

    x = np.random.default_rng(0).random((60, 4, 4), np.float32)
    x[17, 1, 2] = np.nan
    np.savez(tmp_path / "d.npz", x_train=x, y_train=np.arange(60) % 10, x_test=x[:10], y_test=np.arange(10))
    proc = train_on_npz(tmp_path)
    assert proc.returncode == 2 and "of x_train hold NaN or infinite values, the first at x_train[17]" in proc.stderr, (
        proc.stderr
    )
