"""What a new user meets first: TensorBoard after resumes, the evaluator's config, and the
README's own commands."""

import shutil

import pytest

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


@pytest.mark.slow
def test_the_readme_serving_snippet_runs_as_written(tmp_path):
    """The export + serving commands of docs/checkpoints.md, in a fresh directory, as a user would paste them."""
    import re
    import subprocess
    import sys

    from support.cli import run_cli
    from support.configs import ROOT

    readme = (ROOT / "docs" / "checkpoints.md").read_text()
    snippet = readme.split("<!-- serving snippet: tests/e2e/test_first_run_e2e.py runs it as written -->", 1)[1]
    code = re.search(r"```python\n(.*?)```", snippet, re.S).group(1)
    code = "\n".join(line[2:] if line.startswith("  ") else line for line in code.splitlines())  # list indent
    quiet = ["train.steps=300", "log.progress=false", "log.tensorboard=false"]
    assert run_cli("--config", str(ROOT / "configs" / "mnist_mlp.yaml"), *quiet, cwd=tmp_path).returncode == 0
    assert (
        run_cli("export", "--workdir", "runs/mnist_mlp", "--out", "runs/mnist_mlp_export", cwd=tmp_path).returncode == 0
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "load_digits().images / 16.0" in proc.stdout
    predicted, true = re.search(r"predicted \[(.*?)\] true \[(.*?)\]", proc.stdout, re.S).groups()
    assert sum(a == b for a, b in zip(predicted.split(), true.split())) >= 6  # a trained model, fed right
