"""Config sweeps: expansion, validation, running (sequential, parallel, resumed), the report."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from support import slurm_cluster
from support.cli import run_cli, start_cli
from support.configs import ROOT
from support.fuzz_cli import refused_in_one_line, run_in_one_process
from support.sweep import FAST, write_sweep


def index(directory):
    return [json.loads(line) for line in (directory / "sweep.jsonl").read_text().splitlines()]


def test_a_bad_value_stops_the_sweep_before_any_run(tmp_path):
    path = write_sweep(tmp_path / "bad.yaml", grid={"optimizer.learning_rate": [0.001, "fast"]})
    proc = run_cli("sweep", str(path))
    assert proc.returncode == 2
    assert "run 'learning_rate=fast': config key 'optimizer.learning_rate' got 'fast'" in proc.stderr
    assert not any((tmp_path / "out").glob("*/metrics.jsonl"))  # nothing ran


@pytest.mark.slow
def test_grid_runs_ranks_and_plots_and_parallel_finishes_the_same_runs_as_sequential(tmp_path):
    grid = {"optimizer.learning_rate": [0.001, 0.003], "model.hidden_sizes": [[32], [64]]}
    path = write_sweep(tmp_path / "grid.yaml", grid=grid, metric="eval/accuracy", mode="max")
    proc = run_cli("sweep", str(path), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = tmp_path / "out"
    runs = index(out)
    assert len(runs) == 4 and all(r["status"] == "finished" for r in runs)
    assert len([d for d in out.iterdir() if d.is_dir()]) == 4
    assert all(r["final"]["eval/accuracy"] > 0 for r in runs)
    with open(out / "report.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4 and list(table[0])[:4] == ["rank", "run", "status", "eval/accuracy"]
    accuracies = [float(row["eval/accuracy"]) for row in table]
    assert accuracies == sorted(accuracies, reverse=True)  # best first
    assert [row["rank"] for row in table] == ["1", "2", "3", "4"]
    assert "| rank | run | status | eval/accuracy |" in (out / "report.md").read_text()
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    again, typo = run_in_one_process(  # both in one process (support/fuzz_cli.py)
        tmp_path,
        [
            {"argv": ["report", str(out), "--out", str(tmp_path / "again")]},
            {"argv": ["report", str(out), "--metric", "eval/acc", "--out", str(tmp_path / "typo")]},
        ],
    )
    assert again["code"] == 0 and not again["escaped"] and (tmp_path / "again" / "report.png").exists(), again
    refused_in_one_line(typo, "--metric eval/acc is in no run's metrics.jsonl", "eval/accuracy")
    assert not (tmp_path / "typo" / "report.csv").exists()

    # the same grid, two runs at a time: the same runs, the same results (same configs, same seeds)
    parallel = write_sweep(tmp_path / "par.yaml", grid=grid, directory=str(tmp_path / "par"))
    proc = run_cli("sweep", str(parallel), "--parallel", "2", timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:]
    par = index(tmp_path / "par")
    assert [r["name"] for r in runs] == [r["name"] for r in par]
    assert all(r["status"] == "finished" for r in par)
    for a, b in zip(runs, par):
        assert a["final"]["eval/loss"] == pytest.approx(b["final"]["eval/loss"], rel=1e-6)


@pytest.mark.slow
def test_killed_sweep_resumes_only_what_is_missing_and_failed_runs_are_retried_only_when_asked(tmp_path):
    """A sweep SIGKILLed during its second run: the re-run leaves the finished run alone, resumes
    the killed one and runs the third, which diverges (sgd at lr 1e30): recorded as failed with
    its reason, exit 1; a re-run has nothing to run, --retry-failed runs it again."""
    path = write_sweep(
        tmp_path / "kill.yaml",
        grid={"optimizer.learning_rate": [0.001, 0.002, 1e30]},
        overrides={**FAST, "train.steps": 300, "optimizer.name": "sgd"},
    )
    out = tmp_path / "out"
    sweep = start_cli("sweep", str(path), start_new_session=True)
    deadline = time.time() + 300
    while not (out / "sweep.jsonl").exists() or sum(r["status"] == "finished" for r in index(out)) < 1:
        assert time.time() < deadline and sweep.poll() is None, sweep.communicate()
        time.sleep(0.2)
    while read_metrics_steps(out / "learning_rate=0.002") < 40:  # the second run is under way
        assert time.time() < deadline and sweep.poll() is None, sweep.communicate()
        time.sleep(0.1)
    os.killpg(sweep.pid, signal.SIGKILL)  # the sweep and its run, with no chance to clean up
    sweep.wait()
    finished = {r["name"] for r in index(out) if r["status"] == "finished"}
    assert finished == {"learning_rate=0.001"}
    first_log = (out / "learning_rate=0.001" / "metrics.jsonl").read_text()
    proc = run_cli("sweep", str(path), timeout=600)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "3 runs, 1 finished, 0 failed (--retry-failed runs them again), 2 to run (" in proc.stdout
    assert (out / "learning_rate=0.001" / "metrics.jsonl").read_text() == first_log  # not run again
    runs = {r["name"]: r for r in index(out)}
    assert runs["learning_rate=0.001"]["status"] == runs["learning_rate=0.002"]["status"] == "finished"
    assert runs["learning_rate=1e+30"]["status"] == "failed"
    assert "loss is" in runs["learning_rate=1e+30"]["error"]
    resumed = (out / "learning_rate=0.002" / "run.log").read_text()
    assert resumed.count("done: 300 steps") == 1
    proc = run_cli("sweep", str(path))
    assert "0 to run" in proc.stdout
    proc = run_cli("sweep", str(path), "--retry-failed")
    assert "1 to run" in proc.stdout


def read_metrics_steps(workdir):
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line]
    return max(steps, default=0)


@pytest.mark.slow
@pytest.mark.skipif(
    not slurm_cluster.available(), reason="needs root and Debian's slurm-wlm and munge (.ci/run installs them)"
)
def test_slurm_backend_submits_a_job_array(tmp_path):
    """Three runs, vectorised two at a time: one array task trains a group of two, another the
    third run alone."""
    path = write_sweep(
        tmp_path / "array.yaml",
        grid={"optimizer.learning_rate": [0.001, 0.003, 0.01]},
        slurm={"cpus_per_task": 1, "time": "00:10:00"},
        vectorize=2,
    )
    out = tmp_path / "out"
    with slurm_cluster.SlurmCluster(tmp_path / "cluster") as cluster:
        env = {k: v for k, v in cluster.env.items() if k != "XLA_FLAGS"}
        proc = subprocess.run(
            [sys.executable, str(ROOT / "launch.py"), "sweep", str(path), "--backend", "slurm"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert "submitted job array" in proc.stdout and "(3 runs in 2 tasks)" in proc.stdout, proc.stdout
        script = (out / "sweep.sbatch").read_text()
        assert "#SBATCH --array=0-1" in script and "#SBATCH --cpus-per-task=1" in script
        deadline = time.time() + 400
        while not all(r["status"] in ("finished", "failed") for r in index(out)):
            assert time.time() < deadline, [r["status"] for r in index(out)]
            time.sleep(1)
    runs = index(out)
    assert [r["status"] for r in runs] == ["finished"] * 3, [r.get("error") for r in runs]
    assert all(r["final"]["eval/accuracy"] > 0 for r in runs)
    assert len(list((out / "groups").glob("*.log"))) == 1  # the group trained as one process


def test_a_bad_value_in_the_sweep_file_is_said_to_come_from_it(tmp_path):
    path = write_sweep(tmp_path / "bad.yaml", grid={"train.steps": ["many"]})
    proc = run_cli("sweep", str(path))
    assert proc.returncode == 2 and "from the sweep file bad.yaml" in proc.stderr, proc.stderr


def test_the_slurm_backend_without_sbatch_is_one_line_and_exit_2(tmp_path):
    path = write_sweep(tmp_path / "array.yaml", grid={"optimizer.learning_rate": [0.001, 0.003]})
    env = {"PATH": os.path.dirname(sys.executable)}  # python, and no sbatch
    proc = run_cli("sweep", str(path), "--backend", "slurm", env=env)
    assert proc.returncode == 2 and "sbatch, which is not on PATH" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "sweep.sbatch").exists()
